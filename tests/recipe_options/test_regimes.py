"""`benchmarks/regimes.py gsm8k` (issue 27): disjoint GSM8K splits by index, and stages that screen and report apart."""

import json

import pytest

from pr_specforge.training.recipe import load_recipe
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def regimes():
    return load_benchmark("regimes")


def _regime(regimes, tmp_path, *extra):
    args = regimes._parser().parse_args(["gsm8k", "--workdir", str(tmp_path), "--dry-run", *extra])
    return regimes.GSM8KRegime(args)


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_splits_are_disjoint_by_index_and_hold_the_problems_of_their_indices(regimes, tmp_path):
    regimes.write_splits(tmp_path)
    problems = regimes.gsm8k_problems()
    seen = {}
    for name, idx in regimes.SPLITS.items():
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == [f"gsm8k-{i}" for i in idx]
        assert all(r["conversations"] == [{"role": "user", "content": problems[i]}] for r, i in zip(rows, idx))
        seen[name] = set(idx)
    assert not (seen["train"] & seen["screen"]) and not (seen["train"] & seen["report"]) and not (seen["screen"] & seen["report"])
    assert len(seen["report"]) >= 100 and min(seen["train"]) == 40  # 0..39: what `--prompts gsm8k` serves elsewhere
    assert json.loads((tmp_path / "splits.json").read_text())["report"] == [1160, 1318]


def test_warm_drafters_continue_this_seeds_eagle3_and_controls_train_like_it(regimes, tmp_path):
    r = _regime(regimes, tmp_path, "--epochs", "4", "--warm-epochs", "1")
    recipes = {n: load_recipe(str(regimes.RECIPES / regimes.DRAFTERS[n][0]), r.train_overrides(1, n)) for n in regimes.DRAFTERS}
    eagle, two, pr, warm, long = (recipes[n] for n in ("eagle3", "eagle3-2layer", "pr", "pr-warm", "eagle3-long"))
    assert {x.config.training.num_epochs for x in (eagle, two, pr)} == {4} and warm.config.training.num_epochs == 1
    assert {x.config.training.seed for x in recipes.values()} == {1}
    assert two.config.training.strategy == eagle.config.training.strategy == "eagle3"
    assert json.load(open(two.config.model.draft_model_config))["architectures"] == ["LlamaForCausalLMEagle3TwoLayer"]
    assert warm.pr.init_from == long.config.model.draft_checkpoint_path == "<eagle3 checkpoint>"  # filled in at run time
    assert warm.pr.recon_grad == "isolated" and warm.pr.recon_adapter_rank == 16
    assert all(x.config.data.eval_hidden_states_path == str(r.screen / "features") for x in recipes.values())


def test_screening_serves_the_screen_split_and_the_report_the_report_split_with_the_bw9_control(regimes, tmp_path):
    r = _regime(regimes, tmp_path, "--screen-limit", "30", "--report-limit", "120")
    screen = r.build.eval_argv(tmp_path / "s", **r.serve_settings(0, "screen", 30, [48], [0]))
    assert _value(screen, "--prompts").endswith("splits/screen.jsonl") and _value(screen, "--limit") == "30"
    assert "--also-one-pass" in screen and "--skip" not in screen
    names = [s.name for s in r.report_stages(0)]
    assert names == ["seed0 report-b48", "seed0 report-b24", "seed0 report-bw9-b48", "seed0 report-bw9-b24"]
    wide = r.build.eval_argv(tmp_path / "w", **r.serve_settings(0, "report", 120, [48], [0, 1], bw=9,
                                                                 drafters=["eagle3", "eagle3-long"]))
    assert _value(wide, "--bw") == "9" and _value(wide, "--prompts").endswith("splits/report.jsonl")
    assert [a.split("=")[0] for a in wide if "=" in a and not a.startswith("-")] == ["eagle3", "eagle3-long"]
