"""PR training telemetry: what the mixed rollout's steps say about the gate and the depths.

Read-only over the objective's per-step records (`objective.loss.MixedStep`), under
`torch.no_grad`: nothing here reaches the loss. Every metric is a `(numerator,
denominator)` pair, so SpecForge's tracker reduces it across ranks as sums before
dividing. The names (`pr/...`) are what `pr_specforge.training.telemetry` maps onto panels.

Owns: the confidence bands of the banded telemetry (the evaluator's Table 7 bands),
`RECOVER_TOPK`, `step_predictions`, `feature_change` and `mixed_rollout_metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from pr_specforge.training.objective.loss import MixedStep

#: depth-0 top-1 probability bands (the evaluator's Table 7 bands): `< 0.5`, `0.5 .. 0.9`, `>= 0.9`
CONFIDENCE_BANDS = (0.5, 0.9)
CONFIDENCE_BAND_NAMES = ("conf_lt50", "conf_50to90", "conf_ge90")
#: `pr/recovered_outside_topk`: depth-0 misses in the serving sense (the target token is not among
#: depth 0's top RECOVER_TOPK, the tree's k), and the share some depth >= 1 gets right at top-1.
RECOVER_TOPK = 6

RatioMetrics = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def step_predictions(logits: Sequence[torch.Tensor], target_token_ids: torch.Tensor, d2t: torch.Tensor):
    """Per row of one step: top-1 correct per depth `[..., R+1]`, depth 0's top-1 probability,
    whether the target is among depth 0's top `RECOVER_TOPK`, and whether each depth >= 1's
    top-1 is depth 0's `[..., R]`."""
    pred = torch.stack([lg.argmax(-1) for lg in logits], dim=-1)
    agree = pred[..., 1:] == pred[..., :1]
    pred = pred + d2t[pred]
    correct = pred == target_token_ids[..., None]
    confidence = torch.softmax(logits[0].float(), dim=-1).amax(-1)
    top = logits[0].topk(min(RECOVER_TOPK, logits[0].shape[-1]), dim=-1).indices
    in_topk = ((top + d2t[top]) == target_token_ids[..., None]).any(-1)
    return correct, confidence, in_topk, agree


@torch.no_grad()
def feature_change(depth_feats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per row, how far each reconsidered feature moved from the one-pass one: `||f^r - f^0|| / ||f^0||`
    for r = 1..R, `[..., R]` (the features M returns, before the head's norm)."""
    f0 = depth_feats[0].float()
    base = f0.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.stack([(f.float() - f0).norm(dim=-1) / base for f in depth_feats[1:]], dim=-1)


@torch.no_grad()
def mixed_rollout_metrics(steps: List["MixedStep"], max_depth: int) -> RatioMetrics:
    """`pr/...` ratio metrics over every step of the mixed rollout (see docs/telemetry.md)."""
    q = torch.stack([s.q for s in steps])
    pm = torch.stack([s.position_mask for s in steps])
    lm = torch.stack([s.loss_mask for s in steps])
    losses = torch.stack([s.losses for s in steps]).detach()
    correct = torch.stack([s.correct for s in steps]).float()
    lambdas = torch.stack([s.lambdas for s in steps])
    d = torch.stack([s.halt_depth for s in steps])
    pm_sum, lm_sum = pm.sum(), lm.sum()
    rm: RatioMetrics = {}
    for r in range(max_depth + 1):
        rm[f"pr/depth_marginal_{r}"] = ((q[..., r] * pm).sum(), pm_sum)
        rm[f"pr/loss_depth_{r}"] = ((losses[..., r] * pm).sum(), pm_sum)
        rm[f"pr/acc_depth_{r}"] = ((correct[..., r] * lm).sum(), lm_sum)
        rm[f"pr/halt_share_depth_{r}"] = (((d == r).float() * lm).sum(), lm_sum)
    for r in range(max_depth):
        rm[f"pr/gate_mean_depth_{r}"] = ((lambdas[..., r] * lm).sum(), lm_sum)
    change = torch.stack([s.feature_change for s in steps])
    agree = torch.stack([s.agree for s in steps]).float()
    for r in range(1, max_depth + 1):  # does depth r compute anything else than depth 0?
        rm[f"pr/feature_change_depth_{r}"] = ((change[..., r - 1] * lm).sum(), lm_sum)
        rm[f"pr/argmax_agree_depth_{r}"] = ((agree[..., r - 1] * lm).sum(), lm_sum)
    rm["pr/halt_past_0"] = (((d > 0).float() * lm).sum(), lm_sum)
    wrong0 = (1.0 - correct[..., 0]) * lm
    recovered = wrong0 * (correct[..., 1:].amax(-1) if max_depth else torch.zeros_like(wrong0))
    rm["pr/recovered_share"] = (recovered.sum(), wrong0.sum())
    rm["pr/recovered_of_all"] = (recovered.sum(), lm_sum)
    # the serving sense of a miss: the target token is not even among depth 0's top-k proposals
    outside = (1.0 - torch.stack([s.in_topk for s in steps]).float()) * lm
    rm["pr/recovered_outside_topk"] = ((recovered * outside).sum(), outside.sum())
    confidence = torch.stack([s.confidence for s in steps])
    rm.update(_banded(confidence, lm, lm_sum, d, correct, recovered, wrong0, max_depth))
    return rm


def _banded(confidence, lm, lm_sum, d, correct, recovered, wrong0, max_depth: int) -> RatioMetrics:
    """The same by depth-0 confidence band: does the gate open, and do the reconsidered depths
    out-predict depth 0, where the one-pass guess is unsure?"""
    rm: RatioMetrics = {}
    edges = [0.0, *CONFIDENCE_BANDS, float("inf")]
    for name, lo, hi in zip(CONFIDENCE_BAND_NAMES, edges[:-1], edges[1:]):
        in_band = ((confidence >= lo) & (confidence < hi)).float() * lm
        band_sum = in_band.sum()
        rm[f"pr/conf_share_{name}"] = (band_sum, lm_sum)
        rm[f"pr/halt_past_0_{name}"] = (((d > 0).float() * in_band).sum(), band_sum)
        for r in range(max_depth + 1):
            rm[f"pr/acc_depth_{r}_{name}"] = ((correct[..., r] * in_band).sum(), band_sum)
        rm[f"pr/recovered_share_{name}"] = ((recovered * in_band).sum(), (wrong0 * in_band).sum())
    return rm
