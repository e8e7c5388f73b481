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


# ---- issue 43 item 7: the last screen of `pr-specforge run` says what its speedup and gate means mean
def _row(draft, tau, **kw):
    row = {"draft": draft, "set": "mtbench", "budget": 24, "temperature": 0.0, "tau": tau, "speedup": 0.43,
           "lossless": True, "ar_tokens_per_s": 20.0, "draft_s_per_round": 0.030, "verify_s_per_round": 0.120,
           "tokens_per_s": 8.6}
    return {**row, **kw}


def _metrics(q, lam=0.98, step=300):
    return {"step": step, "pr/gate_mean_depth_0": lam, **{f"pr/depth_marginal_{r}": v for r, v in enumerate(q)}}


def test_the_speedup_line_is_derived_from_the_rows_own_timings():
    from pr_specforge.eval.explain import speedup_line

    slow = speedup_line(_row("pr", 1.406))  # one step 50 ms; a round 150 ms = 3 steps for 1.4 tokens
    assert "3.0 target decode steps" in slow and "draft 30 ms + verify 120 ms, one step 50 ms" in slow
    assert "below 1x because tau < 3.0" in slow and "verifying the tree costs 2.4 steps" in slow
    fast = speedup_line(_row("pr", 4.0, speedup=1.3, verify_s_per_round=0.040))
    assert "1.4 target decode steps" in fast and "above 1x" in fast and "below" not in fast
    assert speedup_line(_row("pr", 1.0, ar_tokens_per_s=0.0)) is None


def test_the_gate_line_wording_follows_the_named_thresholds():
    from pr_specforge.eval import explain
    from pr_specforge.eval.explain import gate_line

    same = [_row("pr", 1.406), _row("pr/one-pass", 1.406)]
    closed = gate_line(_metrics([0.97, 0.03, 0.00]), same)
    assert "0.98" in closed and "q = 0.97/0.03/0.00 (step 300)" in closed
    assert "halts at depth 0 at 97% of positions" in closed and "reconsideration changed nothing" in closed
    at_threshold = gate_line(_metrics([explain.HALTS_AT_ZERO, 1 - explain.HALTS_AT_ZERO]), same)
    assert "halts at depth 0" in at_threshold
    partly = gate_line(_metrics([(explain.HALTS_AT_ZERO + explain.RECONSIDERS) / 2, 0.2, 0.1]), same)
    assert "partly at work" in partly
    gained = gate_line(_metrics([explain.RECONSIDERS, 0.3, 0.2]), [_row("pr", 1.55), _row("pr/one-pass", 1.406)])
    assert "50% of positions are reconsidered" in gained and "the mechanism is at work" in gained
    assert "tau +10.2% from reconsideration" in gained
    assert gate_line({"step": 3, "acc_0": 0.5}) is None  # an EAGLE-3 run logs no halt depths


def test_run_summary_ends_with_a_speedup_line_and_a_gate_line(tmp_path):
    import json

    from pr_specforge.pipeline import summary

    run, evald = tmp_path / "runs" / "pr", tmp_path / "eval"
    run.mkdir(parents=True)
    evald.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(_metrics([0.97, 0.03, 0.0])) + "\n")
    (evald / "summary.json").write_text(json.dumps({"results": [_row("pr", 1.406), _row("pr/one-pass", 1.406)]}))
    text = summary(tmp_path, run, tmp_path / "sg", tmp_path / "hf", evald, {"train": 1.0})
    lines = text.splitlines()
    speed = [x for x in lines if x.strip().startswith("speedup 0.43x (pr, B=24)")]
    gate = [x for x in lines if x.strip().startswith("gate: mean halt probability at depth 0 0.98")]
    assert len(speed) == 1 and len(gate) == 1 and "changed nothing" in gate[0]
    assert lines.index(speed[0]) > max(i for i, x in enumerate(lines) if "tau=1.406" in x)
