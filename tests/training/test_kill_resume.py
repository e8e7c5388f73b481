"""kill -9 mid-run and mid-save, resume: the final weights and the loss curve equal an uninterrupted run's, bitwise,
with bf16 features and with float32 ones (whose teacher head is read in float32 at the first step after the resume:
that read must not draw from the restored RNG stream)."""

import os
import subprocess
import sys

import pytest
import torch

from pr_specforge.training.backends.checkpoint import RECIPE_STATE_KEY, SAVE_SLEEP_ENV
from pr_specforge.training.telemetry import read_metrics
from tests.helpers import sigkill_when, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
STEPS = 8


def _cmd(recipe, out, *extra):
    return [sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, f"output_dir={out}", *extra]


def _run(recipe, out, *extra):
    proc = subprocess.run(_cmd(recipe, out, *extra), env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _kill_when(recipe, out, ready, env=None, timeout=120):
    """Start a run, SIGKILL it as soon as `ready()` holds."""
    sigkill_when(_cmd(recipe, out), ready, env=env or ENV, timeout=timeout)


def _final_weights(out):
    state = torch.load(os.path.join(out, f"specforge-run-step{STEPS}", "training_state.pt"), weights_only=False)
    assert state["global_step"] == STEPS
    return state


def _losses(out):
    return {r["step"]: r["pr/loss_total"] for r in read_metrics(out)}


def _logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    return len(read_metrics(out)) if os.path.isfile(path) else 0


# bf16: both kill points; float32: the kill between saves is what puts the float32 head's first read after the
# RNG restore (the kill inside a save is dtype-blind, so it is not run twice).
@pytest.mark.parametrize("feature_dtype,kill_mid_save", [(torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16", "float32"])
def test_kill_mid_run_and_mid_save_then_resume_matches_uninterrupted_run_bitwise(tmp_path, feature_dtype,
                                                                                 kill_mid_save):
    recipe = write_workspace(str(tmp_path), steps=STEPS, n=STEPS, pr_section={"max_depth": 2},
                             extra={"training": {"save_interval": 2}}, feature_dtype=feature_dtype)
    full = str(tmp_path / "full")
    _run(recipe, full)
    reference = _final_weights(full)
    assert reference[RECIPE_STATE_KEY]["pr"]["max_depth"] == 2  # the resolved recipe rides in every checkpoint
    assert reference[RECIPE_STATE_KEY]["training"]["strategy"] == "pr"

    # 1. kill -9 between saves (after step 5 was logged; last checkpoint: step 4), resume from the run dir.
    mid_run = str(tmp_path / "mid_run")
    _kill_when(recipe, mid_run, lambda: _logged_steps(mid_run) >= 5)
    _run(recipe, mid_run, f"training.resume_from={mid_run}")

    resumed_runs = [mid_run]
    if kill_mid_save:
        resumed_runs.append(_kill_mid_save_and_resume(recipe, tmp_path))

    curve = _losses(full)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for out in resumed_runs:
        resumed = _final_weights(out)
        for name, tensor in reference["draft_state_dict"].items():
            assert torch.equal(resumed["draft_state_dict"][name], tensor), (out, name)
        assert _losses(out) == curve, out  # same loss at every step, including the replayed ones


def _kill_mid_save_and_resume(recipe, tmp_path):
    """kill -9 inside the save of step 6 (its training_state.pt.tmp written, not yet renamed), then resume."""
    mid_save = str(tmp_path / "mid_save")
    tmp_state = os.path.join(mid_save, "specforge-run-step6", "training_state.pt.tmp")
    _kill_when(recipe, mid_save, lambda: os.path.isfile(tmp_state) and os.path.getsize(tmp_state) > 0,
               env=dict(ENV, **{SAVE_SLEEP_ENV: "6:120"}))
    assert not os.path.exists(os.path.join(mid_save, "specforge-run-step6", "training_state.pt"))
    last_good = torch.load(os.path.join(mid_save, "specforge-run-step4", "training_state.pt"), weights_only=False)
    assert last_good["global_step"] == 4  # the last good checkpoint is intact and loadable
    _run(recipe, mid_save, f"training.resume_from={mid_save}")
    return mid_save
