"""Draft vocabulary: the `Vd` most frequent loss-bearing target tokens.

Writes `<features>/vocab_mapping/vocab_mapping.pt` = `{"t2d": bool[V], "d2t": int64[Vd]}`
with SpecForge's convention (`specforge.data.preprocessing.process_token_dict_to_mappings`):
pad the counts with zero-count ids `0, 1, ...` when fewer than `Vd` distinct
tokens were seen, take the `Vd` most common, sort them by target id, and store
`d2t[i] = target_id_i - i` (so `draft_id + d2t[draft_id] == target_id`).
We compute it with a vectorised `t2d` instead of SpecForge's `i in list` scan
(O(V*Vd) in Python: minutes at V=49k); a test checks both agree.

It deliberately does not decide `Vd` (the caller does) or read feature files.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

from pr_specforge.data.io import atomic_torch_save, brief

logger = logging.getLogger(__name__)

VOCAB_MAPPING_RELPATH = os.path.join("vocab_mapping", "vocab_mapping.pt")


def count_loss_tokens(counter: Counter, input_ids, loss_mask) -> None:
    """Add the loss-bearing tokens of one sample to `counter`."""
    ids = input_ids[loss_mask.bool()]
    uniq, counts = ids.unique(return_counts=True)
    counter.update(dict(zip(uniq.tolist(), counts.tolist())))


def build_vocab_mapping(counts: Counter, draft_vocab_size: int, target_vocab_size: int) -> dict:
    import torch

    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be at least 1, got {draft_vocab_size}")
    if draft_vocab_size > target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocab size {target_vocab_size}")
    bad = [t for t in counts if not 0 <= t < target_vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the target vocab of {target_vocab_size}")
    counts = Counter(counts)
    if len(counts) < draft_vocab_size:
        for token in range(draft_vocab_size):
            if token not in counts:
                counts[token] = 0
                if len(counts) >= draft_vocab_size:
                    break
    top = counts.most_common(draft_vocab_size)
    total = sum(counts.values())
    if total:
        logger.info("draft vocab of %d covers %.2f%% of loss tokens", draft_vocab_size, 100.0 * sum(c for _, c in top) / total)
    used = torch.tensor(sorted(t for t, _ in top), dtype=torch.long)
    d2t = used - torch.arange(len(used), dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": d2t, "t2d": t2d}


def save_vocab_mapping(mapping: dict, features_dir: str | os.PathLike) -> Path:
    path = Path(features_dir) / VOCAB_MAPPING_RELPATH
    atomic_torch_save(mapping, path)
    return path


def load_vocab_mapping(features_dir: str | os.PathLike) -> dict:
    import torch

    return torch.load(Path(features_dir) / VOCAB_MAPPING_RELPATH, map_location="cpu", weights_only=True)


def vocab_fingerprint(mapping: dict) -> str:
    """A short content hash of a vocab map (`t2d` and `d2t`), recorded in the features' manifest."""
    import hashlib

    h = hashlib.sha256()
    for key in ("t2d", "d2t"):
        t = mapping[key].contiguous().cpu()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def read_vocab_mapping(path: str | os.PathLike) -> dict:
    """Load a vocab map file; a file that is not one raises ValueError naming it."""
    import torch

    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such vocab map file")
    try:
        m = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, pickled objects
        raise ValueError(f"{path}: not a readable vocab map ({brief(e)})") from None
    if not isinstance(m, dict) or "t2d" not in m or "d2t" not in m:
        raise ValueError(f"{path}: not a vocab map (expected a dict with 't2d' and 'd2t')")
    return m


def vocab_mapping_problems(path, m: dict, vocab: int, draft_vocab_size: int | None) -> list[str]:
    """What is wrong with vocab map `m` for a target of `vocab` tokens (empty when it is good)."""
    import torch

    t2d, d2t = m["t2d"], m["d2t"]
    if not isinstance(t2d, torch.Tensor) or t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,):
        return [f"{path}: t2d must be bool[{vocab}] (the target's vocab), got "
                f"{getattr(t2d, 'dtype', type(t2d).__name__)}{list(getattr(t2d, 'shape', []))}"]
    if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.long or d2t.dim() != 1:
        return [f"{path}: d2t must be 1-D int64, got {getattr(d2t, 'dtype', type(d2t).__name__)}{list(getattr(d2t, 'shape', []))}"]
    if len(d2t) == 0:
        return [f"{path}: empty vocab map (0 draft tokens); rebuild the features with --draft-vocab-size >= 1"]
    out = []
    if draft_vocab_size is not None and len(d2t) != draft_vocab_size:
        out.append(f"{path}: d2t has {len(d2t)} entries but the draft vocab size is {draft_vocab_size}")
    targets = torch.arange(len(d2t)) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        out.append(f"{path}: draft ids map outside the target vocab")
    elif int(t2d.sum()) != len(d2t) or not bool(t2d[targets].all()):
        out.append(f"{path}: t2d does not mark exactly the {len(d2t)} draft tokens of d2t")
    return out


def draft_to_target(mapping: dict):
    """Target id of every draft id (`draft_id + d2t[draft_id]`)."""
    import torch

    d2t = mapping["d2t"]
    return torch.arange(len(d2t), dtype=d2t.dtype) + d2t
