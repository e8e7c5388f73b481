"""The PR-aware acceptance simulator: expected accepted length of the teacher-forced TTT chain.

At every eval interval of a training run (SpecForge's eval pass over `data.eval_hidden_states_path`)
and in `pr-specforge diagnose`, on the same batches SpecForge scores:

  a_j(rule) = (sum over the eval set of accept_j(rule) * loss_mask) / (sum of loss_mask),
  sim/acc_len_<rule> = a_0 + a_0 a_1 + a_0 a_1 a_2 + ...

which is SpecForge's own `eval/simulated_acc_len` (`Evaluator._simulated_acc_len` over its pooled
per-position accuracy) with the acceptance rule swapped. Position `p` at TTT step `j` is the chain
started at `p` drafting token `p + j + 1` from the true tokens (teacher forcing along the true path);
"the target token" is the target's own next-token prediction there: the argmax of the target's
logits over its full vocabulary (SpecForge's `target_token_ids`, the frozen `TargetHead` over the
stored final hidden states); a target token outside the draft vocab can never be accepted.

  one_pass  drafter top-1 (argmax of depth 0's logits, mapped by `d2t`) == target token. Its
            per-step counts are SpecForge's own (`_acc_and_loss`'s correct / denom), so
            `sim/acc_len_one_pass` equals `eval/simulated_acc_len` exactly.
  width2    the target token is among depth 0's top-2 (a wider tree's control, one more proposal).
  width6    the target token is among depth 0's top-6: what a tree of offer width k = 6 (the
            evaluator's and the paper's default) holds at a node.
  pr        (PR drafters with R >= 1) depth 0's top-1 is right, or the gate reconsiders past depth 0
            and the halt depth's top-1 is right, in expectation over the halt depth as the serving
            tree draws it (`serving.tree`: pooled with 1 - lambda_0, halting at depth r with
            lambda_r, i.e. d ~ q of Eq. 4, not a threshold):
                accept = c_0 + (1 - c_0) * sum_{r >= 1} q_r [top-1 of depth r == target token].
            c_0 is the one-pass chain's (as in `one_pass`, so `pr - one_pass` is what reconsideration
            adds); the depths r >= 1 and q are the mixed-cache rollout's (training's rollout B,
            `objective.ttt`), which at step 0 reconsiders the one-pass feature itself and at step j
            continues from step j - 1's sampled halt depth, as a reconsidered branch of the tree does.
            Steps past `pr.mixed_rollout_length` have no reconsidered depths: accept = c_0.
  width6_pr (PR drafters) `pr` with c_0 replaced by `width6`'s hit: a halt depth's right token
            counts only where depth 0's top-6 lacks the target token. `width6_pr / width6` is
            what reconsideration can add to a width-6 tree; `pr / one_pass` credits it also with
            tokens the tree already holds as siblings, and over-predicts the served mechanism
            when those dominate (measured: docs/telemetry.md, "Is the simulator honest?").
Not simulated: the serving cap of `m` reconsidered rows per draft step. It binds only through
competition with the tree's off-path nodes, which a teacher-forced chain does not have.

Owns: `ChainObserver` (one forward's per-row chain records, read from SpecForge's per-step scoring
and from the PR model's closed mixed-rollout steps; `eval.headroom` subclasses it), `Simulator`
(the `sim/` metrics), and `install_eval_simulator` (SpecForge's eval pass with `sim/` added).
Does not own: the eval loop or its `eval/` metrics (SpecForge's), the chain (`objective.ttt`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

#: the rules, in the order they are reported
RULES = ("one_pass", "width2", "pr", "width6", "width6_pr")
#: the rules that need reconsidered depths (PR drafters with R >= 1)
PR_RULES = ("pr", "width6_pr")
#: the offer width of the `width6` rules
WIDE_K = 6


def sim_key(rule: str) -> str:
    return f"sim/acc_len_{rule}"


@dataclass
class OnePassRows:
    """Depth 0 of one TTT step of the one-pass chain, per row `[B, T]` (target-vocab ids)."""

    correct: torch.Tensor  # drafter top-1 == target token (SpecForge's argmax rule)
    topk: torch.Tensor  # [B, T, k] depth 0's top-k proposals, best first
    confidence: torch.Tensor  # c_d: depth 0's top-1 probability
    target: torch.Tensor  # the target token
    target_confidence: torch.Tensor  # c_t: the target's probability of its best draft-vocab token
    in_vocab: torch.Tensor  # the target token is in the draft vocab, at a scored row (then c_t is the target's top-1 probability)
    mask: torch.Tensor  # SpecForge's loss mask at this step (float)
    correct_sum: torch.Tensor  # SpecForge's own (correct, denom) of the step
    denom: torch.Tensor


@dataclass
class DepthRows:
    """One closed step of the mixed rollout over its rows `[lo, lo + T_w)`: per depth `[B, T_w, R+1]`."""

    lo: int
    top1: torch.Tensor  # each depth's top-1 (target-vocab id)
    top1_prob: torch.Tensor  # each depth's top-1 probability
    q: torch.Tensor  # the halting distribution of Eq. 4

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """`x[:, rows]` of a `[B, T, ...]` one-pass tensor: the rows this step covers."""
        return x[:, self.lo:self.lo + self.q.shape[1]]

    def recovered(self, target: torch.Tensor) -> torch.Tensor:
        """`[B, T_w, R]`: depth r >= 1's top-1 is the target token."""
        return self.top1[..., 1:] == self.cut(target)[..., None]


