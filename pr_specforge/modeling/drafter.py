"""The Parallel Reconsideration drafter: SpecForge's EAGLE-3 drafter plus two small parts.

Owns:
  * `LlamaForCausalLMEagle3PR` — `LlamaForCausalLMEagle3` (EAGLE-3 parameters keep
    SpecForge's names) with the self-query and halting gate (`core.parts`, plain torch, shared
    with the serving drafter) under the `pr_` prefix, their initialisation, and the
    row-level API over the single decoder layer `M` (`core.parts.PRRows`): `layer_qkv` (norms, fusion
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
from typing import Optional

import torch
import torch.nn as nn

from pr_specforge.config import PR_CONFIG_KEY, PRDraftSettings
from pr_specforge._specforge import LlamaForCausalLMEagle3, apply_rotary_pos_emb, init_rope, register_draft
from pr_specforge.core.parts import PR_PARAM_PREFIXES, HaltGate, PRRows, SelfQuery, halting_distribution  # noqa: F401
from pr_specforge.core.recon_parts import ReconAdapter, ReconHead

PR_ARCHITECTURE = "LlamaForCausalLMEagle3PR"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


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


@register_draft
class LlamaForCausalLMEagle3PR(PRRows, LlamaForCausalLMEagle3):
    """EAGLE-3 drafter with Parallel Reconsideration.

    Reconsideration step (Eq. 3): `f^r = M(f^{r-1}, Q(f^{r-1}))` — the same layer
    `M`, the previous depth's feature in the hidden slot, the self-query in the
    token-embedding slot, the same position index; `head(f^r)` proposes a token. The row-level API
    (`layer_qkv`, `layer_finish`, readouts) is `core.parts.PRRows`, with SpecForge's RoPE application.
    """

    rope_fn = staticmethod(apply_rotary_pos_emb)

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
