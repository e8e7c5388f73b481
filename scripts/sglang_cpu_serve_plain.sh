#!/usr/bin/env bash
# The plain reference server on a CPU: SGLang 0.5.14 serving the target alone (no speculative decoding), with the
# flags and environment of scripts/sglang_cpu_serve.sh (float32, torch_native attention, 127.0.0.1, the caller's
# priority unless NICE is set, the installed package's code where PYTHON has one), so its greedy output is what a
# speculative server's must equal. Sampling is served (no draft to verify).
#
#   scripts/sglang_cpu_serve_plain.sh TARGET_DIR [PORT] [extra launch_server flags...]
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 TARGET_DIR [PORT] [launch_server flags...]" >&2
    exit 2
fi
TARGET=$1 PORT=${2:-30000}
shift $(( $# < 2 ? $# : 2 ))
exec "$(dirname "$0")/sglang_cpu_serve.sh" "$TARGET" none "$PORT" "$@"
