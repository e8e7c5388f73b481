"""Checkpoints that carry their recipe and survive a kill at any instant.

SpecForge's `CheckpointManager` (specforge/training/checkpoint.py) already
writes each file as temp + `os.replace`, counts a `{run_id}-stepN/` directory as
a checkpoint only once its `training_state.pt` exists, falls back to the newest
complete step when the `-latest` link is missing, and restores optimizer,
scheduler, RNG and sampler position on `training.resume_from` (bitwise on CPU;
tests/training/test_kill_resume.py). What it lacks, and this subclass adds:

* the resolved recipe (SpecForge config + `pr:` + `backend:`) inside every
  checkpoint, under `pr_specforge_recipe` (the exporter reads it);
* durability: files and the directory entry are fsynced before the rename,
  so a power cut cannot leave a renamed-but-empty `training_state.pt`;
* no checkpoint of non-finite tensors: a NaN/inf in the drafter's state refuses the
  save in one line naming the tensor (the newest checkpoint stays the last good one);
* ordering across ranks: every rank's `training_state_rank{r}.pt` is on disk
  (all ranks agree) before rank 0 writes the `training_state.pt` that marks the
  checkpoint complete; upstream rank 0 may mark it complete while another rank
  is still writing its shard, and a kill then leaves an unresumable checkpoint.

Test hook: `PR_SPECFORGE_TEST_SAVE_SLEEP=STEP:SECONDS` sleeps after writing
step STEP's `training_state.pt.tmp`, before the rename (a kill lands mid-save).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Optional

import torch

log = logging.getLogger(__name__)

RECIPE_STATE_KEY = "pr_specforge_recipe"
#: the target the run trained on, by content (`data.hidden_states.target_weights_digest`), in every checkpoint
TARGET_STATE_KEY = "pr_specforge_target"
SAVE_SLEEP_ENV = "PR_SPECFORGE_TEST_SAVE_SLEEP"
_RANK_FILE_PREFIX = "training_state_rank"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _manager_class():
    from pr_specforge._specforge import STATE_FILE, checkpoint_manager_base

    class RecipeCheckpointManager(checkpoint_manager_base()):
        """SpecForge's manager plus the recipe in every checkpoint, fsync and rank ordering."""

        recipe: Optional[Dict[str, Any]] = None
        target: Optional[Dict[str, Any]] = None

        def save(self, state, step, *, rank_state=None):
            if state is not None:
                check_finite_state(state.get("draft_state_dict") or {}, step)
            if state is not None and self.recipe is not None:
                state = {**state, RECIPE_STATE_KEY: self.recipe}
            if state is not None and self.target is not None:
                state = {**state, TARGET_STATE_KEY: self.target}
            self._saving_step = step
            return super().save(state, step, rank_state=rank_state)

        def write_file(self, obj: Any, path: str) -> None:
            error = None
            try:
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    torch.save(obj, f)
                    f.flush()
                    os.fsync(f.fileno())
                if os.path.basename(path) == STATE_FILE:
                    self._test_sleep()
                os.replace(tmp, path)
                _fsync_dir(os.path.dirname(path))
            except Exception as exc:  # reported to every rank below, then re-raised
                error = exc
            if os.path.basename(path).startswith(_RANK_FILE_PREFIX):
                self._agree_rank_files_written(error)
            if error is not None:
                raise error

        def _agree_rank_files_written(self, error: Optional[BaseException]) -> None:
            # Every rank writes its shard through here exactly once per save, so this
            # gather pairs up across ranks; rank 0 writes training_state.pt only after it.
            if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
                return
            errors = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
            failed = [(r, e) for r, e in enumerate(errors) if e]
            if failed and error is None:
                raise RuntimeError("another rank failed to write its checkpoint shard: " + "; ".join(f"rank {r}: {e}" for r, e in failed))

        def _test_sleep(self) -> None:
            spec = os.environ.get(SAVE_SLEEP_ENV)
            if not spec:
                return
            step, seconds = spec.split(":")
            if int(step) == getattr(self, "_saving_step", None):
                log.warning("test hook %s: sleeping %ss inside the save of step %s", SAVE_SLEEP_ENV, seconds, step)
                time.sleep(float(seconds))

    return RecipeCheckpointManager


def check_finite_state(tensors: Dict[str, Any], step) -> None:
    """Refuse to checkpoint a drafter state holding a NaN or inf (one line naming the tensor)."""
    from pr_specforge.training.errors import NonFiniteTraining

    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise NonFiniteTraining(f"checkpoint of step {step} not written: drafter tensor {name!r} holds NaN or inf; "
                                    "the newest checkpoint in the run directory is the last finite one")


_CLASS = None


def recipe_checkpoint_manager():
    global _CLASS
    if _CLASS is None:
        _CLASS = _manager_class()
    return _CLASS


def install_checkpoint_manager(resolved_recipe: Dict[str, Any], target: Optional[Dict[str, Any]] = None) -> None:
    """Make SpecForge's trainer build `RecipeCheckpointManager`s carrying `resolved_recipe` and the `target` record
    (`TARGET_STATE_KEY`: its name and weights digest; None for a target that is no local directory)."""
    from pr_specforge._specforge import use_checkpoint_manager

    cls = recipe_checkpoint_manager()
    cls.recipe, cls.target = resolved_recipe, target
    use_checkpoint_manager(cls)
