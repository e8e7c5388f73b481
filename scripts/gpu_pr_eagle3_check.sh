#!/usr/bin/env bash
# PR_EAGLE3 on one CUDA GPU, every check in one go (~20-30 min; logs, JSON and tables land in OUTDIR).
#   1. equality, CUDA graphs off, then on: the live PR_EAGLE3 tests (tests/sglang_live/test_live_pr_eagle3*.py)
#      with their servers on the GPU (PR_SPECFORGE_LIVE_DEVICE=cuda: stock launch_server, Triton attention, fp32,
#      greedy), against our evaluator on the CPU: outputs, verify rounds, accepted drafts and every round's tree
#      at tolerance zero, at three shapes, four concurrent requests included; the PR rows run on SGLang's
#      TritonAttnBackend (PR_EAGLE3_ROW_ATTENTION=auto on CUDA); with SGLang's graphs on, each round is replayed
#      from its CUDA graph (PR_EAGLE3_ROUND_GRAPH=auto), and the Triton module captures with graphs off too (=on);
#      test_live_pr_eagle3.py's server runs SGLang's overlap schedule (the others run without it); every server
#      checks that the draft reads nothing on the host (PR_EAGLE3_CHECK_HOST_READS=on: .item(), .tolist(), .cpu(), ...).
#   2. cost, CUDA graphs off, then on: benchmarks/serving_cost.py --device cuda, PR_EAGLE3 m 0 / m 3 against
#      SGLang's EAGLE3, side by side, 1 and 4 concurrent requests, the paper's shape and a small one; round
#      times, the model-compute floor, tokens/s (serving_cost-graphs-{off,on}.{json,md}).
#   3. tokens/s with SGLang's overlap schedule off, then on (graphs on, untimed servers: the round timer would
#      synchronise the device): serving_cost-overlap-{off,on}.{json,md}.
#   4. temperature > 0 (never run on the CPU, which refuses it per request): SGLang's sampling verify over a PR
#      tree, 2000 seeded requests at T = 1 against plain sampling, a chi-square test of homogeneity per emitted
#      position (tests/sglang_live/test_live_pr_eagle3_sampling.py); and the fault and load module on the GPU
#      (tests/sglang_live/test_live_pr_eagle3_faults.py: retraction, a disconnect, bad requests, the context limit).
# Usage: scripts/gpu_pr_eagle3_check.sh [OUTDIR] [TARGET] [DRAFT]
#   TARGET, DRAFT: a target and its PR export `--to sglang` (default: make run's work/smollm2/target and
#   work/smollm2/export/pr-sglang; without them step 2 is skipped and says so).
# Needs a Python ($PYTHON, default .venv/bin/python, else python3) with this repo installed and SGLang 0.5.14
# with its CUDA kernels (`make setup` installs both from PyPI on a GPU box with network).
# SGLang 0.5.23: SGLANG_PYTHON=.venv-serve/bin/python (scripts/setup_serve.sh: SGLang 0.5.23 + `pip install ./serving`)
# runs every server with that interpreter (PR_SPECFORGE_SGLANG_PYTHON), the evaluator staying in $PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-$(mktemp -d)}}"
TARGET="${2:-work/smollm2/target}"
DRAFT="${3:-work/smollm2/export/pr-sglang}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$OUTDIR"
export TORCHDYNAMO_DISABLE=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_pr_eagle3_check: $PY sees no CUDA device: run it on a GPU machine"; exit 2
fi
if ! "$PY" -c 'import sglang, sgl_kernel' 2>/dev/null; then
  echo "gpu_pr_eagle3_check: $PY cannot import sglang with its CUDA kernels (sgl_kernel): install SGLang 0.5.14 (make setup)"; exit 2
fi
if [ -n "${SGLANG_PYTHON:-}" ]; then
  if ! "$SGLANG_PYTHON" -c 'import sglang, sgl_kernel' 2>/dev/null; then
    echo "gpu_pr_eagle3_check: SGLANG_PYTHON=$SGLANG_PYTHON cannot import sglang with its CUDA kernels (scripts/setup_serve.sh)"; exit 2
  fi
  export PR_SPECFORGE_SGLANG_PYTHON="$SGLANG_PYTHON"
  "$SGLANG_PYTHON" -c 'import torch, sglang; print("servers: torch", torch.__version__, "sglang", sglang.__version__)'
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch, sglang; print("torch", torch.__version__, "cuda", torch.version.cuda, "sglang", sglang.__version__)'
status=0
. scripts/lib/run_step.sh  # run NAME CMD...
RUN_OK_TAIL=4
LIVE=(tests/sglang_live/test_live_pr_eagle3.py tests/sglang_live/test_live_pr_eagle3_b16.py
      tests/sglang_live/test_live_pr_eagle3_b48.py tests/sglang_live/test_live_pr_eagle3_triton.py)
for graphs in 0 1; do
  run "equality-graphs-$graphs" env PR_SPECFORGE_LIVE_DEVICE=cuda PR_SPECFORGE_LIVE_CUDA_GRAPH=$graphs \
    "$PY" -m pytest -q -p no:cacheprovider "${LIVE[@]}" -k "not cpu_serve_script"
done
run "sampling-and-faults" env PR_SPECFORGE_LIVE_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  tests/sglang_live/test_live_pr_eagle3_sampling.py tests/sglang_live/test_live_pr_eagle3_faults.py
if [ -f "$TARGET/config.json" ] && [ -f "$DRAFT/config.json" ]; then
  for graphs in off on; do
    flag=(); [ $graphs = on ] && flag=(--cuda-graph)
    run "serving_cost-graphs-$graphs" "$PY" benchmarks/serving_cost.py --device cuda "${flag[@]}" \
      --target "$TARGET" --draft "$DRAFT" --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --work "$OUTDIR/serving_cost-graphs-$graphs" --json "$OUTDIR/serving_cost-graphs-$graphs.json" \
      --md "$OUTDIR/serving_cost-graphs-$graphs.md"
  done
  for overlap in off on; do
    flag=(--untimed); [ $overlap = on ] && flag=(--overlap)
    run "serving_cost-overlap-$overlap" "$PY" benchmarks/serving_cost.py --device cuda --cuda-graph "${flag[@]}" \
      --target "$TARGET" --draft "$DRAFT" --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --work "$OUTDIR/serving_cost-overlap-$overlap" --json "$OUTDIR/serving_cost-overlap-$overlap.json" \
      --md "$OUTDIR/serving_cost-overlap-$overlap.md"
  done
else
  echo "== serving_cost: skipped: no $TARGET/config.json or $DRAFT/config.json (make run makes them)"
fi
echo "gpu_pr_eagle3_check: $([ $status = 0 ] && echo ALL PASSED || echo SOME FAILED) (logs in $OUTDIR)"
exit $status
