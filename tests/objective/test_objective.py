"""The PR objective against SpecForge's EAGLE-3 TTT model, and the invariants of Eq. 4-7."""

import math

import pytest
import torch

from pr_specforge._specforge import OnlineEagle3Model
from pr_specforge.config import PRConfig
from pr_specforge.modeling import PR_PARAM_PREFIXES, halting_distribution
from pr_specforge.training.objective.ttt import OnlinePRModel, _Group, marginal_entropy
from tests.helpers import make_batch, make_drafters

TTT = 4


class LogitRecorder:
    """Records every `compute_logits` output of a drafter (SpecForge returns none)."""

    def __init__(self, draft):
        self.logits = []
        original = draft.compute_logits

        def wrapped(h):
            out = original(h)
            self.logits.append(out)
            return out

        draft.compute_logits = wrapped


def spec_forward(eagle, batch, length=TTT):
    rec = LogitRecorder(eagle)
    model = OnlineEagle3Model(eagle, length=length)
    plosses = model(**batch)[0]
    loss = sum(0.8**i * p for i, p in enumerate(plosses))
    return loss, plosses, rec.logits


def eagle_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pad_last", [0, 5])
def test_r0_equals_specforge_loss_logits_and_gradients(pad_last):
    eagle, pr, _ = make_drafters(max_depth=0)
    batch = make_batch(eagle.config, pad_last=pad_last)
    ref_loss, ref_plosses, ref_logits = spec_forward(eagle, batch)
    ref_loss.backward()

    out = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=0))(**batch, return_logits=True)
    out.loss.backward()

    torch.testing.assert_close(out.loss, ref_loss)
    for a, b in zip(out.plosses, ref_plosses):
        torch.testing.assert_close(a, b)
    valid = batch["attention_mask"].bool()
    for a, b in zip(out.logits, ref_logits):
        torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
    ref = eagle_grads(eagle)
    got = eagle_grads(pr)
    assert set(ref) == set(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def _force_halt_at_zero(pr):
    with torch.no_grad():
        pr.pr_halt_gate.linear.weight.zero_()
        pr.pr_halt_gate.linear.bias.fill_(100.0)  # lambda_0 == 1.0 exactly in fp32


def test_gate_forced_to_depth0_keeps_one_pass_term_logits_and_eagle_gradients():
    eagle, pr, _ = make_drafters(max_depth=2)
    _force_halt_at_zero(pr)
    batch = make_batch(eagle.config)
    ref_loss, ref_plosses, ref_logits = spec_forward(eagle, batch)
    ref_loss.backward()

    out = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=2))(**batch, return_logits=True)
    out.loss.backward()

    torch.testing.assert_close(out.grad_terms["one_pass"], ref_loss)
    for a, b in zip(out.logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(bool((d == 0).all()) for d in out.halt_depths)
    ref = eagle_grads(eagle)
    for name, p in pr.named_parameters():
        if name.startswith(PR_PARAM_PREFIXES) or name not in ref:
            continue
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # With every position halting at 0 the mixed rollout IS the one-pass rollout.
    for j, depth_logits in enumerate(out.depth_logits):
        torch.testing.assert_close(depth_logits[0], out.logits[j], rtol=1e-5, atol=1e-5)


def test_reconsideration_row_equals_specforge_layer_with_cache_before_its_step():
    """A reconsideration row at TTT step j == SpecForge's own midlayer, fed (Q(f_j), f_j),
    attending through SpecForge's cache lists of steps 0..j-1 plus its own key."""
    eagle, pr, _ = make_drafters(max_depth=1)
    _force_halt_at_zero(pr)  # the mixed chain then holds exactly the one-pass keys
    batch = make_batch(eagle.config, batch=1)
    model = OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=1))
    with torch.no_grad():
        out = model(**batch, return_logits=True)
        # Re-run SpecForge's TTT loop on the same weights, keeping its cache and features.
        draft = pr
        h = draft.project_hidden_states(batch["hidden_states"])
        mask = draft.prepare_decoder_attention_mask(batch["attention_mask"].bool(), h, 1, h.shape[1], 0)
        pos = torch.arange(h.shape[1])[None]
        cache = [[], []]
        ids = batch["input_ids"]
        for j in range(TTT):
            snapshot = [list(cache[0]), list(cache[1])]  # keys of steps 0..j-1
            h = draft.backbone(draft.embed_input_ids(ids), h, cache, mask, pos)  # f_j
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            if j >= 1:  # (at j = 0 SpecForge's cache path would make the rows attend to each other)
                f1 = draft.backbone(draft.self_query(h), h, snapshot, mask, pos)
                torch.testing.assert_close(out.depth_logits[j][1], draft.compute_logits(f1), rtol=1e-5, atol=1e-5)


