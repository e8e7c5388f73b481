"""The PR drafter's own parts and its row-level API, in plain torch (no SpecForge, no SGLang).

Owns:
  * `SelfQuery` - the self-query MLP `Q: R^d -> R^d` (Sec. 3.2) that steers a reconsideration pass; it fills
    the slot where an ordinary step feeds the token embedding.
  * `HaltGate` - `lambda_r = sigmoid(gate(f^r))` (Eq. 4); `halting_distribution` - Eq. 4's `q(r)`.
  * `PRRows` - the row-level API over the single decoder layer `M` of an EAGLE-3 drafter, mixed into the
    training drafter (`modeling.drafter.LlamaForCausalLMEagle3PR`) and the serving one
    (`core.eagle3.PRServingDrafter`): `layer_qkv` (norms, fusion of the two input slots, projections, RoPE at
    explicit positions) and `layer_finish` (residual, MLP), the readouts (`depth_logits`, `halt_probability`)
    and the reconsideration inputs (Eq. 3). The serving runtime also calls `layer_qkv` / `layer_finish`
    unbound on an EAGLE-3 drafter.
  * `apply_rope`, `repeat_kv` - rotary position embedding at explicit positions and grouped-KV expansion.

Does not own: the EAGLE-3 modules the API runs over (SpecForge's for training, `core.eagle3` for serving).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

PR_PARAM_PREFIXES = ("pr_self_query.", "pr_halt_gate.", "pr_recon_head.", "pr_recon_adapter.")


class SelfQuery(nn.Module):
    """`Q(f) = W_out silu(W_in rmsnorm(f))` (Sec. 3.2).

    The input norm makes Q indifferent to the growing scale of pre-norm features
    across depths; its output is normed again by the layer's `input_layernorm`.
    """

    def __init__(self, hidden_size: int, inner_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.w_in = nn.Linear(hidden_size, inner_size, bias=False)
        self.w_out = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.silu(self.w_in(self.norm(feature))))


class HaltGate(nn.Module):
    """`lambda = sigmoid(w . x + b)` (Eq. 4); returns lambda with the last dim squeezed."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x).squeeze(-1).float())


