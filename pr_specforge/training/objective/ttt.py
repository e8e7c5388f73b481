"""The PR training model: SpecForge's EAGLE-3 TTT loop plus reconsideration (Sec. 3-4).

`OnlinePRModel` subclasses SpecForge's `OnlineEagle3Model` and keeps its
interface: same inputs (offline EAGLE-3 features), same teacher (`t2d`-restricted
target distribution), same per-step loss and accuracy (it calls the parent's
`_acc_and_loss`, through the adapter, for the one-pass chain), same `0.8**j` step weights.

Two on-policy rollouts share step 0 (the branch point, Appendix B.2):
  A. the one-pass chain: SpecForge's EAGLE-3 TTT, scored by `l^0` (unconditional);
  B. the mixed-cache chain: at every TTT step `j` the depths `r = 1..R`, the gate's
     `lambda_0..lambda_{R-1}`, `q`, a sampled halt depth `d ~ q`, and the next step
     continues from `f^d` with `kv(f^d)` in the chain; scored by the gated head and
     gate terms of Eq. 6.

One function per equation:
  `reconsideration_row`   Eq. 3   `f^r = M(f^{r-1}, Q(f^{r-1}))`, same position, context +
                                  chain + own key;
  `halting_distribution`  Eq. 4   `q` from the gate (`pr_specforge.modeling`); a row's halt
                                  depth is drawn by `OnlinePRModel.sample_halt_depth`;
  `coforward_schedule`    Eq. 5   the rows that share each batched call of `M`: call `c`
                                  holds A's step `c` and B's next stage (for `c = 1` that is
                                  exactly Eq. 5: `f_{p+1}^0` and `f_p^1` both read `f_p^0`);
  `pr_objective`          Eq. 6   the loss and its four terms (`objective.loss`);
  `mixed_cache`           Eq. 7   each row's `f^d` and `kv(f^d)`;
  `continuation_row`      Eq. 12  step `j + 1` continues from step `j`'s halt depth.
Per-depth logits come from one readout, `OnlinePRModel.readout`.

The loss (`pr_specforge.training.objective.loss`):
  L = sum_j w_j [ l^0_A + sum_{r>=1} sg[q_r] l^r_B + sum_{r>=0} q_r sg[l^r_B] ] - beta * H(q_bar).
With R = 0 there is nothing to route: L is SpecForge's EAGLE-3 loss exactly.

Does not own: the drafter's parameters (`pr_specforge.modeling`), the telemetry
(`pr_specforge.training.objective.metrics`), SpecForge integration (`pr_specforge.training.registration`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pr_specforge import _specforge as sf
from pr_specforge._specforge import OnlineEagle3Model, padding, soft_cross_entropy_rows
from pr_specforge.config import PR_ATTENTION_BACKEND, PRConfig, check_attention_backend
from pr_specforge.modeling.attention import KV, chain_attention, strict_causal_mask
from pr_specforge.modeling.drafter import LlamaForCausalLMEagle3PR, halting_distribution
from pr_specforge.training.objective.loss import LossTerms, MixedStep, marginal_entropy, pr_objective  # noqa: F401
from pr_specforge.training.objective.metrics import feature_change, mixed_rollout_metrics, step_predictions


@dataclass
class PRForwardOutput:
    """What one training forward produces.

    loss: the scalar objective to backpropagate.
    plosses, acces, acceptance_rates, acc_corrects, acc_denoms, metric_losses,
    metric_loss_denoms: per TTT step of the one-pass chain, as SpecForge's
        `OnlineEagle3Model` returns them (so its tracker reduces them as usual).
    terms: detached scalar values of the objective's terms.
    ratio_metrics: `name -> (numerator, denominator)` PR telemetry.
    logits: per TTT step one-pass logits (only with `return_logits=True`).
    depth_logits: per mixed-rollout step, logits per depth (only with `return_logits=True`);
        `halt_depths`, `q`, `position_masks` likewise, per mixed-rollout step.
    grad_terms: the objective's terms with their graphs (`one_pass`, `reconsider`,
        `gate`, `balance`, `one_pass_mixed`), for tests of the stop-gradients.
    """

    loss: torch.Tensor
    plosses: List[torch.Tensor]
    acces: List[torch.Tensor]
    acceptance_rates: List[torch.Tensor]
    acc_corrects: List[torch.Tensor]
    acc_denoms: List[torch.Tensor]
    metric_losses: List[torch.Tensor]
    metric_loss_denoms: List[torch.Tensor]
    terms: Dict[str, torch.Tensor] = field(default_factory=dict)
    ratio_metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    logits: List[torch.Tensor] = field(default_factory=list)
    depth_logits: List[List[torch.Tensor]] = field(default_factory=list)
    halt_depths: List[torch.Tensor] = field(default_factory=list)
    q: List[torch.Tensor] = field(default_factory=list)
    position_masks: List[torch.Tensor] = field(default_factory=list)
    grad_terms: Dict[str, torch.Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------ records
@dataclass
class _Group:
    """One row group of a batched call of M: `[B, T, d]` inputs at position offset `step`."""

    emb: torch.Tensor
    hidden: torch.Tensor
    step: int
    chain: List[KV]
    ctx: KV
    recon: bool = False  # a reconsideration row (Eq. 3): the drafter's adapter, if any, acts on it


@dataclass
class _RowView:
    """The fields of a SpecForge step view that scoring the mixed rollout reads, cut to its rows."""

    target_p: torch.Tensor
    target_token_ids: torch.Tensor
    position_mask: torch.Tensor
    loss_mask: torch.Tensor


@dataclass(frozen=True)
class MixedStage:
    """Depth `depth` of TTT step `step` in the mixed rollout: depth 0 continues from the previous
    step's halt depth (Eq. 12), depth `r >= 1` is a reconsideration pass (Eq. 3)."""

    step: int
    depth: int


