"""Issue 65: `pr-specforge run` (and `make run ARGS=...`) checks everything it is given before its first stage: each
bad input is one line, exit 2, and the workdir is neither made nor given settings that would refuse the corrected
command; `--eval-prompts A B FIELD=VALUE` passes the override to training instead of taking it for a prompt set."""

import os

import pytest

from pr_specforge.pipeline import check_args, main, parse_args, stages, train_overrides
from pr_specforge.stages import REPO_ROOT, StageBuilder


@pytest.fixture
def recipe_with_unknown_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(f"extends: {REPO_ROOT / 'recipes' / 'smollm2-135m-cpu.yaml'}\nbogus_section: 1\n")
    return path


#: each row: extra `run` arguments -> what its one line says
BAD = {
    "an override that is not FIELD=VALUE": (["notanoverride"], ("override 'notanoverride'", "section.field=value")),
    "an override of a field that does not exist": (["training.max_stepz=3"], ("no field 'max_stepz'",)),
    "an unknown pr option after the prompt sets": (["--eval-prompts", "mtbench", "pr.no_such=1"], ("no_such",)),
    "--max-steps 0": (["--max-steps", "0"], ("--max-steps must be at least 1, got 0",)),
    "--conversations 0": (["--conversations", "0"], ("--conversations must be at least 1",)),
    "--budget 0": (["--budget", "0"], ("--budget must be at least 1",)),
    "an unknown prompt set": (["--eval-prompts", "mtbench", "mtbnech"], ("--eval-prompts", "'mtbnech'", "gsm8k")),
    "an EAGLE-3 recipe": (["--recipe", str(REPO_ROOT / "recipes" / "smollm2-135m-cpu-eagle3.yaml")],
                          ("training.strategy is 'eagle3'", "PR drafter", "smollm2-135m-cpu.yaml")),
    "a recipe with an unknown key": (None, ("bogus_section", "Extra inputs are not permitted")),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_before_any_stage(tmp_path, capsys, case, recipe_with_unknown_key):
    extra, needles = BAD[case]
    if extra is None:
        extra = ["--recipe", str(recipe_with_unknown_key)]
    work = tmp_path / "work"
    capsys.readouterr()
    assert main(["--workdir", str(work), *extra]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pr-specforge run:")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert all(n in lines[0] for n in needles), lines[0]
    assert not work.exists()  # no stage ran, no settings recorded: the corrected command runs in the same workdir


def _workdir_file(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    return tmp_path / "notes.txt"


def _read_only_workdir(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    return tmp_path / "ro" / "work"


#: issue 73: `--workdir` under the ownership rule of every output (data.io.check_output_dir) -> what its line says
BAD_WORKDIRS = {
    "a file": (_workdir_file, "notes.txt: is a file, not a directory"),
    "under a file": (lambda t: _workdir_file(t) / "work", "notes.txt is a file, not a directory"),
    "in a read-only directory": (_read_only_workdir, "is not writable"),
}


@pytest.mark.parametrize("case", sorted(BAD_WORKDIRS))
def test_a_workdir_run_may_not_write_is_one_line_before_any_stage(tmp_path, capsys, case):
    build, needle = BAD_WORKDIRS[case]
    work = build(tmp_path)
    capsys.readouterr()
    assert main(["--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pr-specforge run: --workdir")]
    assert "Traceback" not in err and len(lines) == 1 and needle in lines[0], err[-3000:]
    assert (tmp_path / "ro").exists() or (tmp_path / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "ro" / "work").exists()


def test_the_suggested_pr_recipe_names_a_file_from_any_working_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--workdir", str(tmp_path / "w"), "--recipe", str(REPO_ROOT / "recipes" / "smollm2-135m-cpu-eagle3.yaml")]) == 2
    suggested = capsys.readouterr().err.strip().rsplit("--recipe ", 1)[-1]
    assert os.path.isfile(suggested), suggested


def test_an_override_after_the_prompt_sets_goes_to_training(tmp_path):
    """The override used to be taken as a prompt set and the run trained without it."""
    args = parse_args(["--workdir", str(tmp_path), "--eval-prompts", "mtbench", "gsm8k", "pr.gate_init_bias=-1",
                       "--max-steps", "5"])
    assert args.eval_prompts == ["mtbench", "gsm8k"] and args.overrides == ["pr.gate_init_bias=-1"]
    build = StageBuilder(tmp_path)
    check_args(args, build)  # the default recipe with this override and the train stage's own overrides: accepted
    assert [s.name for s in stages(args, build)].count("train") == 1
    from pr_specforge.training.recipe import load_recipe

    recipe = load_recipe(args.recipe, train_overrides(args, build))
    assert recipe.pr.gate_init_bias == -1 and recipe.config.training.max_steps == 5
    # a prompt file whose name has '=' in it stays a prompt file
    odd = tmp_path / "a=b.jsonl"
    odd.write_text('{"turns": ["hi"]}\n')
    assert parse_args(["--eval-prompts", str(odd)]).eval_prompts == [str(odd)]


def test_the_default_settings_pass_every_check(tmp_path):
    args = parse_args(["--workdir", str(tmp_path / "w")])
    check_args(args, StageBuilder(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_experiment_refuses_an_unknown_benchmark_before_any_stage(tmp_path, capsys):
    """Issue 73: `experiment --benchmarks nosuchset` is one line, exit 2, before any stage (no workdir made)."""
    from pr_specforge.experiment import main as experiment

    work = tmp_path / "work"
    capsys.readouterr()
    assert experiment(["--workdir", str(work), "--report", str(tmp_path / "r"), "--benchmarks", "mtbench",
                       "nosuchset"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pr-specforge experiment:")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert "--benchmarks: prompt source 'nosuchset' is neither" in lines[0], lines[0]
    assert not work.exists()
