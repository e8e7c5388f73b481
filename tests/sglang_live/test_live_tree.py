"""SGLang's EAGLE-3 tree (topk 6, B 48, 8 steps) on this CPU serves our EAGLE-3 export losslessly, and its tau is
reported beside our evaluator's at the same shape: one server start-up. The server times its rounds
(`PR_EAGLE3_ROUND_TIMES`, what benchmarks/serving_cost.py reads for SGLang's EAGLE3), and they are checked."""

from __future__ import annotations

from tests.sglang_live.conftest import assert_round_times, spec_args
from tests.sglang_live.eagle3 import serve_prompts, served_tau


def test_tree_drafting_topk6_b48_is_lossless_and_reports_its_tau_next_to_ours(live_run, plain, our_decoder, tmp_path,
                                                                             record_property):
    times = tmp_path / "round_times.jsonl"
    served = serve_prompts(live_run, tmp_path / "server.log", *spec_args(live_run["eagle3"], 8, 6, 49),
                           env={"PR_EAGLE3_ROUND_TIMES": str(times)})
    assert [o["output_ids"] for o in served] == plain  # a verify that ignored the tree mask would not be
    assert_round_times(times, served)  # SGLang's own EAGLE3 rounds, timed by our plugin's wrappers
    pair = [0, len(served) - 1]  # one prompt of the training distribution, one off it (our k = 6 tree is slow on CPU)
    reference = our_decoder(8, k=6, budget=48, prompts=[live_run["prompts"][i] for i in pair])
    ours_tau = sum(sum(r.accept_lengths) for r in reference) / sum(r.rounds for r in reference)
    served = [served[i] for i in pair]
    record_property("sglang_tree_tau", served_tau(served))
    record_property("our_tree_tau", ours_tau)
    print(f"tree topk 6, B 48, 8 steps: SGLang tau {served_tau(served):.3f}, ours {ours_tau:.3f}")
    assert 1.0 <= served_tau(served) <= 9.0
