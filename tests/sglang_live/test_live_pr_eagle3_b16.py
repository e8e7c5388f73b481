"""`PR_EAGLE3` live at (k 4, B_w 4, m 2, gamma 4, B 16): one server; outputs equal plain greedy, and rounds,
accepted drafts, counters and every round's tree equal our decoder's at the same shape (tolerance zero;
see test_live_pr_eagle3.py for why zero holds)."""

from __future__ import annotations

import pytest

from tests.sglang_live.conftest import greedy
from tests.sglang_live.pr_eagle3 import MAX_NEW, Ours, Shape, assert_same, generate, round_log, served_counts, shared_pr

SHAPE = Shape(k=4, bw=4, m=2, gamma=4, budget=16)


@pytest.fixture(scope="module")
def served(live_run, shared):
    srv, rounds, _ = shared_pr(shared, live_run, SHAPE)
    outs = [generate(srv.port, p) for p in live_run["prompts"]]
    log = round_log(rounds)
    return [served_counts(o, log) for o in outs]


def test_shape_k4_bw4_m2_g4_b16_equals_our_decoder_and_plain_greedy(live_run, served, plain_server):
    assert [s["tokens"] for s in served] == [greedy(plain_server, p, MAX_NEW)["output_ids"] for p in live_run["prompts"]]
    assert_same(served, Ours(live_run).decode(SHAPE, live_run["prompts"]))
    assert sum(s["recon_rows"] for s in served) > 0
