#!/usr/bin/env bash
# DeepSpeed backend vs SpecForge's DDP backend on GPU(s): 20 steps each on a tiny random
# target from tests/helpers.py, per-step ploss_0 compared; prints PASS/FAIL. Under 10 min on one GPU.
# Usage: scripts/gpu_check.sh [NPROC (default: visible GPUs)] [WORKDIR (default: mktemp)]
# Ran on one H200 on 2026-11-29: PASS (benchmarks/results/gpu-h200.md); the CPU path is covered by tests/training/test_deepspeed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
NPROC="${1:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}"
WORK="${2:-$(mktemp -d)}"
export TORCHDYNAMO_DISABLE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1
"$PY" - "$WORK" "$NPROC" <<'PY'
import os, sys, yaml
from tests.helpers import write_workspace
root, nproc = sys.argv[1], int(sys.argv[2])
steps = 20
base = write_workspace(root, strategy="pr", steps=steps, nproc=nproc, n=steps * nproc, pr_section={"max_depth": 2},
                       extra={"training": {"save_interval": 10, "total_steps": steps}, "model": {"torch_dtype": "bfloat16"}})
r = yaml.safe_load(open(base))
r["training"]["fsdp_sharding"] = "NO_SHARD"
yaml.safe_dump(r, open(os.path.join(root, "ddp.yaml"), "w"))
for stage in (1, 2):
    r["backend"] = {"name": "deepspeed", "config": os.path.abspath(f"recipes/deepspeed/zero{stage}.json")}
    yaml.safe_dump(r, open(os.path.join(root, f"zero{stage}.yaml"), "w"))
PY
for run in ddp zero1 zero2; do
  echo "== $run"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m pr_specforge.cli train \
    -c "$WORK/$run.yaml" "output_dir=$WORK/out_$run" > "$WORK/$run.log" 2>&1 || { tail -40 "$WORK/$run.log"; echo "FAIL: $run did not finish"; exit 1; }
done
"$PY" - "$WORK" <<'PY'
import sys
from pr_specforge.training.telemetry import read_metrics
root = sys.argv[1]
ref = {r["step"]: r for r in read_metrics(f"{root}/out_ddp")}
ok = len(ref) == 20
for run in ("zero1", "zero2"):
    rows = {r["step"]: r for r in read_metrics(f"{root}/out_{run}")}
    ok &= sorted(rows) == sorted(ref)
    # bf16 compute on GPU: reduction order differs from DDP, so allow 1e-2 relative (CPU fp32 agrees to 1e-7)
    worst = max(abs(rows[s]["ploss_0"] - ref[s]["ploss_0"]) / abs(ref[s]["ploss_0"]) for s in ref if s in rows)
    print(f"{run}: {len(rows)} steps, max relative ploss_0 difference vs DDP {worst:.2e}")
    ok &= worst <= 1e-2
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