def to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


class ChainObserver:
    """Collects, per forward, each TTT step's `OnePassRows` and (PR) `DepthRows`, then hands them
    to `add(one_pass, depths)` once the forward is complete. `topk`: how many depth-0 proposals to keep."""

    topk = 2

    def __init__(self) -> None:
        self.length = 0
        self.max_depth = 0
        self._pr = False
        self._one: List[OnePassRows] = []
        self._depths: Dict[int, DepthRows] = {}
        self._next: Optional["ChainObserver"] = None

    @contextlib.contextmanager
    def observing(self, model):
        """Observe every forward of `model` (an unwrapped `OnlineEagle3Model` or `OnlinePRModel`) while open."""
        from pr_specforge import _specforge as sf

        self._pr = hasattr(model, "step_observer")
        self.start(int(model.length), int(model.pr.max_depth) if self._pr else 0)
        d2t = model.draft_model.d2t
        if self._pr:  # observers nest: each passes the PR model's calls on to the one it replaced
            self._next = model.step_observer
            model.step_observer = self
        try:
            with sf.observe_step_scores(model, lambda result, **views: self._one_pass(result, d2t, **views)):
                yield self
        finally:
            if self._pr:
                model.step_observer, self._next = self._next, None
            self._one, self._depths = [], {}

    def start(self, length: int, max_depth: int) -> None:
        """The chain's TTT length and the drafter's R (`observing` calls it; tests feed `add` directly)."""
        self.length, self.max_depth = length, max_depth
        self.started()

    def started(self) -> None:
        """Called by `start` (`length` and `max_depth` are known)."""

    def _one_pass(self, result, d2t, **views) -> None:
        self._one.append(one_pass_rows(d2t, self.topk, result, **views))
        if not self._pr and len(self._one) == self.length:
            self._flush()

    def depths(self, step: int, lo: int, logits: List[torch.Tensor], q: torch.Tensor, d2t: torch.Tensor) -> None:
        """A closed mixed-rollout step (called by `OnlinePRModel`)."""
        if self._next is not None:
            self._next.depths(step, lo, logits, q, d2t)
        self._depths[step] = depth_rows(lo, logits, q, d2t)

    def forward_done(self) -> None:
        """The PR model's forward has finished (every one-pass and mixed step is in)."""
        if self._next is not None:
            self._next.forward_done()
        self._flush()

    def _flush(self) -> None:
        one, depths = self._one, self._depths
        self._one, self._depths = [], {}
        if one:
            self.add(one, depths)

    def add(self, one_pass: List[OnePassRows], depths: Dict[int, DepthRows]) -> None:
        raise NotImplementedError


@torch.no_grad()
def one_pass_rows(d2t, topk: int, result=None, *, logits, target_p_on_draft, target_token_ids, position_mask, loss_mask,
                  **_) -> OnePassRows:
    """One step's `OnePassRows` from SpecForge's step views; `result` is SpecForge's scoring of the
    step (its correct / denom are used as they are), else they are counted by the same rule."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(min(topk, probs.shape[-1]), dim=-1).indices
    correct = to_target_ids(logits.argmax(-1), d2t) == target_token_ids
    mask = loss_mask.squeeze(-1).float()
    if result is None:
        result = (None, None, None, (correct.float() * mask).sum(), mask.sum().clamp_min(1e-6))
    return OnePassRows(
        correct=correct, topk=to_target_ids(top, d2t), confidence=probs.amax(-1), target=target_token_ids,
        target_confidence=target_p_on_draft.float().amax(-1), in_vocab=position_mask.squeeze(-1) != 0,
        mask=mask, correct_sum=result[3].detach(), denom=result[4].detach(),
    )


@torch.no_grad()
def depth_rows(lo: int, logits: List[torch.Tensor], q: torch.Tensor, d2t: torch.Tensor) -> DepthRows:
    """One closed mixed-rollout step's `DepthRows` from its per-depth logits `[B, T_w, V]` and `q`."""
    probs = [torch.softmax(lg.float(), dim=-1) for lg in logits]
    top1 = torch.stack([to_target_ids(p.argmax(-1), d2t) for p in probs], dim=-1)
    return DepthRows(lo, top1, torch.stack([p.amax(-1) for p in probs], dim=-1), q.float())


