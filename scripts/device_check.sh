#!/usr/bin/env bash
# Every GPU check of this repo in one go (one CUDA GPU, ~5 min on an H200). Each check runs even if
# an earlier one failed; logs and JSON land in OUTDIR (default: $OUT if set, else a temp dir).
#   1. scripts/gpu_serving_check.py  the speculative decoder on CUDA: lossless at T = 0, seeded at T = 1
#   2. scripts/gpu_check.sh          torchrun training on CUDA (bf16, SpecForge's Triton loss): DDP vs
#                                    DeepSpeed ZeRO-1/2, 20 steps each, per-step loss compared
#   3. benchmarks/train_step.py      EAGLE-3 vs PR training step on the GPU
#   4. benchmarks/draft_cost.py      drafting round: EAGLE vs PR co-forwarded vs PR serial on the GPU
# Usage: scripts/device_check.sh [OUTDIR]
# The Python that runs it needs this repo's requirements (specforge 0.2.0, transformers, deepspeed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-$(mktemp -d)}}"
mkdir -p "$OUTDIR"
export TORCHDYNAMO_DISABLE=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
status=0
. scripts/lib/run_step.sh  # run NAME CMD...
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch, transformers, specforge; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "specforge ok")'
run serving "$PY" scripts/gpu_serving_check.py --device cuda --json "$OUTDIR/gpu_serving.json"
run train_backends env PYTHON="$PY" bash scripts/gpu_check.sh 1 "$(mktemp -d)"
run train_step "$PY" benchmarks/train_step.py --device cuda --repeats 20 --json "$OUTDIR/train_step_gpu.json"
run draft_cost "$PY" benchmarks/draft_cost.py --device cuda --repeats 30 --warmup 5 --json "$OUTDIR/draft_cost_gpu.json"
echo "device_check: $([ $status = 0 ] && echo ALL PASSED || echo SOME FAILED) (logs in $OUTDIR)"
exit $status
