"""The PR training model: SpecForge's EAGLE-3 TTT loop plus reconsideration (Eq. 6, 7, 12).

`OnlinePRModel` subclasses SpecForge's `OnlineEagle3Model` and keeps its
interface: same inputs (offline EAGLE-3 features), same teacher (`t2d`-restricted
target distribution), same per-step loss and accuracy (it calls the parent's
`_acc_and_loss` for the one-pass chain), same `0.8**j` step weights.

Two on-policy rollouts share step 0 (the branch point, Appendix B.2):
  A. the one-pass chain: SpecForge's EAGLE-3 TTT, scored by `l^0` (unconditional);
  B. the mixed-cache chain: at every TTT step `j` the depths `r = 1..R`
     (`f^r = M(f^{r-1}, Q(f^{r-1}))`, same position, context + chain + own key),
     the gate's `lambda_0..lambda_{R-1}`, `q` (Eq. 4), a sampled halt depth
     `d ~ q`, and the next step continues from `f^d` with `kv(f^d)` in the chain
     (the mixed cache, Eq. 7); scored by the gated head and gate terms of Eq. 6.
Rows that depend only on what is already computed run in ONE call of `M`: call
`c` holds A's step `c` and B's next stage (for `c = 1` that is exactly Eq. 5:
`f_{p+1}^0` and `f_p^1` both read `f_p^0`).

Loss (per TTT step j, weight w_j = decay^j, means over all B*T rows as SpecForge):
  L = sum_j w_j [ l^0_A + sum_{r>=1} sg[q_r] l^r_B + sum_{r>=0} q_r sg[l^r_B] ]
      - beta * H(q_bar),   q_bar = loss-position mean of q over every step.
With R = 0 there is nothing to route: L is SpecForge's EAGLE-3 loss exactly.

Does not own: the drafter's parameters (`pr_specforge.modeling`), SpecForge
integration (`pr_specforge.integration`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pr_specforge._specforge import OnlineEagle3Model, _compute_target_p_padded, padding, soft_cross_entropy_rows
from pr_specforge.config import PRConfig
from pr_specforge.modeling.attention import KV, chain_attention, strict_causal_mask
from pr_specforge.modeling.drafter import LlamaForCausalLMEagle3PR, halting_distribution

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


#: depth-0 top-1 probability bands of the confidence-banded telemetry (the evaluator's Table 7 bands)
CONFIDENCE_BANDS = (0.5, 0.9)
#: `pr/recovered_outside_topk`: depth-0 misses in the serving sense (the target token is not among
#: depth 0's top RECOVER_TOPK, the tree's k), and the share some depth >= 1 gets right at top-1.
RECOVER_TOPK = 6
CONFIDENCE_BAND_NAMES = ("conf_lt50", "conf_50to90", "conf_ge90")


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


@dataclass
class _Group:
    """One row group of a batched call of M: `[B, T, d]` inputs at position offset `step`."""

    emb: torch.Tensor
    hidden: torch.Tensor
    step: int
    chain: List[KV]
    ctx: KV


@dataclass
class _RowView:
    """The fields of a SpecForge step view that scoring the mixed rollout reads, cut to its rows."""

    target_p: torch.Tensor
    target_token_ids: torch.Tensor
    position_mask: torch.Tensor
    loss_mask: torch.Tensor


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


class OnlinePRModel(OnlineEagle3Model):
    """TTT training model for `LlamaForCausalLMEagle3PR` (see module docstring)."""

    def __init__(
        self,
        draft_model: LlamaForCausalLMEagle3PR,
        length: int = 7,
        attention_backend: str = "sdpa",
        pr: Optional[PRConfig] = None,
        ploss_decay: float = 0.8,
        generator: Optional[torch.Generator] = None,
        skip_unscored_rows: bool = True,
    ) -> None:
        if attention_backend != "sdpa":
            raise ValueError(
                f"training.attention_backend={attention_backend!r}: the pr algorithm composes its own "
                "attention over [context | chain | own key] rows and supports only 'sdpa'; set "
                "training.attention_backend=sdpa"
            )
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

    # ------------------------------------------------------------------ M calls
    def _run(self, groups: List[_Group], pos: torch.Tensor, ctx_mask, start_mask) -> List[Tuple[torch.Tensor, KV]]:
        """One batched call of M over all groups; returns per group `(feature, (k, v))`."""
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        g = len(groups)
        b, t, _ = groups[0].hidden.shape
        emb = torch.cat([gr.emb for gr in groups], dim=0)
        hidden = torch.cat([gr.hidden for gr in groups], dim=0)
        positions = torch.cat([(pos + gr.step).expand(b, t) for gr in groups], dim=0)
        q, k, v = draft.layer_qkv(emb, hidden, positions)
        split = lambda x: x.view(g, b, *x.shape[1:])  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        same_ctx = all(gr.ctx[0] is groups[0].ctx[0] for gr in groups)
        if same_ctx:
            ctx = (groups[0].ctx[0][None], groups[0].ctx[1][None])
        else:
            ctx = (torch.stack([gr.ctx[0] for gr in groups]), torch.stack([gr.ctx[1] for gr in groups]))
        out = chain_attention(q, (k, v), ctx, ctx_mask, [gr.chain for gr in groups], start_mask)
        feats = draft.layer_finish(out.reshape(g * b, *out.shape[2:]), hidden).view(g, b, t, -1)
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
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        length, depth = self.length, self.pr.max_depth
        target_p_padded, target_p_on_draft_padded, target_ids_padded, position_mask = _compute_target_p_padded(
            target=target, t2d=draft.t2d, loss_mask=loss_mask, length=length
        )
        del target
        b, t, _ = hidden_states.shape
        h0 = draft.project_hidden_states(hidden_states.to(draft.fc.weight.dtype))
        pos = self._prepare_position_ids(position_ids, seq_length=t, past_key_values_length=0, device=h0.device)
        if attention_mask is None:
            attention_mask = torch.ones((b, t), dtype=torch.bool, device=h0.device)
        ctx_mask, start_mask = strict_causal_mask(attention_mask, h0.dtype)
        adapter = self._make_adapter()

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

        out = PRForwardOutput(loss=h0.new_zeros(()), plosses=[], acces=[], acceptance_rates=[], acc_corrects=[],
                              acc_denoms=[], metric_losses=[], metric_loss_denoms=[])
        logits_a: List[Optional[torch.Tensor]] = [None] * length

        def score_one_pass(j: int, feature: torch.Tensor) -> None:
            logits = draft.compute_logits(feature)
            logits_a[j] = logits
            v = views[j]
            acc, acc_rate, loss, correct, denom, metric_loss, loss_denom = self._acc_and_loss(
                logits=logits, target_p=v.target_p, target_p_on_draft=v.target_p_on_draft,
                target_token_ids=v.target_token_ids, position_mask=v.position_mask, loss_mask=v.loss_mask,
                adapter=adapter,
            )
            out.plosses.append(loss)
            out.acces.append(acc)
            out.acceptance_rates.append(acc_rate)
            out.acc_corrects.append(correct)
            out.acc_denoms.append(denom)
            out.metric_losses.append(metric_loss)
            out.metric_loss_denoms.append(loss_denom)

        # Call 0: TTT step 0 (shared by both rollouts).
        f0, kv0 = self._checkpointed(self._first_call, embs[0], h0, pos, ctx_mask, start_mask)
        score_one_pass(0, f0)
        feats_a, chain_a = f0, [kv0]
        mixed_len = 0 if depth == 0 else min(length, self.pr.mixed_rollout_length or length)

        # The mixed rollout's rows: all of them, or the window of rows that one of its steps scores.
        lo, hi = 0, t
        if mixed_len and self.skip_unscored_rows and not self.pr.mix_context and not return_logits:
            lo, hi = _scored_window(views[:mixed_len], t)
        rows = slice(lo, hi)
        cut = lambda x: x[:, rows]  # noqa: E731  [B, T, ...] -> the window's rows (a view)
        views_b = [_RowView(cut(v.target_p), cut(v.target_token_ids), cut(v.position_mask), cut(v.loss_mask))
                   for v in views[:mixed_len]]
        inputs_a = (pos, ctx_mask, start_mask)
        inputs_b = (pos[..., rows], ctx_mask[:, :, rows], start_mask[..., rows])
        whole = (lo, hi) == (0, t)  # then both rollouts' rows share one call of M

        # Mixed-cache rollout state (rows `lo:hi`; the context keys stay those of every row).
        stages = [(j, r) for j in range(mixed_len) for r in range(0 if j else 1, depth + 1)]
        depth_feats: List[torch.Tensor] = [cut(f0)]  # g_j^r for the current step j
        depth_kv: List[KV] = [(kv0[0][..., rows, :], kv0[1][..., rows, :])]
        chain_b: List[KV] = []
        ctx_b: KV = kv0  # becomes step 0's mixed keys once step 0 closes, if pr.mix_context
        cont_feat = cut(f0)
        collected: Dict[str, list] = {k: [] for k in ("q", "pm", "lm", "losses", "correct", "lambdas", "d", "conf", "in_topk")}

        a_step, s_idx = 1, 0
        while a_step < length or s_idx < len(stages):
            groups, kinds = [], []
            if a_step < length:
                groups.append(_Group(embs[a_step], feats_a, a_step, list(chain_a), kv0))
                kinds.append(("A", a_step))
            if s_idx < len(stages):
                j, r = stages[s_idx]
                if r == 0:
                    groups.append(_Group(cut(embs[j]), cont_feat, j, list(chain_b), ctx_b))
                else:
                    prev = depth_feats[r - 1]
                    groups.append(_Group(draft.self_query(prev), prev, j, list(chain_b), ctx_b))
                kinds.append(("B", (j, r)))
            n_a = sum(kind == "A" for kind, _ in kinds)
            calls = [(groups, inputs_a)] if whole else [(groups[:n_a], inputs_a), (groups[n_a:], inputs_b)]
            results = [res for gs, inputs in calls if gs for res in self._checkpointed(self._run, gs, *inputs)]
            for (kind, key), (feat, kv) in zip(kinds, results):
                if kind == "A":
                    score_one_pass(key, feat)
                    feats_a = feat
                    chain_a.append(kv)
                    a_step += 1
                    continue
                j, r = key
                if r == 0:
                    depth_feats, depth_kv = [feat], [kv]
                else:
                    depth_feats.append(feat)
                    depth_kv.append(kv)
                s_idx += 1
                if r == depth:
                    cont_feat, mixed_kv = self._close_step(j, depth_feats, depth_kv, views_b, cut(logits_a[0]) if j == 0 else None,
                                                           (lo, hi, t), collected, return_logits, out)
                    chain_b.append(mixed_kv)
                    if j == 0 and self.pr.mix_context:
                        ctx_b = mixed_kv

        weights = [self.ploss_decay**j for j in range(length)]
        one_pass = sum(w * p for w, p in zip(weights, out.plosses))
        out.terms["loss_one_pass"] = one_pass.detach()
        out.grad_terms["one_pass"] = one_pass
        loss = one_pass
        if mixed_len:
            loss = loss + self._routing_terms(collected, weights, b * t, out)
        out.loss = loss
        out.terms["loss_total"] = loss.detach()
        if return_logits:
            out.logits = logits_a
        return out

    def _close_step(self, j, depth_feats, depth_kv, views, logits_0, window, collected, return_logits, out):
        """All depths of mixed-rollout step j are computed: gate, q, halt depth, mixed cache, losses.

        `logits_0`: step 0's one-pass logits (its depth 0 is the one-pass row), else None;
        `window`: `(lo, hi, T)`, the sequence rows the mixed rollout runs."""
        draft: LlamaForCausalLMEagle3PR = self.draft_model
        depth = self.pr.max_depth
        v = views[j]
        lambdas = torch.stack(
            [draft.halt_probability(f, detach_input=self.pr.gate_detach_input) for f in depth_feats[:depth]], dim=-1
        )  # [B,T,R]
        q = halting_distribution(lambdas)  # [B,T,R+1]
        d = self._sample_halt_depth(q.detach(), window)
        sel = F.one_hot(d, depth + 1).to(depth_feats[0].dtype)  # [B,T,R+1]
        feat_d = sum(sel[..., r, None] * depth_feats[r] for r in range(depth + 1))
        k_d = sum(sel[:, None, :, r, None] * depth_kv[r][0] for r in range(depth + 1))
        v_d = sum(sel[:, None, :, r, None] * depth_kv[r][1] for r in range(depth + 1))

        logits = [logits_0 if (j == 0 and r == 0) else draft.compute_logits(f) for r, f in enumerate(depth_feats)]
        losses = torch.stack([soft_cross_entropy_rows(lg, v.target_p) for lg in logits], dim=-1)  # [B,T,R+1]
        with torch.no_grad():
            pred = torch.stack([lg.argmax(-1) for lg in logits], dim=-1)
            pred = pred + draft.d2t[pred]
            correct = pred == v.target_token_ids[..., None]
            conf = torch.softmax(logits[0].float(), dim=-1).amax(-1)  # depth-0 top-1 probability
            top = logits[0].topk(min(RECOVER_TOPK, logits[0].shape[-1]), dim=-1).indices
            in_topk = ((top + draft.d2t[top]) == v.target_token_ids[..., None]).any(-1)
        collected["conf"].append(conf)
        collected["in_topk"].append(in_topk)
        collected["q"].append(q)
        collected["pm"].append(v.position_mask.squeeze(-1).float())
        collected["lm"].append(v.loss_mask.squeeze(-1).float())
        collected["losses"].append(losses)
        collected["correct"].append(correct)
        collected["lambdas"].append(lambdas.detach())
        collected["d"].append(d)
        if return_logits:
            out.depth_logits.append([lg.detach() for lg in logits])
            out.halt_depths.append(d)
            out.q.append(q.detach())
            out.position_masks.append(v.position_mask.squeeze(-1).float())
        return feat_d, (k_d, v_d)

    def _sample_halt_depth(self, q: torch.Tensor, window: Tuple[int, int, int]) -> torch.Tensor:
        """`d ~ q` per row by inverse CDF, from one uniform per sequence row.

        The uniforms are drawn for every row of the sequence and then cut to the mixed
        rollout's window, so a row's halt depth does not depend on which rows run."""
        lo, hi, t = window
        gen = self.generator
        u = torch.rand(q.shape[0], t, generator=gen, device=gen.device if gen is not None else q.device)
        u = u[:, lo:hi].to(device=q.device, dtype=q.dtype)
        below = q.cumsum(-1)[..., :-1]  # P(d <= r), r < R
        return (u[..., None] >= below).sum(-1)

    def _routing_terms(self, c, weights, rows: int, out: PRForwardOutput) -> torch.Tensor:
        """Eq. 6's reconsidered-head, gate and balance terms over the mixed rollout.

        `rows`: the loss denominator, all B*T rows as SpecForge's (the window's rows are fewer)."""
        head = gate = mixed_one_pass = 0.0
        for j, (q, pm, losses) in enumerate(zip(c["q"], c["pm"], c["losses"])):
            use = q[..., 1:].detach() if self.pr.reconsider_weight == "use" else torch.ones_like(q[..., 1:])
            head = head + weights[j] * (use * losses[..., 1:] * pm[..., None]).sum() / rows
            gate = gate + weights[j] * (q * losses.detach() * pm[..., None]).sum() / rows
            if self.pr.one_pass_loss_on_mixed and j > 0:
                mixed_one_pass = mixed_one_pass + weights[j] * (losses[..., 0] * pm).sum() / rows
        q_all = torch.stack(c["q"])
        pm_all = torch.stack(c["pm"])
        entropy, q_bar = marginal_entropy(q_all, pm_all)
        balance = -self.pr.balance_coef * entropy
        out.terms.update(
            loss_reconsider=torch.as_tensor(head).detach(),
            loss_gate=torch.as_tensor(gate).detach(),
            loss_balance=balance.detach(),
            depth_marginal_entropy=entropy.detach(),
        )
        out.grad_terms.update(reconsider=head, gate=gate, balance=balance)
        if self.pr.one_pass_loss_on_mixed:
            out.terms["loss_one_pass_mixed"] = torch.as_tensor(mixed_one_pass).detach()
            out.grad_terms["one_pass_mixed"] = mixed_one_pass
        self._telemetry(c, out)
        return head + gate + mixed_one_pass + balance

    @torch.no_grad()
    def _telemetry(self, c, out: PRForwardOutput) -> None:
        depth = self.pr.max_depth
        q = torch.stack(c["q"])
        pm = torch.stack(c["pm"])
        lm = torch.stack(c["lm"])
        losses = torch.stack(c["losses"]).detach()
        correct = torch.stack(c["correct"]).float()
        lambdas = torch.stack(c["lambdas"])
        d = torch.stack(c["d"])
        pm_sum, lm_sum = pm.sum(), lm.sum()
        rm = out.ratio_metrics
        for r in range(depth + 1):
            rm[f"pr/depth_marginal_{r}"] = ((q[..., r] * pm).sum(), pm_sum)
            rm[f"pr/loss_depth_{r}"] = ((losses[..., r] * pm).sum(), pm_sum)
            rm[f"pr/acc_depth_{r}"] = ((correct[..., r] * lm).sum(), lm_sum)
            rm[f"pr/halt_share_depth_{r}"] = (((d == r).float() * lm).sum(), lm_sum)
        for r in range(depth):
            rm[f"pr/gate_mean_depth_{r}"] = ((lambdas[..., r] * lm).sum(), lm_sum)
        rm["pr/halt_past_0"] = (((d > 0).float() * lm).sum(), lm_sum)
        wrong0 = (1.0 - correct[..., 0]) * lm
        recovered = wrong0 * (correct[..., 1:].amax(-1) if depth else torch.zeros_like(wrong0))
        rm["pr/recovered_share"] = (recovered.sum(), wrong0.sum())
        rm["pr/recovered_of_all"] = (recovered.sum(), lm_sum)
        # the serving sense of a miss: the target token is not even among depth 0's top-k proposals
        outside = (1.0 - torch.stack(c["in_topk"]).float()) * lm
        rm["pr/recovered_outside_topk"] = ((recovered * outside).sum(), outside.sum())
        # The same by depth-0 confidence band (the evaluator's bands): does the gate open, and do the
        # reconsidered depths out-predict depth 0, where the one-pass guess is unsure?
        conf = torch.stack(c["conf"])
        edges = [0.0, *CONFIDENCE_BANDS, float("inf")]
        for name, lo, hi in zip(CONFIDENCE_BAND_NAMES, edges[:-1], edges[1:]):
            in_band = ((conf >= lo) & (conf < hi)).float() * lm
            band_sum = in_band.sum()
            rm[f"pr/conf_share_{name}"] = (band_sum, lm_sum)
            rm[f"pr/halt_past_0_{name}"] = (((d > 0).float() * in_band).sum(), band_sum)
            for r in range(depth + 1):
                rm[f"pr/acc_depth_{r}_{name}"] = ((correct[..., r] * in_band).sum(), band_sum)
            rm[f"pr/recovered_share_{name}"] = ((recovered * in_band).sum(), (wrong0 * in_band).sum())
