"""The tensor draft tree against its oracle, the object tree: same nodes, scores, cut and mask;
fixed shapes, one host synchronisation and one call of M per step; the same decodes."""

import dataclasses

import pytest
import torch

from pr_specforge.eval.evaluator import EvalSettings
from pr_specforge.serving import SpeculativeDecoder, TensorTreeBuilder, TreeConfig, build_tree
from pr_specforge.serving.tensor_tree import DEPTH, PARENT, REPRICED, TOKEN, VALID, VIA
from tests.helpers import make_drafters
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime, tiny_target  # noqa: F401 (models: a fixture)

SHAPES = [
    TreeConfig(budget=24),  # the paper's shape
    TreeConfig(budget=48, k=4, bw=5, gamma=6, m=2),
    TreeConfig(budget=5, k=3, bw=6, gamma=4, m=1),  # a frontier smaller than B_w, a tight cut
    TreeConfig(budget=60, k=2, bw=2, gamma=3, m=3),  # a budget above the node count
]


def both(drafter, target, cfg, seed, reconsider=True):
    rt, root, feat = primed_runtime(drafter, target)
    cfg = cfg if reconsider else dataclasses.replace(cfg, m=0)
    ref = build_tree(rt, root, feat, cfg, torch.Generator().manual_seed(seed))
    got = TensorTreeBuilder(rt, cfg).build(root, feat, torch.Generator().manual_seed(seed), keep_state=True)
    return ref, got


def assert_same_tree(ref, got):
    """Every node (the valid slots, in slot order, are the object tree's nodes), the cut, the mask."""
    info, score = got.state["info"], got.state["score"]
    slots = info[:, VALID].bool().nonzero()[:, 0].tolist()
    node_of = {s: i for i, s in enumerate(slots)}
    assert len(slots) == len(ref.nodes)
    for i, s in enumerate(slots):
        n, row = ref.nodes[i], info[s].tolist()
        assert (row[TOKEN], row[DEPTH], bool(row[VIA]), bool(row[REPRICED])) == (n.token, n.depth, n.via_recon, n.repriced)
        assert i == 0 or node_of[row[PARENT]] == n.parent
        assert float(score[s]) == pytest.approx(n.score, abs=1e-4)  # fp32 GEMMs of other batch shapes
    assert [node_of[s] for s in got.kept] == ref.kept
    assert (got.tokens(), got.depths(), got.parents(), got.children()) == (ref.tokens(), ref.depths(), ref.parents(), ref.children())
    assert torch.equal(got.tree_mask(), ref.tree_mask())
    assert (got.recon_rows, got.recon_kept, got.repriced_kept, got.steps, got.halt_depths) == (
        ref.recon_rows, ref.recon_kept, ref.repriced_kept, ref.steps, ref.halt_depths)
    for j in range(len(ref.kept)):
        a, b = got.one_pass(j), ref.one_pass(j)
        assert (a is None) == (b is None)
        if a is not None:
            assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-5)  # fp32 GEMMs of other batch shapes
        assert got.via_recon(j) == ref.via_recon(j)


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"B{c.budget}k{c.k}w{c.bw}g{c.gamma}m{c.m}")
@pytest.mark.parametrize("bias", [-2.0, 0.0])
def test_tensor_tree_equals_object_tree(models, cfg, bias):
    """Both drafters, several shapes, gate biases and seeds (the seed drives admissions and halts)."""
    target, eagle, pr = models
    eager_gate(pr, bias)
    reconsidered = 0
    for drafter in (eagle, pr):
        for seed in (0, 1):
            ref, got = both(drafter, target, cfg, seed)
            assert_same_tree(ref, got)
            reconsidered += got.recon_rows
    assert reconsidered > 0


