"""A `PRServeError` that ends an SGLang process prints as one line (issue 58: a stock `launch_server` on an EAGLE-3-only
export printed a 40-line traceback ending in the right line); any other exception keeps its traceback. The launch overrides `PR_EAGLE3_BW` / `PR_EAGLE3_M` (issue 65): a value set is
served or refused in one line, `0` or empty included, never silently replaced by the export's."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


#: `PR_EAGLE3_BW` / `PR_EAGLE3_M` as set at launch (None: unset) -> the (B_w, m) served, or the one line refused;
#: the export says B_w 3, m 1, the flags k 4. A set value is what serves or is refused, never the export's instead.
OVERRIDES = [
    ("unset", None, None, (3, 1)),
    ("both-set", "2", "0", (2, 0)),
    ("bw-0", "0", None, "PR_EAGLE3: B_w (PR_EAGLE3_BW) must be >= 1, got 0"),
    ("bw-negative", "-2", None, "PR_EAGLE3: B_w (PR_EAGLE3_BW) must be >= 1, got -2"),
    ("bw-empty", "", None, "PR_EAGLE3: PR_EAGLE3_BW='' is not an integer (unset it to serve the export's value)"),
    ("bw-blank", " ", None, "PR_EAGLE3: PR_EAGLE3_BW=' ' is not an integer (unset it to serve the export's value)"),
    ("bw-word", "four", None, "PR_EAGLE3: PR_EAGLE3_BW='four' is not an integer (unset it to serve the export's value)"),
    ("m-0", None, "0", (3, 0)),
    ("m-negative", None, "-1", "PR_EAGLE3: m (PR_EAGLE3_M) must be >= 0, got -1"),
    ("m-empty", None, "", "PR_EAGLE3: PR_EAGLE3_M='' is not an integer (unset it to serve the export's value)"),
]


@pytest.mark.parametrize("bw,m,expected", [r[1:] for r in OVERRIDES], ids=[r[0] for r in OVERRIDES])
def test_the_launch_overrides_of_bw_and_m_serve_as_set_or_are_refused_in_one_line(bw, m, expected, monkeypatch):
    from types import SimpleNamespace

    from pr_specforge.sglang_plugin.checks import ENV_BW, ENV_M, PRServeError, serve_shape

    for name, value in ((ENV_BW, bw), (ENV_M, m)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    flags = SimpleNamespace(speculative_eagle_topk=4, speculative_num_steps=4, speculative_num_draft_tokens=17)
    export = {"pr_serving": {"bw": 3, "m": 1}}
    if isinstance(expected, str):
        with pytest.raises(PRServeError) as refused:
            serve_shape(flags, export)
        assert str(refused.value) == expected
    else:
        shape = serve_shape(flags, export)
        assert (shape.bw, shape.m, shape.k, shape.gamma, shape.budget) == (*expected, 4, 4, 16)
