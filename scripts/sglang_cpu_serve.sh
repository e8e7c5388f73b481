#!/usr/bin/env bash
# Serve an exported drafter (`pr-specforge export CKPT DIR --to sglang`) with SGLang's EAGLE-3 on a CPU (0.5.14, or
# 0.5.16-0.5.23 with PYTHON=that environment's python), through the CPU bridge (pr_specforge/sglang_cpu; nothing is
# patched on a GPU machine). Needs nothing of training: SGLang's own environment plus `pip install ./serving` serves.
#
#   scripts/sglang_cpu_serve.sh TARGET_DIR DRAFT_DIR [PORT] [extra launch_server flags...]
#
# Defaults: chain drafting (3 steps, topk 1), greedy only (the CPU verify has no sampling path), float32
# (what the live tests verify equal to plain greedy), bound to 127.0.0.1, at the caller's priority (NICE=19 runs the
# server at nice 19, e.g. a test beside other work).
# Which code serves: where PYTHON has the package installed (`pip install ./serving`, or the training install), that
# copy, with nothing of this checkout on PYTHONPATH (and PYTHONSAFEPATH=1: not the current directory either). An
# editable install is its checkout's source, so it and a python without the package (an SGLang environment only)
# serve this checkout: it goes first on PYTHONPATH. A line on stderr says which, once the preflight passed.
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
# where PYTHON imports pr_specforge from with nothing of ours on its path (outside any checkout: cd /): an installed copy
# (not a source checkout, which holds serving/pyproject.toml), or nothing
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
HOME_DIR=$(cd / && "$PY" -E -c 'import importlib.util as u, os
s = u.find_spec("pr_specforge")
print(os.path.dirname(os.path.dirname(os.path.abspath(s.origin))) if s and s.origin else "")' 2>/dev/null) || HOME_DIR=""
if [ -n "$HOME_DIR" ] && [ ! -e "$HOME_DIR/serving/pyproject.toml" ] && [ -d "$HOME_DIR/pr_specforge/sglang_cpu/site" ]; then
    CODE=$HOME_DIR  # the installed package: nothing of the checkout on the path
    export PYTHONSAFEPATH=1  # `python -m` does not put the current directory (a checkout, maybe) first
    SERVES="serving pr_specforge installed in $PY ($CODE/pr_specforge)"
else
    CODE=$ROOT
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    SERVES="serving pr_specforge from the checkout $ROOT (not installed in $PY, or installed editable)"
fi
# the preflight prints the draft attention backend of PY's SGLang line (empty: the bridge's own, 0.5.14)
DRAFT_ATTENTION=$("$PY" -m pr_specforge.sglang_cpu.preflight "$TARGET" "$DRAFT" "$PORT" "$ALGO") || exit 2
echo "$(basename "$0"): $SERVES" >&2  # after the preflight: a refusal stays one line
SPEC=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT"
      --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
if [ -n "$DRAFT_ATTENTION" ]; then  # SGLang 0.5.16+: the draft, and PR_EAGLE3's rows, on Triton's interpreter
    SPEC+=(--speculative-draft-attention-backend "$DRAFT_ATTENTION")
    export PR_EAGLE3_ROW_ATTENTION=${PR_EAGLE3_ROW_ATTENTION:-$DRAFT_ATTENTION}
fi
if [ "$DRAFT" = none ]; then SPEC=(); fi
export PYTHONPATH="$CODE/pr_specforge/sglang_cpu/site${PYTHONPATH:+:$PYTHONPATH}"
export PR_SPECFORGE_SGLANG_CPU=1 SGLANG_USE_CPU_ENGINE=1 SGLANG_NATIVE_MOVE_KV_CACHE=1 TRITON_INTERPRET=1
PRIORITY=()  # the caller's priority; NICE=N (e.g. 19, a test beside other work) runs the server at nice N
if [ -n "${NICE:-}" ]; then PRIORITY=(nice -n "$NICE"); fi
exec ${PRIORITY[@]+"${PRIORITY[@]}"} "$PY" -m sglang.launch_server --model-path "$TARGET" \
    --device cpu --attention-backend torch_native --disable-cuda-graph --disable-overlap-schedule --sleep-on-idle --dtype float32 \
    --host 127.0.0.1 --port "$PORT" --max-total-tokens 4096 ${SPEC[@]+"${SPEC[@]}"} "$@"
