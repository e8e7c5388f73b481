#!/usr/bin/env bash
# The three environments `make test` needs, installed side by side (each writes its own folder: .venv, .venv-serve,
# .venv-vllm; pip's shared cache writes its files atomically): scripts/setup.sh, setup_serve.sh and setup_vllm.sh in
# parallel, each logged to .setup-logs/NAME.log with its wall time in .setup-logs/times.json. Side by side they take
# about as long as the slowest alone (4 min from nothing on a 2-core AMD EPYC, against ~9.5 min one after another).
# A failure prints the end of that environment's log and exits non-zero. Idempotent, as each script is.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .setup-logs
names=(setup setup_serve setup_vllm)
declare -A pids starts
for name in "${names[@]}"; do
    starts[$name]=$(date +%s.%N)
    bash "scripts/$name.sh" > ".setup-logs/$name.log" 2>&1 &
    pids[$name]=$!
done
failed=0
json="{"
for name in "${names[@]}"; do
    if wait "${pids[$name]}"; then status=0; else status=$?; fi
    end=$(date +%s.%N)
    secs=$(python3 -c "print(round($end - ${starts[$name]}, 1))")
    json+="\"$name\": {\"seconds\": $secs, \"exit\": $status}, "
    if [ "$status" -ne 0 ]; then
        failed=1
        echo "scripts/$name.sh failed (exit $status); the end of .setup-logs/$name.log:" >&2
        tail -n 30 ".setup-logs/$name.log" >&2
    else
        tail -n 1 ".setup-logs/$name.log"
    fi
done
echo "${json%, }}" > .setup-logs/times.json
exit $failed