def test_coforwarded_groups_equal_each_group_forwarded_alone():
    _, pr, _ = make_drafters(max_depth=2)
    cfg = pr.config
    torch.manual_seed(3)
    b, t, d = 2, 12, cfg.hidden_size
    model = OnlinePRModel(pr, length=TTT)
    from pr_specforge.modeling.attention import strict_causal_mask

    ctx_mask, start_mask = strict_causal_mask(torch.ones(b, t, dtype=torch.long), torch.float32)
    pos = torch.arange(t)[None]
    kv = lambda: (torch.randn(b, cfg.num_attention_heads, t, d // cfg.num_attention_heads),) * 2  # noqa: E731
    ctx, c1, c2 = kv(), kv(), kv()
    groups = [
        _Group(torch.randn(b, t, d), torch.randn(b, t, d), 3, [c1, c2], ctx),  # a one-pass row at step 3
        _Group(torch.randn(b, t, d), torch.randn(b, t, d), 2, [c1], ctx),  # a reconsideration row at step 2
        _Group(torch.randn(b, t, d), torch.randn(b, t, d), 0, [], ctx),  # a reconsideration row at step 0
    ]
    with torch.no_grad():
        together = model._run(groups, pos, ctx_mask, start_mask)
        for g, (feat, (k, v)) in zip(groups, together):
            alone_feat, (alone_k, alone_v) = model._run([g], pos, ctx_mask, start_mask)[0]
            torch.testing.assert_close(feat, alone_feat, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k, alone_k)
        # And each row of a group equals that row computed on its own (no leakage across rows).
        g = groups[1]
        full = model._run([g], pos, ctx_mask, start_mask)[0][0]
        for row in range(t):
            cut = _Group(g.emb[:, : row + 1], g.hidden[:, : row + 1], g.step,
                         [(k[..., : row + 1, :], v[..., : row + 1, :]) for k, v in g.chain],
                         (g.ctx[0][..., : row + 1, :], g.ctx[1][..., : row + 1, :]))
            m, s = strict_causal_mask(torch.ones(b, row + 1, dtype=torch.long), torch.float32)
            part = model._run([cut], pos[:, : row + 1], m, s)[0][0]
            torch.testing.assert_close(part[:, row], full[:, row], rtol=1e-5, atol=1e-5)


def test_q_sums_to_one_and_cap_is_product_of_continuations():
    lambdas = torch.rand(5, 7, 3)
    q = halting_distribution(lambdas)
    torch.testing.assert_close(q.sum(-1), torch.ones(5, 7))
    torch.testing.assert_close(q[..., 3], torch.prod(1 - lambdas, dim=-1))
    torch.testing.assert_close(q[..., 1], lambdas[..., 1] * (1 - lambdas[..., 0]))
    # and inside the model
    _, pr, _ = make_drafters(max_depth=2)
    with torch.no_grad():
        pr.pr_halt_gate.linear.weight.normal_(0, 1.0)
    out = OnlinePRModel(pr, length=TTT)(**make_batch(pr.config), return_logits=True)
    for q in out.q:
        torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:-1]))


