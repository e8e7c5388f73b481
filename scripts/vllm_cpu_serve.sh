#!/usr/bin/env bash
# Serve TARGET with vLLM's CPU build (.venv-vllm: scripts/setup_vllm.sh), with an `export --to vllm` drafter as EAGLE-3
# (a chain of NUM_SPECULATIVE_TOKENS, default the export's own), or alone with EXPORT "-". OpenAI API on
# 127.0.0.1:PORT (default 8000), greedy-ready float32 (DTYPE), --enforce-eager. Extra arguments go to vLLM.
#
#   scripts/vllm_cpu_serve.sh work/smollm2/target work/smollm2/export/pr-vllm 8000
#   scripts/vllm_cpu_serve.sh work/smollm2/target - 8001            # the target alone
#
# Environment: PYTHON (default .venv-vllm/bin/python), VLLM_CPU_KVCACHE_SPACE (GiB, default 2),
# VLLM_CPU_OMP_THREADS_BIND (default nobind: a shared machine), MAX_MODEL_LEN (default: the target's).
# On a GPU, stock vLLM takes the same export: `vllm serve TARGET --speculative-config '{"method": "eagle3",
# "model": "EXPORT", "num_speculative_tokens": 3}'` (docs/export.md, "vLLM").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: $0 TARGET [EXPORT|-] [PORT] [vLLM args...]" >&2
  exit 2
fi
target=$1
export_dir=${2:--}
port=${3:-8000}
shift $(( $# < 3 ? $# : 3 ))
PYTHON=${PYTHON:-$here/.venv-vllm/bin/python}
if [ ! -x "$PYTHON" ]; then
  echo "vllm_cpu_serve: $PYTHON not found: build it with scripts/setup_vllm.sh (or set PYTHON to vLLM's interpreter)" >&2
  exit 2
fi
if [ ! -f "$target/config.json" ]; then
  echo "vllm_cpu_serve: TARGET $target: no config.json; name the target model's directory" >&2
  exit 2
fi
args=(--model "$target" --host 127.0.0.1 --port "$port" --dtype "${DTYPE:-float32}" --enforce-eager)
if [ -n "${MAX_MODEL_LEN:-}" ]; then args+=(--max-model-len "$MAX_MODEL_LEN"); fi
if [ "$export_dir" != "-" ]; then
  # the export's speculative_tokens (or NUM_SPECULATIVE_TOKENS); anything but a `--to vllm` export is one line
  spec=$("$PYTHON" - "$export_dir" "${NUM_SPECULATIVE_TOKENS:-}" <<'EOF' || exit 2
import json, os, sys
def refuse(message):
    print(message, file=sys.stderr)
    sys.exit(2)
path, tokens = sys.argv[1], sys.argv[2]
cfg_path = os.path.join(path, "config.json")
try:
    cfg = json.load(open(cfg_path))
except (OSError, ValueError) as e:
    refuse(f"vllm_cpu_serve: EXPORT {path}: no readable config.json ({type(e).__name__})")
if cfg.get("speculators_model_type") != "eagle3":
    refuse(f"vllm_cpu_serve: EXPORT {path} is not an `export --to vllm` directory (no speculators_model_type "
             "eagle3): pr-specforge export RUN OUT --to vllm --target TARGET")
if not tokens:
    tokens = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
if not str(tokens).isdigit() or int(tokens) < 1:
    refuse(f"vllm_cpu_serve: NUM_SPECULATIVE_TOKENS must be a positive integer, got {tokens!r}")
print(json.dumps({"method": "eagle3", "model": os.path.abspath(path), "num_speculative_tokens": int(tokens)}))
EOF
)
  args+=(--speculative-config "$spec")
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# the `vllm` console script of vllm-cpu fails (PackageNotFoundError: vllm): the module entry point works
exec "$PYTHON" -m vllm.entrypoints.openai.api_server "${args[@]}" "$@"
