"""Checks a training run makes before its first step, each failing in one line naming the file and the fix.

Owns: the target directory check, the vocab map check (readable, a map, the sizes
the drafter needs, and the map the features were made with: the features'
`manifest.json` records its fingerprint), and the guard on a run directory that
already holds checkpoints (resume it, or start over only when told to).

Does not own: recipe parsing and the feature-file and draft-config checks
(`pr_specforge.train.preflight`, which calls these).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from pr_specforge.config import ConfigError


def _looks_local(path: str) -> bool:
    """A path meant on this disk (vs a hub id such as `org/name`)."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return True
    head = path.split("/", 1)[0]
    return "/" not in path or os.path.isdir(head)


def check_target(path: Optional[str]) -> Optional[dict]:
    """`model.target_model_path` is a directory with a readable config.json; returns that config.

    A hub id (`org/name`, nothing of that name on disk) is left to SpecForge."""
    if not path:
        return None
    fix = "give a model directory (pr-specforge data smollm2-target --output DIR makes the default one)"
    if not os.path.exists(path):
        if _looks_local(path):
            raise ConfigError(f"model.target_model_path: {path!r} does not exist; {fix}")
        return None
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"model.target_model_path: {path} has no config.json, so it is not a model directory; {fix}")
    try:
        with open(config) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.target_model_path: {config} is not valid JSON ({e})") from None


def check_vocab_map(path: Optional[str], draft: Optional[dict], features: Optional[str]) -> None:
    """`model.vocab_mapping_path` is a vocab map of the drafter's sizes, and the one `features` were made with."""
    if not path:
        return
    from pr_specforge.data.hidden_states import MANIFEST
    from pr_specforge.data.vocab import VOCAB_MAPPING_RELPATH, read_vocab_mapping, vocab_fingerprint, vocab_mapping_problems

    made_by = "pr-specforge data hidden-states writes FEATURES/" + VOCAB_MAPPING_RELPATH
    if not os.path.isfile(path):
        raise ConfigError(f"model.vocab_mapping_path: {path!r} does not exist ({made_by})")
    try:
        mapping = read_vocab_mapping(path)
    except ValueError as e:
        raise ConfigError(f"model.vocab_mapping_path: {e} ({made_by})") from None
    if draft is not None:
        vocab = int(draft.get("vocab_size") or 0)
        size = draft.get("draft_vocab_size")
        problems = vocab_mapping_problems(path, mapping, vocab, int(size) if size is not None else None)
        if problems:
            raise ConfigError(f"model.vocab_mapping_path: {problems[0]} (the draft config "
                              f"model.draft_model_config has vocab_size {vocab}, draft_vocab_size {size})")
    manifest = os.path.join(features or "", MANIFEST)
    if features and os.path.isfile(manifest):
        with open(manifest) as f:
            recorded = json.load(f).get("vocab_fingerprint")
        if recorded is not None and recorded != vocab_fingerprint(mapping):
            own = os.path.join(features, VOCAB_MAPPING_RELPATH)
            raise ConfigError(
                f"model.vocab_mapping_path: {path} is not the map the features in {features} were made with "
                f"(fingerprint {vocab_fingerprint(mapping)}, {manifest} records {recorded}); use {own}")


def run_checkpoints(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint directory under a run directory, or None."""
    from pr_specforge.pipeline import latest_checkpoint

    if not os.path.isdir(output_dir):
        return None
    return latest_checkpoint(output_dir, required=False)


def resume_or_start_over(output_dir: str, resume_from: Optional[str], start_over: bool) -> Optional[str]:
    """What a run in `output_dir` resumes from: the given `resume_from`, else the directory's own
    newest checkpoint (a rerun continues, it never restarts over finished work). With `start_over`
    the directory's checkpoints and metrics are deleted first and nothing is resumed."""
    from pr_specforge.telemetry import METRICS_FILE

    latest = run_checkpoints(output_dir)
    if start_over:
        if resume_from:
            raise ConfigError("--start-over with training.resume_from: choose one")
        if latest is not None:
            for name in os.listdir(output_dir):
                full = os.path.join(output_dir, name)
                if "-step" in name and os.path.isdir(full):
                    shutil.rmtree(full)
                elif name == METRICS_FILE or (name.endswith("-latest") and os.path.islink(full)):
                    os.unlink(full)
        return None
    if resume_from or latest is None:
        return resume_from
    return output_dir
