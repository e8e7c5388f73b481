"""`benchmarks/best.py` (issue 16, part D): the trainings of one variant against its matched EAGLE-3, per seed."""

import pytest

from pr_specforge.training.recipe import load_recipe
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def best():
    return load_benchmark("best")


def _trainings(best, tmp_path, variant, seed=1):
    args = best._parser().parse_args(["--workdir", str(tmp_path), "--variant", variant, "--steps", "40",
                                      "--warm-steps", "10", "--seeds", "0", str(seed)])
    return best.Best(args), best.Best(args).trainings(seed)


def _value(overrides, key):
    (value,) = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return value


def test_a_warm_start_and_its_baseline_continue_the_same_eagle3_checkpoint_for_as_many_steps(best, tmp_path):
    b, runs = _trainings(best, tmp_path, "warm-isolated-separate-adapter16")
    assert list(runs) == ["eagle3-base", "eagle3", "pr"]
    base, eagle, pr = (load_recipe(recipe, overrides) for recipe, overrides in runs.values())
    assert base.config.training.max_steps == 40 and eagle.config.training.max_steps == pr.config.training.max_steps == 10
    assert {r.config.training.seed for r in (base, eagle, pr)} == {1}
    start = _value(runs["eagle3"][1], "model.draft_checkpoint_path")
    assert start == pr.pr.init_from == "<eagle3-base checkpoint>"  # filled in when the stage runs
    assert pr.pr.recon_grad == "isolated" and pr.pr.recon_head == "separate" and pr.pr.recon_adapter_rank == 16
    assert _value(runs["pr"][1], "output_dir") == str(b.out / "runs" / "pr-seed1")
    # once the base run has a checkpoint, both continuations start from it
    ckpt = b.out / "runs" / "eagle3-base-seed1" / "smollm2-135m-eagle3-step40"
    ckpt.mkdir(parents=True)
    (ckpt / "training_state.pt").write_bytes(b"")
    runs = b.trainings(1)
    assert _value(runs["eagle3"][1], "model.draft_checkpoint_path") == _value(runs["pr"][1], "pr.init_from") == str(ckpt)


def test_a_cold_variant_trains_as_many_steps_as_eagle3_and_every_stage_serves_the_final_prompts(best, tmp_path):
    b, runs = _trainings(best, tmp_path, "baseline", seed=0)
    assert list(runs) == ["eagle3", "pr"]
    assert {load_recipe(r, o).config.training.max_steps for r, o in runs.values()} == {40}
    names = [s.name for s in b.stages(0)]
    assert names[:2] == ["seed 0: train eagle3", "seed 0: train pr"] and names[-2:] == ["seed 0: eval-b48", "seed 0: eval-b24"]
    argv = b.build.eval_argv(tmp_path / "ev", budgets=[48], temperatures=[0.0], **b.serve_settings(0))
    assert "--skip" not in argv and argv[argv.index("--limit") + 1] == "40"  # the final evaluation's prompts
    assert "--also-one-pass" in argv and "--decompose" in argv  # decomposed into one-pass and mechanism parts
    assert f"eagle3={b.out / 'export' / 'eagle3-seed0'}" in argv and f"pr={b.out / 'export' / 'pr-seed0'}" in argv
