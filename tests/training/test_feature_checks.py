"""Issue 65: every feature sample is checked as SpecForge's loader reads it (`preflight.FeatureSampleCheck`,
`data validate`'s checks), so a bad file anywhere in a features directory ends `train` (training and eval
features) in one line naming the file and the field, exit 2, instead of a later step's torch traceback."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import later_feature_file_cases, write_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    recipe = write_workspace(str(root), steps=4, n=4)
    cases = later_feature_file_cases(root / "features", root / "bad")
    return root, recipe, cases


def _every_file_after_the_first(features, edit_like, tmp):
    """A copy of `features` whose files after the first are all the last file of `edit_like` (the damaged one), so
    the first steps read one whatever the sampler's order."""
    out = tmp / "feats"
    shutil.copytree(features, out)
    damaged = sorted(edit_like.rglob("*.ckpt"))
    damaged = [p for p in damaged if "vocab_mapping" not in str(p)][-1]
    files = sorted(p for p in out.rglob("*.ckpt") if "vocab_mapping" not in str(p))
    for path in files[1:]:
        shutil.copyfile(damaged, path)
    return out, files[1].name


def _one_line(err, command="train"):
    lines = [x for x in err.splitlines() if x.startswith(f"pr-specforge {command}:")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    return lines[0]


#: the rows of `later_feature_file_cases` (one per damage) that `train` is run on
TRAIN_CASES = ["a later features file truncated", "a later features file of another width",
               "a later features file without loss_mask", "a later features file of another dtype",
               "a later features file whose hidden states are shorter than input_ids",
               "a later features file whose input_ids are shorter than the states", "a later features file holding NaN",
               "a later features file holding a token id >= the vocab", "a later features file with a 2-D loss_mask"]


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_a_bad_later_training_file_ends_train_in_one_line(workspace, tmp_path, capsys, case):
    from pr_specforge.cli import main

    root, recipe, cases = workspace
    edited, needles = cases[case]
    feats, name = _every_file_after_the_first(root / "features", edited, tmp_path)
    capsys.readouterr()
    rc = main(["train", "-c", recipe, f"data.hidden_states_path={feats}", f"output_dir={tmp_path / 'out'}"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and f"{feats}" in line and all(n in line for n in needles[1:]), line
    assert not list((tmp_path / "out").glob("*-step*"))  # it stopped before the first checkpoint (step 3)


def test_a_bad_eval_file_ends_train_in_one_line(workspace, tmp_path, capsys):
    """The eval pass reads held-out features through the same loader: a NaN there is one line too."""
    from pr_specforge.cli import main

    root, recipe, cases = workspace
    edited, needles = cases["a later features file holding NaN"]
    feats, _ = _every_file_after_the_first(root / "features", edited, tmp_path)
    capsys.readouterr()
    rc = main(["train", "-c", recipe, f"data.eval_hidden_states_path={feats}", "training.eval_interval=2",
               f"output_dir={tmp_path / 'out'}"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and f"{feats}" in line and "non-finite values" in line and "aux_hidden_state" in line, line


def test_a_bad_file_read_by_one_of_two_ranks_is_one_line(workspace, tmp_path, capsys):
    """Two ranks self-launched under torchrun (gloo): the rank that reads the bad sample says it; the launcher says
    that line once, with its exit code, and none of the peers' broken-connection tracebacks or torchrun's report."""
    from pr_specforge.cli import main

    root, recipe, cases = workspace
    edited, _ = cases["a later features file holding a token id >= the vocab"]
    feats, _ = _every_file_after_the_first(root / "features", edited, tmp_path)
    capsys.readouterr()
    rc = main(["train", "-c", recipe, "deployment.trainer.nproc_per_node=2", f"data.hidden_states_path={feats}",
               f"output_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    line = _one_line(captured.err + captured.out)
    assert rc == 2 and f"{feats}" in line and "input_ids outside [0, 97)" in line, line
    assert "ChildFailedError" not in captured.err and "[rank" not in captured.err, captured.err[-3000:]


def test_good_features_pass_every_check_and_train(workspace, tmp_path, capsys):
    from pr_specforge.cli import main

    root, recipe, _ = workspace
    assert main(["train", "-c", recipe, f"output_dir={tmp_path / 'out'}"]) == 0
    assert (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_sample_check_is_exact_on_finite_values_whose_sum_overflows():
    """The finiteness check is one sum per tensor; a sum that overflows on finite values falls back to the exact
    check (no false refusal), and one NaN or Inf among finite values is always found."""
    from pr_specforge.data.validate import sample_problem

    L, H = 16, 8
    sample = {"input_ids": torch.arange(L), "loss_mask": torch.ones(L, dtype=torch.long),
              "hidden_state": torch.full((1, L, H), 3e38, dtype=torch.bfloat16),
              "aux_hidden_state": torch.full((1, L, 3 * H), 3e38, dtype=torch.bfloat16)}
    assert not torch.isfinite(sample["hidden_state"].sum())  # the cheap sum alone would refuse it
    assert sample_problem(sample, H, 100) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        damaged = dict(sample, hidden_state=sample["hidden_state"].clone())
        damaged["hidden_state"][0, L - 1, H - 1] = bad
        assert sample_problem(damaged, H, 100) == "non-finite values (NaN or Inf) in hidden_state"


def test_the_check_reads_only_the_directories_of_its_run(workspace, tmp_path):
    """The check stays installed in SpecForge's loader after a run in this process; another run's features (another
    width) read later are not judged by it."""
    from pr_specforge.training.preflight import FeatureSampleCheck

    root, _, _ = workspace
    check = FeatureSampleCheck({"target_hidden_size": 96, "vocab_size": 97}, (root / "elsewhere",))
    first = sorted((root / "features").rglob("data_*.ckpt"))[0]
    check(str(first), torch.load(first, weights_only=True))  # width 64, not under its roots: not judged
    with pytest.raises(Exception, match="hidden_state shape"):
        FeatureSampleCheck({"target_hidden_size": 96, "vocab_size": 97}, (root / "features",))(
            str(first), torch.load(first, weights_only=True))


def test_a_command_importing_specforge_says_a_bad_input_in_exactly_one_line(workspace):
    """SpecForge's import-time flash_attn notice no longer precedes the one-line error."""
    root, recipe, _ = workspace
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "training.nofield=1"],
                          capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "no field 'nofield'" in proc.stderr, proc.stderr
