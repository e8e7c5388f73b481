"""`scripts/sglang_cpu_serve.sh` serves the export `make run` makes (issue 44): one server start-up.

`make run` exports against SmolLM2-135M, whose config declares a context of 8192, with a drafter config
of 2048 (`recipes/drafters/smollm2-135m-eagle3.json`); SGLang refuses a drafter whose context is below its
target's. Here the live tests' target is copied with its config declaring 8192 (its weights, so its greedy
decode, unchanged), the drafter config keeps 512, and the run's checkpoint is exported the way `make run`
does (`export CKPT OUT --to sglang --target TARGET`). The script then serves it with its defaults (float32,
chain of 3): the output must be the target's greedy decode and the accepted drafts our evaluator's, prompt
by prompt, and plain greedy serving's. This is the PR export served as EAGLE-3 (its `pr_*` tensors
are skipped). A request at temperature 0.8 is refused in one line (HTTP 400: no sampling verify on a CPU) and the
server serves the next; so is an empty text (issue 74). A renamed or missing tensor fails it (the script's preflight names the tensor, or the bridge's `DraftLoadError` stops the server), as would a drafter left random.

The serving install on its own (issue 65): `scripts/sglang_cpu_serve_pr.sh` with `PYTHON=.venv-serve/bin/python`
(SGLang 0.5.23's own environment with the serving install, no SpecForge) starts with its defaults on the export made
as `make run` makes it and answers: plain greedy serving's tokens, through PR_EAGLE3's rounds. It serves the installed
package's code (issue 74): started outside the checkout with no PYTHONPATH, the script says it serves the copy in
site-packages, and SGLang's scheduler loaded PR_EAGLE3 from there (the draft worker's ready line names it). The
scripts run at the caller's priority; the first test here asks for nice 19 (`NICE=19`), the session's 0.5.23 server
does not.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request

import pytest

from pr_specforge.sglang_cpu import child_env
from tests.export.conftest import ENV
from tests.export.test_export import long_context_target
from tests.sglang_live.conftest import STEPS, _free_port, greedy, post, serving
from tests.sglang_live.eagle3 import CHAIN_STEPS, MAX_NEW, served_tau
from tests.sglang_live.refusals import EMPTY_TEXT, GREEDY
from tests.sglang_live.refusals import refused as refused_request

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve.sh")
PR_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve_pr.sh")


def test_the_serve_script_serves_an_export_made_against_a_longer_context_target(live_run, our_decoder, plain, tmp_path):
    from pr_specforge.export import main as export_main

    root = live_run["root"]
    target = long_context_target(root / "target", tmp_path / "target")
    assert json.loads((root / "draft.json").read_text())["max_position_embeddings"] < 8192  # as make run's drafter
    export = tmp_path / "pr-sglang"
    ckpt = str(root / "out" / f"specforge-run-step{STEPS}")
    assert export_main([ckpt, str(export), "--to", "sglang", "--target", str(target), "--overwrite"]) == 0
    assert json.loads((export / "config.json").read_text())["max_position_embeddings"] == 8192

    port = _free_port()
    env = child_env(dict(ENV, HF_HUB_OFFLINE="1", PYTHON=sys.executable, NICE="19"))  # beside other work
    with serving(["bash", SCRIPT, str(target), str(export), str(port)], port, tmp_path / "server.log", env):
        served = [greedy(port, p, MAX_NEW) for p in live_run["prompts"]]
        sampled = {"input_ids": live_run["prompts"][0], "sampling_params": {"temperature": 0.8, "max_new_tokens": 4}}
        with pytest.raises(urllib.error.HTTPError) as refused:  # EAGLE3 on a CPU: no sampling verify, one line
            post(port, "/generate", sampled)
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"]["message"].startswith(
            "sampling_params.temperature 0.8 (top_k all): this speculative server on a CPU verifies greedily only")
        assert greedy(port, live_run["prompts"][0], MAX_NEW)["output_ids"] == served[0]["output_ids"]  # still serving
        assert refused_request(port, {"text": "", "sampling_params": GREEDY}) == (400, EMPTY_TEXT)  # EAGLE3 too
        assert greedy(port, live_run["prompts"][0], MAX_NEW)["output_ids"] == served[0]["output_ids"]
    reference = our_decoder(CHAIN_STEPS)  # the script's default: a chain of 3 drafts
    assert [o["output_ids"] for o in served] == [r.tokens for r in reference] == plain  # lossless
    for out, ref in zip(served, reference):
        meta = out["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (ref.rounds, sum(ref.accept_lengths) - ref.rounds)
    assert served_tau(served) > 2.0, f"the trained drafter should accept most drafts on its own distribution, tau {served_tau(served)}"
    log = (tmp_path / "server.log").read_text()
    assert re.search(r"[(, ]dtype='float32'", log)  # the verified default, not 'auto'
    assert "sglang_cpu_serve.sh: serving pr_specforge from the checkout" in log  # .venv's install is editable


def test_the_pr_script_serves_in_sglang_0_5_23s_own_environment_with_only_the_serving_install(live_run, plain, shared):
    """The script alone, no test environment of ours (no PYTHONPATH, no bridge environment: the script sets what it
    needs; on 0.5.23 its preflight gives the draft SGLang's Triton attention), on `export CKPT OUT --to sglang
    --target TARGET` of the live run; 127.0.0.1, a free port, stopped also on failure. The session's one 0.5.23 PR
    server (`shared_pr_script_0523`, which test_live_pr_eagle3_0523.py checks round by round). The shape is given after
    PORT (later flags override the script's k 6, gamma 8, B 48): the paper's shape starts in about 5 minutes on 2 cores
    (SGLang's warm-up request in Triton's interpreter), which CI's budget cannot carry; it served the same way."""
    from tests.serve_contract import serve_python
    from tests.sglang_live.pr_eagle3 import shared_pr_script_0523

    server, _ = shared_pr_script_0523(shared, live_run)
    port = server.port
    new = 4
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=60) as r:
        info = json.loads(r.read())
    out = greedy(port, live_run["prompts"][0], new)
    assert info["version"] == "0.5.23" and "PR_EAGLE3" in str(info["speculative_algorithm"])
    assert (info["speculative_eagle_topk"], info["speculative_num_steps"], info["speculative_num_draft_tokens"]) == (2, 3, 7)
    assert info["speculative_draft_attention_backend"] == "triton"  # the preflight's pick for 0.5.16+
    assert out["output_ids"] == plain[0][:new]  # lossless: plain greedy serving's first tokens
    assert out["meta_info"]["spec_verify_ct"] >= 1, out["meta_info"]
    # the installed package served, not this checkout: the script's line and the scheduler's own ready line
    python = serve_python()
    checkout = os.path.join(os.path.dirname(os.path.abspath(PR_SCRIPT)), "..")
    installed = _site_packages(python)
    log = server.log.read_text()
    assert f"sglang_cpu_serve.sh: serving pr_specforge installed in {python} ({installed}/pr_specforge)" in log, log[:2000]
    ready = [line for line in log.splitlines() if "PR_EAGLE3 draft worker ready" in line]
    assert ready and all(line.endswith(f"pr_specforge from {installed}/pr_specforge") for line in ready), ready
    for root in {checkout, os.path.realpath(checkout)}:  # the checkout's own package never appears
        assert os.path.join(os.path.normpath(root), "pr_specforge") not in log
    assert "Traceback" not in log


def _site_packages(python: str) -> str:
    """Where `python` (an absolute path) imports the installed `pr_specforge` from, asked outside any checkout."""
    import subprocess

    found = subprocess.run([python, "-E", "-c", "import pr_specforge, os; "
                            "print(os.path.dirname(os.path.dirname(os.path.abspath(pr_specforge.__file__))))"],
                           cwd="/", capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert os.path.basename(found) == "site-packages", found
    return found
