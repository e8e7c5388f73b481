#!/usr/bin/env bash
# Serve an exported drafter (`pr-specforge export CKPT DIR --to sglang`) with SGLang's EAGLE-3 on a CPU (0.5.14, or
# 0.5.16-0.5.23 with PYTHON=that environment's python), through the CPU bridge (pr_specforge/sglang_cpu; nothing is
# patched on a GPU machine). Needs nothing of training: SGLang's own environment plus `pip install ./serving` serves.
#
#   scripts/sglang_cpu_serve.sh TARGET_DIR DRAFT_DIR [PORT] [extra launch_server flags...]
#
# Defaults: chain drafting (3 steps, topk 1), greedy only (the CPU verify has no sampling path), float32
# (what the live tests verify equal to plain greedy), bound to 127.0.0.1, nice 19.
# bf16: add `--dtype bfloat16` after PORT: faster, but its rounding can flip a near-tie between the top two
# tokens, so its output may differ from the float32 target's greedy decode after some tokens.
# Before SGLang starts, `python -m pr_specforge.sglang_cpu.preflight` checks PYTHON's SGLang, the directories (an
# `export --to sglang` drafter, its tensors, its context length against the target's) and that PORT is free; on
# SGLang 0.5.16+ the draft runs SGLang's Triton attention in Triton's interpreter (0.5.23's torch_native has no EAGLE
# draft backend). Tree drafting: --speculative-num-steps 8 --speculative-eagle-topk 6
# --speculative-num-draft-tokens 49 after PORT (later flags override). Speed: a correctness path, not a fast one
# (see docs/export.md, "SGLang on a CPU").
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 TARGET_DIR DRAFT_DIR [PORT] [launch_server flags...]" >&2
    exit 2
fi
TARGET=$1 DRAFT=$2 PORT=${3:-30000}
shift $(( $# < 3 ? $# : 3 ))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python
ALGO=EAGLE3 PREV=""  # the algorithm SGLang will run: the last --speculative-algorithm of the flags
for ARG in "$@"; do
    [ "$PREV" = --speculative-algorithm ] && ALGO=$ARG
    case "$ARG" in --speculative-algorithm=*) ALGO=${ARG#*=} ;; esac
    PREV=$ARG
done
# the preflight prints the draft attention backend of PY's SGLang line (empty: the bridge's own, 0.5.14)
DRAFT_ATTENTION=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pr_specforge.sglang_cpu.preflight "$TARGET" "$DRAFT" "$PORT" "$ALGO") || exit 2
SPEC=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT"
      --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
if [ -n "$DRAFT_ATTENTION" ]; then  # SGLang 0.5.16+: the draft, and PR_EAGLE3's rows, on Triton's interpreter
    SPEC+=(--speculative-draft-attention-backend "$DRAFT_ATTENTION")
    export PR_EAGLE3_ROW_ATTENTION=${PR_EAGLE3_ROW_ATTENTION:-$DRAFT_ATTENTION}
fi
if [ "$DRAFT" = none ]; then SPEC=(); fi
export PYTHONPATH="$ROOT/pr_specforge/sglang_cpu/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PR_SPECFORGE_SGLANG_CPU=1 SGLANG_USE_CPU_ENGINE=1 SGLANG_NATIVE_MOVE_KV_CACHE=1 TRITON_INTERPRET=1
exec nice -n 19 "$PY" -m sglang.launch_server --model-path "$TARGET" \
    --device cpu --attention-backend torch_native --disable-cuda-graph --disable-overlap-schedule --sleep-on-idle --dtype float32 \
    --host 127.0.0.1 --port "$PORT" --max-total-tokens 4096 ${SPEC[@]+"${SPEC[@]}"} "$@"
