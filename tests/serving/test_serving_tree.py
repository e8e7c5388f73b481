"""The draft tree: EAGLE degeneracy of PR, invariants, exact tree attention, bad input."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pr_specforge.serving import DrafterRuntime, TreeConfig, build_tree, tree_mask
from tests.helpers import make_drafters


def tiny_target(seed=0, vocab=97, hidden=64, layers=4):
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def primed_runtime(drafter, target, n=9, seed=3):
    """A runtime whose context holds n rows (random target-like features)."""
    rt = DrafterRuntime(drafter.eval(), target)
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3 * target.config.hidden_size, generator=g)
    toks = torch.randint(1, target.config.vocab_size, (n,), generator=g)
    root_feature = rt.extend(aux, toks)[-1]
    return rt, int(toks[-1]), root_feature


def draft(drafter, target, cfg, reconsider=True, seed=0):
    rt, root, feat = primed_runtime(drafter, target)
    cfg = cfg if reconsider else dataclasses.replace(cfg, m=0)
    return build_tree(rt, root, feat, cfg, torch.Generator().manual_seed(seed)), rt


def signature(tree):
    nodes = [(n.token, n.parent, n.depth, n.score, n.via_recon) for n in tree.nodes]
    return nodes, tree.kept


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    eagle, pr, _ = make_drafters(max_depth=2)
    sharpen(eagle, pr)
    strong_self_query(pr)
    return target, eagle.eval(), pr.eval()


def sharpen(*drafters, seed=0):
    """Give identical drafters a random head with peaked distributions (std-0.02 heads are ~uniform)."""
    g = torch.Generator().manual_seed(seed)
    names = ["lm_head.weight"] + [n for n, p in drafters[0].named_parameters() if n.startswith("midlayer.") and p.dim() == 2]
    with torch.no_grad():
        for name in names:
            ref = drafters[0].get_parameter(name)
            w = torch.randn(ref.shape, generator=g) * (1.0 if name == "lm_head.weight" else 0.15)
            for d in drafters:
                d.get_parameter(name).copy_(w)


def strong_self_query(pr, seed=0):
    """A random self-query large enough that reconsidered rows propose new tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (pr.pr_self_query.w_in.weight, pr.pr_self_query.w_out.weight):
            w.copy_(torch.randn(w.shape, generator=g) * 0.5)


def eager_gate(pr, bias):
    pr.pr_halt_gate.linear.bias.data.fill_(bias)


def test_pr_tree_with_m0_is_the_eagle_tree(models):
    target, eagle, pr = models
    eager_gate(pr, -3.0)  # the pool fills up, but m = 0 carries nobody
    cfg = TreeConfig(budget=24, m=0)
    ref, _ = draft(eagle, target, cfg)
    got, _ = draft(pr, target, cfg)
    assert got.recon_rows == 0
    assert signature(got) == signature(ref)


def test_pr_tree_with_gate_halting_at_depth0_is_the_eagle_tree(models):
    target, eagle, pr = models
    eager_gate(pr, 100.0)
    for budget in (24, 48):
        cfg = TreeConfig(budget=budget, m=3)
        ref, _ = draft(eagle, target, cfg)
        got, _ = draft(pr, target, cfg)
        assert got.recon_rows == 0 and got.recon_kept == 0 and got.repriced_kept == 0
        assert signature(got) == signature(ref)


def test_reconsidered_tree_invariants(models):
    target, _, pr = models
    eager_gate(pr, -2.0)
    for budget, seed in ((24, 0), (48, 1), (5, 2)):
        cfg = TreeConfig(budget=budget, k=6, bw=6, gamma=8, m=3)
        tree, _ = draft(pr, target, cfg, seed=seed)
        nodes = tree.nodes
        assert tree.recon_rows > 0 and any(n.via_recon for n in nodes)
        assert len(tree.kept) - 1 == min(budget, len(nodes) - 1)
        # the room-under-the-cut counters count exactly the kept nodes reconsideration proposed / moved
        assert tree.recon_kept == sum(nodes[i].via_recon for i in tree.kept)
        assert tree.recon_kept <= tree.repriced_kept <= budget
        for i, n in enumerate(nodes[1:], 1):  # a repriced node's whole subtree was shifted with it
            if n.repriced:
                assert all(nodes[c].repriced for c in n.children)
        kept = set(tree.kept)
        assert tree.kept[0] == 0
        for i in tree.kept[1:]:
            assert nodes[i].parent in kept
        for i, n in enumerate(nodes[1:], 1):
            assert n.score <= nodes[n.parent].score
            assert n.depth == nodes[n.parent].depth + 1 <= cfg.gamma
        # the kept set is the top-B by score
        others = [nodes[i].score for i in range(1, len(nodes)) if i not in kept]
        if others:
            assert min(nodes[i].score for i in tree.kept[1:]) >= max(others)
        # mask == ancestor-or-self relation
        mask = tree.tree_mask()
        for a, ia in enumerate(tree.kept):
            anc, u = {ia}, ia
            while nodes[u].parent >= 0:
                u = nodes[u].parent
                anc.add(u)
            for b, ib in enumerate(tree.kept):
                assert bool(mask[a, b]) == (ib in anc)


