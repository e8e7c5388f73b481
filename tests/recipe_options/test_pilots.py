"""`benchmarks/pilots.py`: every variant's overrides load into a valid recipe; the table ranks by served tau."""

import json
import os

import pytest

from pr_specforge.training.recipe import load_recipe
from tests.helpers import load_benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def pilots():
    return load_benchmark("pilots")


def test_every_variant_loads_as_a_recipe_with_its_options(pilots, tmp_path):
    args = pilots._parser().parse_args(["--workdir", str(tmp_path), "--steps", "7", "--dry-run"])
    args.out = str(tmp_path / "pilots")
    for name, (recipe, options) in pilots.VARIANTS.items():
        overrides = pilots.train_overrides(args, tmp_path, name, tmp_path / "runs" / name)
        loaded = load_recipe(os.path.join(ROOT, "recipes", recipe), overrides)
        assert loaded.config.training.max_steps == 7, name
        for option in options:
            key, value = option[len("pr."):].split("=")
            assert str(getattr(loaded.pr, key)).lower() == value.lower(), (name, option)
        if name == "warm-frozen-separate-adapter16":
            assert loaded.pr.init_from == "<eagle3 pilot checkpoint>" and loaded.pr.freeze_one_pass


def test_rows_and_table_rank_by_served_tau(pilots):
    diag = {"one_pass_acc": [0.7, 0.5], "simulated_acc_len": 2.5, "pr": {"pr/acc_depth_1": 0.6, "pr/recovered_share": 0.1}}
    summary = {"results": [{"draft": "a", "set": s, "tau": t} for s, t in zip(pilots.SETS, (3.0, 3.3, 3.6))]
               + [{"draft": "a/one-pass", "set": s, "tau": 3.0} for s in pilots.SETS]}
    a = pilots.row("a", diag, summary)
    assert a["tau_mean"] == pytest.approx(3.3) and a["tau_mean_m0"] == pytest.approx(3.0) and a["acc_depth_1"] == 0.6
    b = pilots.row("b", None, {"results": [{"draft": "b", "set": "gsm8k", "tau": 3.1}]})
    args = pilots._parser().parse_args(["--steps", "100"])
    table = pilots.render([b, a], args)
    assert table.index("| a |") < table.index("| b |") and "| 3.300 | 3.000 |" in table


def test_decompose_serves_pr_pilots_only_and_rows_average_the_counters(pilots, tmp_path):
    args = pilots._parser().parse_args(["--workdir", str(tmp_path), "--decompose", "--max-new-tokens", "64", "--budget", "24"])
    args.out = str(tmp_path / "pilots")

    def argv(name):
        return pilots.serve_argv(args, tmp_path, name, tmp_path / "x", tmp_path / "ev")

    pr, eagle = argv("baseline"), argv("eagle3")
    assert "--decompose" in pr and "--also-one-pass" in pr and "--decompose" not in eagle
    assert pr[pr.index("--max-new-tokens") + 1] == "64" and pr[pr.index("--budget") + 1] == "24"
    entries = [{"draft": "a", "set": s, "tau": 3.0, "decomposition": {"displaced_per_round": d, "lost_lb_per_round": 0.1}}
               for s, d in zip(pilots.SETS, (1.0, 2.0, 6.0))]
    out = pilots.row("a", None, {"results": entries + [{"draft": "a/one-pass", "set": "gsm8k", "tau": 2.0,
                                                         "decomposition": {"displaced_per_round": 100.0}}]})
    assert out["displaced"] == pytest.approx(3.0) and out["lost_lb"] == pytest.approx(0.1) and "gained_proposal" not in out


def test_comparisons_split_the_gain_into_one_pass_and_mechanism(pilots, tmp_path):
    def write(name, rows):
        (tmp_path / "eval" / name).mkdir(parents=True)
        (tmp_path / "eval" / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def rows(draft, accepted):
        return [{"draft": draft, "set": s, "prompt": str(i), "accepted": accepted, "rounds": 10}
                for s in pilots.SETS for i in range(4)]

    write("eagle3", rows("eagle3", 10))
    write("baseline", rows("baseline", 11) + rows("baseline/one-pass", 8))      # one-pass -20%, mechanism +37.5%
    write("eagle3-long", rows("eagle3-long", 12))
    write("warm-frozen-separate-adapter16", rows("warm-frozen-separate-adapter16", 12)
          + rows("warm-frozen-separate-adapter16/one-pass", 12))
    cells = {c["variant"]: c for c in pilots.comparisons(tmp_path, ["eagle3", "baseline", "warm-frozen-separate-adapter16", "eagle3-long"])}
    assert set(cells) == {"baseline", "warm-frozen-separate-adapter16"}
    base = cells["baseline"]
    assert base["baseline"] == "eagle3" and base["gain"]["prompts"] == 12
    assert base["gain"]["gain_rel"] == pytest.approx(0.1) and base["one_pass"]["gain_rel"] == pytest.approx(-0.2)
    assert base["mechanism"]["gain_rel"] == pytest.approx(11 / 8 - 1)
    warm = cells["warm-frozen-separate-adapter16"]
    assert warm["baseline"] == "eagle3-long" and warm["gain"]["gain_rel"] == 0.0 and warm["gain"]["gain_rel_ci95"] == [0.0, 0.0]
    table = "\n".join(pilots.render_comparisons(list(cells.values())))
    assert "| baseline | eagle3 | 12 | +10.0% [+10.0, +10.0] | -20.0% [-20.0, -20.0] | +37.5% [+37.5, +37.5] |" in table


def test_warm_steps_apply_to_warm_starts_and_their_baseline_only(pilots, tmp_path):
    args = pilots._parser().parse_args(["--workdir", str(tmp_path), "--steps", "1000", "--warm-steps", "500", "--dry-run"])
    args.out = str(tmp_path / "pilots")
    steps = {name: [o for o in pilots.train_overrides(args, tmp_path, name, tmp_path / name) if o.startswith("training.max_steps=")]
             for name in ("eagle3", "baseline", "warm-frozen-separate-adapter16", "eagle3-long")}
    assert steps == {"eagle3": ["training.max_steps=1000"], "baseline": ["training.max_steps=1000"],
                     "warm-frozen-separate-adapter16": ["training.max_steps=500"], "eagle3-long": ["training.max_steps=500"]}