def _grad(term, params):
    grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


@pytest.mark.parametrize("detach", [True, False])
def test_stop_gradients(detach):
    _, pr, _ = make_drafters(max_depth=2)
    with torch.no_grad():
        pr.pr_halt_gate.linear.weight.normal_(0, 0.5)
    out = OnlinePRModel(pr, length=TTT, pr=PRConfig(gate_detach_input=detach))(**make_batch(pr.config))
    gate_params = list(pr.pr_halt_gate.parameters())
    head = [pr.lm_head.weight]
    layer = list(pr.midlayer.parameters()) + list(pr.pr_self_query.parameters()) + [pr.fc.weight]
    # head terms never reach the gate
    for term in ("one_pass", "reconsider"):
        assert all(float(g.abs().max()) == 0.0 for g in _grad(out.grad_terms[term], gate_params)), term
    # gate term never reaches the lm_head, and does reach the gate
    assert float(_grad(out.grad_terms["gate"], head)[0].abs().max()) == 0.0
    assert any(float(g.abs().max()) > 0 for g in _grad(out.grad_terms["gate"], gate_params))
    # the reconsidered heads are trained by the reconsider term
    assert float(_grad(out.grad_terms["reconsider"], head)[0].abs().max()) > 0
    layer_grad = max(float(g.abs().max()) for g in _grad(out.grad_terms["gate"], layer))
    if detach:
        assert layer_grad == 0.0  # the gate reads a detached feature: routing trains the gate alone
    else:
        assert layer_grad > 0.0


def test_reconsider_weight_use_follows_the_gate_and_uniform_does_not():
    """`use` (the paper) weights l^r by sg[q(r)]; `uniform` trains every depth's head at weight 1.

    With a one-step mixed rollout the depth features do not depend on the gate, so only the
    weighting can make the reconsider term move with the gate's bias.
    """
    values = {}
    for weight in ("use", "uniform"):
        for bias in (-2.0, 2.0):
            _, pr, _ = make_drafters(max_depth=2, seed=4)
            with torch.no_grad():
                pr.pr_halt_gate.linear.bias.fill_(bias)
            cfg = PRConfig(reconsider_weight=weight, mixed_rollout_length=1)
            out = OnlinePRModel(pr, length=TTT, pr=cfg, generator=torch.Generator().manual_seed(0))(**make_batch(pr.config))
            values[weight, bias] = float(out.terms["loss_reconsider"])
            gate_params = list(pr.pr_halt_gate.parameters())
            assert all(float(g.abs().max()) == 0.0 for g in _grad(out.grad_terms["reconsider"], gate_params))
    assert values["uniform", -2.0] == pytest.approx(values["uniform", 2.0], rel=1e-6)
    assert values["use", -2.0] > 2 * values["use", 2.0]  # gate open: deeper depths are used, so weighted more
    assert values["uniform", 2.0] > values["use", 2.0]
    with pytest.raises(Exception, match="pr.reconsider_weight"):
        PRConfig(reconsider_weight="marginal")


def test_balance_term_is_entropy_of_minibatch_marginal():
    _, pr, _ = make_drafters(max_depth=2)
    with torch.no_grad():
        pr.pr_halt_gate.linear.weight.normal_(0, 2.0)
    beta = 0.37
    out = OnlinePRModel(pr, length=TTT, pr=PRConfig(balance_coef=beta))(**make_batch(pr.config), return_logits=True)
    q = torch.stack(out.q)
    w = torch.stack(out.position_masks)
    q_bar = (q * w[..., None]).sum((0, 1, 2)) / w.sum()
    expected = -(q_bar * q_bar.log()).sum()
    torch.testing.assert_close(out.terms["loss_balance"], -beta * expected)
    torch.testing.assert_close(out.terms["depth_marginal_entropy"], expected)
    per_position = (-(q * q.clamp_min(1e-12).log()).sum(-1) * w).sum() / w.sum()
    assert not torch.allclose(per_position, expected)  # it is NOT the mean per-position entropy
    # marginal_entropy is finite (and zero) at a one-hot marginal, gradients included
    one_hot = torch.tensor([[1.0, 0.0, 0.0]], requires_grad=True)
    h, _ = marginal_entropy(one_hot, torch.ones(1))
    h.backward()
    assert float(h) == 0.0 and torch.isfinite(one_hot.grad).all()


