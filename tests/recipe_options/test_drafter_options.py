"""Issue 16's drafter-side recipe options: the second head, the reconsideration-only adapter, the gate bias."""

import pytest
import torch

from pr_specforge.config import ConfigError, PRConfig
from pr_specforge.modeling import PR_PARAM_PREFIXES, LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
from pr_specforge.serving import DrafterRuntime, TreeConfig, build_tree
from tests.helpers import make_drafters
from tests.serving.test_serving_tree import primed_runtime, sharpen, strong_self_query, tiny_target


def pr_drafter(seed=0, **settings):
    eagle, _, _ = make_drafters(max_depth=2, seed=seed)
    pr = LlamaForCausalLMEagle3PR(build_pr_config(eagle.config, PRDraftSettings(max_depth=2, **settings))).float()
    missing, unexpected = pr.load_state_dict(eagle.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(PR_PARAM_PREFIXES) for k in missing)
    pr.copy_one_pass_head()
    return eagle, pr


def randomise(module, scale, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_default_settings_add_no_tensors():
    _, pr, missing = make_drafters(max_depth=2)
    assert {k.split(".")[0] for k in missing} == {"pr_self_query", "pr_halt_gate"}
    assert not hasattr(pr, "pr_recon_head") and not hasattr(pr, "pr_recon_adapter")
    f = torch.randn(3, 5, 64)
    assert torch.equal(pr.depth_logits(f, 1), pr.compute_logits(f))


def test_separate_head_starts_as_the_one_pass_head_and_is_its_own_readout():
    _, pr = pr_drafter(recon_head="separate")
    f = torch.randn(2, 7, 64)
    assert torch.equal(pr.depth_logits(f, 0), pr.compute_logits(f))
    assert torch.equal(pr.depth_logits(f, 2), pr.compute_logits(f))  # a copy at init
    randomise(pr.pr_recon_head, 0.3)
    deep = pr.pr_recon_head.lm_head(pr.pr_recon_head.norm(f))
    torch.testing.assert_close(pr.depth_logits(f, 1), deep)
    depths = torch.tensor([[0, 1, 2, 0, 0, 1, 0], [2, 2, 0, 0, 1, 0, 0]])
    mixed = pr.depth_logits(f, depths)
    want = torch.where((depths > 0)[..., None], deep, pr.compute_logits(f))
    assert torch.equal(mixed, want)
    # the one-pass readout is untouched by the second head's parameters
    assert torch.equal(pr.depth_logits(f, 0), pr.compute_logits(f))


def _rows(pr, n=4, t=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb, hidden = torch.randn(n, t, 64, generator=g), torch.randn(n, t, 64, generator=g)
    pos = torch.arange(t)[None].expand(n, t) + 2
    return emb, hidden, pos


def _layer(pr, emb, hidden, pos, recon_rows):
    q, k, v = pr.layer_qkv(emb, hidden, pos, recon_rows=recon_rows)
    return q, k, v, pr.layer_finish(q, hidden, recon_rows)  # attention replaced by q: enough to reach o and the MLP


def test_adapter_is_off_on_one_pass_rows_and_fresh_adapter_changes_nothing():
    _, plain = pr_drafter()
    _, pr = pr_drafter(recon_adapter_rank=4)
    emb, hidden, pos = _rows(pr)
    recon = torch.tensor([False, True, False, True])
    ref = _layer(plain, emb, hidden, pos, None)
    for got in (_layer(pr, emb, hidden, pos, recon), _layer(pr, emb, hidden, pos, None)):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    randomise(pr.pr_recon_adapter, 0.2)
    got = _layer(pr, emb, hidden, pos, recon)
    for a, b in zip(got, ref):  # one-pass rows: bit-identical to no adapter; reconsideration rows: changed
        assert torch.equal(a[~recon], b[~recon])
        assert not torch.allclose(a[recon], b[recon])
    # one batched call == the reconsideration rows run on their own with the adapter on
    alone = _layer(pr, emb[recon], hidden[recon], pos[recon], torch.ones(2, dtype=torch.bool))
    for a, b in zip(got, alone):
        torch.testing.assert_close(a[recon], b, rtol=1e-5, atol=1e-6)


def test_adapter_gets_gradient_only_from_reconsideration_rows():
    _, pr = pr_drafter(recon_adapter_rank=2)
    randomise(pr.pr_recon_adapter, 0.2)
    emb, hidden, pos = _rows(pr)
    q, k, v, out = _layer(pr, emb, hidden, pos, torch.tensor([True, False, False, False]))
    (out[1:].sum() + k[1:].sum() + v[1:].sum()).backward()
    assert all(p.grad is None or not p.grad.any() for p in pr.pr_recon_adapter.parameters())
    pr.zero_grad()
    q, k, v, out = _layer(pr, emb, hidden, pos, torch.tensor([True, False, False, False]))
    (out[:1].sum() + k[:1].sum() + v[:1].sum()).backward()
    assert all(p.grad is not None and p.grad.any() for p in pr.pr_recon_adapter.parameters())


def test_gate_init_bias_sets_lambda_everywhere():
    from pr_specforge.training.registration import prepare_draft

    _, pr = pr_drafter()
    prepare_draft(pr, PRConfig(gate_init_bias=-1.5))
    lam = pr.halt_probability(torch.randn(3, 64))
    torch.testing.assert_close(lam, torch.sigmoid(torch.tensor(-1.5)).expand(3))


@pytest.mark.parametrize("field,value", [("gate_init_bias", "x"), ("init_from", ""), ("freeze_one_pass", "yes")])
def test_bad_option_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"pr.{field}"):
        PRConfig(**{field: value})


def test_freezing_with_nothing_to_train_is_refused():
    with pytest.raises(ConfigError, match="pr.freeze_one_pass"):
        PRConfig(max_depth=0, freeze_one_pass=True)


def test_serving_tree_reads_reconsidered_depths_through_the_second_head():
    """With the second head's lm_head zeroed, pi_{d_v} is uniform: every halted node's recon_logp says so,
    while the one-pass proposals (and an m = 0 tree) are the shared-head drafter's."""
    target = tiny_target()
    eagle, pr = pr_drafter(recon_head="separate")
    _, shared = pr_drafter()
    sharpen(eagle, pr, shared)
    strong_self_query(pr)
    strong_self_query(shared)
    pr.copy_one_pass_head()
    with torch.no_grad():
        pr.pr_recon_head.lm_head.weight.zero_()
        for d in (pr, shared):
            d.pr_halt_gate.linear.bias.fill_(-2.0)
    trees = {}
    for name, d in (("separate", pr), ("shared", shared)):
        rt, root, feat = primed_runtime(d.eval(), target)
        trees[name] = build_tree(rt, root, feat, TreeConfig(budget=48, m=3), torch.Generator().manual_seed(0))
        trees[name + "_m0"] = build_tree(rt, root, feat, TreeConfig(budget=48, m=0), True, torch.Generator().manual_seed(0))
    halted = [n for n in trees["separate"].nodes if n.halt_depth > 0]
    assert halted
    uniform = torch.full((48,), -torch.log(torch.tensor(48.0)).item())
    for n in halted:
        torch.testing.assert_close(n.recon_logp, uniform)
    assert all(not torch.allclose(n.recon_logp, uniform) for n in trees["shared"].nodes if n.halt_depth > 0)
    sig = lambda t: [(n.token, n.parent, n.score) for n in t.nodes]  # noqa: E731
    assert sig(trees["separate_m0"]) == sig(trees["shared_m0"])


def test_both_tree_builders_agree_for_a_drafter_with_second_head_and_adapter():
    """The tensor builder reads out and adapts reconsideration rows as the object builder does."""
    from tests.serving.test_serving_tensor_tree import assert_same_tree, both

    target = tiny_target()
    eagle, pr = pr_drafter(recon_head="separate", recon_adapter_rank=3)
    sharpen(eagle, pr)
    strong_self_query(pr)
    randomise(pr.pr_recon_head, 0.5, seed=7)
    randomise(pr.pr_recon_adapter, 0.1, seed=8)
    with torch.no_grad():
        pr.pr_halt_gate.linear.bias.fill_(-2.0)
    ref, got = both(pr.eval(), target, TreeConfig(budget=24), seed=0)
    assert ref.recon_rows > 0
    assert_same_tree(ref, got)