def test_repricing_follows_eq9(models):
    target, _, pr = models
    eager_gate(pr, -2.0)
    tree, _ = draft(pr, target, TreeConfig(budget=48), seed=4)
    halted = [n for n in tree.nodes if n.halt_depth >= 1]
    assert halted
    for v in halted:
        pi_one, pi_d = v.logp_one.double().exp(), v.recon_logp.double().exp()
        mix = pi_one + v.q_halt * (pi_d - pi_one)
        assert 0 < v.q_halt <= 1
        for c in v.children:
            child = tree.nodes[c]
            torch.testing.assert_close(child.score - v.score, float(torch.log(mix[child.draft_id])), rtol=0, atol=1e-9)


def test_tree_attention_sees_only_ancestors(models):
    """Recompute nodes from their own branch alone: same features as in the batched tree."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    tree, rt = draft(pr, target, TreeConfig(budget=24), seed=5)
    checked = 0
    for i, n in enumerate(tree.nodes[1:], 1):
        if n.feature is None or n.depth < 2:
            continue
        parent = tree.nodes[n.parent]
        # rebuild the branch's rows from scratch: ancestors as this branch sees them
        anc_k, anc_v = [], []
        u, slots = n, []
        while u.parent >= 0:
            p = tree.nodes[u.parent]
            slots.append((p, u.via_recon))
            u = p
        for p, via_recon in reversed(slots):
            if p.parent < 0:
                anc_k.append(rt.k_cache[:, -1]); anc_v.append(rt.v_cache[:, -1])
                continue
            pp = tree.nodes[p.parent]
            k_list, v_list = torch.stack(anc_k), torch.stack(anc_v)
            hidden = pp.recon_feature if p.via_recon else pp.feature
            _, k, v = rt.forward_rows(rt.embed(torch.tensor([p.token])), hidden[None],
                                      torch.tensor([rt.length - 1 + p.depth]), rt.length - 1,
                                      k_list, v_list, [list(range(len(anc_k)))])
            if via_recon:  # replay v's reconsideration passes up to its halt depth
                f = p.feature
                for _ in range(p.halt_depth):
                    f, k, v = rt.forward_rows(rt.drafter.self_query(f[None]), f[None],
                                              torch.tensor([rt.length - 1 + p.depth]), rt.length - 1,
                                              k_list, v_list, [list(range(len(anc_k)))])
                    f = f[0]
            anc_k.append(k[0]); anc_v.append(v[0])
        hidden = parent.recon_feature if n.via_recon else parent.feature
        feat, _, _ = rt.forward_rows(rt.embed(torch.tensor([n.token])), hidden[None],
                                     torch.tensor([rt.length - 1 + n.depth]), rt.length - 1,
                                     torch.stack(anc_k), torch.stack(anc_v), [list(range(len(anc_k)))])
        torch.testing.assert_close(feat[0], n.feature, rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked > 5


def test_extend_and_row_forward_agree(models):
    """A context row computed by `extend` equals the same row through `forward_rows`."""
    target, eagle, _ = models
    rt, _, _ = primed_runtime(eagle, target, n=6)
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(1, 3 * 64, generator=g)
    tok = torch.tensor([11])
    hidden = eagle.project_hidden_states(aux)
    row_feat, _, _ = rt.forward_rows(rt.embed(tok), hidden, torch.tensor([6]), 6,
                                     rt.k_cache[:, :0].transpose(0, 1), rt.v_cache[:, :0].transpose(0, 1), [[]])
    ext_feat = rt.extend(aux, tok)
    torch.testing.assert_close(row_feat, ext_feat, rtol=1e-5, atol=1e-6)


def test_tree_mask_is_ancestor_relation():
    parents = [-1, 0, 0, 1, 3, 2]
    expect = torch.tensor([
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree_mask(parents), expect)


@pytest.mark.parametrize("field,kwargs", [("budget", dict(budget=0)), ("k", dict(k=0)), ("gamma", dict(gamma=0)), ("m", dict(m=-1)), ("bw", dict(bw=0))])
def test_bad_tree_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        TreeConfig(**kwargs)


def test_k_larger_than_draft_vocab_is_rejected(models):
    target, eagle, _ = models
    rt, root, feat = primed_runtime(eagle, target)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_tree(rt, root, feat, TreeConfig(k=eagle.lm_head.out_features + 1))


def test_drafter_target_mismatch_is_a_clear_error():
    eagle, _, _ = make_drafters()
    with pytest.raises(ValueError, match="vocab_size"):
        DrafterRuntime(eagle, tiny_target(vocab=101))
    with pytest.raises(ValueError, match="hidden_size"):
        DrafterRuntime(eagle, tiny_target(hidden=32))


def test_coforward_and_serial_reconsideration_build_the_same_tree(models):
    """Co-forwarding is an execution order, not a different algorithm (Appendix A.1)."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    rt, root, feat = primed_runtime(pr, target)
    cfg = TreeConfig(budget=24)
    a = build_tree(rt, root, feat, cfg, torch.Generator().manual_seed(9), coforward=True)
    b = build_tree(rt, root, feat, cfg, torch.Generator().manual_seed(9), coforward=False)
    assert a.recon_rows > 0 and a.kept == b.kept
    for x, y in zip(a.nodes, b.nodes):
        assert (x.token, x.parent, x.via_recon) == (y.token, y.parent, y.via_recon)
        assert abs(x.score - y.score) < 1e-4  # fp32 GEMMs of different batch shapes
