"""The acceptance simulator (`training.simulate`): SpecForge's own number for the one-pass chain,
the chain length for an oracle drafter, the maximal PR figure when reconsidered depths are right."""

import pytest
import torch

from pr_specforge import _specforge as sf
from pr_specforge.config import PRConfig
from pr_specforge.training.objective.ttt import OnlinePRModel
from pr_specforge.training.simulate import Simulator, depth_rows, one_pass_rows, sim_key
from tests.helpers import make_batch, make_drafters

TTT = 4


@pytest.mark.parametrize("kind", ["eagle3", "pr"])
def test_one_pass_equals_specforges_simulated_length_on_the_same_batch(kind):
    eagle, pr, _ = make_drafters(max_depth=2)
    torch.manual_seed(0)
    model = sf.OnlineEagle3Model(eagle, length=TTT) if kind == "eagle3" else OnlinePRModel(pr, length=TTT, pr=PRConfig(max_depth=2))
    sim = Simulator()
    batches = [make_batch(eagle.config, seed=s, pad_last=3 * s) for s in (1, 2)]
    correct, denom = [0.0] * TTT, [0.0] * TTT
    with torch.no_grad(), sim.observing(model):
        for batch in batches:
            out = model(**batch)
            cs, ds = (out[3], out[4]) if kind == "eagle3" else (out.acc_corrects, out.acc_denoms)
            for j in range(TTT):
                correct[j] += float(cs[j])
                denom[j] += float(ds[j])
    m = sim.metrics()
    assert m[sim_key("one_pass")] == sf.simulated_acc_len([c / d for c, d in zip(correct, denom)])
    assert m[sim_key("width2")] >= m[sim_key("one_pass")]
    assert (sim_key("pr") in m) == (kind == "pr")
    if kind == "pr":
        assert m[sim_key("pr")] >= m[sim_key("one_pass")]
    assert "_acc_and_loss" not in vars(model) and getattr(model, "step_observer", None) is None  # taps removed


def _step(target_logits, mask, t2d, j):
    """SpecForge-shaped step views of hand-built target logits at TTT step j (rows shifted by j)."""
    target_p_padded, on_draft, ids, position_mask = sf.teacher_distributions(
        target=target_logits, t2d=t2d, loss_mask=mask[..., None], length=TTT)
    t = target_logits.shape[1]
    lm = torch.cat([mask[:, j:], torch.zeros_like(mask[:, :j])], dim=1)[..., None]
    pm = torch.cat([position_mask[:, j:], torch.zeros_like(position_mask[:, :j])], dim=1)
    return dict(target_p_on_draft=on_draft[:, j:j + t], target_token_ids=ids[:, j:j + t], position_mask=pm, loss_mask=lm)


def _oracle_setup(b=2, t=12, v=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, t, v, generator=g) * 3
    mask = torch.ones(b, t, dtype=torch.long)
    mask[:, :6] = 0  # rows 0, 1 stay unscored at every step (the PR test leaves them out of its window)
    t2d = torch.ones(v, dtype=torch.bool)  # every target token is in the draft vocab
    d2t = torch.zeros(v, dtype=torch.long)
    return target, mask, t2d, d2t


def test_an_oracle_drafter_accepts_the_whole_chain():
    target, mask, t2d, d2t = _oracle_setup()
    sim = Simulator()
    sim.start(TTT, 0)
    rows = []
    for j in range(TTT):
        views = _step(target, mask, t2d, j)
        logits = torch.cat([target[:, j:], target[:, :j]], dim=1)  # the target's own logits at each row's position
        rows.append(one_pass_rows(d2t, 2, logits=logits, **views))
    sim.add(rows, {})
    m = sim.metrics()
    assert m[sim_key("one_pass")] == pytest.approx(TTT) and m[sim_key("width2")] == pytest.approx(TTT)
    assert sim_key("pr") not in m


@pytest.mark.parametrize("q0", [0.0, 0.25])
def test_a_pr_drafter_whose_reconsidered_head_is_the_target_gives_the_maximal_pr_figure(q0):
    target, mask, t2d, d2t = _oracle_setup(seed=1)
    g = torch.Generator().manual_seed(5)
    sim = Simulator()
    sim.start(TTT, 2)
    rows, depths, expected, expected_wide = [], {}, [], []
    lo = 2
    for j in range(TTT):
        views = _step(target, mask, t2d, j)
        oracle = torch.cat([target[:, j:], target[:, :j]], dim=1)
        wrong = torch.randn(oracle.shape, generator=g)  # depth 0: a random guess
        rows.append(one_pass_rows(d2t, 2, logits=wrong, **views))
        q = torch.tensor([q0, (1 - q0) / 2, (1 - q0) / 2]).expand(*oracle.shape[:2], 3)[:, lo:]
        depths[j] = depth_rows(lo, [wrong[:, lo:], oracle[:, lo:], oracle[:, lo:]], q, d2t)
        c0 = rows[-1].correct.float()
        m = rows[-1].mask
        expected.append(float(((c0 + (1 - c0) * (1 - q0)) * m).sum() / m.sum()))  # rows < lo are unscored (mask)
        w = (rows[-1].topk == rows[-1].target[..., None]).any(-1).float()  # the top-k hit (k = 2 proposals kept here)
        expected_wide.append(float(((w + (1 - w) * (1 - q0)) * m).sum() / m.sum()))
    sim.add(rows, depths)
    m = sim.metrics()
    assert m[sim_key("pr")] == pytest.approx(sf.simulated_acc_len(expected))
    assert m[sim_key("width6_pr")] == pytest.approx(sf.simulated_acc_len(expected_wide))
    if q0 == 0.0:
        assert m[sim_key("pr")] == pytest.approx(TTT) and m[sim_key("width6_pr")] == pytest.approx(TTT)
    assert m[sim_key("one_pass")] < m[sim_key("pr")]


def test_width6_holds_rank_4_and_a_reconsidered_sibling_adds_nothing_to_it():
    """Depth 0 ranks the target token 4th everywhere; every reconsidered depth has it at top-1.
    The top-1 chain and width 2 accept nothing, width 6 the whole chain; `pr` credits
    reconsideration with the whole chain, `width6_pr` with nothing beyond width 6 (the token is a
    sibling a width-6 tree already holds)."""
    target, mask, t2d, d2t = _oracle_setup(seed=2)
    sim = Simulator()
    sim.start(TTT, 1)
    rows, depths, lo = [], {}, 2
    for j in range(TTT):
        views = _step(target, mask, t2d, j)
        oracle = torch.cat([target[:, j:], target[:, :j]], dim=1)
        tok = oracle.argmax(-1, keepdim=True)
        fourth = oracle.clone()  # three other tokens above the target's
        others = (tok + torch.arange(1, 4)) % oracle.shape[-1]
        fourth.scatter_(-1, others, oracle.gather(-1, tok).expand_as(others) + torch.arange(3, 0, -1).float())
        rows.append(one_pass_rows(d2t, 6, logits=fourth, **views))
        q = torch.tensor([0.0, 1.0]).expand(*oracle.shape[:2], 2)[:, lo:]
        depths[j] = depth_rows(lo, [fourth[:, lo:], oracle[:, lo:]], q, d2t)
    sim.add(rows, depths)
    m = sim.metrics()
    assert m[sim_key("one_pass")] == 0.0 and m[sim_key("width2")] == 0.0
    assert m[sim_key("width6")] == pytest.approx(TTT) and m[sim_key("pr")] == pytest.approx(TTT)
    assert m[sim_key("width6_pr")] == pytest.approx(m[sim_key("width6")])
