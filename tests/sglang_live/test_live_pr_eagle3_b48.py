"""`PR_EAGLE3` live at (k 6, B_w 6, m 3, gamma 8, B 48), the paper's shape: one server; outputs equal plain greedy, and rounds,
accepted drafts, counters and every round's tree equal our decoder's at the same shape (tolerance zero;
see test_live_pr_eagle3.py for why zero holds). Two prompts (one of the training distribution, one off
it): this tree is the slowest on the CPU, for both sides."""

from __future__ import annotations

import pytest

from tests.sglang_live.conftest import greedy
from tests.sglang_live.pr_eagle3 import MAX_NEW, Ours, Shape, assert_same, generate, pr_server, round_log, served_counts


def _prompts(live_run):
    return [live_run["prompts"][0], live_run["prompts"][-1]]


SHAPE = Shape(k=6, bw=6, m=3, gamma=8, budget=48)


@pytest.fixture(scope="module")
def served(live_run, tmp_path_factory):
    ctx, rounds = pr_server(live_run, tmp_path_factory.mktemp("pr_eagle3_b48"), SHAPE)
    with ctx as port:
        outs = [generate(port, p) for p in _prompts(live_run)]
    log = round_log(rounds)
    return [served_counts(o, log) for o in outs]


def test_shape_k6_bw6_m3_g8_b48_equals_our_decoder_and_plain_greedy(live_run, served, plain_server):
    assert [s["tokens"] for s in served] == [greedy(plain_server, p, MAX_NEW)["output_ids"] for p in _prompts(live_run)]
    assert_same(served, Ours(live_run).decode(SHAPE, _prompts(live_run)))
    assert sum(s["recon_rows"] for s in served) > 0
