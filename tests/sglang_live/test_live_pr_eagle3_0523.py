"""`PR_EAGLE3` live on SGLang 0.5.23 on this CPU: `.venv-serve` (SGLang's own pins, `pip install ./serving`, no
SpecForge) behind the CPU bridge's stand-in `sgl_kernel` (`sglang_cpu.kernels`), the PR rows and the draft on SGLang's
own Triton attention in Triton's interpreter (0.5.23's torch_native has no EAGLE draft backend). The server is the
session's one 0.5.23 PR server: `scripts/sglang_cpu_serve_pr.sh` in that environment with only the serving install
(`shared_pr_script_0523`; test_serve_script.py checks what the script itself starts). fp32, greedy, 127.0.0.1. At
(k 2, B_w 2, m 1, gamma 3, B 6), as test_live_pr_eagle3.py on 0.5.14, tolerance zero: four concurrent requests and
the same four one by one each equal our decoder (outputs = plain greedy serving, verify rounds, accepted drafts,
counters, every round's tree); a request's m = 0 equals our m = 0; a repeated prompt hits the radix cache and gives
the same. (The one-line refusal through a real 0.5.23 launch: test_live_sglang_0523.py.)"""

from __future__ import annotations


import pytest

from tests.sglang_live.pr_eagle3 import (SCRIPT_SHAPE, Ours, Shape, assert_same, generate, generate_together, round_log,
                                         served_counts, shared_pr_script_0523)

SHAPE = SCRIPT_SHAPE


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
