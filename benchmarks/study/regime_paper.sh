#!/usr/bin/env bash
# The paper's recipe in the GSM8K regime (issue 40, item 3): `pr-paper` (paper-pr.yaml's options, from scratch, against
# `eagle3`) and `pr-paper-warm` (the same options with full gradients on this seed's `eagle3`, against `eagle3-long`),
# on the committed study's splits, flags and kept regenerated data. A resumable sitting: rerun the same line to go on
# (every stage is skipped once done; a training resumes from its newest checkpoint).
#
#   benchmarks/study/regime_paper.sh SEED UNTIL        # UNTIL: data | train | screen | report
#   benchmarks/study/regime_paper.sh 1 train           # the first sitting: data, then seed 1's trainings
#   DRAFTERS=pr-paper THREADS=1 benchmarks/study/regime_paper.sh 0 train   # only pr-paper, on one thread
#
# Run it from a clean checkout of one commit (a pinned worktree): it refuses uncommitted changes, and appends the
# sitting's provenance (commit, date, machine, threads, command) to WORK/sittings.jsonl before it starts.
# WORK defaults to work/regime-gsm8k; JOBS_NICE (default 19) is the sitting's niceness.
#
# Threads: the kept rows were served by drafters trained on one thread for seed 1 and on two for seed 0
# (docs/results/regimes.md, "Rebuild at the thread count the drafter was trained with"); training is bitwise
# reproducible at the same thread count only, and a served folder refuses a rebuilt drafter whose fingerprint differs.
# So seed 1 trains on one thread, seed 0 on two; the features (data stage) are rebuilt on two threads as kept.
#
# DRAFTERS (default: the four below) narrows a sitting to some of them: `pr-paper` alone is matched to the kept
# `eagle3` rows and needs no rebuilt `eagle3`. THREADS overrides the seed's thread count, for a drafter no kept row
# was served by (a new `pr-paper` may train on one thread per seed, two seeds side by side). REPORT_TEMPS (default:
# "0 1") narrows the report serves to some temperatures: "0" serves the T = 0 cells, which alone decide the verdict,
# before T = 1. REPORT_DIRS (default: every report folder) narrows them to some folders: a second sitting on the same
# seed serves the others side by side (one folder is served by one sitting at a time). Every argument is checked before
# any work.
set -euo pipefail
usage="usage: regime_paper.sh SEED data|train|screen|report (SEED: 0, 1, ...)"
SEED=${1:?$usage}
UNTIL=${2:?$usage}
[[ "$SEED" =~ ^[0-9]+$ ]] || { echo "regime_paper.sh: SEED must be a non-negative integer, not '$SEED'; $usage" >&2; exit 2; }
case "$UNTIL" in data|train|screen|report) ;; *) echo "regime_paper.sh: UNTIL must be data, train, screen or report, not '$UNTIL'" >&2; exit 2 ;; esac
ALL="eagle3 pr-paper pr-paper-warm eagle3-long"
for d in ${DRAFTERS:-$ALL}; do
  [[ " $ALL " == *" $d "* ]] || { echo "regime_paper.sh: DRAFTERS: '$d' is not one of: $ALL" >&2; exit 2; }
done
case "$SEED" in 0) THREADS=${THREADS:-2} ;; *) THREADS=${THREADS:-1} ;; esac
for t in ${REPORT_TEMPS:-0 1}; do
  [[ "$t" == 0 || "$t" == 1 ]] || { echo "regime_paper.sh: REPORT_TEMPS: '$t' is not a report temperature (0 or 1)" >&2; exit 2; }
done
FOLDERS="report-b48 report-b24 report-b48-2layer report-bw9-b48"
for f in ${REPORT_DIRS:-$FOLDERS}; do
  [[ " $FOLDERS " == *" $f "* ]] || { echo "regime_paper.sh: REPORT_DIRS: '$f' is not one of: $FOLDERS" >&2; exit 2; }
done
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || { echo "regime_paper.sh: THREADS must be a positive integer, not '$THREADS'" >&2; exit 2; }
# the kept drafters trained in bf16 on CPUs with native bf16; elsewhere `auto` makes features and trainings float32
# (pr_specforge/dtypes.py), and bf16 forced there runs emulated: ~56 s a training step against ~1 s, with sums that
# are not the native ones bit for bit (docs/results/regimes.md, "Rebuild on a CPU with native bf16")
if ! grep -qwE 'avx512_bf16|amx_bf16' "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null && [ "${ALLOW_EMULATED_BF16:-0}" != 1 ]; then
  echo "regime_paper.sh: this CPU has no native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): the study's features and trainings would be float32 here (auto), not the kept drafters' bf16, so they would not rebuild the kept drafters; run it on a CPU with native bf16, or set ALLOW_EMULATED_BF16=1 to go on anyway; nothing was written" >&2
  exit 2
fi
cd "$(dirname "$0")/../.."
# the interpreter every stage runs, before anything is restored or written: `python` on PATH is the training venv's
PY=$(command -v python || true)
if [ -z "$PY" ] || ! "$PY" -c "import torch, pr_specforge" 2>/dev/null; then
  echo "regime_paper.sh: '${PY:-python}' cannot import torch and pr_specforge; put the training venv first on PATH (. .venv/bin/activate) and rerun; nothing was written" >&2
  exit 2
fi
WORK=${WORK:-work/regime-gsm8k}
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "regime_paper.sh: uncommitted changes; run a sitting from a clean, pinned commit" >&2
  exit 1
fi
G="--workdir $WORK --train-limit 400 --epochs 3 --warm-epochs 1 --screen-limit 20 --report-limit 100 --report-step 10 --save-interval 100"
D="--drafters ${DRAFTERS:-$ALL} --report-temperatures ${REPORT_TEMPS:-0 1} --report-dirs ${REPORT_DIRS:-$FOLDERS}"
run() {  # one regimes.py call, niced, at THREADS threads, its provenance recorded first
  local threads=$1; shift
  mkdir -p "$WORK"
  python - "$WORK/sittings.jsonl" "$threads" "$*" <<'EOF'
import json, os, platform, subprocess, sys, time
path, threads, command = sys.argv[1:]
row = {"commit": subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip(),
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
       "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, native bf16 "
                  f"{'yes' if any(f in open('/proc/cpuinfo').read().split() for f in ('avx512_bf16', 'amx_bf16')) else 'no'}",
       "threads": threads,
       "command": f"python benchmarks/regimes.py {command}"}
with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
  nice -n "${JOBS_NICE:-19}" env OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" TORCHDYNAMO_DISABLE=1 \
    WANDB_MODE=disabled HF_HUB_OFFLINE=1 python benchmarks/regimes.py "$@"
}
# the kept regenerated text, stage times, command log and served rows (never overwrites a file already there)
python benchmarks/regimes.py restore --from benchmarks/results/regime-gsm8k --workdir "$WORK"
run 2 gsm8k $G $D --seeds "$SEED" --until data
[ "$UNTIL" = data ] || run "$THREADS" gsm8k $G $D --seeds "$SEED" --until "$UNTIL"
