"""The second SGLang line: SGLang 0.5.23 in `.venv-serve` (`scripts/setup_serve.sh`, run by `make test`), with the
serving install of this repository and no SpecForge. Modules here run inside that environment; the tests that
launch them live in the main suite (`serve_python` finds the interpreter)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_PYTHON = os.path.join(ROOT, ".venv-serve", "bin", "python")
REQUIRED_ENV = "PR_SERVE_VENV_REQUIRED"  # set by `make test`: a missing .venv-serve fails instead of skipping


def serve_python() -> str:
    """The 0.5.23 environment's interpreter; skips (outside `make test` and CI) when it was not built."""
    if os.path.exists(SERVE_PYTHON):
        return SERVE_PYTHON
    if os.environ.get(REQUIRED_ENV) or os.environ.get("CI"):
        pytest.fail(f"{SERVE_PYTHON} is missing: `make test` builds it (scripts/setup_serve.sh)")
    pytest.skip("no .venv-serve (SGLang 0.5.23): run scripts/setup_serve.sh, or `make test`, to test the second SGLang line")
