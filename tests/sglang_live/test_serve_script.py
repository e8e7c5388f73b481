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
scripts run at the caller's priority; the test here asks for nice 19 (`NICE=19`), the test run's 0.5.23 server does
not. (That test, on the one 0.5.23 PR server, lives in test_live_pr_eagle3_0523.py beside the round-by-round checks of
the same server, so the server is started once.)
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