def halting_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """Eq. 4: `q(r) = lambda_r prod_{s<r}(1 - lambda_s)`, `q(R) = prod_{s<R}(1 - lambda_s)`.

    `lambdas[..., r]` for `r = 0..R-1` (`lambda_R` is never computed: at the cap
    the drafter halts regardless). Returns `q[..., 0..R]`, summing to 1.
    """
    ones = torch.ones_like(lambdas[..., :1])
    survive = torch.cumprod(torch.cat([ones, 1.0 - lambdas], dim=-1), dim=-1)  # [..., R+1]
    halt_here = torch.cat([lambdas, ones], dim=-1)
    return survive * halt_here


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor):
    """`q, k [N, H, T, Dh]` rotated at `position_ids [N, T]`; `cos, sin [1, 1, S, Dh]` (a rotary cache's rows)."""
    cos = cos[0, 0][position_ids][:, None]
    sin = sin[0, 0][position_ids][:, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[N, H_kv, T, Dh]` -> `[N, H_kv * groups, T, Dh]`, each KV head repeated for its query heads."""
    if groups == 1:
        return x
    n, h, t, d = x.shape
    return x[:, :, None].expand(n, h, groups, t, d).reshape(n, h * groups, t, d)


class PRRows:
    """The row-level API of a PR drafter (mixed into a module with EAGLE-3's `midlayer`, `norm`, `lm_head`,
    `compute_logits`, `norm_output` and the PR parts `pr_self_query`, `pr_halt_gate`, `pr_settings`)."""

    # the RoPE application `layer_qkv` uses; the training drafter keeps SpecForge's (compiled) one
    rope_fn = staticmethod(apply_rope)

    @property
    def max_depth(self) -> int:
        return self.pr_settings.max_depth

    def self_query(self, feature: torch.Tensor) -> torch.Tensor:
        return self.pr_self_query(feature).to(feature.dtype)

    def reconsideration_inputs(self, feature: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3, `f^r = M(f^{r-1}, Q(f^{r-1}))`: the two input slots of a reconsideration pass.

        Returns `(Q(f^{r-1}), f^{r-1})`: the self-query in the token-embedding slot, the previous
        depth's feature in the hidden slot, at the same position (both read `norm(f^{r-1})` with
        `post_norm_feedback`, see `feedback`). Training (`objective.ttt`) and
        serving (`serving.tree`) both build their reconsideration rows through this.
        """
        fed = self.feedback(feature)
        return self.self_query(fed), fed

    def feedback(self, feature: torch.Tensor) -> torch.Tensor:
        """What the next step or depth reads of `feature` in its hidden slot: `norm(f)` with
        `post_norm_feedback` (EAGLE-3.1), else `f` itself (EAGLE-3)."""
        return self.norm(feature) if self.pr_settings.post_norm_feedback else feature

    def depth_logits(self, feature: torch.Tensor, depth) -> torch.Tensor:
        """Draft-vocab logits of features read out at reconsideration depth `depth` (the ONE readout
        every caller uses: training, and both serving tree builders).

        Depth 0 is the one-pass head (`compute_logits`). Depths >= 1 use the second head with
        `recon_head: separate`, else the one-pass head too. `depth` is an int (every row at that
        depth) or a per-row tensor `[N]` / `[N, T]` matching `feature`'s leading dims.
        """
        if not hasattr(self, "pr_recon_head"):
            return self.compute_logits(feature)
        if not torch.is_tensor(depth):
            return self.compute_logits(feature) if depth == 0 else self.pr_recon_head(feature, self.norm_output)
        deep = depth.to(feature.device) > 0  # both heads on every row: no host sync to ask which rows are deep
        one, two = self.compute_logits(feature), self.pr_recon_head(feature, self.norm_output)
        return torch.where(deep[..., None], two, one)

    def halt_probability(self, feature: torch.Tensor, detach_input: bool = False) -> torch.Tensor:
        """lambda for each row's feature (fp32)."""
        x = self.norm(feature) if self.pr_settings.gate_reads_normed else feature
        if detach_input:
            x = x.detach()
        return self.pr_halt_gate(x)

    def layer_qkv(self, input_emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                  max_position: Optional[int] = None, recon_rows: Optional[torch.Tensor] = None,
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of `M` for rows `[N, T, d]` at explicit positions `[N, T]`.

        Returns `q [N, H, T, Dh]` and RoPE'd `k, v [N, H, T, Dh]` (KV heads
        repeated to H, as SpecForge caches them). `max_position`, when the caller
        knows a bound on `position_ids`, saves reading it back from the device.
        `recon_rows` (`[N]` or `[N, T]`, nonzero = a reconsideration row) switches the
        adapter on for those rows only; without an adapter (or with None) it is ignored.
        """
        attn = self.midlayer.self_attn
        if type(attn.rotary_emb).__name__ == "LlamaMutiRotaryEmbedding":
            raise NotImplementedError("PR rows do not support multimodal RoPE (mrope) drafters")
        layer = self.midlayer
        x = torch.cat((layer.input_layernorm(input_emb), layer.hidden_norm(hidden)), dim=-1)
        n, t, _ = x.shape
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        rows = _adapter_rows(self, recon_rows, n, t, x.device)
        if rows is not None:
            ad = self.pr_recon_adapter
            q, k, v = q + ad.delta("q", x, rows), k + ad.delta("k", x, rows), v + ad.delta("v", x, rows)
        q = q.view(n, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k.view(n, t, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        v = v.view(n, t, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        seq_len = (int(position_ids.max()) if max_position is None else max_position) + 1
        cos, sin = attn.rotary_emb(q, seq_len=seq_len)
        rope = getattr(self, "rope_fn", apply_rope)  # an EAGLE-3 drafter (unbound call) has none: ours
        q, k = rope(q, k, cos.to(q.device), sin.to(q.device), position_ids)
        return q, repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)

    def layer_finish(self, attn_out: torch.Tensor, hidden: torch.Tensor, recon_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Second half of `M`: `attn_out [N, H, T, Dh]` -> feature `[N, T, d]` (pre-norm).

        `recon_rows` as in `layer_qkv` (the adapter's o and MLP deltas on those rows only)."""
        attn = self.midlayer.self_attn
        n, _, t, _ = attn_out.shape
        a = attn_out.transpose(1, 2).reshape(n, t, attn.num_heads * attn.head_dim)
        rows = _adapter_rows(self, recon_rows, n, t, a.device)
        if rows is None:
            h = hidden + attn.o_proj(a)
            return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
        ad, mlp = self.pr_recon_adapter, self.midlayer.mlp
        h = hidden + attn.o_proj(a) + ad.delta("o", a, rows)
        x = self.midlayer.post_attention_layernorm(h)
        g = mlp.gate_proj(x) + ad.delta("mlp_in_g", x, rows)
        u = mlp.up_proj(x) + ad.delta("mlp_in_u", x, rows)
        inner = mlp.act_fn(g) * u
        return h + mlp.down_proj(inner) + ad.delta("mlp_out", inner, rows)


def _adapter_rows(model, recon_rows, n: int, t: int, device) -> Optional[torch.Tensor]:
    """The adapter's row mask `[N, T, 1]`, or None when there is no adapter or no reconsideration row.

    A function, not a method: the serving runtime calls the row API unbound on EAGLE-3 drafters too."""
    if recon_rows is None or getattr(model, "pr_recon_adapter", None) is None:
        return None
    from pr_specforge.core.recon_parts import row_mask

    return row_mask(recon_rows, n, t, device)