def test_tensor_tree_reconsiders_repricing_and_new_children(models):
    """The parity above is not vacuous: halts at both depths, repriced and reconsidered nodes kept."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    halts, recon_kept, repriced_kept = {}, 0, 0
    for seed in range(3):
        ref, got = both(pr, target, TreeConfig(budget=48), seed)
        assert_same_tree(ref, got)
        for d, c in got.halt_depths.items():
            halts[d] = halts.get(d, 0) + c
        recon_kept += got.recon_kept
        repriced_kept += got.repriced_kept
    assert halts.get(1, 0) > 0 and halts.get(2, 0) > 0
    assert recon_kept > 0 and repriced_kept > recon_kept


def test_tensor_tree_with_m0_is_the_eagle_tree(models):
    target, eagle, pr = models
    eager_gate(pr, -3.0)
    cfg = TreeConfig(budget=24, m=0)
    _, ref = both(eagle, target, cfg, 0)
    _, got = both(pr, target, cfg, 0)
    assert got.recon_rows == 0 and got.state["info"].shape == ref.state["info"].shape
    assert (got.tokens(), got.parents(), got.scores) == (ref.tokens(), ref.parents(), ref.scores)


def test_fixed_shapes_one_call_of_m_per_step_and_a_preallocated_cache(models, monkeypatch):
    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = TreeConfig(budget=24)
    rt, root, feat = primed_runtime(pr, target, n=9)
    builder = TensorTreeBuilder(rt, cfg)
    calls = []
    real = type(rt).forward_tree_rows
    monkeypatch.setattr(type(rt), "forward_tree_rows", lambda self, emb, *a: calls.append(emb.shape[0]) or real(self, emb, *a))
    first = builder.build(root, feat, torch.Generator().manual_seed(0), keep_state=True)
    assert calls == [cfg.bw + cfg.m] * (cfg.gamma - 1)  # frontier and reconsidered rows together, every step
    ctx_k, buf = rt.k_cache.clone(), rt.k_buf.data_ptr()
    rt2, root2, feat2 = primed_runtime(pr, target, n=13, seed=4)  # another context length, another tree
    second = TensorTreeBuilder(rt2, cfg).build(root2, feat2, torch.Generator().manual_seed(5), keep_state=True)
    for name, t in first.state.items():
        assert t.shape == second.state[name].shape, name
    builder.build(root, feat, torch.Generator().manual_seed(1))
    assert rt.k_buf.data_ptr() == buf and torch.equal(rt.k_cache, ctx_k)  # no reallocation, context untouched
    calls.clear()
    TensorTreeBuilder(rt, cfg, coforward=False).build(root, feat, torch.Generator().manual_seed(0))
    assert calls == [cfg.bw, cfg.m] * (cfg.gamma - 1)  # the serial baseline: two calls per step


def test_one_host_synchronisation_per_round(models, monkeypatch):
    """No tensor is read back on the host (item, tolist, bool, int, float) before the result's one copy."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    rt, root, feat = primed_runtime(pr, target)
    builder = TensorTreeBuilder(rt, TreeConfig(budget=24))
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    seen = []
    real_unpack = TensorTreeBuilder._unpack
    monkeypatch.setattr(TensorTreeBuilder, "_unpack", lambda self, *a: seen.append(list(reads)) or real_unpack(self, *a))
    tree = builder.build(root, feat, torch.Generator().manual_seed(0))
    assert seen == [[]] and tree.recon_rows > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tensor_and_object_builders_decode_identically(models, temperature):
    target, _, pr = models
    eager_gate(pr, -2.0)
    runs = []
    for builder in ("tensor", "object"):
        dec = SpeculativeDecoder(target, pr, TreeConfig(budget=24), tree_builder=builder)
        runs.append(dec.generate([5, 17, 33, 2, 9], 24, temperature=temperature, seed=3))
    a, b = runs
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert (a.recon_rows, a.recon_kept, a.repriced_kept, a.tree_sizes) == (b.recon_rows, b.recon_kept, b.repriced_kept, b.tree_sizes)
    assert a.recon_rows > 0 and len(a.diagnostics) == len(b.diagnostics)
    for x, y in zip(a.diagnostics, b.diagnostics):
        assert x[2:] == y[2:] and x[:2] == pytest.approx(y[:2], rel=1e-5)


def test_the_evaluator_uses_the_tensor_builder_unless_told_otherwise():
    assert EvalSettings().tree_builder == "tensor"
    with pytest.raises(ValueError, match="tree_builder"):
        EvalSettings(tree_builder="nodes")
    with pytest.raises(ValueError, match="tree_builder"):
        SpeculativeDecoder(tiny_target(), make_drafters()[0], TreeConfig(), tree_builder="nodes")