def pr_accept(a: OnePassRows, d: Optional[DepthRows], c0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expected PR acceptance per row of one step (see the module docstring): `c0` is depth 0's own
    acceptance per row (default: its top-1 is right; `width6_pr` passes the top-6 hit)."""
    c0 = a.correct.float() if c0 is None else c0.float()
    if d is None:
        return c0
    recovered = (d.recovered(a.target).float() * d.q[..., 1:]).sum(-1)
    out = c0.clone()
    c0w = d.cut(c0)
    d.cut(out).copy_(c0w + (1.0 - c0w) * recovered)
    return out


class Simulator(ChainObserver):
    """Pooled per-step acceptance counts of each rule; `metrics()` gives the `sim/` lengths."""

    topk = WIDE_K

    def __init__(self) -> None:
        super().__init__()
        self.sums: Optional[torch.Tensor] = None  # [len(RULES) + 1, L] float64: denom, then one row per rule

    def started(self) -> None:
        if self.sums is None:
            self.sums = torch.zeros(len(RULES) + 1, self.length, dtype=torch.float64)

    def add(self, one_pass: List[OnePassRows], depths: Dict[int, DepthRows]) -> None:
        for j, a in enumerate(one_pass):
            w2 = a.correct | (a.topk[..., : 2] == a.target[..., None]).any(-1)
            w6 = a.correct | (a.topk[..., :WIDE_K] == a.target[..., None]).any(-1)
            accept = {"width2": w2.float(), "pr": pr_accept(a, depths.get(j)), "width6": w6.float(),
                      "width6_pr": pr_accept(a, depths.get(j), c0=w6)}
            self.sums[0, j] += float(a.denom)
            self.sums[1, j] += float(a.correct_sum)
            for i, rule in enumerate(RULES[1:], start=2):
                self.sums[i, j] += float((accept[rule] * a.mask).sum())

    def reduce(self) -> None:
        """Sum the counts over the ranks (collective: every rank calls it)."""
        import torch.distributed as dist

        if self.sums is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()).lower() else "cpu"
        buf = self.sums.to(device)
        dist.all_reduce(buf)
        self.sums = buf.cpu()

    def rules(self) -> List[str]:
        return [r for r in RULES if self.max_depth > 0 or r not in PR_RULES]

    def per_step(self) -> Dict[str, List[float]]:
        """Each rule's pooled acceptance per TTT step (SpecForge's `clamp_min(1)` on the denominator)."""
        if self.sums is None:
            return {}
        den = self.sums[0].clamp_min(1.0)
        return {rule: (self.sums[1 + i] / den).tolist() for i, rule in enumerate(RULES) if rule in self.rules()}

    def metrics(self) -> Dict[str, float]:
        from pr_specforge import _specforge as sf

        return {sim_key(rule): float(sf.simulated_acc_len(acc)) for rule, acc in self.per_step().items()}


def chain_model(strategy):
    """The strategy's (unwrapped) TTT model if it is SpecForge's EAGLE-3 one or ours, else None."""
    from pr_specforge._specforge import OnlineEagle3Model
    from pr_specforge.training.registration import _unwrap

    model = getattr(strategy, "eagle3_model", None)
    model = _unwrap(model) if model is not None else None
    return model if isinstance(model, OnlineEagle3Model) else None


def _evaluate_with_sim(controller, data, original):
    from pr_specforge import _specforge as sf

    model = chain_model(sf.controller_strategy(controller))
    if model is None:
        return original(controller, data)
    sim = Simulator()
    with sim.observing(model):
        metrics = original(controller, data)
    sim.reduce()
    if metrics:
        metrics.update(sim.metrics())
    return metrics


def install_eval_simulator() -> None:
    """SpecForge's eval pass adds the `sim/` metrics to its `eval/` ones (idempotent)."""
    from pr_specforge._specforge import wrap_evaluate

    wrap_evaluate(_evaluate_with_sim)
