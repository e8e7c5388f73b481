"""The experiment report's statistics: PR's relative tau gain with a paired bootstrap CI."""

import pytest

from pr_specforge.eval.statistics import paired_bootstrap_gain


def _rows(pairs):
    return {f"p{i}": {"accepted": a, "rounds": r} for i, (a, r) in enumerate(pairs)}


def test_identical_drafters_have_zero_gain_and_a_degenerate_interval():
    rows = _rows([(30, 20), (25, 20), (40, 22), (18, 15)])
    out = paired_bootstrap_gain(rows, rows, n=500)
    assert out["gain_rel"] == 0.0 and out["gain_rel_ci95"] == [0.0, 0.0]
    assert out["prompts"] == 4


def test_tau_is_pooled_over_prompts_and_a_uniform_gain_is_significant():
    a = _rows([(30, 20), (25, 20), (40, 22), (18, 15), (22, 20), (35, 25)])
    b = _rows([(33, 20), (28, 20), (44, 22), (20, 15), (24, 20), (38, 25)])  # better on every prompt
    out = paired_bootstrap_gain(a, b, n=1000, seed=1)
    assert out["tau_eagle3"] == pytest.approx(170 / 122)
    assert out["tau_pr"] == pytest.approx(187 / 122)
    lo, hi = out["gain_rel_ci95"]
    assert 0 < lo <= out["gain_rel"] <= hi


def test_pairing_uses_only_prompts_evaluated_for_both():
    a = _rows([(30, 20), (25, 20)])
    b = {"p0": {"accepted": 30, "rounds": 20}, "other": {"accepted": 99, "rounds": 1}}
    assert paired_bootstrap_gain(a, b, n=100)["prompts"] == 1
    with pytest.raises(ValueError, match="both drafters"):
        paired_bootstrap_gain(a, {"zzz": {"accepted": 1, "rounds": 1}}, n=10)


def test_a_workdir_is_not_reused_with_other_settings(tmp_path):
    from pr_specforge.stages import check_settings

    path = tmp_path / "run_settings.json"
    check_settings(path, {"conversations": 256, "max_steps": 300})
    check_settings(path, {"conversations": 256, "max_steps": 300})  # same settings: resume
    from pr_specforge.config import ConfigError

    with pytest.raises(ConfigError, match=r"conversations: 256 -> 4000.*new --workdir"):
        check_settings(path, {"conversations": 4000, "max_steps": 300})


def test_every_evaluated_seed_is_compared_and_rendered_side_by_side(tmp_path):
    import json

    from pr_specforge.eval.experiment_report import render_markdown
    from pr_specforge.eval.statistics import seed_comparisons

    def write_eval(name, pr_accepted):
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text("{}")
        with open(d / "results.jsonl", "w") as f:
            for i in range(5):
                for draft, acc in (("eagle3", 20), ("pr", pr_accepted)):
                    f.write(json.dumps({"draft": draft, "set": "gsm8k", "budget": 48, "temperature": 0.0,
                                        "prompt": f"p{i}", "accepted": acc + i, "rounds": 10}) + "\n")

    write_eval("eval-b48-seed0", 22)
    write_eval("eval-b48-seed1", 20)
    (tmp_path / "eval-b24-seed2").mkdir()  # a seed whose evaluation has not finished is left out
    seeds = seed_comparisons(tmp_path, n=200)
    assert sorted(seeds) == [0, 1]
    assert seeds[0][0]["gain_rel"] == pytest.approx(120 / 110 - 1) and seeds[1][0]["gain_rel"] == 0.0
    report = {"commit": "x", "machine": {"platform": "p", "cpus": 2}, "comparisons": seeds[0], "results": [],
              "training": {}, "stage_wall_s": {}, "seeds": {str(k): v for k, v in seeds.items()}}
    md = render_markdown(report)
    assert "Across training seeds" in md and "| gsm8k | 48 | 0 | +9.1%" in md and f"| {100 * (120 / 110 - 1) / 2:+.1f}% |" in md


def test_a_pr_drafter_served_at_m0_splits_each_cell_into_one_pass_and_mechanism(tmp_path):
    import json

    from pr_specforge.eval.experiment_report import render_markdown
    from pr_specforge.eval.statistics import comparisons

    d = tmp_path / "eval-b48-seed0"
    d.mkdir()
    rows = [{"draft": draft, "set": "gsm8k", "budget": 48, "temperature": 0.0, "prompt": f"p{i}", "accepted": acc + i,
             "rounds": 10} for i in range(5) for draft, acc in (("eagle3", 20), ("pr/one-pass", 18), ("pr", 24))]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell,) = comparisons([d], n=200, seed=0)
    one, mech = cell["one_pass"], cell["mechanism"]
    assert cell["gain_rel"] == pytest.approx(130 / 110 - 1)
    assert one["gain_rel"] == pytest.approx(100 / 110 - 1) and mech["gain_rel"] == pytest.approx(130 / 100 - 1)
    assert (1 + one["gain_rel"]) * (1 + mech["gain_rel"]) == pytest.approx(1 + cell["gain_rel"])
    counters = {"frontier_recon_per_round": 3.0, "displaced_per_round": 1.0, "gained_proposal_per_round": 0.25}
    report = {"commit": "x", "machine": {"platform": "p", "cpus": 2}, "comparisons": [cell], "training": {}, "notes": ["At reduced scale."],
              "stage_wall_s": {}, "results": [{"draft": "pr", "set": "gsm8k", "budget": 48, "temperature": 0.0,
                                               "tokens_per_s": 1.0, "ar_tokens_per_s": 1.0, "speedup": 1.0,
                                               "lossless": True, "decomposition": counters}]}
    md = render_markdown(report)
    assert "| 0 | gsm8k | 48 | 0 | +18.2% [" in md and "| -9.1% [" in md and "| +30.0% [" in md
    assert "| gsm8k | 48 | 0 | 3.000 | 1.000 | 0.250 | - | - |" in md
    assert md.index("At reduced scale.") < md.index("## Acceptance length")  # how the run was made, at its head
    # the experiment's own cells (no m = 0 rows): no split, no section
    rows = [r for r in rows if r["draft"] != "pr/one-pass"]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell,) = comparisons([d], n=50, seed=0)
    assert "one_pass" not in cell and "Where the gain comes from" not in render_markdown({**report, "comparisons": [cell]})
