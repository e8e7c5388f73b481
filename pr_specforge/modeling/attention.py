"""Attention for co-forwarded rows of the TTT chain (training) — composed, not a module.

In SpecForge's sdpa TTT, the row of TTT step `j` at sequence row `t` (position
`t + j`) attends to the step-0 keys of rows `< t` (the committed context), the
chain of keys of its own draft positions (`t` at step 0, ..., `t + j - 1` at step
`j - 1`) and its own key. A reconsideration row at step `j` attends to exactly the
same context and chain plus its OWN key, not the one-pass row's key (Sec. 3.4).
Both are "context + chain + own key", differing only in which chain they read
(one-pass keys, or the mixed cache of Eq. 7), so any mix of such row groups runs
in one batched call of the decoder layer.

Owns: `chain_attention` (softmax over [context | chain | own] per row).
Does not own: projections, RoPE (`LlamaForCausalLMEagle3PR.layer_qkv`), or which
keys form a chain (`pr_specforge.training.objective.ttt`).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

KV = Tuple[torch.Tensor, torch.Tensor]


def strict_causal_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Additive masks from a `[B, T]` key-padding mask.

    Returns `ctx_mask [B, 1, T, T]` (row `t` may see context keys `< t` that are
    not padding) and `start_mask [B, 1, T]` (row `t`'s chain-start key is its own
    step-0 key, masked when row `t` is padding, as SpecForge's causal mask does).
    """
    b, t = attention_mask.shape
    keep = attention_mask.bool()
    lower = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril(-1)
    allowed = lower[None] & keep[:, None, :]
    neg = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    ctx_mask = torch.where(allowed, zero, torch.tensor(neg, dtype=dtype, device=attention_mask.device))
    start_mask = torch.where(keep, zero, torch.tensor(neg, dtype=dtype, device=attention_mask.device))
    return ctx_mask[:, None], start_mask[:, None]


def chain_attention(
    q: torch.Tensor,
    own: KV,
    ctx: KV,
    ctx_mask: torch.Tensor,
    chains: Sequence[Sequence[KV]],
    start_mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of `G` co-forwarded row groups.

    q, own k/v: `[G, B, H, T, Dh]`; ctx k/v: `[G or 1, B, H, T, Dh]`;
    ctx_mask `[B, 1, T, T]` (strict causal + padding); chains[g] = list of
    row-aligned `(k, v)` `[B, H, T, Dh]` for group `g` (may be empty; lengths
    may differ); start_mask `[B, 1, T]` is added to each group's first chain
    entry (its own key when the chain is empty).
    Returns `[G, B, H, T, Dh]` in `q`'s dtype.
    """
    g = q.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    own_k, own_v = own
    ctx_k, ctx_v = ctx
    scores_ctx = torch.matmul(q, ctx_k.transpose(-1, -2)) * scale + ctx_mask  # [G,B,H,T,T]
    width = max((len(c) for c in chains), default=0)
    neg = torch.finfo(scores_ctx.dtype).min
    extra: List[torch.Tensor] = []  # per group [B,H,T,width+1]
    for gi in range(g):
        cols = [(q[gi] * k).sum(-1) * scale for k, _ in chains[gi]]
        cols.append((q[gi] * own_k[gi]).sum(-1) * scale)
        cols[0] = cols[0] + start_mask
        pad = width + 1 - len(cols)
        stacked = torch.stack(cols, dim=-1)
        if pad:
            stacked = torch.cat([stacked[..., :-1], stacked.new_full(stacked.shape[:-1] + (pad,), neg), stacked[..., -1:]], dim=-1)
        extra.append(stacked)
    scores = torch.cat([scores_ctx, torch.stack(extra, dim=0)], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    t_ctx = ctx_k.shape[-2]
    out_ctx = torch.matmul(weights[..., :t_ctx], ctx_v)
    outs = []
    for gi in range(g):
        w = weights[gi, ..., t_ctx:]
        acc = out_ctx[gi]
        for i, (_, v) in enumerate(chains[gi]):
            acc = acc + w[..., i, None] * v
        outs.append(acc + w[..., width, None] * own_v[gi])
    return torch.stack(outs, dim=0)
