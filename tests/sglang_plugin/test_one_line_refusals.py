"""A `PRServeError` that ends an SGLang process prints as one line (issue 58: a stock `launch_server` on an EAGLE-3-only
export printed a 40-line traceback ending in the right line); any other exception keeps its traceback."""

from __future__ import annotations

import subprocess
import sys

SETUP = "from pr_specforge.sglang_plugin import one_line_refusals; one_line_refusals(); one_line_refusals(); "


def _run(raise_line: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SETUP + raise_line], capture_output=True, text=True, timeout=120)


def test_a_refusal_that_ends_the_process_is_one_line():
    out = _run("from pr_specforge.sglang_plugin.checks import PRServeError; "
               "raise PRServeError('PR_EAGLE3: the drafter has no PR tensors')")
    assert out.returncode == 1
    assert out.stderr == "PRServeError: PR_EAGLE3: the drafter has no PR tensors\n"


def test_any_other_exception_keeps_its_traceback():
    out = _run("raise KeyError('not ours')")
    assert out.returncode == 1
    assert out.stderr.startswith("Traceback (most recent call last):") and out.stderr.endswith("KeyError: 'not ours'\n")
