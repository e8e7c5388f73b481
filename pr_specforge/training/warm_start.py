"""`pr.init_from` / `pr.freeze_one_pass`: add reconsideration to an EAGLE-3 drafter someone already has.

Owns: reading the one-pass (EAGLE-3) tensors of a trained drafter — a SpecForge
checkpoint (dir, its `training_state.pt`, or a run dir: latest) of strategy `eagle3`
or `pr`, or an HF drafter directory (`config.json` + `*.safetensors`, e.g. an
`export --to hf|sglang` output) — checking every name and shape against the fresh
PR drafter, loading them (the `pr_` tensors stay fresh; a separate second head is
re-copied from the loaded one-pass head), and freezing the one-pass tensors.

SpecForge's own `model.draft_checkpoint_path` warm start cannot do this: it refuses a
checkpoint of another strategy and any missing tensor (every `pr_` tensor is missing
from an EAGLE-3 drafter).

Does not own: building the drafter (`pr_specforge.training.registration`).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Dict

import torch

from pr_specforge.config import ConfigError
from pr_specforge.modeling.drafter import PR_PARAM_PREFIXES

log = logging.getLogger(__name__)


class InitFromError(ConfigError):
    """`pr.init_from` names something that is not a compatible EAGLE-3 drafter."""


def _is_embedding(name: str) -> bool:
    return "embed" in name.lower()


def read_one_pass_state(path: str) -> Dict[str, torch.Tensor]:
    """The EAGLE-3 tensors (no embedding, no `pr_` tensor) of the drafter at `path`."""
    where = f"pr.init_from={path!r}"
    if not os.path.exists(path):
        raise InitFromError(f"{where}: no such file or directory")
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if shards and os.path.isfile(os.path.join(path, "config.json")):
        from safetensors.torch import load_file

        state: Dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(shard))
    else:
        from pr_specforge._specforge import resolve_training_state

        try:
            payload = resolve_training_state(path)
        except (FileNotFoundError, ValueError) as e:
            raise InitFromError(f"{where}: neither an HF drafter directory (config.json + *.safetensors) "
                                f"nor a SpecForge checkpoint: {e}") from None
        if payload.get("strategy") not in ("eagle3", "pr") or not isinstance(payload.get("draft_state_dict"), dict):
            raise InitFromError(f"{where}: a checkpoint of strategy {payload.get('strategy')!r}; expected an eagle3 or pr checkpoint")
        state = dict(payload["draft_state_dict"])
    return {k: v for k, v in state.items() if not _is_embedding(k) and not k.startswith(PR_PARAM_PREFIXES)}


def one_pass_names(draft) -> Dict[str, torch.Size]:
    """Name -> shape of every one-pass tensor (parameters and the vocab buffers) the drafter needs."""
    return {k: v.shape for k, v in draft.state_dict().items() if not _is_embedding(k) and not k.startswith(PR_PARAM_PREFIXES)}


def _check_fits(where: str, state: Dict[str, torch.Tensor], expected: Dict[str, torch.Size]) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise InitFromError(f"{where}: does not match this EAGLE-3 drafter: missing {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    wrong = [f"{k}: {tuple(state[k].shape)} vs {tuple(s)}" for k, s in expected.items() if tuple(state[k].shape) != tuple(s)]
    if wrong:
        raise InitFromError(f"{where}: tensor shapes differ from the draft config: {'; '.join(wrong[:3])}"
                            f"{f' (and {len(wrong) - 3} more)' if len(wrong) > 3 else ''}")


def check_init_from(pr, draft_config_path: str) -> None:
    """Pre-flight (also `train --dry-run`): `pr.init_from` is a drafter whose one-pass tensors fit the
    recipe's draft config by name and shape (the drafter is built on the meta device: no weights)."""
    import json

    from transformers import LlamaConfig

    from pr_specforge.modeling import LlamaForCausalLMEagle3PR
    from pr_specforge.modeling.drafter import pr_draft_config

    state = read_one_pass_state(pr.init_from)
    with open(draft_config_path) as f:
        config = pr_draft_config(LlamaConfig.from_dict(json.load(f)), pr)
    with torch.device("meta"):
        expected = one_pass_names(LlamaForCausalLMEagle3PR(config))
    _check_fits(f"pr.init_from={pr.init_from!r}", state, expected)


@torch.no_grad()
def init_one_pass_from(draft, path: str) -> None:
    """Load the one-pass tensors of `path` into `draft` (see module doc); refuse any mismatch by name."""
    where = f"pr.init_from={path!r}"
    state = read_one_pass_state(path)
    _check_fits(where, state, one_pass_names(draft))
    own = draft.state_dict()
    for key in ("t2d", "d2t"):
        if not torch.equal(state[key].to(own[key].dtype).cpu(), own[key].cpu()):
            raise InitFromError(f"{where}: its {key} differs from the recipe's vocab mapping; warm-start from a drafter "
                                "trained with the same model.vocab_mapping_path")
    for key, value in state.items():
        own[key].copy_(value.to(own[key].dtype))
    if hasattr(draft, "copy_one_pass_head"):
        draft.copy_one_pass_head()
    log.info("pr.init_from: loaded %d one-pass tensors from %s; pr_ tensors fresh", len(state), path)


def freeze_one_pass(draft) -> int:
    """No gradient for any one-pass parameter; returns how many parameters still train."""
    for name, p in draft.named_parameters():
        if not name.startswith(PR_PARAM_PREFIXES):
            p.requires_grad_(False)
    return sum(p.requires_grad for p in draft.parameters())
