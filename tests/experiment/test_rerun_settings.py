"""Issue 63: `run` and `experiment` reuse a finished stage only under the settings that made it, the recipe by its
content. An edited recipe was reused (every stage "skipped", the export still saying max_depth 2) while the same
recipe by a relative path was refused; an experiment rerun with other --epochs/--lr/--eval-limit skipped every stage
and rewrote the report with settings that did not run."""

import json
import shutil

import pytest

from pr_specforge.config import ConfigError


def _recipe(tmp_path):
    from pr_specforge.pipeline import DEFAULT_RECIPE

    shutil.copytree(DEFAULT_RECIPE.parent, tmp_path / "recipes")  # with the recipes it extends
    path = tmp_path / "recipes" / DEFAULT_RECIPE.name
    text = path.read_text()
    assert "max_depth: 2" in text
    return path, text


def test_run_identifies_its_recipe_by_content_not_by_path(tmp_path, monkeypatch):
    from pr_specforge import pipeline

    recipe, text = _recipe(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    parse = pipeline._parser().parse_args
    pipeline.check_run_settings(parse(["--workdir", str(work), "--recipe", str(recipe)]), work)
    monkeypatch.chdir(tmp_path)
    pipeline.check_run_settings(parse(["--workdir", str(work), "--recipe", f"recipes/{recipe.name}"]), work)  # same recipe
    recipe.write_text(text.replace("max_depth: 2", "max_depth: 1"))
    with pytest.raises(ConfigError, match=r"recipe\.pr\.max_depth: 2 -> 1.*new --workdir"):
        pipeline.check_run_settings(parse(["--workdir", str(work), "--recipe", str(recipe)]), work)
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=r"max_steps: 300 -> 400"):
        pipeline.check_run_settings(parse(["--workdir", str(work), "--recipe", str(recipe), "--max-steps", "400"]), work)


def test_run_migrates_a_workdir_that_recorded_its_recipe_by_path(tmp_path):
    from pr_specforge import pipeline

    recipe, _ = _recipe(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    args = pipeline._parser().parse_args(["--workdir", str(work), "--recipe", str(recipe)])
    old = {k: v for k, v in vars(args).items() if k != "workdir"}
    (work / "run_settings.json").write_text(json.dumps(old))
    pipeline.check_run_settings(args, work)
    assert json.loads((work / "run_settings.json").read_text())["recipe"]["pr"]["max_depth"] == 2


@pytest.mark.parametrize("flag, before, after", [("--epochs", "1", "5"), ("--lr", "0.001", "0.05"),
                                                 ("--eval-limit", "1", "40"), ("--eval-max-new-tokens", "16", "32")])
def test_an_experiment_seed_is_reused_only_under_the_settings_that_made_it(tmp_path, flag, before, after):
    from pr_specforge.experiment import Experiment, _parser
    from pr_specforge.stages import check_settings

    def check(value, seed="0"):
        exp = Experiment(_parser().parse_args(["--workdir", str(tmp_path), "--seed", seed, flag, value]))
        check_settings(tmp_path / f"seed{seed}_settings.json", exp.seed_settings())

    check(before)
    check(before)  # the same command resumes
    with pytest.raises(ConfigError, match=f"{flag[2:].replace('-', '_')}: {before} -> {after}"):
        check(after)
    check(after, seed="1")  # another seed is its own set of stages


def test_a_recipe_in_another_checkout_is_the_same_setting_and_an_edited_draft_config_another(tmp_path):
    from pr_specforge.pipeline import DEFAULT_RECIPE
    from pr_specforge.stages import recipe_content

    shutil.copytree(DEFAULT_RECIPE.parent, tmp_path / "a" / "recipes")
    shutil.copytree(DEFAULT_RECIPE.parent, tmp_path / "b" / "recipes")
    a, b = (recipe_content(str(tmp_path / x / "recipes" / DEFAULT_RECIPE.name)) for x in "ab")
    assert a == b and "sha256" in a["model"]["draft_model_config"]
    draft = tmp_path / "b" / "recipes" / "drafters"
    for f in draft.glob("*.json"):
        f.write_text(f.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    assert recipe_content(str(tmp_path / "b" / "recipes" / DEFAULT_RECIPE.name)) != a


def test_a_finished_training_stage_is_reused_only_under_the_settings_that_trained_it(tmp_path):
    """The rule every command's train stage shares (`run`, `experiment`, the regime study)."""
    import yaml

    from pr_specforge.stages import StageBuilder
    from pr_specforge.training.recipe import load_recipe, resolved_payload
    from tests.helpers import write_workspace

    recipe = write_workspace(str(tmp_path), strategy="pr", steps=6, pr_section={"max_depth": 2})
    run = tmp_path / "out"
    run.mkdir()
    (run / "resolved_recipe.yaml").write_text(yaml.safe_dump(resolved_payload(load_recipe(recipe, []))))
    (run / "train.done").write_text("ok\n")

    def stage(*overrides):
        return StageBuilder(tmp_path).train_stage("train", recipe, run, lambda: list(overrides))

    assert stage().done() and stage("training.log_interval=5").done()
    for override, needle in (("training.learning_rate=0.5", "training.learning_rate' is 0.001 but this run's is 0.5"),
                             ("pr.max_depth=1", "pr.max_depth' is 2 but this run's is 1"),
                             ("training.max_steps=9", "training.max_steps' is 6 but this run's is 9")):
        with pytest.raises(ConfigError, match=needle):
            stage(override).done()
    assert not StageBuilder(tmp_path).train_stage("train", recipe, tmp_path / "none", lambda: []).done()
