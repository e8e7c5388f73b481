#!/usr/bin/env bash
# Serve a PR export (`pr-specforge export CKPT DIR --to sglang` of a `pr` checkpoint) WITH reconsideration on a CPU:
# SGLang's server (0.5.14; 0.5.23 with PYTHON=.venv-serve/bin/python, SGLang's own environment with only
# `pip install ./serving`), our `PR_EAGLE3` plugin (pr_specforge/sglang_plugin), through the CPU bridge
# (scripts/sglang_cpu_serve.sh, whose flags this passes on; later flags override).
#
#   scripts/sglang_cpu_serve_pr.sh TARGET_DIR PR_DRAFT_DIR [PORT] [extra launch_server flags...]
#
# Shape: the paper's, k = --speculative-eagle-topk 6, gamma = --speculative-num-steps 8,
# B = --speculative-num-draft-tokens - 1 = 48. B_w and m: the export's config.json `pr_serving`
# ({"bw": .., "m": ..}) if present, else B_w = k, m = 3; PR_EAGLE3_BW / PR_EAGLE3_M override them,
# and a request may set its own: sampling_params.custom_params = {"pr_eagle3": {"bw": 4, "m": 0}}.
# Greedy only on CPU; the per-request accept length is in each response's meta_info
# (spec_verify_ct rounds, spec_num_correct_drafts accepted drafts).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 TARGET_DIR PR_DRAFT_DIR [PORT] [launch_server flags...]" >&2
    exit 2
fi
TARGET=$1 DRAFT=$2 PORT=${3:-30000}
shift $(( $# < 3 ? $# : 3 ))
exec "$(dirname "$0")/sglang_cpu_serve.sh" "$TARGET" "$DRAFT" "$PORT" --speculative-algorithm PR_EAGLE3 \
    --speculative-num-steps 8 --speculative-eagle-topk 6 --speculative-num-draft-tokens 49 "$@"
