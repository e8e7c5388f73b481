"""Issue 16's objective-side recipe options: isolated reconsideration gradients, the second head and the
adapter in the loss, and the balance term's normalisation."""

import pytest
import torch

from pr_specforge.config import PRConfig
from pr_specforge.modeling import PR_PARAM_PREFIXES
from pr_specforge.training.objective.ttt import OnlinePRModel
from tests.helpers import make_batch
from tests.objective.test_objective import TTT, eagle_grads, spec_forward
from tests.recipe_options.test_drafter_options import pr_drafter, randomise


def _forward(pr, batch, seed=0, **options):
    model = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=2, **options), generator=torch.Generator().manual_seed(seed))
    return model(**batch)


def _grads(model, prefix_ok):
    return {n: p.grad for n, p in model.named_parameters() if prefix_ok(n) and p.grad is not None and p.grad.any()}


@pytest.mark.parametrize("settings", [{}, {"recon_head": "separate", "recon_adapter_rank": 2}])
def test_isolated_one_pass_trains_exactly_as_eagle3(settings):
    eagle, pr = pr_drafter(**settings)
    with torch.no_grad():
        pr.pr_halt_gate.linear.bias.fill_(-1.0)  # most positions go deep: rollout B is busy
    if settings:
        randomise(pr.pr_recon_adapter, 0.05)
    batch = make_batch(eagle.config, pad_last=3)
    ref_loss, _, _ = spec_forward(eagle, batch)
    ref_loss.backward()
    out = _forward(pr, batch, recon_grad="isolated", **settings)
    out.loss.backward()
    torch.testing.assert_close(out.grad_terms["one_pass"], ref_loss)
    ref = eagle_grads(eagle)
    for name, p in pr.named_parameters():
        if name.startswith(PR_PARAM_PREFIXES) or name not in ref:
            continue
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # ... while every reconsideration-only parameter is trained by the routing terms
    pr_names = {n for n, _ in pr.named_parameters() if n.startswith(PR_PARAM_PREFIXES)}
    assert set(_grads(pr, lambda n: n.startswith(PR_PARAM_PREFIXES))) == pr_names


def test_full_gradients_reach_the_one_pass_drafter_and_differ_from_eagle3():
    eagle, pr = pr_drafter()
    batch = make_batch(eagle.config)
    ref_loss, _, _ = spec_forward(eagle, batch)
    ref_loss.backward()
    _forward(pr, batch).loss.backward()
    ref = eagle_grads(eagle)
    assert not torch.allclose(pr.midlayer.mlp.down_proj.weight.grad, ref["midlayer.mlp.down_proj.weight"], rtol=1e-4, atol=1e-6)


def test_separate_head_takes_the_reconsidered_readout_off_the_one_pass_head():
    eagle, pr = pr_drafter(recon_head="separate")
    batch = make_batch(eagle.config)
    out = _forward(pr, batch, recon_head="separate")
    out.grad_terms["reconsider"].backward()
    assert pr.lm_head.weight.grad is None or not pr.lm_head.weight.grad.any()
    assert pr.pr_recon_head.lm_head.weight.grad.any() and pr.pr_recon_head.norm.weight.grad.any()
    assert pr.midlayer.self_attn.q_proj.weight.grad.any()  # recon_grad: full still trains M
    pr.zero_grad()
    _, shared = pr_drafter()
    shared.load_state_dict(pr.state_dict(), strict=False)  # the same Q and gate
    out_shared = _forward(shared, batch)
    assert torch.equal(out.loss, out_shared.loss)  # a copied head changes nothing at init
    out_shared.grad_terms["reconsider"].backward()
    assert shared.lm_head.weight.grad.any()  # the shared head is trained by the reconsideration term


def test_adapter_trains_on_reconsideration_rows_only_and_starts_as_a_no_op():
    eagle, pr = pr_drafter(recon_adapter_rank=2)
    _, plain = pr_drafter()
    plain.load_state_dict(pr.state_dict(), strict=False)  # the same Q and gate
    batch = make_batch(eagle.config)
    out = _forward(pr, batch, recon_adapter_rank=2)
    assert torch.equal(out.loss, _forward(plain, batch).loss)
    out.grad_terms["one_pass"].backward(retain_graph=True)
    assert not _grads(pr, lambda n: n.startswith("pr_recon_adapter."))
    out.grad_terms["reconsider"].backward()
    ups = _grads(pr, lambda n: n.startswith("pr_recon_adapter.") and n.endswith("up.weight"))
    assert len(ups) == 7  # q, k, v, o, MLP gate / up / down


def test_balance_per_position_is_normalised_like_the_head_terms():
    eagle, pr = pr_drafter()
    batch = make_batch(eagle.config, pad_last=4)
    a = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=2), generator=torch.Generator().manual_seed(0))
    b = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=2, balance_norm="per_position"),
                      generator=torch.Generator().manual_seed(0))
    out_a, out_b = a(**batch, return_logits=True), b(**batch, return_logits=True)
    rows = batch["input_ids"].numel()
    scale = sum(0.8**j * pm.sum() for j, pm in enumerate(out_b.position_masks)) / rows
    assert 0.0 < float(scale) < sum(0.8**j for j in range(TTT)) and float(scale) != 1.0
    torch.testing.assert_close(out_b.terms["loss_balance"], out_a.terms["loss_balance"] * scale)
    torch.testing.assert_close(out_b.terms["loss_gate"], out_a.terms["loss_gate"])
