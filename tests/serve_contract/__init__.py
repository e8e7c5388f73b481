"""The second SGLang line: SGLang 0.5.23 in `.venv-serve` (`scripts/setup_serve.sh`, run by `make test`), with the
serving install of this repository and no SpecForge. Modules here run inside that environment; the tests that
launch them live in the main suite (`serve_python` finds the interpreter)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_PYTHON = os.path.join(ROOT, ".venv-serve", "bin", "python")
REQUIRED_ENV = "PR_SERVE_VENV_REQUIRED"  # set by `make test`: a missing .venv-serve fails instead of skipping


def built_python(python: str, setup: str, what: str) -> str:
    """The interpreter `python` of an environment `make test` builds with `scripts/{setup}`; when it was not built,
    fails under `make test` and CI (`REQUIRED_ENV`, `CI`) and skips elsewhere, saying how to build it (`what`)."""
    if os.path.exists(python):
        return python
    if os.environ.get(REQUIRED_ENV) or os.environ.get("CI"):
        pytest.fail(f"{python} is missing: `make test` builds it (scripts/{setup})")
    pytest.skip(f"no {os.path.basename(os.path.dirname(os.path.dirname(python)))}: run scripts/{setup}, or `make test`, "
                f"to test {what}")


def serve_python() -> str:
    """The 0.5.23 environment's interpreter (`built_python`)."""
    return built_python(SERVE_PYTHON, "setup_serve.sh", "the second SGLang line (SGLang 0.5.23)")