def test_balance_gradient_pushes_marginal_toward_uniform():
    lambdas = torch.full((64, 2), 0.9, requires_grad=True)  # q concentrated on depth 0
    h, _ = marginal_entropy(halting_distribution(lambdas), torch.ones(64))
    (-h).backward()  # the balance term's gradient direction (beta > 0)
    assert float(lambdas.grad[:, 0].mean()) > 0  # descending lowers lambda_0: less mass on depth 0


def test_eagle3_state_dict_loads_with_only_new_keys_missing():
    eagle, pr, missing = make_drafters(max_depth=2)
    assert missing and all(k.startswith(PR_PARAM_PREFIXES) for k in missing)
    assert set(missing) == {k for k in pr.state_dict() if k.startswith(PR_PARAM_PREFIXES)}
    for k, v in eagle.state_dict().items():
        torch.testing.assert_close(pr.state_dict()[k], v)


def test_halt_depth_sampling_follows_q():
    _, pr, _ = make_drafters(max_depth=2)
    with torch.no_grad():
        pr.pr_halt_gate.linear.bias.fill_(math.log(0.3 / 0.7))  # lambda = 0.3 everywhere
    gen = torch.Generator().manual_seed(0)
    model = OnlinePRModel(pr, length=2, generator=gen)
    counts = torch.zeros(3)
    with torch.no_grad():
        for seed in range(4):
            out = model(**make_batch(pr.config, batch=4, seq=40, seed=seed), return_logits=True)
            for d in out.halt_depths:
                counts += torch.bincount(d.flatten(), minlength=3)
    freq = counts / counts.sum()
    expected = torch.tensor([0.3, 0.7 * 0.3, 0.7 * 0.7])
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_training_reduces_loss_and_opens_reconsideration_on_learnable_data():
    """A few dozen steps on a fixed batch: the total loss falls and every depth is used."""
    _, pr, _ = make_drafters(max_depth=2)
    batch = make_batch(pr.config, batch=2, seq=16)
    model = OnlinePRModel(pr, length=3)
    opt = torch.optim.AdamW([p for p in pr.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(**batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss))
    assert losses[-1] < 0.8 * losses[0]
    marg = [float(out.ratio_metrics[f"pr/depth_marginal_{r}"][0] / out.ratio_metrics[f"pr/depth_marginal_{r}"][1]) for r in range(3)]
    assert all(m > 0.01 for m in marg)



def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    grads = []
    for ckpt in (False, True):
        _, pr, _ = make_drafters(max_depth=2, seed=5)
        with torch.no_grad():
            pr.pr_halt_gate.linear.weight.normal_(0, 0.5)
        model = OnlinePRModel(pr, length=TTT, pr=PRConfig(gradient_checkpointing=ckpt), generator=torch.Generator().manual_seed(0))
        out = model(**make_batch(pr.config))
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in pr.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    assert set(grads[0][1]) == set(grads[1][1])
    for name in grads[0][1]:
        torch.testing.assert_close(grads[1][1][name], grads[0][1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_keeps_far_fewer_activations():
    def saved_bytes(ckpt):
        _, pr, _ = make_drafters(max_depth=2, seed=5)
        model = OnlinePRModel(pr, length=TTT, pr=PRConfig(gradient_checkpointing=ckpt))
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**make_batch(pr.config, seq=48))
        return total[0]

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


def test_mix_context_changes_only_the_mixed_rollout():
    outs = []
    for mix in (False, True):
        _, pr, _ = make_drafters(max_depth=2, seed=7)
        with torch.no_grad():
            pr.pr_halt_gate.linear.bias.fill_(-2.0)  # mostly reconsider: the mixed keys differ from the one-pass keys
        model = OnlinePRModel(pr, length=TTT, pr=PRConfig(mix_context=mix), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs.append(model(**make_batch(pr.config), return_logits=True))
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b)  # rollout A never reads the mixed cache
    torch.testing.assert_close(outs[0].depth_logits[0][1], outs[1].depth_logits[0][1])  # step 0 precedes any mixing
    assert not torch.allclose(outs[0].depth_logits[2][0], outs[1].depth_logits[2][0])


def test_confidence_banded_telemetry_partitions_the_positions_and_matches_the_logits():
    from pr_specforge.eval.evaluator import BANDS
    from pr_specforge.training.objective.metrics import CONFIDENCE_BAND_NAMES, CONFIDENCE_BANDS
    from pr_specforge.training.telemetry import panel_name

    assert CONFIDENCE_BANDS == BANDS  # training telemetry and the evaluator's Table 7 use the same bands
    _, pr, _ = make_drafters(max_depth=2, seed=3)
    with torch.no_grad():  # a peaked head, so the positions spread over all three bands
        pr.lm_head.weight.mul_(40.0)
        pr.pr_halt_gate.linear.weight.normal_(0, 0.5)
    batch = make_batch(pr.config, batch=2, seq=24)
    out = OnlinePRModel(pr, length=TTT, generator=torch.Generator().manual_seed(0))(**batch, return_logits=True)
    rm = {k: (float(n), float(d)) for k, (n, d) in out.ratio_metrics.items()}
    for key in rm:
        assert panel_name(key) is not None, key  # every PR metric reaches a wandb panel
    shares = [rm[f"pr/conf_share_{b}"] for b in CONFIDENCE_BAND_NAMES]
    assert sum(n for n, _ in shares) == pytest.approx(rm["pr/acc_depth_0"][1])  # the bands partition the positions
    assert sum(1 for n, _ in shares if n > 0) >= 2
    for key in ("pr/acc_depth_0", "pr/acc_depth_2", "pr/halt_past_0", "pr/recovered_share"):
        assert sum(rm[f"{key}_{b}"][0] for b in CONFIDENCE_BAND_NAMES) == pytest.approx(rm[key][0]), key
    # band counts recomputed from the returned depth-0 logits and SpecForge's per-step loss-mask shift
    from pr_specforge._specforge import padding

    lm, masks = batch["loss_mask"], []
    for _ in out.depth_logits:
        masks.append(lm.reshape(lm.shape[0], -1).float())
        lm = padding(lm, left=False)
    conf = torch.stack([torch.softmax(lg[0], -1).amax(-1) for lg in out.depth_logits])
    high = float(((conf >= CONFIDENCE_BANDS[1]).float() * torch.stack(masks)).sum())
    assert rm["pr/conf_share_conf_ge90"][0] == pytest.approx(high)

    # misses in the serving sense (target not in depth 0's top-k) are a subset of depth-0 top-1 misses,
    # and so are their recoveries; the count matches the returned depth-0 logits and the target
    from pr_specforge.training.objective.metrics import RECOVER_TOPK

    rec_k, outside = rm["pr/recovered_outside_topk"]
    rec, wrong0 = rm["pr/recovered_share"]
    assert rec_k <= rec and 0 < outside <= wrong0
    target_ids = batch["target"].argmax(-1)  # make_batch's soft targets; the token SpecForge scores is their argmax
    ids = []
    for _ in out.depth_logits:
        ids.append(target_ids)
        target_ids = padding(target_ids, left=False)
    top = torch.stack([lg[0].topk(RECOVER_TOPK, -1).indices for lg in out.depth_logits])
    top = top + pr.d2t[top]
    miss = ~(top == torch.stack(ids)[..., None]).any(-1)
    assert outside == pytest.approx(float((miss.float() * torch.stack(masks)).sum()))
    # depth r's top-1 agreeing with depth 0's, counted from the returned logits; features moved by depth >= 1
    for r in (1, 2):
        agree = torch.stack([(lg[r].argmax(-1) == lg[0].argmax(-1)).float() for lg in out.depth_logits])
        assert rm[f"pr/argmax_agree_depth_{r}"] == pytest.approx((float((agree * torch.stack(masks)).sum()), rm["pr/acc_depth_0"][1]))
        assert rm[f"pr/feature_change_depth_{r}"][0] > 0


def test_feature_change_is_the_relative_distance_of_each_reconsidered_feature_from_depth_0():
    from pr_specforge.training.objective.metrics import feature_change

    f0 = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    change = feature_change([f0, f0.clone(), 2 * f0, torch.zeros_like(f0)])
    torch.testing.assert_close(change, torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    assert torch.isfinite(feature_change([torch.zeros(2), torch.ones(2)])).all()  # a zero f^0 never divides by 0


def record_call_widths(model):
    """The number of sequence rows of every call of M the model makes (appended as they run)."""
    widths, run = [], model._run

    def recording(groups, *args):
        widths.append(groups[0].hidden.shape[1])
        return run(groups, *args)

    model._run = recording
    return widths


@pytest.mark.parametrize("ckpt", [False, True])
def test_skipping_unscored_rows_leaves_loss_gradients_and_telemetry_unchanged(ckpt):
    """The mixed rollout skips rows no step scores (a masked prompt, padding): same objective, fewer rows."""
    batch = make_batch(make_drafters(max_depth=2)[1].config, batch=2, seq=30, pad_last=4)
    batch["loss_mask"][0, -1] = 1
    batch["loss_mask"][:, :12] = 0  # a prompt: rows 0..11 are never scored at step 0 ...
    batch["loss_mask"][0, 12:15] = 0  # ... nor rows 12..14 of sequence 0 (sequence 1 scores them)
    results = []
    for skip in (False, True):
        _, pr, _ = make_drafters(max_depth=2, seed=5)
        with torch.no_grad():
            pr.pr_halt_gate.linear.weight.normal_(0, 0.5)  # halt depths vary across rows
        model = OnlinePRModel(pr, length=TTT, pr=PRConfig(gradient_checkpointing=ckpt),
                              generator=torch.Generator().manual_seed(0), skip_unscored_rows=skip)
        widths = record_call_widths(model)
        out = model(**batch)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in pr.named_parameters() if p.grad is not None}
        results.append((out, grads, widths))
    (full, g_full, w_full), (skip, g_skip, w_skip) = results
    assert set(w_full) == {30}
    # Row t at step j is scored at position t + j: the window starts TTT - 1 rows before the first scored row.
    assert min(w_skip) == 30 - (12 - (TTT - 1)) and max(w_skip) == 30  # sequence 0 is scored to its end
    torch.testing.assert_close(skip.loss, full.loss)
    assert set(skip.terms) == set(full.terms)
    for name in full.terms:
        torch.testing.assert_close(skip.terms[name], full.terms[name], msg=name)
    assert set(skip.ratio_metrics) == set(full.ratio_metrics)
    for name, (num, den) in full.ratio_metrics.items():
        torch.testing.assert_close(skip.ratio_metrics[name][0], num, msg=name)
        torch.testing.assert_close(skip.ratio_metrics[name][1], den, msg=name)
    assert set(g_skip) == set(g_full)
    for name in g_full:
        torch.testing.assert_close(g_skip[name], g_full[name], rtol=1e-5, atol=1e-7, msg=name)


def test_skipping_unscored_rows_is_off_where_the_rows_are_read():
    """With `mix_context` every row's halt-depth key is context for later rows; with `return_logits`
    the per-row outputs are returned: both run every row."""
    for pr_cfg, ret in ((PRConfig(mix_context=True), False), (PRConfig(), True)):
        _, pr, _ = make_drafters(max_depth=2)
        batch = make_batch(pr.config, batch=1, seq=20)
        batch["loss_mask"][:, :10] = 0
        model = OnlinePRModel(pr, length=TTT, pr=pr_cfg)
        widths = record_call_widths(model)
        with torch.no_grad():
            out = model(**batch, return_logits=ret)
        assert set(widths) == {20}
        if ret:
            assert all(d.shape == (1, 20) for d in out.halt_depths)


def test_rows_equal_specforge_layer_on_explicit_causal_sequences():
    """Each row, rebuilt as a plain causal sequence through SpecForge's own midlayer: step 0's
    reconsidered depths ([context rows < t, the row]) and step 1 over the sampled mixed cache
    ([context rows < t, row t's halt-depth input, the row]), with random gates so halt depths vary."""
    _, pr, _ = make_drafters(max_depth=2, seed=2)
    with torch.no_grad():
        pr.pr_halt_gate.linear.weight.normal_(0, 0.5)
    batch = make_batch(pr.config, batch=1, seq=10)
    model = OnlinePRModel(pr, length=3, generator=torch.Generator().manual_seed(0))

    def layer(emb, hid):
        return pr.midlayer(input_emb=emb, hidden_states=hid, cache_hidden=None, attention_mask=None,
                           position_ids=torch.arange(emb.shape[1])[None])

    with torch.no_grad():
        out = model(**batch, return_logits=True)
        h0 = pr.project_hidden_states(batch["hidden_states"])
        e0 = pr.embed_input_ids(batch["input_ids"])
        t_len = h0.shape[1]
        feats = [layer(e0, h0)]
        torch.testing.assert_close(pr.compute_logits(feats[0]), out.logits[0], rtol=1e-5, atol=1e-5)
        for r in (1, 2):  # step 0, depth r: f^r = M(f^{r-1}, Q(f^{r-1})) at position t, context rows < t
            prev, fr = feats[-1], torch.empty_like(feats[-1])
            for t in range(t_len):
                fr[:, t] = layer(torch.cat([e0[:, :t], pr.self_query(prev[:, t : t + 1])], 1),
                                 torch.cat([h0[:, :t], prev[:, t : t + 1]], 1))[:, t]
            torch.testing.assert_close(pr.compute_logits(fr), out.depth_logits[0][r], rtol=1e-5, atol=1e-5)
            feats.append(fr)
        d0 = out.halt_depths[0][0]
        assert len(set(d0.tolist())) > 1  # the mixed cache really mixes depths
        e1 = pr.embed_input_ids(torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, :1]], 1))
        for t in range(t_len - 1):
            d = int(d0[t])
            halt_emb, halt_hid = (e0[:, t : t + 1], h0[:, t : t + 1]) if d == 0 else (
                pr.self_query(feats[d - 1][:, t : t + 1]), feats[d - 1][:, t : t + 1])
            emb, hid = torch.cat([e0[:, :t], halt_emb], 1), torch.cat([h0[:, :t], halt_hid], 1)
            g0 = layer(torch.cat([emb, e1[:, t : t + 1]], 1), torch.cat([hid, feats[d][:, t : t + 1]], 1))[:, -1:]
            g1 = layer(torch.cat([emb, pr.self_query(g0)], 1), torch.cat([hid, g0], 1))[:, -1:]
            for r, g in ((0, g0), (1, g1)):
                torch.testing.assert_close(pr.compute_logits(g)[0, 0], out.depth_logits[1][r][0, t], rtol=1e-5, atol=1e-5)