@dataclass(frozen=True)
class CoforwardCall:
    """One batched call of `M`: the one-pass chain's step and the mixed rollout's next stage (either may be absent)."""

    one_pass_step: Optional[int]
    mixed: Optional[MixedStage]


def coforward_schedule(length: int, mixed_length: int, max_depth: int) -> List[CoforwardCall]:
    """Eq. 5: the calls of `M` after step 0. Call `c` co-forwards the one-pass chain's step `c + 1`
    with stage `c` of the mixed rollout (its stages: depths `1..R` of step 0, then `0..R` of each
    later step): every row of a call reads only what earlier calls computed."""
    stages = [MixedStage(j, r) for j in range(mixed_length) for r in range(0 if j else 1, max_depth + 1)]
    calls = max(length - 1, len(stages))
    return [CoforwardCall(c + 1 if c + 1 < length else None, stages[c] if c < len(stages) else None) for c in range(calls)]


# ---------------------------------------------------------------- equations
def reconsideration_row(draft: LlamaForCausalLMEagle3PR, prev: torch.Tensor, step: int, chain: List[KV], ctx: KV) -> _Group:
    """Eq. 3: the rows of `f^r = M(f^{r-1}, Q(f^{r-1}))` at TTT step `step`: the same position,
    attending to the context, the rollout's chain and their own new key."""
    emb, hidden = draft.reconsideration_inputs(prev)
    return _Group(emb, hidden, step, list(chain), ctx, recon=True)


def continuation_row(emb: torch.Tensor, halted: torch.Tensor, step: int, chain: List[KV], ctx: KV) -> _Group:
    """Eq. 12: depth 0 of TTT step `step` in the mixed rollout reads step `step - 1`'s feature at its
    halt depth, `f^d`, and attends over the mixed cache of the steps before it (Eq. 7)."""
    return _Group(emb, halted, step, list(chain), ctx)


def mixed_cache(depth_feats: List[torch.Tensor], depth_kv: List[KV], halt_depth: torch.Tensor) -> Tuple[torch.Tensor, KV]:
    """Eq. 7: per row, the feature and key/value at its halt depth `d`: `f^d` and `kv(f^d)`."""
    depth = len(depth_feats) - 1
    sel = F.one_hot(halt_depth, depth + 1).to(depth_feats[0].dtype)  # [B,T,R+1]
    feat_d = sum(sel[..., r, None] * depth_feats[r] for r in range(depth + 1))
    k_d = sum(sel[:, None, :, r, None] * depth_kv[r][0] for r in range(depth + 1))
    v_d = sum(sel[:, None, :, r, None] * depth_kv[r][1] for r in range(depth + 1))
    return feat_d, (k_d, v_d)


