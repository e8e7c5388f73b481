"""The paper's depth control (Table 3, last row): EAGLE-3 with a second, ordinary decoder layer.

Owns:
  * `SecondDecoderLayer` — a plain pre-norm Llama decoder layer over the drafter's feature
    (`d` in, `d` out: input norm, self-attention, residual, post-attention norm, MLP,
    residual). It reads only what `M` wrote (no token slot: EAGLE's `[e(t); h]` fusion is
    `M`'s alone) and keeps its own KV per position, exactly as `M` does. Its attention is
    SpecForge's `LlamaAttention` (so SpecForge's TTT cache works for it unchanged) with the
    q/k/v projections narrowed from `2d` to `d` inputs.
  * `LlamaForCausalLMEagle3TwoLayer` — `LlamaForCausalLMEagle3` whose backbone is
    `second_layer(M(e, h))`: every position pays for two layers, where PR pays for a second
    pass only at the positions it reconsiders. Trained by SpecForge's own `eagle3` strategy
    (its TTT loop calls `backbone`; `training.registration` widens that strategy's accepted
    architectures to this one), served by our evaluator (`serving.drafter_runtime` runs both
    layers on every row, each against its own KV). SGLang's `LlamaForCausalLMEagle3` has one
    layer, so there is no `--to sglang` export of it.

During SpecForge's TTT loop the second layer's KV lives in a third slot of the loop's
`cache_hidden` list (`[keys, values]` of `M`, then `[keys, values]` of this layer), which
SpecForge's code never reads past index 1.

Does not own: reconsideration (`modeling.drafter`), the training loop (SpecForge's).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from pr_specforge._specforge import (
    LlamaAttention,
    LlamaForCausalLMEagle3,
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    register_draft,
    repeat_kv,
)

TWO_LAYER_ARCHITECTURE = "LlamaForCausalLMEagle3TwoLayer"


class SecondDecoderLayer(nn.Module):
    """An ordinary decoder layer over the feature `M` produced (pre-norm in, pre-norm out)."""

    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        attn = self.self_attn
        # SpecForge's attention reads EAGLE's 2d-wide [e; h]; an ordinary layer reads d
        attn.q_proj = nn.Linear(d, attn.num_heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(d, attn.num_key_value_heads * attn.head_dim, bias=False)
        attn.v_proj = nn.Linear(d, attn.num_key_value_heads * attn.head_dim, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, cache_hidden=None, attention_mask=None, position_ids=None) -> torch.Tensor:
        h = hidden + self.self_attn(hidden_states=self.input_layernorm(hidden), cache_hidden=cache_hidden,
                                    attention_mask=attention_mask, position_ids=position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))

    # ---------------------------------------------------- the serving row API (as `M`'s layer_qkv/_finish)
    def qkv(self, hidden: torch.Tensor, position_ids: torch.Tensor,
            max_position: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `[N, T, d]` at positions `[N, T]` -> `q [N, H, T, Dh]`, RoPE'd `k`, `v` (KV heads repeated to H)."""
        attn = self.self_attn
        x = self.input_layernorm(hidden)
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(n, t, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        seq_len = (int(position_ids.max()) if max_position is None else max_position) + 1
        cos, sin = attn.rotary_emb(q, seq_len=seq_len)
        q, k = apply_rotary_pos_emb(q, k, cos.to(q.device), sin.to(q.device), position_ids)
        return q, repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`attn_out [N, H, T, Dh]` and the layer's input `[N, T, d]` -> its output `[N, T, d]`."""
        attn = self.self_attn
        n, _, t, _ = attn_out.shape
        h = hidden + attn.o_proj(attn_out.transpose(1, 2).reshape(n, t, attn.num_heads * attn.head_dim))
        return h + self.mlp(self.post_attention_layernorm(h))


@register_draft
class LlamaForCausalLMEagle3TwoLayer(LlamaForCausalLMEagle3):
    """EAGLE-3 with `second_layer` after `M` on every position (Table 3's "two decoder layers")."""

    def __init__(self, config, quant_config=None, attention_backend: str = "sdpa") -> None:
        super().__init__(config, quant_config=quant_config, attention_backend=attention_backend)
        self.second_layer = SecondDecoderLayer(config)
        self.post_init()

    def backbone(self, input_embeds, hidden_states, cache_hidden, attention_mask, position_ids,
                 past_key_values=None, use_cache: bool = True) -> torch.Tensor:
        feature = super().backbone(input_embeds, hidden_states, cache_hidden, attention_mask, position_ids,
                                   past_key_values, use_cache)
        second_cache = None
        if cache_hidden is not None:
            if len(cache_hidden) == 2:  # the loop's first step: open this layer's slot
                cache_hidden.append([[], []])
            second_cache = cache_hidden[2]
        return self.second_layer(feature, second_cache, attention_mask, position_ids)
