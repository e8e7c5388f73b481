"""What the live EAGLE-3 modules share: the chain's shape, our evaluator's decoder and served tau."""

from __future__ import annotations

from tests.sglang_live.conftest import greedy, sglang_server

CHAIN_STEPS = 3
MAX_NEW = 24


def serve_prompts(live_run, log, *args, env=None):
    """Each live prompt's greedy response from a server of the live target started with `args` (and `env`)."""
    with sglang_server(live_run["target"], log, *args, env=env) as port:
        return [greedy(port, p, MAX_NEW) for p in live_run["prompts"]]


def served_tau(outs):
    rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return (sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) + rounds) / rounds
