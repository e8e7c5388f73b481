#!/usr/bin/env bash
# Run any recipe on N GPUs (one node or several), every rank re-entering pr_specforge.cli:
#   recipes/launch/torchrun.sh recipes/llama3.1-8b-pr.yaml [section.field=value ...]
#   NPROC=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 recipes/launch/torchrun.sh recipes/qwen3-8b-pr.yaml
# Knobs (environment): NPROC (GPUs per node, default 4), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1), MASTER_PORT (29500). The per-device batch and data-parallel
# size come from the recipe; deployment.trainer.nproc_per_node is set to NPROC here.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 RECIPE.yaml [section.field=value ...]" >&2
  exit 2
fi
recipe="$1"; shift
NPROC="${NPROC:-4}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
exec torchrun --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m pr_specforge.cli train -c "$recipe" \
  "deployment.trainer.nproc_per_node=$NPROC" "deployment.trainer.nnodes=$NNODES" "$@"
