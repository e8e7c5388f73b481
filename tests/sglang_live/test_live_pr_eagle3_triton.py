"""`PR_EAGLE3` live with its rows on SGLang's own Triton draft attention (`PR_EAGLE3_ROW_ATTENTION=triton`, the GPU
path): SGLang's `TritonAttnBackend` and its `decode_attention_fwd` kernel, run on this CPU by Triton's interpreter
(`TRITON_INTERPRET=1`, the bridge's environment), with two KV splits per row so the kernel's split merge runs.
Four concurrent requests at (k 2, B_w 2, m 1, gamma 3, B 6): outputs, verify rounds, accepted drafts, counters and
every round's tree equal our decoder's (tolerance zero, as test_live_pr_eagle3.py); every round ran on the Triton
rows, and the four requests shared a draft step's rows. SGLang's decode graph sizes are 2 and 4
(`--cuda-graph-bs-decode`): a captured round of 1 or 3 requests is padded to the next size with padding requests,
which change no tree (the request alone, at m = 0, runs every round padded to 2)."""

from __future__ import annotations


import pytest

from pr_specforge.sglang_plugin.round_graph import padded_size
from tests.sglang_live.conftest import LIVE_CUDA_GRAPH, LIVE_DEVICE
from tests.sglang_live.pr_eagle3 import (Ours, Shape, assert_same, generate, generate_together, pr_server, round_log,
                                         served_counts)

SHAPE = Shape(k=2, bw=2, m=1, gamma=3, budget=6)
GRAPH = "replay" if LIVE_DEVICE == "cuda" else "guard"  # PR_EAGLE3_ROUND_GRAPH=on: captured on CUDA, checked here
SIZES = [2, 4]  # SGLang's decode graph sizes: a captured round's batch is padded to one (with SGLang's graphs off on a
PADDED = LIVE_DEVICE == "cpu" or LIVE_CUDA_GRAPH  # GPU there are none to pad to: each batch size is captured as it is)


@pytest.fixture(scope="module")
def served(live_run, tmp_path_factory):
    ctx, rounds = pr_server(live_run, tmp_path_factory.mktemp("pr_eagle3_triton"), SHAPE,
                            # m = 0 drafted by PR's round (not SGLang's own draft): its graph and padding are tested
                            env={"PR_EAGLE3_ROW_ATTENTION": "triton", "PR_EAGLE3_ROUND_GRAPH": "on",
                                 "PR_EAGLE3_M0_DRAFT": "pr"},
                            args=("--triton-attention-num-kv-splits", "2", "--cuda-graph-bs-decode", *map(str, SIZES)))
    with ctx as port:
        outs = generate_together(port, live_run["prompts"])
        alone = generate(port, live_run["prompts"][1], m=0)
    log = round_log(rounds)
    return [served_counts(o, log) for o in outs], served_counts(alone, log), [r for rs in log.values() for r in rs]


def test_triton_rows_four_concurrent_requests_equal_our_decoder(live_run, served):
    concurrent, _, rounds = served
    assert len(concurrent) == 4
    assert_same(concurrent, Ours(live_run).decode(SHAPE, live_run["prompts"]))
    assert sum(s["recon_rows"] for s in concurrent) > 0 and sum(s["recon_kept"] for s in concurrent) > 0
    assert all(r["rows"] == "sglang" and r["attention"] == "triton" and r["graph"] == GRAPH for r in rounds)
    assert max(r["batch"] for r in rounds) == 4
    if PADDED:  # padded to the graph sizes; the request alone always (1 -> 2), and its trees equal ours
        assert all(r["graph_batch"] == padded_size(r["batch"], SIZES) for r in rounds)
        assert any(r["graph_batch"] > r["batch"] for r in rounds)


def test_triton_rows_m0_equals_our_decoders_m0_tree(live_run, served):
    _, alone, _ = served
    assert alone["recon_rows"] == 0
    assert_same([alone], Ours(live_run).decode(Shape(k=2, bw=2, m=0, gamma=3, budget=6), live_run["prompts"][1:2]))
