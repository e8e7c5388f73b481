"""What an `export --to sglang` directory holds, read without SpecForge: the exporter checks what it writes with
these, and the serving side (`sglang_cpu.preflight`, in SGLang's own environment) checks what it serves with them.

Owns:
  * `ExportError` - an export that would serve silently broken (one line, or one line per problem);
  * `SAFETENSORS_NAME` - the export's tensor file;
  * `declared_context` / `target_context` - the context length SGLang derives from a config (`CONTEXT_KEYS`);
  * `check_tensors` / `check_weights` - every tensor name and shape a drafter expects, and the vocab map.

Does not own: writing an export (`pr_specforge.export`, which needs SpecForge), the drafter classes
(`pr_specforge.modeling` for training, `core.eagle3` for serving).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional

import torch

SAFETENSORS_NAME = "model.safetensors"
#: the config keys SGLang 0.5.14 takes a model's context length from, first found wins (its `get_context_length`)
CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


class ExportError(ValueError):
    """The checkpoint would export into a silently broken drafter; the message says why."""


def declared_context(cfg: Dict[str, Any]) -> Optional[int]:
    """The context length SGLang derives from a config dict: the first of `CONTEXT_KEYS`, times the rope
    scaling factor unless the rope block carries its own `original_max_position_embeddings` (or is llama3's)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 5 names it rope_parameters
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" else rope.get("factor", 1)
    for key in CONTEXT_KEYS:
        if cfg.get(key) is not None:
            return int(factor * cfg[key])
    return None


def target_context(target_dir: Optional[str]) -> Optional[int]:
    """The target's context length as SGLang derives it (its text config), or None without a target."""
    if not (target_dir and os.path.isfile(os.path.join(target_dir, "config.json"))):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target_dir).get_text_config()
    except (OSError, ValueError) as e:
        raise ExportError(f"--target {target_dir}: its config.json does not load ({e})") from None
    return declared_context(config.to_dict())


def is_embedding(name: str) -> bool:
    """A tensor of the shared embedding: the target's, never the drafter's to check or to ship."""
    return "embed" in name.lower()


def check_tensors(expected: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], draft_config: Dict[str, Any],
                  architecture: str) -> None:
    """Refuse `weights` that would load silently broken into a drafter whose tensors are `expected` (names to
    tensors of their shapes; the embedding is the target's, never checked): every key, shape and the vocab map."""
    expected = {k: v for k, v in expected.items() if not is_embedding(k)}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(k for k in set(weights) - set(expected) if not is_embedding(k))
    problems: List[str] = []
    if missing:
        problems.append(f"missing tensors {missing} (SGLang would leave them random, silently)")
    if unexpected:
        problems.append(f"tensors the {architecture} architecture does not have: {unexpected}")
    for k in sorted(set(expected) & set(weights)):
        if tuple(weights[k].shape) != tuple(expected[k].shape):
            problems.append(f"{k}: shape {tuple(weights[k].shape)} in the checkpoint, {tuple(expected[k].shape)} expected by the draft config")
    if problems:
        raise ExportError("checkpoint does not match the draft config:\n  " + "\n  ".join(problems))
    vocab, draft_vocab = int(draft_config["vocab_size"]), int(draft_config.get("draft_vocab_size") or draft_config["vocab_size"])
    t2d, d2t = weights["t2d"], weights["d2t"]
    if int(t2d.to(torch.int64).sum()) != draft_vocab:
        raise ExportError(f"t2d marks {int(t2d.to(torch.int64).sum())} target tokens but draft_vocab_size is {draft_vocab}: the vocab mapping belongs to another draft vocab")
    hot = d2t.to(torch.int64) + torch.arange(draft_vocab)
    if int(hot.min()) < 0 or int(hot.max()) >= vocab or not torch.equal(torch.nonzero(t2d.bool()).flatten(), hot):
        raise ExportError("d2t and t2d disagree (d2t[i] + i must list the target ids t2d marks, ascending): the vocab mapping is corrupt or mixed from two runs")


def check_weights(model, weights: Mapping[str, torch.Tensor], draft_config: Dict[str, Any]) -> None:
    """`check_tensors` against `model`'s own tensors (a drafter skeleton)."""
    check_tensors(model.state_dict(), weights, draft_config, type(model).__name__)
