"""Eq. 6: the PR objective over the two rollouts, composed in one place.

    L = sum_j w_j [ l^0_A + sum_{r>=1} sg[q_r] l^r_B + sum_{r>=0} q_r sg[l^r_B] ]
        - beta * H(q_bar),   q_bar = loss-position mean of q over every step,

with `w_j = decay^j` and means over all B*T rows, as SpecForge's. The one-pass term
`l^0_A` is SpecForge's per-step loss of the one-pass chain; the reconsidered-head,
gate and balance terms read the mixed rollout's closed steps (`MixedStep`).

Owns: `MixedStep` (the typed record of one closed step), `marginal_entropy`, the
per-step terms and `pr_objective`. Does not own the rollouts (`objective.ttt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from pr_specforge.config import PRConfig

ENTROPY_EPS = 1e-12


def marginal_entropy(q: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`H(q_bar)` with `q_bar = sum(weight * q) / sum(weight)` (Appendix B.3, J).

    The entropy of the minibatch depth marginal, NOT the mean per-position
    entropy. `q [..., R+1]`, `weight [...]`. Returns `(H, q_bar)`.
    """
    w = weight.to(q.dtype)
    q_bar = (q * w[..., None]).reshape(-1, q.shape[-1]).sum(0) / w.sum().clamp_min(1.0)
    entropy = -(q_bar * torch.log(q_bar.clamp_min(ENTROPY_EPS))).sum()
    return entropy, q_bar


@dataclass
class MixedStep:
    """TTT step `j` of the mixed rollout, closed and scored (`[B, T']` over the rollout's rows).

    q: `[.., R+1]` halting distribution (Eq. 4), with its graph; lambdas: `[.., R]` the gate (detached);
    halt_depth: the sampled `d`; losses: `[.., R+1]` `l^r` per depth, with their graphs;
    position_mask, loss_mask: the step's masks (float); correct, confidence, in_topk, agree: telemetry
    (`objective.metrics.step_predictions`); feature_change: `[.., R]` `||f^r - f^0|| / ||f^0||`
    (`objective.metrics.feature_change`); logits: per depth, detached, only for `return_logits`.
    """

    q: torch.Tensor
    lambdas: torch.Tensor
    halt_depth: torch.Tensor
    losses: torch.Tensor
    position_mask: torch.Tensor
    loss_mask: torch.Tensor
    correct: torch.Tensor
    confidence: torch.Tensor
    in_topk: torch.Tensor
    agree: torch.Tensor
    feature_change: torch.Tensor
    logits: List[torch.Tensor] = field(default_factory=list)


@dataclass
class LossTerms:
    """Eq. 6's terms, with their graphs; the routing terms are absent when nothing is routed (R = 0)."""

    one_pass: torch.Tensor
    reconsider: Any = None
    gate: Any = None
    balance: Optional[torch.Tensor] = None
    one_pass_mixed: Any = 0.0
    entropy: Optional[torch.Tensor] = None

    def total(self) -> torch.Tensor:
        if self.balance is None:
            return self.one_pass
        return self.one_pass + (self.reconsider + self.gate + self.one_pass_mixed + self.balance)


def reconsider_term(step: MixedStep, pr: PRConfig) -> torch.Tensor:
    """`sum_{r>=1} sg[q_r] l^r` over the step's rows (or weight 1 with `reconsider_weight: uniform`)."""
    q, losses, pm = step.q, step.losses, step.position_mask
    use = q[..., 1:].detach() if pr.reconsider_weight == "use" else torch.ones_like(q[..., 1:])
    return (use * losses[..., 1:] * pm[..., None]).sum()


def gate_term(step: MixedStep) -> torch.Tensor:
    """`sum_{r>=0} q_r sg[l^r]` over the step's rows: the gate learns where depth pays."""
    return (step.q * step.losses.detach() * step.position_mask[..., None]).sum()


def pr_objective(plosses: List[torch.Tensor], steps: List[MixedStep], weights: List[float], rows: int,
                 pr: PRConfig) -> LossTerms:
    """Eq. 6: the one-pass term (SpecForge's per-step losses), and over the mixed rollout the
    reconsidered-head, gate and balance terms. `rows`: the loss denominator, all B*T rows as
    SpecForge's (the mixed rollout's window of rows may be fewer)."""
    terms = LossTerms(one_pass=sum(w * p for w, p in zip(weights, plosses)))
    if not steps:
        return terms
    head = gate = mixed_one_pass = 0.0
    for j, step in enumerate(steps):
        head = head + weights[j] * reconsider_term(step, pr) / rows
        gate = gate + weights[j] * gate_term(step) / rows
        if pr.one_pass_loss_on_mixed and j > 0:
            mixed_one_pass = mixed_one_pass + weights[j] * (step.losses[..., 0] * step.position_mask).sum() / rows
    entropy, _ = marginal_entropy(torch.stack([s.q for s in steps]), torch.stack([s.position_mask for s in steps]))
    terms.reconsider, terms.gate, terms.one_pass_mixed = head, gate, mixed_one_pass
    terms.balance, terms.entropy = -pr.balance_coef * entropy, entropy
    if pr.balance_norm == "per_position":
        terms.balance = terms.balance * balance_scale(steps, weights, rows)
    return terms


def balance_scale(steps: List[MixedStep], weights: List[float], rows: int) -> torch.Tensor:
    """`pr.balance_norm: per_position`: Eq. 6's `-beta H` inside its sum over positions, normalised as
    the head terms are: `sum_j w_j * (scored rows of step j) / rows` (`per_minibatch` applies it once)."""
    return sum(weights[j] * step.position_mask.sum() for j, step in enumerate(steps)) / rows
