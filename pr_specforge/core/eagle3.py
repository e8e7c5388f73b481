"""The serving drafter: a single-layer EAGLE-3 drafter with the PR parts, in plain torch.

Owns:
  * `PRServingDrafter` - built from an export's `config.json` alone (`from_export_config`), with the
    parameter names of the export (`embed_tokens`, `fc`, `fc_norm`, `midlayer.{self_attn,mlp,*_norm}`, `norm`,
    `lm_head`, `d2t`/`t2d`, and the `pr_*` tensors), and `core.parts.PRRows`: what the serving runtime
    (`serving.drafter_runtime.DrafterRuntime`) and the SGLang plugin need, without SpecForge. Its math is
    the training drafter's (pre-norm RMSNorm in fp32, RoPE at explicit positions, SiLU MLP), checked
    value for value against it in `tests/serving/test_serving_drafter.py`.
  * `ServingDrafterError` - a config this drafter does not build (one line, naming the field).

Does not own: training (SpecForge's `LlamaForCausalLMEagle3` plus `PRRows`, `pr_specforge.modeling`), the
attention between rows (`DrafterRuntime`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from pr_specforge.config import PR_CONFIG_KEY, PRDraftSettings
from pr_specforge.core.parts import HaltGate, PRRows, SelfQuery
from pr_specforge.core.recon_parts import ReconHead

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": F.silu}


class ServingDrafterError(ValueError):
    """An export config the serving drafter does not build."""


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, the mean of squares taken in fp32."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _inv_freq(dim: int, theta: float, rope: Dict[str, Any]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind != "llama3":
        return inv
    factor, low, high = float(rope.get("factor") or 1.0), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    orig = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low) if low != high else 0
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < orig / high, inv, torch.where(wavelen > orig / low, inv / factor, mid))


class Rotary(nn.Module):
    """cos / sin rows `[1, 1, S, Dh]` for positions `0..S-1` (grown on demand; each row is exact at any size)."""

    def __init__(self, dim: int, theta: float, rope: Dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(dim, theta, rope), persistent=False)
        self.cached = 0

    def _grow(self, length: int) -> None:
        t = torch.arange(length, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        emb = torch.outer(t, self.inv_freq).repeat(1, 2)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)
        self.cached = length

    def forward(self, x: torch.Tensor, seq_len: int):
        if seq_len > self.cached or self.cos_cached.device != x.device:
            self._grow(max(int(seq_len), 2 * self.cached, 256))
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.num_key_value_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(2 * d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.rotary_emb = Rotary(self.head_dim, cfg.rope_theta, cfg.rope)


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The decoder layer `M`; its forward is `PRRows.layer_qkv` / `layer_finish` with the caller's attention."""

    def __init__(self, cfg) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)


def serving_config(raw: Dict[str, Any]) -> SimpleNamespace:
    """The fields the serving drafter reads from an export's config.json, refused in one line when unsupported."""
    def need(name):
        if raw.get(name) is None:
            raise ServingDrafterError(f"drafter config.json has no {name!r}")
        return raw[name]

    d, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ServingDrafterError(f"drafter config.json: RoPE type {kind!r} is not served (served: {', '.join(ROPE_TYPES)})")
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ServingDrafterError(f"drafter config.json: hidden_act {act!r} is not served (served: {', '.join(ACTIVATIONS)})")
    if int(raw.get("pretraining_tp") or 1) != 1 or int(raw.get("num_hidden_layers") or 1) != 1:
        raise ServingDrafterError("drafter config.json: the serving drafter has one decoder layer and pretraining_tp 1")
    vocab = int(need("vocab_size"))
    return SimpleNamespace(
        hidden_size=d, num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or d // heads), intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), hidden_act=act, vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab), target_hidden_size=int(raw.get("target_hidden_size") or d),
        rope=rope, rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        fc_norm=bool(raw.get("fc_norm", False)), norm_output=bool(raw.get("norm_output", True)),
        **{PR_CONFIG_KEY: raw.get(PR_CONFIG_KEY) or {}})


class PRServingDrafter(PRRows, nn.Module):
    """A PR drafter for serving (see the module doc); EAGLE-3's tensors under SpecForge's names."""

    def __init__(self, cfg: SimpleNamespace) -> None:
        super().__init__()
        self.config, d = cfg, cfg.hidden_size
        self.pr_settings = PRDraftSettings.from_config(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.midlayer = Layer(cfg)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, d, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm_output = cfg.norm_output
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.pr_self_query = SelfQuery(d, self.pr_settings.self_query_hidden_size or d, cfg.rms_norm_eps)
        self.pr_halt_gate = HaltGate(d)
        if self.pr_settings.recon_head == "separate":
            self.pr_recon_head = ReconHead(self.norm, self.lm_head)
        if self.pr_settings.recon_adapter_rank:
            raise ServingDrafterError("the serving drafter does not run a reconsideration adapter (pr.recon_adapter_rank > 0)")

    @classmethod
    def from_export_config(cls, raw: Dict[str, Any]) -> "PRServingDrafter":
        return cls(serving_config(raw))

    def project_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, hidden.chunk(3, dim=-1))], dim=-1)
        return self.fc(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden) if self.norm_output else hidden)


def eagle3_tensors(cfg: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The EAGLE-3 tensors (not `pr_*`) an SGLang export of `cfg` must hold, as meta tensors of their shapes: the
    serving drafter's, whose names are the export's. Built with what changes no tensor's shape (RoPE, activation,
    the PR settings) left at its defaults, so only the shapes can refuse. `export --to vllm` checks an SGLang export
    with it before converting, and the SGLang bridge's preflight before serving."""
    from pr_specforge.core.parts import PR_PARAM_PREFIXES

    shaped = {k: v for k, v in cfg.items() if k not in (PR_CONFIG_KEY, "rope_scaling", "rope_parameters", "hidden_act")}
    with torch.device("meta"):
        model = PRServingDrafter.from_export_config(shaped)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(PR_PARAM_PREFIXES)}
