"""SGLang 0.5.23 live on this CPU (`.venv-serve`: SGLang's own pins, the serving install, no SpecForge), through the
CPU bridge (`sglang_cpu.kernels`' stand-in `sgl_kernel`): plain greedy serving of the live target equals SGLang
0.5.14's (the package's `plain` server), an empty text (which killed a plain 0.5.23 server: SGLang's prefill of no
token) is refused in one line (`sglang_plugin.admission`, loaded by the bridge and the serving install's entry
point) and the server goes on serving, and a real `PR_EAGLE3` launch on 0.5.23 takes the serving install's
entry point and refuses an unsupported shape in one line. (PR_EAGLE3's rounds on 0.5.23: test_live_pr_eagle3_0523.py;
its touch points one by one: tests/sglang_plugin/test_sglang_lines.py.)"""

from __future__ import annotations

from pr_specforge.sglang_cpu import SERVER_FLAGS, child_env
from pr_specforge.sglang_cpu.server import SGLANG_PYTHON_ENV
from tests.serve_contract import ROOT, serve_python
from tests.sglang_live.conftest import ENV, greedy, refused_launch, sglang_server
from tests.sglang_live.eagle3 import MAX_NEW
from tests.sglang_live.refusals import EMPTY_TEXT, GREEDY, refused


def test_plain_greedy_serving_on_0_5_23_equals_0_5_14s(live_run, plain, tmp_path, monkeypatch):
    monkeypatch.setenv(SGLANG_PYTHON_ENV, serve_python())
    with sglang_server(live_run["target"], tmp_path / "plain-0.5.23.log") as port:
        assert refused(port, {"text": "", "sampling_params": GREEDY}) == (400, EMPTY_TEXT)
        served = [greedy(port, p, MAX_NEW)["output_ids"] for p in live_run["prompts"]]
    assert served == plain


def test_a_pr_eagle3_launch_on_0_5_23_refuses_topk_1_in_one_line(live_run):
    """A real `launch_server` of 0.5.23 with `--speculative-algorithm PR_EAGLE3` (the entry point of
    `pip install ./serving`): argument resolution refuses k = 1 in one line, before anything starts."""
    from tests.sglang_live.conftest import _free_port

    cmd = [serve_python(), "-m", "sglang.launch_server", "--model-path", live_run["target"], *SERVER_FLAGS,
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(_free_port()), "--speculative-algorithm",
           "PR_EAGLE3", "--speculative-draft-model-path", live_run["pr"], "--speculative-num-steps", "3",
           "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    last = refused_launch(cmd, child_env(dict(ENV, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)))
    assert last.startswith("PRServeError: PR_EAGLE3 needs --speculative-eagle-topk >= 2"), last