def _record_terms(terms: LossTerms, loss: torch.Tensor, pr: PRConfig, out: PRForwardOutput) -> None:
    out.terms["loss_one_pass"] = terms.one_pass.detach()
    out.grad_terms["one_pass"] = terms.one_pass
    if terms.balance is not None:
        out.terms.update(
            loss_reconsider=torch.as_tensor(terms.reconsider).detach(),
            loss_gate=torch.as_tensor(terms.gate).detach(),
            loss_balance=terms.balance.detach(),
            depth_marginal_entropy=terms.entropy.detach(),
        )
        out.grad_terms.update(reconsider=terms.reconsider, gate=terms.gate, balance=terms.balance)
        if pr.one_pass_loss_on_mixed:
            out.terms["loss_one_pass_mixed"] = torch.as_tensor(terms.one_pass_mixed).detach()
            out.grad_terms["one_pass_mixed"] = terms.one_pass_mixed
    out.terms["loss_total"] = loss.detach()


# -------------------------------------------------------------- the rollouts
def _scored_window(views, t: int) -> Tuple[int, int]:
    """The smallest `[lo, hi)` of sequence rows that holds every row some step scores.

    A row the mixed rollout computes matters only through its own losses (weighted by the
    step's loss and position masks) and its own later steps: the context keys are the
    step-0 keys of every row, which the one-pass call computes (unless `pr.mix_context`).
    So rows whose masks are 0 at every step of the rollout (prompt tokens, padding) can
    be skipped with the objective and telemetry unchanged. Falls back to `[0, t)` when no
    row is scored.
    """
    scored = torch.zeros(t, dtype=torch.bool, device=views[0].loss_mask.device)
    for v in views:
        scored |= (v.loss_mask.reshape(v.loss_mask.shape[0], t) != 0).any(0)
        scored |= (v.position_mask.reshape(v.position_mask.shape[0], t) != 0).any(0)
    idx = scored.nonzero()
    if idx.numel() == 0:
        return 0, t
    return int(idx[0]), int(idx[-1]) + 1


@dataclass
class _Inputs:
    """What every call of `M` reads, prepared once per forward (per-step views shifted as SpecForge's)."""

    views: list
    embs: List[torch.Tensor]
    h0: torch.Tensor
    masks: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (position ids, context mask, chain-start mask)
    adapter: Any


@dataclass
class _Rows:
    """The sequence rows `[lo, hi)` of `T` the mixed rollout runs, and its inputs cut to them."""

    lo: int
    hi: int
    t: int
    views: List[_RowView]
    masks: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def whole(self) -> bool:
        """All rows: then both rollouts' rows share one call of M."""
        return (self.lo, self.hi) == (0, self.t)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.lo:self.hi]  # [B, T, ...] -> the window's rows (a view)


@dataclass
class _OnePass:
    """Rollout A's state: its latest feature, its chain of keys, its logits per step."""

    feature: torch.Tensor
    chain: List[KV]
    logits: List[torch.Tensor] = field(default_factory=list)


@dataclass
class _Mixed:
    """Rollout B's state over its rows: the current step's depths, the mixed cache of earlier steps."""

    depth_feats: List[torch.Tensor]  # g_j^r for the current step j
    depth_kv: List[KV]
    chain: List[KV]
    ctx: KV  # step 0's keys of every row; step 0's mixed keys once step 0 closes, if pr.mix_context
    continuation: torch.Tensor  # f^d of the last closed step
    steps: List[MixedStep] = field(default_factory=list)


