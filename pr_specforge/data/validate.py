"""Check a features directory before spending GPU hours training on it.

For every `*.ckpt` under the directory: it loads; it has the four SpecForge
keys; `input_ids`/`loss_mask` are 1-D of the same length L; `hidden_state` is
`[1, L, H]` and `aux_hidden_state` `[1, L, 3H]` with H the target's hidden
size; hidden states are floating point and finite; the loss mask is non-empty;
`input_ids` lie in the target vocab. The vocab map must exist, be
`{"t2d": bool[V], "d2t": int64[Vd]}`, and agree with itself (`t2d` marks
exactly the `Vd` draft tokens `i + d2t[i]`).

H and V come from the target config when a target path is given, else from
`manifest.json`. It deliberately does not repair anything.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

FEATURE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


@dataclass
class ValidationReport:
    files: int = 0
    bad: dict = field(default_factory=dict)  # path -> reason
    problems: list = field(default_factory=list)  # directory-level problems

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems and self.files > 0


def _finite(t) -> bool:
    """No NaN or Inf in `t`, at the cost of one sum in its own dtype (NaN and Inf propagate through it; no copy of
    `t`); the exact elementwise check runs only when that sum is not finite (a non-finite value, or finite values
    whose sum overflows)."""
    import torch

    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def sample_problem(sample, hidden: int, vocab: int | None, dtype=None) -> str | None:
    """The first problem of one loaded feature sample, naming its field, or None (see the module doc; `dtype`:
    the hidden states' dtype every sample of a directory must share, when known). It costs a few reductions over
    the sample's tensors, so a loader runs it on every sample it reads (`training.preflight.FeatureSampleCheck`)."""
    import torch

    if not isinstance(sample, dict):
        return f"holds a {type(sample).__name__}, not a dict"
    missing = [k for k in FEATURE_KEYS if k not in sample]
    if missing:
        return f"missing key(s) {missing}"
    ids, mask, hs, aux = (sample[k] for k in FEATURE_KEYS)
    not_tensors = [k for k in FEATURE_KEYS if not isinstance(sample[k], torch.Tensor)]
    if not_tensors:
        return f"{not_tensors[0]} is a {type(sample[not_tensors[0]]).__name__}, not a tensor"
    if ids.dim() != 1 or ids.dtype != torch.long:
        return f"input_ids must be 1-D int64, got {tuple(ids.shape)} {ids.dtype}"
    L = ids.shape[0]
    if tuple(mask.shape) != (L,):
        return f"loss_mask shape {tuple(mask.shape)} != ({L},) (1-D, one entry per input_ids token)"
    if tuple(hs.shape) != (1, L, hidden):
        return f"hidden_state shape {tuple(hs.shape)} != (1, {L}, {hidden}) ({L} input_ids tokens, hidden size {hidden})"
    if tuple(aux.shape) != (1, L, 3 * hidden):
        return (f"aux_hidden_state shape {tuple(aux.shape)} != (1, {L}, {3 * hidden}) ({L} input_ids tokens, "
                f"3 x hidden size {hidden})")
    if not hs.is_floating_point() or not aux.is_floating_point():
        return f"hidden states must be floating point, got hidden_state {hs.dtype}, aux_hidden_state {aux.dtype}"
    for key, t in (("hidden_state", hs), ("aux_hidden_state", aux)):
        if dtype is not None and t.dtype != dtype:
            return f"{key} is {t.dtype}, the directory's first feature file {dtype}; every file must come from one capture"
    for key, t in (("hidden_state", hs), ("aux_hidden_state", aux)):
        if not _finite(t):
            return f"non-finite values (NaN or Inf) in {key}"
    if int((mask != 0).sum()) == 0:
        return "empty loss_mask (no position is supervised)"
    if L and vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return f"input_ids outside [0, {vocab}) (max {int(ids.max())}, min {int(ids.min())}): not this target's vocab"
    return None


def _check_file(path: Path, hidden: int, vocab: int) -> str | None:
    import torch

    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is a finding, not a crash
        return f"does not load ({type(e).__name__}: {str(e)[:120]})"
    return sample_problem(d, hidden, vocab)


def _check_vocab(features_dir: Path, vocab: int, manifest: dict) -> list[str]:
    from pr_specforge.data.vocab import (VOCAB_MAPPING_RELPATH, read_vocab_mapping, vocab_fingerprint,
                                         vocab_mapping_problems)

    path = features_dir / VOCAB_MAPPING_RELPATH
    if not path.exists():
        return [f"{path}: missing vocab mapping"]
    try:
        m = read_vocab_mapping(path)
    except ValueError as e:
        return [str(e)]
    out = vocab_mapping_problems(path, m, vocab, manifest.get("draft_vocab_size"))
    recorded = manifest.get("vocab_fingerprint")
    if not out and recorded is not None and recorded != vocab_fingerprint(m):
        out.append(f"{path}: not the map these features were made with (fingerprint {vocab_fingerprint(m)}, "
                   f"manifest.json records {recorded})")
    return out


def validate_features(features_dir: str | os.PathLike, target_path: str | None = None, max_files: int | None = None) -> ValidationReport:
    """Validate every feature file (or the first `max_files`); see module doc."""
    from tqdm import tqdm

    from pr_specforge.data.hidden_states import MANIFEST
    from pr_specforge.data.vocab import VOCAB_MAPPING_RELPATH

    features_dir = Path(features_dir)
    report = ValidationReport()
    manifest = {}
    if (features_dir / MANIFEST).exists():
        manifest = json.loads((features_dir / MANIFEST).read_text())
    if manifest.get("status", "complete") != "complete":
        report.problems.append(f"{features_dir / MANIFEST}: status is {manifest.get('status')!r}: the hidden-states "
                               "run that writes this directory did not finish; rerun the same command to complete it")
    if target_path is not None:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(target_path)
        cfg = getattr(cfg, "text_config", None) or cfg
        hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
        for key, value in (("hidden_size", hidden), ("vocab_size", vocab)):
            old = manifest.get("target", {}).get(key)
            if old is not None and old != value:
                report.problems.append(f"{features_dir / MANIFEST}: field 'target.{key}' is {old} but {target_path} has {value}")
    elif manifest.get("target"):
        hidden, vocab = int(manifest["target"]["hidden_size"]), int(manifest["target"]["vocab_size"])
    else:
        report.problems.append(f"{features_dir}: no manifest.json and no --target given; cannot know the hidden size")
        return report

    files = sorted(p for p in features_dir.rglob("*.ckpt") if VOCAB_MAPPING_RELPATH not in str(p))
    if max_files is not None:
        files = files[:max_files]
    if not files:
        report.problems.append(f"{features_dir}: no .ckpt feature files")
    for path in tqdm(files, desc="validate", unit="file"):
        report.files += 1
        reason = _check_file(path, hidden, vocab)
        if reason:
            report.bad[str(path)] = reason
    report.problems.extend(_check_vocab(features_dir, vocab, manifest))
    if report.bad:
        logger.error("%d of %d feature files are bad", len(report.bad), report.files)
    return report
