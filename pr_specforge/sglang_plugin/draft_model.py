"""The PR drafter as an SGLang model: SGLang's `LlamaForCausalLMEagle3` plus the PR tensors of the export.

`PRDraftModel` subclasses SGLang 0.5.14's `LlamaForCausalLMEagle3` (`models/llama_eagle3.py`), so draft-extend,
the shared embedding and every EAGLE-3 tensor are SGLang's own. It adds:
  * the PR tensors of the `--to sglang` export (`pr_self_query.*`, `pr_halt_gate.*`, `pr_recon_head.*` when the
    drafter has a second head), as the same modules our drafters use (`pr_specforge.core.parts`), loaded by
    `load_weights` and checked there: a PR tensor of the file that fills nothing, or a PR parameter left
    unfilled, raises (the EAGLE-3 tensors go to SGLang's loader);
  * a forward for a PR draft step's rows (`spec_info.pr_recon_index` set): eager decode passes no
    `input_embeds`, so the model builds them itself - the target embedding of each row's token, and for
    the reconsideration rows Eq. 3's self-query `Q(h)` of the row's hidden slot `h` (the previous depth's
    feature as the next step reads it); it returns the rows' pre-norm features (`hidden_states`) and no
    logits (the tree reads its rows through the drafter's heads, `serving.tensor_tree.step_readouts`).
A drafter with a low-rank adapter on `M` (`pr.recon_adapter_rank > 0`) is refused (`checks`): SGLang's
fused projections would need the adapter's deltas inside its decoder layer.

Loaded in place of SGLang's class when `PR_EAGLE3_ROWS=sglang` (`use_for_draft`): the export declares
`LlamaForCausalLMEagle3`, SGLang's registry resolves that name, and the PR worker points the name at this
class in its own process while the draft model loads (the same entry `SGLANG_EXTERNAL_MODEL_PACKAGE`
overwrites), then restores it.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Tuple

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

from pr_specforge.config import PRDraftSettings
from pr_specforge.core.parts import PR_PARAM_PREFIXES, HaltGate, SelfQuery

ARCHITECTURE = "LlamaForCausalLMEagle3"


class PRDraftLoadError(ValueError):
    """The export's PR tensors do not fill the PR draft model (one line, naming the tensors)."""


class PRDraftModel(LlamaForCausalLMEagle3):
    """SGLang's EAGLE-3 draft model with the PR tensors and the PR rows' forward (see the module doc)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.pr_settings = PRDraftSettings.from_config(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.pr_self_query = SelfQuery(d, self.pr_settings.self_query_hidden_size or d, eps)
        self.pr_halt_gate = HaltGate(d)
        if self.pr_settings.recon_head == "separate":  # `ReconHead`'s tensors (norm, lm_head), held for the readouts
            self.pr_recon_head = torch.nn.Module()
            self.pr_recon_head.norm = torch.nn.RMSNorm(d, eps=eps)
            self.pr_recon_head.lm_head = torch.nn.Linear(d, config.draft_vocab_size or config.vocab_size, bias=False)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        params = {n: p for n, p in self.named_parameters() if n.startswith(PR_PARAM_PREFIXES)}
        filled, unknown, rest = set(), [], []
        for name, tensor in weights:
            if not name.startswith(PR_PARAM_PREFIXES):
                rest.append((name, tensor))
            elif name in params and tuple(params[name].shape) == tuple(tensor.shape):
                with torch.no_grad():
                    params[name].copy_(tensor.to(params[name].dtype))
                filled.add(name)
            else:
                unknown.append(name)
        missing = sorted(set(params) - filled)
        if unknown or missing:
            raise PRDraftLoadError(f"PR_EAGLE3: the export's PR tensors do not fill the PR draft model: unknown or "
                                   f"mis-shaped {sorted(unknown)}, missing {missing}")
        super().load_weights(rest)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding: bool = False,
                pp_proxy_tensors=None):
        spec = forward_batch.spec_info
        recon = getattr(spec, "pr_recon_index", None)
        if recon is None or not forward_batch.forward_mode.is_decode():
            return super().forward(input_ids, positions, forward_batch, input_embeds, get_embedding, pp_proxy_tensors)
        embeds = self.model.embed_tokens(input_ids)
        if recon.numel():
            query = self.pr_self_query(spec.hidden_states.index_select(0, recon)).to(embeds.dtype)
            embeds = embeds.index_copy(0, recon, query)
        _, aux = self.model(input_ids, positions, forward_batch, input_embeds=embeds)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=aux[0])


@contextlib.contextmanager
def use_for_draft():
    """Inside, SGLang's model registry resolves `LlamaForCausalLMEagle3` to `PRDraftModel` (this process only)."""
    from sglang.srt.models.registry import ModelRegistry

    saved = ModelRegistry.models.get(ARCHITECTURE)
    ModelRegistry.models[ARCHITECTURE] = PRDraftModel
    try:
        yield
    finally:
        ModelRegistry.models[ARCHITECTURE] = saved

