"""SGLang's own EAGLE-3 engine, live on this CPU, serves our exports (the bridge: `pr_specforge.sglang_cpu`).

Both sides run float32 and greedy: SGLang's chain (topk 1) must emit the plain server's tokens and
accept, prompt by prompt and round by round, what our evaluator's decoder accepts with the same
drafter at k = 1, B_w = 1, gamma = B = steps. Tolerance: none (equal counts). float32 removes bf16
rounding; the remaining kernel differences (SGLang's fused qkv / gate_up matmuls, its SDPA calls vs
transformers' eager attention) move logits by ~1e-6, far below the margins of the tiny target's
peaked argmaxes, and the test is seeded, so a near-tie would fail it every time, not at random.
One server start-up per module: SGLang's tree is test_live_tree.py's, a broken export test_live_broken_export.py's.
"""

from __future__ import annotations

import pytest

from tests.sglang_live.conftest import spec_args
from tests.sglang_live.eagle3 import CHAIN_STEPS, serve_prompts, served_tau


def test_chain_drafting_is_lossless_and_accepts_what_our_evaluator_accepts(live_run, plain, our_decoder, tmp_path):
    """The EAGLE-3 export (of the run's checkpoint as an `eagle3` run). The PR export served as EAGLE-3 is
    test_serve_script.py's, through the serve script, with the same checks."""
    served = serve_prompts(live_run, tmp_path / "server.log", *spec_args(live_run["eagle3"], CHAIN_STEPS, 1, CHAIN_STEPS + 1))
    reference = our_decoder(CHAIN_STEPS)
    assert [o["output_ids"] for o in served] == plain
    assert [r.tokens for r in reference] == plain
    for out, ref in zip(served, reference):  # rounds and accepted drafts, prompt by prompt
        meta = out["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (ref.rounds, sum(ref.accept_lengths) - ref.rounds)
    tau = served_tau(served)
    assert tau == pytest.approx(sum(sum(r.accept_lengths) for r in reference) / sum(r.rounds for r in reference))
    assert tau > 2.0, f"the trained drafter should accept most drafts on its own distribution, tau {tau}"
