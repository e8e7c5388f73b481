"""`PR_EAGLE3` live on SGLang 0.5.23 on this CPU: `.venv-serve` (SGLang's own pins, `pip install ./serving`, no
SpecForge) behind the CPU bridge's stand-in `sgl_kernel` (`sglang_cpu.kernels`), the PR rows and the draft on SGLang's
own Triton attention in Triton's interpreter (0.5.23's torch_native has no EAGLE draft backend). The server is the
session's one 0.5.23 PR server: `scripts/sglang_cpu_serve_pr.sh` in that environment with only the serving install
(`shared_pr_script_0523`; test_serve_script.py checks what the script itself starts). fp32, greedy, 127.0.0.1. At
(k 2, B_w 2, m 1, gamma 3, B 6), as test_live_pr_eagle3.py on 0.5.14, tolerance zero: four concurrent requests and
the same four one by one each equal our decoder (outputs = plain greedy serving, verify rounds, accepted drafts,
counters, every round's tree); a request's m = 0 equals our m = 0; a repeated prompt hits the radix cache and gives
the same. The same server then gets every bad request of the refusal table (issue 74: empty text, which killed a
0.5.23 server, malformed bodies, over-long prompts, the request refusals), each HTTP 400 in one line and each
followed by a good request equal to plain greedy. (The one-line refusal through a real 0.5.23 launch:
test_live_sglang_0523.py.)"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.sglang_live.conftest import greedy
from tests.sglang_live.pr_eagle3 import (SCRIPT_SHAPE, SCRIPTS, Ours, Shape, assert_same, generate, generate_together,
                                         round_log, served_counts, shared_pr_script_0523)
from tests.sglang_live.refusals import assert_each_refused_then_greedy, prompt_table

SHAPE = SCRIPT_SHAPE
CONTEXT = 512  # the live target's max_position_embeddings (tests.helpers), SGLang's context length here
FIELD = "sampling_params.custom_params.pr_eagle3"
#: the request refusals of this shape that do not depend on the server's KV room (sent as custom_params["pr_eagle3"],
#: or as sampling parameters), with the start of each one line
REQUEST_REFUSALS = [
    ({"m": -1}, f"{FIELD}.m -1 is outside [0, 3]"), ({"m": "x"}, f"{FIELD}.m must be an integer, got 'x'"),
    ({"bw": 1000}, f"{FIELD}.bw 1000 is outside [1, 6]"), ({"bw": 0}, f"{FIELD}.bw 0 is outside [1, 6]"),
    ({"m": 100}, f"{FIELD}.m 100 is outside [0, 3]"), ("junk", f"{FIELD} must be an object"),
    ({"zz": 1}, f"{FIELD} has unknown key(s) 'zz'"),
    ({"temperature": 0.8}, "sampling_params.temperature 0.8 (top_k all): this speculative server on a CPU verifies "
                           "greedily only (SGLang 0.5.23's sampling verify needs sgl-kernel's sampling op")]


@pytest.fixture(scope="module")
def served(live_run, shared):
    server, rounds = shared_pr_script_0523(shared, live_run)
    port = server.port
    concurrent = generate_together(port, live_run["prompts"])
    sequential = [generate(port, p) for p in live_run["prompts"]]
    alone = generate(port, live_run["prompts"][1], m=0)
    log = round_log(rounds)
    mine = [r for o in concurrent + sequential for r in log[alone_id(o)]]  # this module's rounds at m = 1
    return ([served_counts(o, log) for o in concurrent], [served_counts(o, log) for o in sequential],
            served_counts(alone, log), sequential, mine, log[alone_id(alone)])


def alone_id(out) -> str:
    return out["meta_info"]["id"]


def test_on_0_5_23_four_concurrent_and_four_sequential_requests_equal_our_decoder(live_run, plain, served):
    concurrent, sequential, _, outs, rounds, _ = served
    ours = Ours(live_run).decode(SHAPE, live_run["prompts"])
    assert_same(concurrent, ours)
    assert_same(sequential, ours)
    assert [s["tokens"] for s in sequential] == plain  # = plain greedy serving
    assert sum(s["recon_rows"] for s in concurrent) > 0
    assert all(r["rows"] == "sglang" and r["attention"] == "triton" for r in rounds)
    assert max(r["batch"] for r in rounds) > 1
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs), "the second request of each prompt hits the radix cache"


def test_on_0_5_23_m0_equals_our_decoders_m0_tree(live_run, served):
    alone = served[2]
    assert alone["recon_rows"] == 0
    # a batch all at m = 0 is SGLang 0.5.23's own EAGLE-3 draft (`PR_EAGLE3_M0_DRAFT=sglang`), the tree still ours
    assert served[5] and all(r["rows"] == "eagle3" for r in served[5])
    assert_same([alone], Ours(live_run).decode(Shape(k=2, bw=2, m=0, gamma=3, budget=6), live_run["prompts"][1:2]))


def _request_body(prompt, bad) -> dict:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    if isinstance(bad, dict) and "temperature" in bad:
        params.update(bad)
    else:
        params["custom_params"] = {"pr_eagle3": bad}
    return {"input_ids": list(prompt), "sampling_params": params}


def test_on_0_5_23_every_bad_request_of_the_table_is_one_line_and_the_next_good_request_equals_plain_greedy(
        live_run, plain, shared, served):
    """On the session's 0.5.23 PR server, after `served` (the module's rounds are read first)."""
    server, _ = shared_pr_script_0523(shared, live_run)
    port, prompt, new = server.port, live_run["prompts"][0], 4
    table = prompt_table(CONTEXT, prompt) + [(f"custom/sampling {bad!r}", _request_body(prompt, bad), start)
                                             for bad, start in REQUEST_REFUSALS]
    assert_each_refused_then_greedy(port, table, lambda: greedy(port, prompt, new)["output_ids"], plain[0][:new])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
    assert "Traceback" not in server.log.read_text()


def test_the_pr_script_serves_in_sglang_0_5_23s_own_environment_with_only_the_serving_install(live_run, plain, shared):
    """The script alone, no test environment of ours (no PYTHONPATH, no bridge environment: the script sets what it
    needs; on 0.5.23 its preflight gives the draft SGLang's Triton attention), on `export CKPT OUT --to sglang
    --target TARGET` of the live run; 127.0.0.1, a free port, stopped also on failure. The test run's one 0.5.23 PR
    server (`shared_pr_script_0523`, which this module's other tests check round by round). The shape is given after
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
    checkout = str(SCRIPTS.parent)
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
