"""`--speculative-algorithm PR_EAGLE3` live on this CPU at (k 2, B_w 2, m 1, gamma 3, B 6): one server, every check.

SGLang's own server (through the CPU bridge, with our plugin) against our evaluator's `SpeculativeDecoder`
at the same shape, float32, greedy, tolerance zero (the kernel differences, ~1e-6, sit far below the tiny
target's and drafter's margins; a near-tie would fail every run, the test is seeded): each prompt's output
(also equal to plain greedy serving), verify rounds and accepted drafts (from the response's `meta_info`),
reconsideration rows and kept reconsidered nodes, and every round's tree, node for node. The drafter is
the live run's PR drafter as trained (its gate is not edited): reconsidered nodes survive the cut in some
rounds, which the test asserts. Per request, `custom_params` sets m = 0 (our evaluator's m = 0 tree).
The server times its rounds (`PR_EAGLE3_ROUND_TIMES`): every equality here holds with the timing wrappers on,
and the times are checked.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.export.conftest import ENV
from tests.helpers import load_benchmark
from tests.sglang_live.conftest import (LIVE_CUDA_GRAPH, LIVE_DEVICE, _free_port, assert_round_times, greedy,
                                        refused_launch)
from tests.sglang_live.pr_eagle3 import (MAX_NEW, Ours, Shape, assert_same, generate, generate_together, round_log,
                                         served_counts, shared_pr)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = Shape(k=2, bw=2, m=1, gamma=3, budget=6)
OVERLAP = True  # this module's server runs SGLang's overlap schedule (its default)


@pytest.fixture(scope="module")
def ours(live_run):
    return Ours(live_run)


@pytest.fixture
def server(live_run, shared):
    """The session's PR server at SHAPE under the overlap schedule, with its round log and round times: (port, round
    log); `server_of` has the rest."""
    srv, rounds, _ = _shared(live_run, shared)
    return srv.port, rounds


def _shared(live_run, shared):
    return shared_pr(shared, live_run, SHAPE, times=True, overlap=OVERLAP, name="pr-k2-overlap")


@pytest.fixture(scope="module")
def sequential(live_run, shared):
    srv, rounds, _ = _shared(live_run, shared)
    port = srv.port
    outs = [generate(port, p) for p in live_run["prompts"]]
    log = round_log(rounds)
    return [served_counts(o, log, OVERLAP) for o in outs]


def test_output_rounds_accepted_drafts_and_trees_equal_our_decoder(live_run, sequential, ours, plain_server):
    plain = [greedy(plain_server, p, MAX_NEW)["output_ids"] for p in live_run["prompts"]]
    assert [s["tokens"] for s in sequential] == plain
    assert_same(sequential, ours.decode(SHAPE, live_run["prompts"]))
    assert sum(s["recon_rows"] for s in sequential) > 0
    assert sum(s["recon_kept"] for s in sequential) > 0, "no reconsidered node survived the cut in any round"


def test_m0_serves_exactly_our_evaluators_m0_tree(live_run, server, ours):
    port, rounds = server
    outs = [generate(port, p, m=0) for p in live_run["prompts"]]
    served = [served_counts(o, round_log(rounds), OVERLAP) for o in outs]
    assert all(s["recon_rows"] == 0 for s in served)
    # a batch all at m = 0 is SGLang's own EAGLE-3 draft (`PR_EAGLE3_M0_DRAFT=sglang`), and its trees are still ours
    log = round_log(rounds)
    assert all(r["rows"] == "eagle3" and r["readouts"] is r["attention"] is r["row_invariant"] is None
               for o in outs for r in log[o["meta_info"]["id"]])
    assert_same(served, ours.decode(Shape(k=2, bw=2, m=0, gamma=3, budget=6), live_run["prompts"]))


def test_sampling_seed_seeds_the_tree_as_the_evaluators_seed_and_meta_info_carries_the_counters(live_run, server,
                                                                                                 ours, sequential):
    """The seed convention: a request's `sampling_seed` (0 when unset) seeds its PR tree as our evaluator's seed
    does (the evaluator gives prompt i seed + i): with equal seeds every round's tree and counter is equal. And
    `meta_info["pr_eagle3"]`, read without the round log, says the same counters and the B_w and m served."""
    port, rounds = server
    seeds = [3 + i for i in range(len(live_run["prompts"]))]
    outs = [generate(port, p, seed=s) for p, s in zip(live_run["prompts"], seeds)]
    served = [served_counts(o, round_log(rounds), OVERLAP) for o in outs]
    reference = ours.decode(SHAPE, live_run["prompts"], seeds)
    assert_same(served, reference)
    assert [s["trees"] for s in served] != [s["trees"] for s in sequential], "seeds 3.. drew the trees of seed 0"
    for out, ref in zip(outs, reference):
        assert out["meta_info"]["pr_eagle3"][-1] == {"bw": SHAPE.bw, "m": SHAPE.m, "rounds": ref["rounds"],
                                                     "recon_rows": ref["recon_rows"], "recon_kept": ref["recon_kept"]}
    m0 = generate(port, live_run["prompts"][1], m=0)["meta_info"]["pr_eagle3"][-1]
    assert (m0["bw"], m0["m"], m0["recon_rows"], m0["recon_kept"]) == (SHAPE.bw, 0, 0, 0)


def test_the_rounds_are_timed_for_m0_and_m1_and_reconsideration_rows_are_draft_compute(live_run, shared):
    srv, _, times = _shared(live_run, shared)
    outs = [generate(srv.port, live_run["prompts"][1], m=m) for m in (0, 1)]
    assert_round_times(times, outs, OVERLAP)
    lines = [json.loads(x) for x in open(times) if x.strip()]
    for m, out in zip((0, 1), outs):  # our drafter's readouts run in the draft phase only, and only in PR's round
        mine = [t for t in lines if t["rids"] == [out["meta_info"]["id"]]]
        if m == 0:  # SGLang's own draft: its head runs inside its draft model's forward
            assert all(t.get("readout_compute_s", 0.0) == 0.0 and t["draft.draft_compute_s"] > 0 for t in mine)
            continue
        assert all(t["draft.readout_compute_s"] > 0 and t["readout_compute_s"] == t["draft.readout_compute_s"]
                   for t in mine)


def test_four_concurrent_requests_give_what_four_sequential_ones_gave(live_run, server, sequential):
    port, rounds = server
    outs = generate_together(port, live_run["prompts"])
    log = round_log(rounds)
    concurrent = [served_counts(o, log, OVERLAP) for o in outs]
    assert len(concurrent) == 4
    assert concurrent == sequential
    mine = [r for o in outs for r in log[o["meta_info"]["id"]]]  # their rounds: rows and readouts batched
    assert all(r["rows"] == "sglang" and r["readouts"] == "batched" and isinstance(r["row_invariant"], bool)
               for r in mine)
    assert max(r["batch"] for r in mine) == 4


def test_the_benchmark_reads_the_servers_start_up_line(live_run, shared):
    """What benchmarks/serving_cost.py reads of a PR server's start-up, read from this server's own log."""
    srv, _, _ = _shared(live_run, shared)
    said = load_benchmark("serving_cost").served_readouts(str(srv.log))
    on_cuda = LIVE_DEVICE == "cuda"
    assert isinstance(said.pop("row_invariant"), bool)
    assert said == {"mode": "batched", "attention": "triton" if on_cuda else "torch_native",
                    "graph": "capture" if on_cuda and LIVE_CUDA_GRAPH else "off"}


def test_a_radix_cache_hit_gives_the_same_result(live_run, server, sequential):
    port, rounds = server
    out = generate(port, live_run["prompts"][0])
    assert out["meta_info"]["cached_tokens"] > 0, "the second request of a prompt should hit the radix cache"
    assert served_counts(out, round_log(rounds), OVERLAP) == sequential[0]


def test_the_cpu_serve_script_launches_pr_eagle3_and_refuses_topk_1_in_one_line(live_run):
    """scripts/sglang_cpu_serve_pr.sh, a real `launch_server` (which stops before start-up here)."""
    script = os.path.join(ROOT, "scripts", "sglang_cpu_serve_pr.sh")
    cmd = [script, live_run["target"], live_run["pr"], str(_free_port()), "--speculative-eagle-topk", "1",
           "--speculative-num-draft-tokens", "4"]
    last = refused_launch(cmd, dict(ENV, HF_HUB_OFFLINE="1"))
    assert last.startswith("PRServeError: PR_EAGLE3 needs --speculative-eagle-topk >= 2"), last
