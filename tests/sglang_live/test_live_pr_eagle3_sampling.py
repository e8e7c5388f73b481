"""`PR_EAGLE3` at temperature > 0 on a GPU (`scripts/gpu_pr_eagle3_check.sh`, `PR_SPECFORGE_LIVE_DEVICE=cuda`):
SGLang's own sampling verify (`eagle_sample`, target-only tree sampling) over a PR tree must be lossless, so each
emitted position's token distribution must equal plain sampling's. On this CPU a speculative server refuses
sampling per request (tests/sglang_live/test_live_pr_eagle3_faults.py), so this module is skipped here.

The test: one prompt, `N` requests at temperature 1 of `NEW` tokens each, seeds 0..N-1, on the PR server
(k 2, B_w 2, m 1, gamma 3, B 6) and on the plain server; at each position after the first (the first is the
prefill's, not a verify's) a two-sample chi-square test of homogeneity over the tokens (tokens seen fewer than 5
times in both samples pooled into one category) must not reject at `ALPHA`. Every response is checked whole (no
error, `NEW` tokens) and the server answers `/health` afterwards.
"""

from __future__ import annotations

import collections
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sglang_live.conftest import LIVE_DEVICE, post
from tests.sglang_live.pr_eagle3 import Shape, shared_pr

pytestmark = pytest.mark.skipif(LIVE_DEVICE != "cuda", reason="sampling verify needs SGLang's CUDA kernels")

SHAPE = Shape(k=2, bw=2, m=1, gamma=3, budget=6)
N, NEW, ALPHA = 2000, 4, 1e-3


def _samples(port, prompt):
    def one(seed):
        out = post(port, "/generate", {"input_ids": list(prompt), "sampling_params": {
            "temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True, "sampling_seed": seed}})
        assert len(out["output_ids"]) == NEW
        return out["output_ids"]

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(N)))


def _homogeneous(a, b) -> float:
    """The p-value of the two-sample chi-square test of homogeneity of token lists `a` and `b`."""
    from scipy.stats import chi2_contingency

    ca, cb = collections.Counter(a), collections.Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rows = [[ca[t] for t in common], [cb[t] for t in common]]
    rows[0].append(len(a) - sum(rows[0]))
    rows[1].append(len(b) - sum(rows[1]))
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:
        return 1.0
    return float(chi2_contingency(rows)[1])


def test_sampling_through_a_pr_tree_matches_plain_sampling_at_each_position(live_run, plain_server, shared):
    pytest.importorskip("scipy.stats")
    prompt = live_run["prompts"][0]
    srv, _, _ = shared_pr(shared, live_run, SHAPE, env={"PR_EAGLE3_CHECK_HOST_READS": "off"}, rounds=False,
                          name="pr-k2-sampling")
    port = srv.port
    served = _samples(port, prompt)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
    plain = _samples(plain_server, prompt)
    for pos in range(1, NEW):
        p = _homogeneous([s[pos] for s in served], [s[pos] for s in plain])
        assert p > ALPHA, f"position {pos}: PR_EAGLE3's sampled tokens differ from plain sampling's (p = {p:.2e})"
