"""The Parallel Reconsideration drafter: SpecForge's EAGLE-3 drafter plus two small parts.

Owns:
  * `SelfQuery` — the self-query MLP `Q: R^d -> R^d` (Sec. 3.2) that steers a
    reconsideration pass; it fills the slot where an ordinary step feeds the
    token embedding.
  * `HaltGate` — `lambda_r = sigmoid(gate(f^r))` (Eq. 4).
  * `LlamaForCausalLMEagle3PR` — `LlamaForCausalLMEagle3` (EAGLE-3 parameters keep
    SpecForge's names) with the two parts above under the `pr_` prefix, and a
    row-level API over the single decoder layer `M`: `layer_qkv` (norms, fusion
    of the two input slots, projections, RoPE at explicit positions) and
    `layer_finish` (residual, MLP). Attention between rows is composed by the
    caller (`pr_specforge.modeling.attention`), which is what lets an ordinary
    draft step and reconsideration rows of different positions and caches run
    in ONE batched call of `M` (co-forwarding, Eq. 5).

Does not own: the training objective (`pr_specforge.training.objective`), the serving tree
(`pr_specforge.serving`), or checkpoint export (`pr_specforge.export`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pr_specforge.config import PR_CONFIG_KEY, PRDraftSettings
from pr_specforge._specforge import (
    LlamaForCausalLMEagle3,
    LlamaMutiRotaryEmbedding,
    apply_rotary_pos_emb,
    init_rope,
    register_draft,
    repeat_kv,
)
from pr_specforge.modeling.recon_parts import ReconAdapter, ReconHead, row_mask

PR_ARCHITECTURE = "LlamaForCausalLMEagle3PR"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
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


def rebuild_rope(draft: nn.Module) -> None:
    """Recompute the drafter's non-persistent rotary buffers in place.

    `from_pretrained` in transformers 5.8.1 leaves them uninitialised (garbage
    `inv_freq`, zero cos/sin caches): attention goes uniform and the drafter
    silently accepts nothing. Every load path in this package calls this once
    (`load_drafter`, and the training registration's `build_draft`).
    """
    device = next(draft.parameters()).device
    layers = [draft.midlayer] + ([draft.second_layer] if hasattr(draft, "second_layer") else [])
    for layer in layers:  # the two-layer control's second layer has RoPE of its own
        init_rope(layer.self_attn)
        layer.self_attn.rotary_emb.to(device)


def halting_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """Eq. 4: `q(r) = lambda_r prod_{s<r}(1 - lambda_s)`, `q(R) = prod_{s<R}(1 - lambda_s)`.

    `lambdas[..., r]` for `r = 0..R-1` (`lambda_R` is never computed: at the cap
    the drafter halts regardless). Returns `q[..., 0..R]`, summing to 1.
    """
    ones = torch.ones_like(lambdas[..., :1])
    survive = torch.cumprod(torch.cat([ones, 1.0 - lambdas], dim=-1), dim=-1)  # [..., R+1]
    halt_here = torch.cat([lambdas, ones], dim=-1)
    return survive * halt_here


@register_draft
class LlamaForCausalLMEagle3PR(LlamaForCausalLMEagle3):
    """EAGLE-3 drafter with Parallel Reconsideration.

    Reconsideration step (Eq. 3): `f^r = M(f^{r-1}, Q(f^{r-1}))` — the same layer
    `M`, the previous depth's feature in the hidden slot, the self-query in the
    token-embedding slot, the same position index; `head(f^r)` proposes a token.
    """

    def __init__(self, config, quant_config=None, attention_backend: str = "sdpa") -> None:
        super().__init__(config, quant_config=quant_config, attention_backend=attention_backend)
        self.pr_settings = PRDraftSettings.from_config(config)
        d = config.hidden_size
        inner = self.pr_settings.self_query_hidden_size or d
        self.pr_self_query = SelfQuery(d, inner, config.rms_norm_eps)
        self.pr_halt_gate = HaltGate(d)
        std = float(getattr(config, "initializer_range", 0.02))
        if self.pr_settings.recon_head == "separate":
            self.pr_recon_head = ReconHead(self.norm, self.lm_head)
        if self.pr_settings.recon_adapter_rank:
            self.pr_recon_adapter = ReconAdapter(self.midlayer, self.pr_settings.recon_adapter_rank, std)
        self._init_pr_parameters()

    @torch.no_grad()
    def _init_pr_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        nn.init.normal_(self.pr_self_query.w_in.weight, std=std)
        nn.init.normal_(self.pr_self_query.w_out.weight, std=std)
        self.pr_self_query.norm.weight.fill_(1.0)
        # A zero gate starts at lambda = 1/2 everywhere: q = (1/2, 1/4, 1/4) for R = 2,
        # so every depth is read and trained from the first step.
        self.pr_halt_gate.linear.weight.zero_()
        self.pr_halt_gate.linear.bias.zero_()
        self.copy_one_pass_head()

    @torch.no_grad()
    def copy_one_pass_head(self) -> None:
        """Start the second head (`recon_head: separate`) as a copy of the one-pass head; a no-op when shared.

        Called at init and after one-pass weights are loaded into a fresh drafter (warm start)."""
        if hasattr(self, "pr_recon_head"):
            self.pr_recon_head.copy_from(self.norm, self.lm_head)

    @torch.no_grad()
    def set_gate_bias(self, bias: float) -> None:
        """The gate's initial bias: `lambda = sigmoid(bias)` everywhere at the start (weight stays zero)."""
        self.pr_halt_gate.linear.bias.fill_(float(bias))

    @property
    def max_depth(self) -> int:
        return self.pr_settings.max_depth

    @contextmanager
    def one_pass_detached(self):
        """Inside, every one-pass (EAGLE-3) parameter reads as a detached tensor of the same value,
        so whatever runs there sends gradient only to the reconsideration-only parameters
        (`pr.recon_grad: isolated`). Re-entered by gradient checkpointing's recomputation."""
        saved = []
        for name, p in list(self.named_parameters()):
            if name.startswith(PR_PARAM_PREFIXES):
                continue
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            saved.append((module, leaf, module._parameters[leaf]))
            module._parameters[leaf] = p.detach()
        try:
            yield
        finally:
            for module, leaf, p in saved:
                module._parameters[leaf] = p

    # ------------------------------------------------------------- row-level M
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

    def depth_logits(self, feature: torch.Tensor, depth: int | torch.Tensor) -> torch.Tensor:
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

    def layer_qkv(
        self,
        input_emb: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        max_position: Optional[int] = None,
        recon_rows: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of `M` for rows `[N, T, d]` at explicit positions `[N, T]`.

        Returns `q [N, H, T, Dh]` and RoPE'd `k, v [N, H, T, Dh]` (KV heads
        repeated to H, as SpecForge caches them). `max_position`, when the caller
        knows a bound on `position_ids`, saves reading it back from the device.
        `recon_rows` (`[N]` or `[N, T]`, nonzero = a reconsideration row) switches the
        adapter on for those rows only; without an adapter (or with None) it is ignored.
        """
        attn = self.midlayer.self_attn
        if isinstance(attn.rotary_emb, LlamaMutiRotaryEmbedding):
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
        q, k = apply_rotary_pos_emb(q, k, cos.to(q.device), sin.to(q.device), position_ids)
        k = repeat_kv(k, attn.num_key_value_groups)
        v = repeat_kv(v, attn.num_key_value_groups)
        return q, k, v

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
    return row_mask(recon_rows, n, t, device)


def build_pr_config(eagle3_config, settings: Optional[PRDraftSettings] = None):
    """A PR draft config from an EAGLE-3 draft config (a copy; the input is untouched)."""
    cfg = eagle3_config.__class__.from_dict(eagle3_config.to_dict())
    cfg.architectures = [PR_ARCHITECTURE]
    setattr(cfg, PR_CONFIG_KEY, (settings or PRDraftSettings()).draft_settings().to_dict())
    return cfg


def pr_draft_config(draft_config, pr: PRDraftSettings):
    """The draft config with PR's architecture and the recipe's `pr` settings (a `PRConfig`; EAGLE-3 configs are
    converted); refuses a drafter PR does not extend."""
    archs = list(getattr(draft_config, "architectures", None) or [EAGLE3_ARCHITECTURE])
    if archs[0] not in (EAGLE3_ARCHITECTURE, PR_ARCHITECTURE):
        raise ValueError(
            f"draft config architectures[0] = {archs[0]!r} is not an EAGLE-3 drafter; the pr algorithm extends "
            f"{EAGLE3_ARCHITECTURE} (use an EAGLE-3 draft config, e.g. SpecForge's configs/*-eagle3.json)"
        )
    if int(getattr(draft_config, "num_hidden_layers", 1)) != 1:
        raise ValueError("the pr algorithm needs a single-layer EAGLE-3 drafter (num_hidden_layers: 1)")
    return build_pr_config(draft_config, pr.draft_settings())


def drafter_architecture(path: str) -> str:
    """`architectures[0]` of a drafter directory's config.json, checked to be one `load_drafter` builds
    (FileNotFoundError without config.json; ValueError, naming the file, for anything else)."""
    from pr_specforge.data.io import read_json_object
    from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; expected a drafter directory written by `pr-specforge export --to hf` or SpecForge")
    cfg = read_json_object(cfg_path, error=ValueError)
    arch = (cfg.get("architectures") or [EAGLE3_ARCHITECTURE])[0]
    known = (PR_ARCHITECTURE, EAGLE3_ARCHITECTURE, TWO_LAYER_ARCHITECTURE)
    if arch not in known:
        raise ValueError(f"{cfg_path}: architectures[0] = {arch!r} is not an EAGLE-3 drafter ({', '.join(known)})")
    return arch


def load_drafter(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load an EAGLE-3 or PR drafter directory (HF layout) with RoPE rebuilt.

    The class is chosen by `architectures[0]` of its config.json (`drafter_architecture`).
    """
    from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE, LlamaForCausalLMEagle3TwoLayer

    classes = {PR_ARCHITECTURE: LlamaForCausalLMEagle3PR, EAGLE3_ARCHITECTURE: LlamaForCausalLMEagle3,
               TWO_LAYER_ARCHITECTURE: LlamaForCausalLMEagle3TwoLayer}
    cls = classes[drafter_architecture(path)]
    model = cls.from_pretrained(path, torch_dtype=dtype)
    rebuild_rope(model)
    return model.to(device).eval()
