#!/usr/bin/env bash
# Create .venv-serve: SGLang 0.5.23 in its own environment (its pins: torch 2.14.1, transformers 5.19.0,
# sglang-kernel 0.4.10; ~11 GB of wheels from PyPI, ~4-5 minutes), plus the serving install of this repository
# (`pip install ./serving`: PR_EAGLE3 and the CPU bridge without SpecForge). `make test` runs it, so the suite tests
# both SGLang lines. Idempotent: a second run reinstalls ./serving only when the serving sources changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_SERVE_VERSION=0.5.23
if [ ! -x .venv-serve/bin/python ]; then
  "$PY" -m venv .venv-serve
fi
stamp=.venv-serve/.sglang_${SGLANG_SERVE_VERSION}_installed
if [ ! -f "$stamp" ]; then
  .venv-serve/bin/python -m pip install --quiet --upgrade pip
  .venv-serve/bin/python -m pip install --quiet "sglang==${SGLANG_SERVE_VERSION}" pytest pytest-timeout
  touch "$stamp"
fi
served=.venv-serve/.pr_specforge_serve_installed
# what the serving wheel ships (serving/pyproject.toml, serving/setup.py): a change to any of it reinstalls
if [ ! -f "$served" ] || [ -n "$(find serving pr_specforge/core pr_specforge/serving pr_specforge/sglang_plugin \
      pr_specforge/sglang_cpu pr_specforge/__init__.py pr_specforge/config.py pr_specforge/local_server.py pr_specforge/op_parts.py \
      pr_specforge/data/__init__.py \
      pr_specforge/data/io.py -newer "$served" -name '*.py' -o -newer "$served" -name '*.toml' | head -1)" ]; then
  .venv-serve/bin/python -m pip install --quiet ./serving
  touch "$served"
fi
.venv-serve/bin/python -c "from importlib.metadata import version as v; print('serving env: sglang', v('sglang'), '| torch', v('torch'), '| pr_specforge_serve', v('pr_specforge_serve'))"
