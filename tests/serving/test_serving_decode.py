"""The speculative decode loop: lossless at T = 0 (EAGLE-3 and PR drafters), seeded at T > 0."""

import pytest
import torch

from pr_specforge.serving import TREE_BUILDERS, SpeculativeDecoder, TreeConfig, autoregressive_decode
from tests.helpers import make_drafters
from tests.serving.test_serving_tree import eager_gate, sharpen, strong_self_query, tiny_target

PROMPTS = [[5, 17, 33, 2, 9, 41, 8], [60, 3, 3, 71, 12]]


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=1)
    eagle, pr, _ = make_drafters(max_depth=2)
    sharpen(eagle, pr)
    strong_self_query(pr)
    eager_gate(pr, -2.0)
    return target, eagle.eval(), pr.eval()


def test_greedy_output_equals_target_greedy_decode(setup):
    target, eagle, pr = setup
    for drafter in (eagle, pr):
        dec = SpeculativeDecoder(target, drafter, TreeConfig(budget=24))
        for prompt in PROMPTS:
            ref, _ = autoregressive_decode(target, prompt, 30)
            res = dec.generate(prompt, 30)
            assert res.tokens == ref
            assert sum(res.accept_lengths) + 1 >= 30
    assert res.recon_rows > 0  # the PR drafter really reconsidered


def oracle_draft(ref, prompt_len, real=SpeculativeDecoder.draft):
    """`SpeculativeDecoder.draft` that drafts as usual, then writes the target's greedy
    continuation along the deepest kept branch (either builder's tree)."""

    def wrapped(self, root_token, root_feature, gen):
        tree = real(self, root_token, root_feature, gen)
        i = self.rt.length - prompt_len  # the root is ref[i]
        assert ref[i] == root_token
        depths, parents = tree.depths(), tree.parents()
        u = max(range(len(depths)), key=lambda j: (depths[j], -j))
        chain = []
        while u > 0:
            chain.append(u)
            u = parents[u]
        for d, j in enumerate(reversed(chain), 1):
            if i + d < len(ref):
                if hasattr(tree, "nodes"):
                    tree.nodes[tree.kept[j]].token = ref[i + d]
                else:
                    tree.token_ids[j] = ref[i + d]
        return tree

    return wrapped


@pytest.mark.parametrize("builder", TREE_BUILDERS)
def test_long_accepted_paths_keep_cache_and_drafter_context_consistent(setup, monkeypatch, builder):
    """Deep acceptance through non-contiguous tree slots: the cache commit must stay exact."""
    target, eagle, pr = setup
    prompt = PROMPTS[0]
    ref, _ = autoregressive_decode(target, prompt, 60)
    monkeypatch.setattr(SpeculativeDecoder, "draft", oracle_draft(ref + [0] * 20, len(prompt)))
    for drafter in (eagle, pr):
        res = SpeculativeDecoder(target, drafter, TreeConfig(budget=24, gamma=6), tree_builder=builder).generate(prompt, 60)
        assert res.tokens == ref
        assert res.tau > 4.0


def test_sampling_is_seeded_and_complete(setup):
    target, _, pr = setup
    dec = SpeculativeDecoder(target, pr, TreeConfig(budget=12, gamma=4))
    a = dec.generate(PROMPTS[0], 25, temperature=1.0, seed=3)
    b = dec.generate(PROMPTS[0], 25, temperature=1.0, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 25
    assert all(0 <= t < target.config.vocab_size for t in a.tokens)


def test_eos_stops_decoding(setup):
    target, eagle, _ = setup
    ref, _ = autoregressive_decode(target, PROMPTS[1], 30)
    eos = ref[5]
    cut = ref[: ref.index(eos) + 1]
    res = SpeculativeDecoder(target, eagle, TreeConfig(budget=8)).generate(PROMPTS[1], 30, eos_token_id=eos)
    assert res.tokens == cut


def test_lazy_logits_decode_exactly_as_full_logits_with_fewer_head_rows(setup):
    """Acceptance reads the target's logits only on the path it walks; the output is unchanged."""
    target, _, pr = setup
    head = target.get_output_embeddings()
    rows = [0]
    hook = head.register_forward_hook(lambda m, inp, out: rows.__setitem__(0, rows[0] + inp[0].reshape(-1, inp[0].shape[-1]).shape[0]))
    try:
        runs = {}
        for lazy in (False, True):
            for temperature in (0.0, 1.0):
                rows[0] = 0
                dec = SpeculativeDecoder(target, pr, TreeConfig(budget=24), lazy_logits=lazy)
                res = dec.generate(PROMPTS[0], 30, temperature=temperature, seed=7)
                runs[lazy, temperature] = (res, rows[0])
    finally:
        hook.remove()
    for temperature in (0.0, 1.0):
        (full, full_rows), (lazy, lazy_rows) = runs[False, temperature], runs[True, temperature]
        assert lazy.tokens == full.tokens and lazy.accept_lengths == full.accept_lengths
        assert len(lazy.diagnostics) == len(full.diagnostics)
        for a, b in zip(lazy.diagnostics, full.diagnostics):
            assert a[2:] == b[2:] and a[:2] == pytest.approx(b[:2], rel=1e-5)
        assert lazy_rows < full_rows / 2  # the head ran on the walked path, not on every tree node


def test_output_head_is_refused_when_the_forward_transforms_its_logits(setup):
    """A target whose logits are not its output embedding's (a soft cap, a scale) keeps full logits."""
    import torch

    from pr_specforge.serving import output_head

    target, _, _ = setup
    with torch.no_grad():
        out = target(input_ids=torch.tensor([PROMPTS[0]]), output_hidden_states=True)
    hidden, logits = out.hidden_states[-1][0], out.logits[0]
    assert output_head(target, hidden, logits) is target.get_output_embeddings()
    cap = float(logits.abs().max()) / 2  # a soft cap that binds on the largest logits
    assert output_head(target, hidden, cap * torch.tanh(logits / cap)) is None
    assert output_head(target, hidden, 1.05 * logits) is None  # a logit scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_serving_check.py runs the full set)")
def test_cuda_decode_is_lossless_and_samples_with_a_cpu_generator(setup):
    target, eagle, pr = setup
    target, pr = target.to("cuda"), pr.to("cuda")
    try:
        dec = SpeculativeDecoder(target, pr, TreeConfig(budget=24))
        ref, _ = autoregressive_decode(target, PROMPTS[0], 20)
        assert dec.generate(PROMPTS[0], 20).tokens == ref
        a = dec.generate(PROMPTS[0], 20, temperature=1.0, seed=3)
        assert a.tokens == dec.generate(PROMPTS[0], 20, temperature=1.0, seed=3).tokens
    finally:
        target.to("cpu"), pr.to("cpu")
