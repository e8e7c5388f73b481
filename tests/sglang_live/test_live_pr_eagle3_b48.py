"""`PR_EAGLE3` live at (k 6, B_w 6, m 3, gamma 8, B 48), the paper's shape: one server; outputs equal plain greedy, and rounds,
accepted drafts, counters and every round's tree equal our decoder's at the same shape (tolerance zero;
see test_live_pr_eagle3.py for why zero holds). Two prompts (one of the training distribution, one off
it): this tree is the slowest on the CPU, for both sides. And one request at m = 0, which SGLang's own draft drafts."""

from __future__ import annotations

import pytest

from tests.sglang_live.conftest import greedy
from tests.sglang_live.pr_eagle3 import MAX_NEW, Ours, Shape, assert_same, generate, round_log, served_counts, shared_pr


def _prompts(live_run):
    return [live_run["prompts"][0], live_run["prompts"][-1]]


SHAPE = Shape(k=6, bw=6, m=3, gamma=8, budget=48)


@pytest.fixture(scope="module")
def served(live_run, shared):
    srv, rounds, _ = shared_pr(shared, live_run, SHAPE)
    outs = [generate(srv.port, p) for p in _prompts(live_run)]
    alone = generate(srv.port, _prompts(live_run)[0], m=0)
    log = round_log(rounds)
    return [served_counts(o, log) for o in outs], served_counts(alone, log), log[alone["meta_info"]["id"]]


def test_shape_k6_bw6_m3_g8_b48_equals_our_decoder_and_plain_greedy(live_run, served, plain_server):
    served = served[0]
    assert [s["tokens"] for s in served] == [greedy(plain_server, p, MAX_NEW)["output_ids"] for p in _prompts(live_run)]
    assert_same(served, Ours(live_run).decode(SHAPE, _prompts(live_run)))
    assert sum(s["recon_rows"] for s in served) > 0


def test_at_the_papers_shape_m0_is_sglangs_own_draft_and_its_trees_equal_our_decoders(live_run, served):
    """A request at m = 0 alone: SGLang's own EAGLE-3 draft (`PR_EAGLE3_M0_DRAFT=sglang`: top-k beams of k = 6 scored
    by products of probabilities) keeps our decoder's m = 0 tree (sums of log-probabilities), node for node."""
    _, alone, rows = served
    assert rows and all(r["rows"] == "eagle3" for r in rows)
    assert alone["recon_rows"] == 0
    assert_same([alone], Ours(live_run).decode(Shape(k=6, bw=6, m=0, gamma=8, budget=48), _prompts(live_run)[:1]))
