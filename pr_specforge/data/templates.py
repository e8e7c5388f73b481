"""Chat templates and tokenisation with SpecForge's own loss-mask rule.

SpecForge computes the training loss mask from a `ChatTemplate` in its
`TEMPLATE_REGISTRY` (assistant header ... end-of-turn token, see
`specforge.data.parse.GeneralParser`). SpecForge ships no SmolLM2 template; we
register one here (`smollm2`: ChatML with SmolLM's default system prompt, the
mask covering the reply plus `<|im_end|>\\n`) and then let SpecForge's
`preprocess_conversations` tokenise and mask, so the mask is exactly the one
SpecForge's own data path would compute.

This is the only module of `pr_specforge.data` that imports SpecForge's data
internals. It deliberately does not pad, batch or run a model.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from pr_specforge.data.smollm2 import SMOLLM2_SYSTEM_PROMPT

logger = logging.getLogger(__name__)

SMOLLM2_TEMPLATE_NAME = "smollm2"


class ChatTemplateError(ValueError):
    """The tokenizer or the named template cannot render/mask conversations."""


def register_templates() -> None:
    """Register our templates with SpecForge's registry (idempotent)."""
    from pr_specforge._specforge import TEMPLATE_REGISTRY, ChatTemplate

    if SMOLLM2_TEMPLATE_NAME not in TEMPLATE_REGISTRY.get_all_template_names():
        TEMPLATE_REGISTRY.register(
            name=SMOLLM2_TEMPLATE_NAME,
            template=ChatTemplate(
                assistant_header="<|im_start|>assistant\n",
                user_header="<|im_start|>user\n",
                system_prompt=SMOLLM2_SYSTEM_PROMPT,
                end_of_turn_token="<|im_end|>\n",
            ),
        )


def get_template(name: str):
    from pr_specforge._specforge import TEMPLATE_REGISTRY

    register_templates()
    names = TEMPLATE_REGISTRY.get_all_template_names()
    if name not in names:
        raise ChatTemplateError(f"unknown chat template {name!r}; known: {sorted(names)}")
    return TEMPLATE_REGISTRY.get(name)


def check_tokenizer(tokenizer, template_name: str) -> None:
    """Refuse tokenizers that cannot render the conversations we will mask.

    SpecForge silently falls back to a hand-rolled rendering when the tokenizer
    has no chat template; the target would then be fed text it was never
    trained on, so we make that an error instead.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "set `tokenizer.chat_template` (e.g. save one into tokenizer_config.json) "
            f"matching SpecForge template {template_name!r}"
        )
    template = get_template(template_name)
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(probe, tokenize=False)
    if template.assistant_header not in text or template.end_of_turn_token not in text:
        raise ChatTemplateError(
            f"the tokenizer's chat template does not match SpecForge template {template_name!r}: "
            f"rendered {text!r}, expected assistant header {template.assistant_header!r} "
            f"and end of turn {template.end_of_turn_token!r}"
        )


@dataclass
class TokenizedSample:
    input_ids: "object"  # torch.LongTensor [L]
    loss_mask: "object"  # torch.LongTensor [L]


def tokenize_conversation(tokenizer, conversation: list[dict], template_name: str, max_length: int) -> TokenizedSample:
    """Render with the tokenizer's chat template; mask with SpecForge's parser."""
    from pr_specforge._specforge import preprocess_conversations

    template = get_template(template_name)
    with warnings.catch_warnings():
        # SpecForge warns on every conversation that carries its own system turn.
        warnings.filterwarnings("ignore", message="The first message is from system")
        out = preprocess_conversations(tokenizer, [conversation], template, max_length=max_length)
    if not out["input_ids"]:
        raise ValueError("empty conversation")
    return TokenizedSample(out["input_ids"][0][0], out["loss_mask"][0][0])