class OnlinePRModel(OnlineEagle3Model):
    """TTT training model for `LlamaForCausalLMEagle3PR` (see module docstring)."""

    def __init__(
        self,
        draft_model: LlamaForCausalLMEagle3PR,
        length: int = 7,
        attention_backend: str = PR_ATTENTION_BACKEND,
        pr: Optional[PRConfig] = None,
        ploss_decay: float = 0.8,
        generator: Optional[torch.Generator] = None,
        skip_unscored_rows: bool = True,
    ) -> None:
        check_attention_backend(attention_backend)
        if not isinstance(draft_model, LlamaForCausalLMEagle3PR):
            raise TypeError(
                f"the pr algorithm needs a LlamaForCausalLMEagle3PR drafter, got {type(draft_model).__name__}; "
                "set the draft config's architectures to ['LlamaForCausalLMEagle3PR']"
            )
        super().__init__(draft_model, length=length, attention_backend=attention_backend)
        self.pr = pr or PRConfig(max_depth=draft_model.max_depth)
        if self.pr.max_depth != draft_model.max_depth:
            raise ValueError(
                f"pr.max_depth={self.pr.max_depth} disagrees with the drafter's pr_config.max_depth="
                f"{draft_model.max_depth}"
            )
        self.ploss_decay = ploss_decay
        self.generator = generator
        # The mixed-cache rollout runs only the window of sequence rows that some TTT step scores
        # (see `_scored_window`); the objective and telemetry are unchanged, only the work shrinks.
        self.skip_unscored_rows = skip_unscored_rows
        #: reads each closed mixed-rollout step's per-depth logits and `q` (`training.simulate.ChainObserver`);
        #: None outside the simulator and `pr-specforge headroom`. It never reaches the loss.
        self.step_observer = None

    # ------------------------------------------------------------------ M calls
    def _run(self, groups: List[_Group], pos: torch.Tensor, ctx_mask, start_mask) -> List[Tuple[torch.Tensor, KV]]:
        """One batched call of M over all groups; returns per group `(feature, (k, v))`."""
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        g = len(groups)
        b, t, _ = groups[0].hidden.shape
        emb = torch.cat([gr.emb for gr in groups], dim=0)
        hidden = torch.cat([gr.hidden for gr in groups], dim=0)
        positions = torch.cat([(pos + gr.step).expand(b, t) for gr in groups], dim=0)
        recon = (torch.tensor([gr.recon for gr in groups for _ in range(b)], device=positions.device)
                 if any(gr.recon for gr in groups) else None)
        q, k, v = draft.layer_qkv(emb, hidden, positions, recon_rows=recon)
        split = lambda x: x.view(g, b, *x.shape[1:])  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        same_ctx = all(gr.ctx[0] is groups[0].ctx[0] for gr in groups)
        if same_ctx:
            ctx = (groups[0].ctx[0][None], groups[0].ctx[1][None])
        else:
            ctx = (torch.stack([gr.ctx[0] for gr in groups]), torch.stack([gr.ctx[1] for gr in groups]))
        out = chain_attention(q, (k, v), ctx, ctx_mask, [gr.chain for gr in groups], start_mask)
        feats = draft.layer_finish(out.reshape(g * b, *out.shape[2:]), hidden, recon).view(g, b, t, -1)
        return [(feats[i], (k[i], v[i])) for i in range(g)]

    def _first_call(self, emb, hidden, pos, ctx_mask, start_mask) -> Tuple[torch.Tensor, KV]:
        """TTT step 0: causal self-attention of the step-0 rows (its keys become the context)."""
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        b, t, _ = hidden.shape
        q, k, v = draft.layer_qkv(emb, hidden, pos.expand(b, t))
        out = chain_attention(q[None], (k[None], v[None]), (k[None], v[None]), ctx_mask, [[]], start_mask)
        return draft.layer_finish(out[0], hidden), (k, v)

    def _checkpointed(self, fn, *args):
        """`fn(*args)`, recomputed in backward when `pr.gradient_checkpointing` (no RNG inside M)."""
        if self.pr.gradient_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _run_mixed(self, groups: List[_Group], pos: torch.Tensor, ctx_mask, start_mask) -> List[Tuple[torch.Tensor, KV]]:
        """`_run` for the mixed rollout's rows: with `pr.recon_grad: isolated` the one-pass weights read
        detached, so these rows train only the reconsideration-only parameters."""
        with self._isolated():
            return self._run(groups, pos, ctx_mask, start_mask)

    def _isolated(self):
        return self.draft_model.one_pass_detached() if self.pr.recon_grad == "isolated" else nullcontext()

    def readout(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        """The logits of a feature at reconsideration depth `depth`: the drafter's one per-depth
        readout (`depth_logits`: the second head for `r >= 1` with `pr.recon_head: separate`)."""
        return self.draft_model.depth_logits(feature, depth)

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        target: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_states: torch.Tensor,
        past_key_values=None,
        position_ids: Optional[torch.Tensor] = None,
        target_hidden_for_compact: Optional[torch.Tensor] = None,
        target_head_weight: Optional[torch.Tensor] = None,
        compact_teacher_chunk_size: Optional[int] = None,
        return_logits: bool = False,
    ) -> PRForwardOutput:
        if target_hidden_for_compact is not None:
            raise ValueError("training.compact_teacher is not supported by the pr algorithm; set training.compact_teacher=false")
        inp = self._prepare(input_ids, attention_mask, target, loss_mask, hidden_states, position_ids)
        del target
        out = PRForwardOutput(loss=inp.h0.new_zeros(()), plosses=[], acces=[], acceptance_rates=[], acc_corrects=[],
                              acc_denoms=[], metric_losses=[], metric_loss_denoms=[])
        # Call 0: TTT step 0 (shared by both rollouts, the branch point).
        f0, kv0 = self._checkpointed(self._first_call, inp.embs[0], inp.h0, *inp.masks)
        one_pass = _OnePass(f0, [kv0])
        self._score_one_pass(0, f0, inp, one_pass, out)
        depth = self.pr.max_depth
        mixed_len = 0 if depth == 0 else min(self.length, self.pr.mixed_rollout_length or self.length)
        rows = self._rows(inp, mixed_len, return_logits)
        if self.pr.recon_grad == "isolated":  # the branch point: rollout B sends no gradient into step 0
            f0, kv0 = f0.detach(), (kv0[0].detach(), kv0[1].detach())
        mixed = _Mixed([rows.cut(f0)], [(kv0[0][..., rows.lo:rows.hi, :], kv0[1][..., rows.lo:rows.hi, :])],
                       chain=[], ctx=kv0, continuation=rows.cut(f0))
        for call in coforward_schedule(self.length, mixed_len, depth):
            self._coforward(call, inp, rows, one_pass, mixed, out, return_logits)

        weights = [self.ploss_decay**j for j in range(self.length)]
        terms = pr_objective(out.plosses, mixed.steps, weights, inp.h0.shape[0] * inp.h0.shape[1], self.pr)
        out.loss = terms.total()
        _record_terms(terms, out.loss, self.pr, out)
        if mixed.steps:
            out.ratio_metrics.update(mixed_rollout_metrics(mixed.steps, depth))
        if self.step_observer is not None:
            self.step_observer.forward_done()
        if return_logits:
            out.logits = one_pass.logits
            for step in mixed.steps:
                out.depth_logits.append(step.logits)
                out.halt_depths.append(step.halt_depth)
                out.q.append(step.q.detach())
                out.position_masks.append(step.position_mask)
        return out

    def _prepare(self, input_ids, attention_mask, target, loss_mask, hidden_states, position_ids) -> _Inputs:
        """The teacher, the projected features, the masks and SpecForge's per-step views."""
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        length = self.length
        target_p_padded, target_p_on_draft_padded, target_ids_padded, position_mask = sf.teacher_distributions(
            target=target, t2d=draft.t2d, loss_mask=loss_mask, length=length
        )
        b, t, _ = hidden_states.shape
        h0 = draft.project_hidden_states(hidden_states.to(draft.fc.weight.dtype))
        pos = sf.draft_position_ids(self, position_ids, seq_length=t, device=h0.device)
        if attention_mask is None:
            attention_mask = torch.ones((b, t), dtype=torch.bool, device=h0.device)
        ctx_mask, start_mask = strict_causal_mask(attention_mask, h0.dtype)
        adapter = sf.loss_adapter(self)
        # Per-step views, shifted exactly as SpecForge shifts them.
        views, ids, pm, lm = [], input_ids, position_mask, loss_mask
        for j in range(length):
            views.append(
                adapter.step_view(
                    idx=j, ttt_length=length, global_input_ids=ids, attention_mask=attention_mask,
                    loss_mask=lm, position_ids=pos, hidden_states=h0, target_p_padded=target_p_padded,
                    target_p_on_draft_padded=target_p_on_draft_padded, target_token_ids_padded=target_ids_padded,
                    position_mask=pm, seq_length=t,
                )
            )
            ids, pm, lm = padding(ids, left=False), padding(pm, left=False), padding(lm, left=False)
        embs = [draft.embed_input_ids(v.input_ids).to(h0.dtype) for v in views]
        return _Inputs(views, embs, h0, (pos, ctx_mask, start_mask), adapter)

    def _rows(self, inp: _Inputs, mixed_len: int, return_logits: bool) -> _Rows:
        """The mixed rollout's rows: all of them, or the window of rows that one of its steps scores."""
        b, t = inp.h0.shape[:2]
        lo, hi = 0, t
        if mixed_len and self.skip_unscored_rows and not self.pr.mix_context and not return_logits:
            lo, hi = _scored_window(inp.views[:mixed_len], t)
        rows = slice(lo, hi)
        cut = lambda x: x[:, rows]  # noqa: E731
        views = [_RowView(cut(v.target_p), cut(v.target_token_ids), cut(v.position_mask), cut(v.loss_mask))
                 for v in inp.views[:mixed_len]]
        pos, ctx_mask, start_mask = inp.masks
        return _Rows(lo, hi, t, views, (pos[..., rows], ctx_mask[:, :, rows], start_mask[..., rows]))

    def _coforward(self, call: CoforwardCall, inp: _Inputs, rows: _Rows, one_pass: _OnePass, mixed: _Mixed,
                   out: PRForwardOutput, return_logits: bool) -> None:
        """One call of `M` (two when the mixed rollout runs fewer rows): build its rows, run, advance both rollouts."""
        groups = []
        if call.one_pass_step is not None:
            s = call.one_pass_step
            groups.append(_Group(inp.embs[s], self.draft_model.feedback(one_pass.feature), s, list(one_pass.chain),
                                 one_pass.chain[0]))
        if call.mixed is not None:
            groups.append(self._mixed_row(call.mixed, inp, rows, mixed))
        n_a = int(call.one_pass_step is not None)
        if rows.whole and self.pr.recon_grad == "full":
            batches = [(self._run, groups, inp.masks)]
        else:  # isolated: rollout B reads detached one-pass weights, so it needs its own call of M
            batches = [(self._run, groups[:n_a], inp.masks), (self._run_mixed, groups[n_a:], rows.masks)]
        results = [res for fn, gs, masks in batches if gs for res in self._checkpointed(fn, gs, *masks)]
        if call.one_pass_step is not None:
            feat, kv = results.pop(0)
            one_pass.feature = feat
            one_pass.chain.append(kv)
            self._score_one_pass(call.one_pass_step, feat, inp, one_pass, out)
        if call.mixed is not None:
            self._advance_mixed(call.mixed, *results[0], rows, one_pass, mixed, return_logits)

    def _mixed_row(self, stage: MixedStage, inp: _Inputs, rows: _Rows, mixed: _Mixed) -> _Group:
        if stage.depth == 0:
            emb = rows.cut(inp.embs[stage.step])
            if self.pr.recon_grad == "isolated":  # the token embedding is a one-pass parameter too (frozen in SpecForge)
                emb = emb.detach()
            with self._isolated():  # `post_norm_feedback`'s norm is a one-pass parameter
                halted = self.draft_model.feedback(mixed.continuation)
            return continuation_row(emb, halted, stage.step, mixed.chain, mixed.ctx)
        with self._isolated():
            return reconsideration_row(self.draft_model, mixed.depth_feats[stage.depth - 1], stage.step, mixed.chain,
                                       mixed.ctx)

    def _advance_mixed(self, stage: MixedStage, feat: torch.Tensor, kv: KV, rows: _Rows, one_pass: _OnePass,
                       mixed: _Mixed, return_logits: bool) -> None:
        """Store depth `r` of step `j`; once all depths of step `j` are in, close the step: gate, `q`,
        halt depth, the mixed cache (Eq. 7) the next step continues from (Eq. 12), and its losses."""
        with self._isolated():  # the gate's norm and the readouts of the mixed rollout
            self._store_or_close(stage, feat, kv, rows, one_pass, mixed, return_logits)

    def _store_or_close(self, stage: MixedStage, feat: torch.Tensor, kv: KV, rows: _Rows, one_pass: _OnePass,
                        mixed: _Mixed, return_logits: bool) -> None:
        if stage.depth == 0:
            mixed.depth_feats, mixed.depth_kv = [feat], [kv]
        else:
            mixed.depth_feats.append(feat)
            mixed.depth_kv.append(kv)
        if stage.depth < self.pr.max_depth:
            return
        j = stage.step
        lambdas = torch.stack(
            [self.draft_model.halt_probability(f, detach_input=self.pr.gate_detach_input) for f in mixed.depth_feats[:-1]],
            dim=-1,
        )  # [B,T,R]
        q = halting_distribution(lambdas)  # [B,T,R+1]
        d = self.sample_halt_depth(q.detach(), rows)
        mixed.continuation, kv_d = mixed_cache(mixed.depth_feats, mixed.depth_kv, d)
        mixed.chain.append(kv_d)
        if j == 0 and self.pr.mix_context:
            mixed.ctx = kv_d
        logits_0 = rows.cut(one_pass.logits[0]) if j == 0 else None  # step 0's depth 0 is the one-pass row
        if logits_0 is not None and self.pr.recon_grad == "isolated":
            logits_0 = logits_0.detach()
        mixed.steps.append(self._score_depths(mixed.depth_feats, rows.views[j], logits_0, q, lambdas, d, return_logits,
                                              step=j, lo=rows.lo))

    def _score_depths(self, depth_feats, view: _RowView, logits_0, q, lambdas, d, return_logits: bool,
                      step: int = 0, lo: int = 0) -> MixedStep:
        """The per-depth losses `l^r` of a closed step (and its telemetry's predictions); the step
        observer, if any, reads the per-depth logits of its rows `[lo, ...)` of the sequence."""
        logits = [logits_0 if (logits_0 is not None and r == 0) else self.readout(f, r) for r, f in enumerate(depth_feats)]
        if self.step_observer is not None:  # the acceptance simulator / headroom (`training.simulate`)
            self.step_observer.depths(step, lo, [lg.detach() for lg in logits], q.detach(), self.draft_model.d2t)
        losses = torch.stack([soft_cross_entropy_rows(lg, view.target_p) for lg in logits], dim=-1)  # [B,T,R+1]
        correct, confidence, in_topk, agree = step_predictions(logits, view.target_token_ids, self.draft_model.d2t)
        return MixedStep(
            q=q, lambdas=lambdas.detach(), halt_depth=d, losses=losses,
            position_mask=view.position_mask.squeeze(-1).float(), loss_mask=view.loss_mask.squeeze(-1).float(),
            correct=correct, confidence=confidence, in_topk=in_topk, agree=agree, feature_change=feature_change(depth_feats),
            logits=[lg.detach() for lg in logits] if return_logits else [],
        )

    def _score_one_pass(self, j: int, feature: torch.Tensor, inp: _Inputs, one_pass: _OnePass, out: PRForwardOutput) -> None:
        """SpecForge's per-step loss and accuracy of the one-pass chain (`l^0_A`)."""
        logits = self.readout(feature, 0)
        one_pass.logits.append(logits)
        v = inp.views[j]
        acc, acc_rate, loss, correct, denom, metric_loss, loss_denom = sf.step_acc_and_loss(
            self, logits=logits, target_p=v.target_p, target_p_on_draft=v.target_p_on_draft,
            target_token_ids=v.target_token_ids, position_mask=v.position_mask, loss_mask=v.loss_mask,
            adapter=inp.adapter,
        )
        out.plosses.append(loss)
        out.acces.append(acc)
        out.acceptance_rates.append(acc_rate)
        out.acc_corrects.append(correct)
        out.acc_denoms.append(denom)
        out.metric_losses.append(metric_loss)
        out.metric_loss_denoms.append(loss_denom)

    def sample_halt_depth(self, q: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """`d ~ q` per row by inverse CDF, from one uniform per sequence row.

        The uniforms are drawn for every row of the sequence and then cut to the mixed
        rollout's window, so a row's halt depth does not depend on which rows run."""
        gen = self.generator
        u = torch.rand(q.shape[0], rows.t, generator=gen, device=gen.device if gen is not None else q.device)
        u = u[:, rows.lo:rows.hi].to(device=q.device, dtype=q.dtype)
        below = q.cumsum(-1)[..., :-1]  # P(d <= r), r < R
        return (u[..., None] >= below).sum(-1)