@pytest.mark.parametrize("gate_reads_normed", [True, False])
def test_readout_and_halt_is_log_probs_and_halt_probability(models, gate_reads_normed, monkeypatch):
    """The shared-norm readout the tensor builder uses gives exactly the separate calls' values."""
    target, _, pr = models
    eager_gate(pr, -1.0)
    monkeypatch.setattr(pr, "pr_settings", dataclasses.replace(pr.pr_settings, gate_reads_normed=gate_reads_normed))
    rt, _, _ = primed_runtime(pr, target)
    feats = torch.randn(5, pr.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logp, lam = rt.readout_and_halt(feats)
    assert torch.equal(logp, rt.log_probs(feats, 0)) and torch.equal(lam, rt.halt_probability(feats))


def test_a_head_sharp_enough_to_underflow_pi_mix_gives_no_nan(models):
    """Children whose pi_mix underflows to 0 (log -inf) must not turn the scores into NaN through `anc @ delta`
    (the tensor builder floors log pi_mix at -1e300), and pooled nodes whose bid is -inf are still picked:
    the object tree's tree."""
    import copy

    target, _, pr = models
    sharp = copy.deepcopy(pr)
    eager_gate(sharp, -2.0)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(3e3)  # log-probs of all but the top token far below -745: exp() is 0 in fp64
    ref, got = both(sharp, target, TreeConfig(budget=24), 0)
    assert got.recon_rows > 0 and sum(ref.halt_depths.values()) > 0
    assert any(n.score == float("-inf") for n in ref.nodes)  # the case happened in the oracle
    assert not torch.isnan(got.state["score"]).any()
    assert (got.tokens(), got.parents(), got.depths()) == (ref.tokens(), ref.parents(), ref.depths())
    # bids of -inf (max pi_one rounds to 1) are still carried before an empty pick, as in the object tree
    assert any(n.top1_prob == 1.0 and n.depth_r > 0 for n in ref.nodes)
    assert (got.recon_rows, got.halt_depths, got.recon_kept) == (ref.recon_rows, ref.halt_depths, ref.recon_kept)
    finite = [(a, b) for a, b in zip(got.scores, (ref.nodes[i].score for i in ref.kept)) if b > float("-inf")]
    assert finite and all(a == pytest.approx(b, rel=1e-3, abs=1e-4) for a, b in finite)  # fp32 GEMMs, a 3e3x head


def _kary_ancestors(k: int, depth: int) -> torch.Tensor:
    """`anc[x, c]`: node c is an ancestor-or-self of node x, in the full k-ary tree of `depth` levels below the root
    (nodes numbered level by level)."""
    n = sum(k**d for d in range(depth + 1))
    parent = [-1] + [(i - 1) // k for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    for x in range(n):
        c = x
        while c >= 0:
            anc[x, c] = True
            c = parent[c]
    return anc


def test_shift_terms_give_each_node_the_one_delta_of_each_row_it_lies_under():
    """Eq. 9's propagation (`tensor_tree.shift_terms`): per reconsidered row, a node gets the delta of the one child
    it lies under, else 0, exactly; nested rows (a row under another's child) each give their own term; an
    infinite delta reaches its own subtree only (masked, not multiplied: no NaN elsewhere); and a batch of trees
    gives each tree's terms."""
    from pr_specforge.serving.tensor_tree import shift_terms

    k, gen = 2, torch.Generator().manual_seed(0)
    anc = _kary_ancestors(k, 4)
    rows = [0, 1, 4]  # nested: node 1 is a child of 0, node 4 a child of 1
    kids = torch.tensor([[k * v + 1 + j for j in range(k)] for v in rows])
    delta = torch.randn(len(rows), k, dtype=torch.float64, generator=gen)
    delta[2, 1] = float("-inf")
    got = shift_terms(anc.index_select(1, kids.view(-1)), delta)
    want = torch.zeros(anc.shape[0], len(rows), dtype=torch.float64)
    for x in range(anc.shape[0]):
        for i in range(len(rows)):
            for j in range(k):
                if anc[x, kids[i, j]]:
                    want[x, i] = delta[i, j]
    assert torch.equal(got, want) and not got.isnan().any()
    assert (got != 0).sum(1).max() == len(rows)  # some node lies under all three rows: three terms, in row order
    other = torch.randn(len(rows), k, dtype=torch.float64, generator=gen)
    below = anc.index_select(1, kids.view(-1))
    both = shift_terms(torch.stack([below, below]), torch.stack([delta, other]))
    assert torch.equal(both[0], got) and torch.equal(both[1], shift_terms(below, other))
