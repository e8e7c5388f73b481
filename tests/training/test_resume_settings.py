"""Issue 63: a resumed `train` continues the run that wrote its checkpoint only under the settings it was trained
with. A changed learning rate was recorded but not used (the restored schedule kept the old one), a changed `pr.*`
field ended in a 41-line traceback: both are refused in one line naming the setting and both values; settings that
shape no step (when to log or save) resume."""

import os
import shutil

import pytest

from tests.helpers import run_cli, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")


@pytest.fixture(scope="module")
def cut_back(tmp_path_factory):
    """A 6-step PR run (checkpoints at 3 and 6), then its step-6 checkpoint removed: a run to resume from step 3."""
    root = tmp_path_factory.mktemp("resume")
    recipe = write_workspace(str(root), strategy="pr", steps=6, pr_section={"max_depth": 2})
    rc, out = run_cli("train", "-c", recipe, cwd=root, env=ENV)
    assert rc == 0, out[-3000:]
    run = root / "out"
    shutil.rmtree(next(run.glob("*-step6")))
    (run / "specforge-run-latest").unlink(missing_ok=True)
    return root, recipe


@pytest.mark.parametrize("override, needles", [
    ("training.learning_rate=0.5", ("training.learning_rate", "0.001", "0.5")),
    ("pr.max_depth=1", ("pr.max_depth", "2", "1")),
    ("training.ttt_length=4", ("training.ttt_length", "3", "4")),
    ("training.seed=7", ("training.seed", "0", "7")),
])
def test_a_changed_setting_on_resume_is_refused_in_one_line(cut_back, override, needles):
    root, recipe = cut_back
    before = (root / "out" / "resolved_recipe.yaml").read_text()
    rc, out = run_cli("train", "-c", recipe, override, cwd=root, env=ENV)
    lines = [line for line in out.splitlines() if line.startswith("pr-specforge train:")]
    assert rc == 2 and "Traceback" not in out and len(lines) == 1, out[-3000:]
    assert all(n in lines[0] for n in needles) and "--start-over" in lines[0], lines[0]
    assert (root / "out" / "resolved_recipe.yaml").read_text() == before  # the record still says what ran
    assert not list((root / "out").glob("*-step6"))


def test_the_same_settings_resume_and_a_logging_interval_may_change(cut_back):
    root, recipe = cut_back
    rc, out = run_cli("train", "-c", recipe, "training.log_interval=2", cwd=root, env=ENV)
    assert rc == 0, out[-3000:]
    assert list((root / "out").glob("*-step6"))
