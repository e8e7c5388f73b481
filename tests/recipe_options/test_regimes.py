"""`benchmarks/regimes.py gsm8k` (issue 27): disjoint GSM8K splits by index, and stages that screen and report apart."""

import json
import os
import shutil
from pathlib import Path

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


def test_the_paper_drafters_train_paper_pr_yamls_options_matched_to_eagle3_and_eagle3_long(regimes, tmp_path):
    import yaml

    r = _regime(regimes, tmp_path, "--epochs", "3", "--warm-epochs", "1")
    paper = yaml.safe_load((regimes.RECIPES / "_base" / "paper-pr.yaml").read_text())["pr"]
    default = load_recipe(str(regimes.RECIPES / "smollm2-135m-cpu.yaml")).pr
    assert {k for k, v in paper.items() if getattr(default, k) != v} >= {"recon_head", "balance_norm"}  # what it changes
    for name in ("pr-paper", "pr-paper-warm"):
        x = load_recipe(str(regimes.RECIPES / regimes.DRAFTERS[name][0]), r.train_overrides(0, name))
        for key, value in paper.items():  # every option of paper-pr.yaml but the memory-only one
            assert getattr(x.pr, key) == (default.gradient_checkpointing if key == "gradient_checkpointing" else value), key
        assert x.pr.recon_grad == "full" and x.config.training.strategy == "pr"
    scratch, warm = (load_recipe(str(regimes.RECIPES / "smollm2-135m-cpu.yaml"), r.train_overrides(0, n)) for n in ("pr-paper", "pr-paper-warm"))
    assert scratch.pr.init_from is None and scratch.config.training.num_epochs == 3  # eagle3's epochs
    assert warm.pr.init_from == "<eagle3 checkpoint>" and warm.config.training.num_epochs == 1  # eagle3-long's
    assert regimes.BASELINE["pr-paper"] == "eagle3" and regimes.BASELINE["pr-paper-warm"] == "eagle3-long"
    # every PR variant is a drafter with its matched baseline; the warm ones train after the eagle3 they start from
    assert set(regimes.PR_VARIANTS) == set(regimes.BASELINE) and set(regimes.PR_VARIANTS) <= set(regimes.DRAFTERS)
    names = [s.name for s in _regime(regimes, tmp_path, "--drafters", "pr-paper-warm", "eagle3-long", "pr-paper", "eagle3")
             .drafter_stages(0)]
    assert [n.split(":")[0] for n in names[::6]] == ["seed0 pr-paper", "seed0 eagle3", "seed0 pr-paper-warm", "seed0 eagle3-long"]
    assert names[:6] == [f"seed0 pr-paper: {s}" for s in ("train", "export", "kept fingerprint", "diagnose", "headroom",
                                                           "held-out measures")]


def test_a_rebuilt_drafter_is_checked_against_the_fingerprint_that_served_its_kept_rows(regimes, tmp_path):
    from study.regime_keep import kept_fingerprint_check

    from pr_specforge.data.io import dir_fingerprint
    from pr_specforge.stages import StageFailed

    sd, export = tmp_path / "seed1", tmp_path / "seed1" / "export" / "eagle3"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"weights")
    fp = dir_fingerprint(str(export))
    for folder, drafters in (("report-b48", {"eagle3": fp, "pr-warm": "0123"}), ("report-b48-2layer", {"eagle3-2layer": "x"})):
        (sd / folder).mkdir()
        (sd / folder / "eval_config.json").write_text(json.dumps({"drafters": drafters}))
    kept_fingerprint_check(sd, "eagle3", export, sd / "fingerprints" / "eagle3.json")
    assert json.loads((sd / "fingerprints" / "eagle3.json").read_text()) == {"drafter": "eagle3", "fingerprint": fp,
                                                                            "kept": {"report-b48": fp}}
    kept_fingerprint_check(sd, "pr-paper", export, sd / "fingerprints" / "pr-paper.json")  # a new drafter: nothing kept
    (export / "model.safetensors").write_bytes(b"other weights")  # rebuilt on another thread count
    with pytest.raises(StageFailed, match="rebuilt with fingerprint .*report-b48's kept rows were served by"):
        kept_fingerprint_check(sd, "eagle3", export, sd / "fingerprints" / "again.json")
    assert not (sd / "fingerprints" / "again.json").exists()


def test_the_paper_sittings_script_runs_the_documented_flags_and_drafters(regimes):
    script = (regimes.REPO_ROOT / "benchmarks" / "study" / "regime_paper.sh").read_text()
    doc = (regimes.REPO_ROOT / "docs" / "results" / "regimes.md").read_text()
    flags = next(line for line in script.splitlines() if line.startswith('G="'))[3:-1].replace("$WORK", "work/regime-gsm8k")
    assert f'G="{flags}"' in doc  # the committed study's flags
    folders = next(line for line in script.splitlines() if line.startswith('FOLDERS="'))[9:-1].split()
    assert folders == list(regimes.REPORT_FOLDERS)  # the script's report folders are the study's
    drafters = next(line for line in script.splitlines() if line.startswith('ALL="'))[5:-1].split()
    assert drafters == ["eagle3", "pr-paper", "pr-paper-warm", "eagle3-long"] and set(drafters) <= set(regimes.DRAFTERS)
    assert "git status --porcelain" in script and "sittings.jsonl" in script and "benchmarks/study/regime_paper.sh 1 train" in doc


@pytest.mark.parametrize("env, bad", [({"REPORT_TEMPS": "0 0.5"}, "REPORT_TEMPS: '0.5'"), ({"DRAFTERS": "pr"}, "DRAFTERS: 'pr'"),
                                      ({"THREADS": "two"}, "THREADS must be a positive integer"),
                                      ({"REPORT_DIRS": "report-b48 report-b96"}, "REPORT_DIRS: 'report-b96'")])
def test_the_paper_sittings_script_refuses_a_bad_setting_in_one_line_before_any_work(regimes, tmp_path, env, bad):
    import os
    import subprocess

    script = regimes.REPO_ROOT / "benchmarks" / "study" / "regime_paper.sh"
    work = tmp_path / "work"
    done = subprocess.run(["bash", str(script), "0", "report"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORK": str(work), **env})
    assert done.returncode == 2 and bad in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not work.exists()  # nothing written, nothing restored


def test_the_held_out_measures_record_the_curve_and_what_the_depths_compute(regimes, tmp_path):
    from study.regime_measures import FLAT_GAIN, measures, write_measures

    run, sd = tmp_path / "seed0" / "runs" / "pr-paper", tmp_path / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 9.0}, {"step": 250, "eval/avg_loss": 9.7, "eval/simulated_acc_len": 0.60},
        {"step": 500, "eval/avg_loss": 8.6, "eval/simulated_acc_len": 0.74},
        {"step": 750, "eval/avg_loss": 8.5, "eval/simulated_acc_len": 0.745}, {"step": 800, "loss": 8.4})))
    (sd / "diagnose").mkdir()
    (sd / "diagnose" / "pr-paper.json").write_text(json.dumps({"pr": {
        "pr/feature_change_depth_1": 0.31, "pr/feature_change_depth_2": 0.4, "pr/argmax_agree_depth_1": 0.9,
        "pr/argmax_agree_depth_2": 0.85, "pr/recovered_share": 0.07, "pr/acc_depth_0": 0.46, "pr/acc_depth_1": 0.42,
        "pr/acc_depth_2": 0.38, "pr/acc_depth_0_conf_lt50": 0.29, "pr/halt_share_depth_0": 0.997}}))
    (sd / "headroom").mkdir()
    (sd / "headroom" / "pr-paper.json").write_text(json.dumps({"pooled": {"table7": {"recovered": [[0, 0, 0, 0.063]]}}}))
    write_measures(run, sd / "diagnose" / "pr-paper.json", sd / "headroom" / "pr-paper.json", sd / "measures" / "pr-paper.json")
    m = json.loads((sd / "measures" / "pr-paper.json").read_text())
    assert m["curve"] == [[250, 9.7, 0.60], [500, 8.6, 0.74], [750, 8.5, 0.745]]
    assert (m["steps"], m["curve_steps"]) == (800, 750)  # the step that served, and the curve's last point (issue 63)
    assert m["last_gain"] == pytest.approx(0.745 / 0.74 - 1) and m["last_gain"] < FLAT_GAIN and m["flattened"]
    assert m["feature_change"] == {"1": 0.31, "2": 0.4} and m["argmax_agree"] == {"1": 0.9, "2": 0.85}
    assert m["recovered_share"] == 0.07 and m["recovered_low_cd"] == 0.063
    assert m["acc_depth"] == {"0": 0.46, "1": 0.42, "2": 0.38} and m["halt_at_0"] == 0.997  # per depth, not per band
    # an EAGLE-3 run: its curve only; a curve still rising has not flattened
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "metrics.jsonl").write_text('{"step": 250, "eval/avg_loss": 9, "eval/simulated_acc_len": 0.6}\n'
                                                  '{"step": 500, "eval/avg_loss": 8, "eval/simulated_acc_len": 0.7}\n')
    e = measures(tmp_path / "e", tmp_path / "none.json", tmp_path / "none.json")
    assert e["flattened"] is False and e["feature_change"] == {} and e["recovered_share"] is None
    assert measures(tmp_path / "nothing", tmp_path / "none.json", tmp_path / "none.json")["flattened"] is None
    (tmp_path / "data_settings.json").write_text("{}")
    row = regimes.gsm8k_row(tmp_path)
    assert row["measures"] == {"seed0": {"pr-paper": m}}
    text = regimes.render({"regimes": [row]})
    assert "### Held-out measures before serving" in text
    assert "| seed0 | pr-paper | 800 (curve to 750) | +0.7% | yes | 46.0% / 42.0% / 38.0% | 99.7% | 0.310 / 0.400 | 90.0% / 85.0% | 7.0% | 6.3% |" in text
    # a measures file written before the depths' accuracy and the gate were kept: read from its diagnose beside it
    older = {k: v for k, v in m.items() if k not in ("acc_depth", "halt_at_0")}
    (sd / "measures" / "pr-paper.json").write_text(json.dumps(older))
    assert regimes.gsm8k_row(tmp_path)["measures"] == {"seed0": {"pr-paper": m}}
    # one written when `steps` was the curve's last point: the served step is read from the run (or its kept curve)
    (sd / "measures" / "pr-paper.json").write_text(json.dumps({k: v for k, v in m.items() if k != "curve_steps"} | {"steps": 750}))
    assert regimes.gsm8k_row(tmp_path)["measures"]["seed0"]["pr-paper"]["steps"] == 800


def test_a_cell_shows_how_many_verified_nodes_per_round_reconsideration_proposed_or_repriced(regimes, tmp_path):
    sd = tmp_path / "seed0"
    _served(sd / "screen-b48", [(d, 48, 0.0, f"p{i}", 30, 10) for i in range(2) for d in ("eagle3", "pr-paper", "pr-paper/one-pass")])
    rows = [json.loads(line) for line in (sd / "screen-b48" / "results.jsonl").read_text().splitlines()]
    for r in rows:  # pr-paper: 1 proposed and 4 repriced nodes over its two problems' 20 rounds; m = 0 none
        r.update(recon_kept=1 if r["draft"] == "pr-paper" and r["prompt"] == "p0" else 0,
                 repriced_kept=2 if r["draft"] == "pr-paper" else 0)
    (sd / "screen-b48" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell,) = regimes.gsm8k_row(tmp_path)["screening"][0]["cells"]
    assert cell["recon_kept"] == {"pr-paper": (0.05, 0.2)}  # PR drafters only, not their one-pass trees or EAGLE-3
    text = regimes.render({"regimes": [regimes.gsm8k_row(tmp_path)]})
    assert "| pr-paper | 2 | 3.000 | eagle3 | +0.0% [+0.0, +0.0] | +0.0% [+0.0, +0.0] | +0.0% [+0.0, +0.0] | 0.050 / 0.200 |" in text
    assert "| eagle3 | 2 | 3.000 | - | - | - | - | - |" in text


def test_each_pr_drafter_is_read_up_to_its_own_rounds_and_judged_against_its_matched_baseline(regimes, tmp_path):
    def serve(seed, paper_done, gain):
        sd = tmp_path / f"seed{seed}"
        kept = [(d, 48, t, f"r{i}", a, 10) for i in range(4) for t in (0.0, 1.0)
                for d, a in (("eagle3", 30), ("eagle3-long", 31), ("pr-warm", 31), ("pr-warm/one-pass", 31))]
        paper = [(d, 48, t, f"r{i}", a, 10) for i in range(paper_done + 1) for t in (0.0, 1.0)
                 for d, a in (("pr-paper", 30 + gain), ("pr-paper/one-pass", 30), ("pr-paper-warm", 31 + gain),
                              ("pr-paper-warm/one-pass", 31))]
        _served(sd / "report-b48", kept + paper, finished={f"r{i}" for i in range(4)})
        summary = json.loads((sd / "report-b48" / "summary.json").read_text())
        for e in summary["results"]:  # the paper drafters' last finished round: their first `paper_done` problems
            if e["draft"].startswith("pr-paper"):
                e["per_prompt_tau"] = {p: v for p, v in e["per_prompt_tau"].items() if int(p[1:]) < paper_done}
                e["prompts"] = len(e["per_prompt_tau"])
        (sd / "report-b48" / "summary.json").write_text(json.dumps(summary))
        _served(sd / "report-b24", [(d, 24, 0.0, f"r{i}", a, 10) for i in range(4)
                                    for d, a in (("eagle3", 25), ("eagle3-long", 26), ("pr-warm", 26), ("pr-warm/one-pass", 26),
                                                 ("pr-paper", 25 + gain), ("pr-paper/one-pass", 25),
                                                 ("pr-paper-warm", 26 + gain), ("pr-paper-warm/one-pass", 26))])

    serve(0, 2, 1)
    serve(1, 4, 1)
    row = regimes.gsm8k_row(tmp_path, report_limit=4)
    b48 = row["seeds"][0]["cells"][0]
    # the kept drafters keep their 4 problems while the paper drafters have finished 2 (and a third is running)
    assert b48["prompts"]["eagle3"] == b48["prompts"]["pr-warm"] == 4 and b48["prompts"]["pr-paper"] == 2
    assert b48["pr-paper"]["gain_rel"] == pytest.approx(31 / 30 - 1)  # over eagle3
    assert b48["pr-paper-warm"]["gain_rel"] == pytest.approx(32 / 31 - 1)  # over eagle3-long
    assert b48["pr-paper-warm@eagle3"]["gain_rel"] == pytest.approx(32 / 30 - 1)
    assert b48["pr-paper/mechanism"]["gain_rel"] == pytest.approx(31 / 30 - 1) and b48["pr-paper/one-pass"]["gain_rel"] == 0
    v = row["verdict"]
    assert v["pr-warm"]["decided"] and not v["pr-warm"]["wins"]  # +0% over eagle3-long
    assert not v["pr-paper"]["seeds"][0]["counts"] and not v["pr-paper"]["decided"]  # seed 0 holds 2 of 4 problems
    serve(0, 4, 1)
    v = regimes.gsm8k_row(tmp_path, report_limit=4)["verdict"]
    assert v["pr-paper"]["decided"] and v["pr-paper"]["wins"] and v["pr-paper-warm"]["wins"]  # +3.3%/+4%, +3.2%/+3.8%
    row = regimes.gsm8k_row(tmp_path, report_limit=4)
    text = regimes.render({"regimes": [row]})
    assert "- **pr-paper**: WINS" in text and "- **pr-paper-warm**: WINS" in text and "- **pr-warm**: does not win" in text
    assert "| pr-paper | 4 | 3.100 | eagle3 | +3.3%" in text and "| pr-paper-warm | 4 | 3.200 | eagle3-long | +3.2%" in text
    assert row["conditions"]["mechanism_gain"]["measured"]["seed1 pr-paper"]["value"] == pytest.approx(31 / 30 - 1)


def test_screening_serves_the_screen_split_and_the_report_the_report_split_with_the_bw9_control(regimes, tmp_path):
    r = _regime(regimes, tmp_path, "--screen-limit", "30", "--report-limit", "120")
    screen = r.build.eval_argv(tmp_path / "s", **r.serve_settings(0, [r.splits / "screen.jsonl"], 30, [48], [0]))
    assert _value(screen, "--prompts").endswith("splits/screen.jsonl") and _value(screen, "--limit") == "30"
    assert "--also-one-pass" in screen and "--skip" not in screen
    assert [s.name for s in r.report_stages(0)] == ["seed0 report-b48", "seed0 report-b24", "seed0 report-b48-2layer",
                                                    "seed0 report-bw9-b48"]
    serves = {name.split()[1]: r.build.eval_argv(out, **settings) for name, out, settings in r.report_serves(0)}

    def drafters(argv):
        return [argv[i + 1].split("=")[0] for i, a in enumerate(argv) if a == "--draft"]

    def repeated(argv, flag):  # a repeatable flag's values
        return [argv[i + 1] for i, a in enumerate(argv) if a == flag]

    def values(argv, flag):  # a many-valued flag's values
        i = argv.index(flag) + 1
        j = next((j for j in range(i, len(argv)) if argv[j].startswith("--")), len(argv))
        return argv[i:j]

    every = ["eagle3", "pr", "pr-warm", "pr-paper", "pr-paper-warm", "eagle3-long"]  # PR, their baselines, EAGLE-3
    assert drafters(serves["report-b48"]) == every
    assert drafters(serves["report-b24"]) == every  # eagle3: pr's and pr-paper's baseline
    assert drafters(serves["report-b48-2layer"]) == ["eagle3-2layer"] and drafters(serves["report-bw9-b48"]) == ["eagle3"]
    cells = {n: (values(a, "--budget"), values(a, "--temperature"), _value(a, "--bw")) for n, a in serves.items()}
    assert cells == {"report-b48": (["48"], ["0", "1"], "6"), "report-b24": (["24"], ["0"], "6"),
                     "report-b48-2layer": (["48"], ["0"], "6"), "report-bw9-b48": (["48"], ["0", "1"], "9")}
    for name, argv in serves.items():
        assert _value(argv, "--prompts").endswith("splits/report.jsonl") and _value(argv, "--limit") == "120"
        assert repeated(argv, "--baseline-from") == ([] if name == "report-b48" else [str(tmp_path / "seed0" / "report-b48")])
    # pr-warm alone: its baseline eagle3-long in every cell, EAGLE-3 at B 48 only; no control that was not asked for
    only = _regime(regimes, tmp_path, "--drafters", "eagle3", "pr-warm", "eagle3-long")
    serves = {name.split()[1]: only.build.eval_argv(out, **settings) for name, out, settings in only.report_serves(0)}
    assert drafters(serves["report-b48"]) == ["eagle3", "pr-warm", "eagle3-long"]
    assert drafters(serves["report-b24"]) == ["pr-warm", "eagle3-long"] and "report-b48-2layer" not in serves
    # a second runner on the same seed, the other folders: it lends report-b48's target decodes once that has served
    side = _regime(regimes, tmp_path, "--report-dirs", "report-bw9-b48", "report-b48-2layer")
    assert [name for name, *_ in side.report_serves(0)] == ["seed0 report-b48-2layer", "seed0 report-bw9-b48"]
    assert all(repeated(side.build.eval_argv(out, **st), "--baseline-from") == [] for _, out, st in side.report_serves(0))
    (tmp_path / "seed0" / "report-b48").mkdir(parents=True)
    (tmp_path / "seed0" / "report-b48" / "eval_config.json").write_text("{}")
    assert all(repeated(side.build.eval_argv(out, **st), "--baseline-from") == [str(tmp_path / "seed0" / "report-b48")]
               for _, out, st in side.report_serves(0))
    with pytest.raises(SystemExit):
        _regime(regimes, tmp_path, "--report-dirs", "report-b96")
    # the T = 0 cells first (they alone decide the verdict): every folder at T = 0 only; a later sitting serves T = 1
    t0 = _regime(regimes, tmp_path, "--drafters", "eagle3", "pr-paper", "--report-temperatures", "0")
    t0_cells = {name.split()[1]: (values(a, "--temperature"), drafters(a))
                for name, out, st in t0.report_serves(0) for a in [t0.build.eval_argv(out, **st)]}
    assert t0_cells == {"report-b48": (["0"], ["eagle3", "pr-paper"]), "report-b24": (["0"], ["eagle3", "pr-paper"]),
                        "report-bw9-b48": (["0"], ["eagle3"])}
    t1 = _regime(regimes, tmp_path, "--drafters", "pr-paper", "--report-temperatures", "1")
    assert [(name, st["temperatures"]) for name, _, st in t1.report_serves(0)] == [("seed0 report-b48", [1])]
    with pytest.raises(SystemExit):  # a temperature no report folder serves
        _regime(regimes, tmp_path, "--report-temperatures", "0.5")


def _served(path, rows, finished=None):
    """An eval --out-dir holding results.jsonl rows: (draft, budget, temperature, prompt, accepted, rounds), and the
    `summary.json` of a finished run over the prompts `finished` (default: every row's; [] writes none)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps({"draft": d, "budget": b, "temperature": t, "set": "screen",
                                                            "prompt": p, "accepted": a, "rounds": n}) + "\n"
                                                for d, b, t, p, a, n in rows))
    cells = {}
    for d, b, t, p, a, n in rows:
        if finished is None or p in finished:
            cells.setdefault((d, b, t), {})[p] = a / n
    if cells:  # what `eval --json` writes: one entry per cell, the prompts it served and each one's tau
        (path / "summary.json").write_text(json.dumps({"results": [
            {"draft": d, "budget": b, "temperature": t, "set": "screen", "prompts": len(taus), "per_prompt_tau": taus}
            for (d, b, t), taus in cells.items()]}))


def test_the_report_shows_screening_apart_from_the_report_split_and_gives_no_verdict_without_it(regimes, tmp_path):
    sd = tmp_path / "seed0"
    # screening: EAGLE-3 tau 3.0, the warm PR drafter 3.3 over its m = 0 tree's 3.0, eagle3-long 3.0; the
    # two-layer control in a folder of its own (screen-b48-2layer) at 3.15
    _served(sd / "screen-b48", [(d, 48, 0.0, f"p{i}", a, 10) for i in range(4)
                                for d, a in (("eagle3", 30), ("eagle3-long", 30), ("pr-warm", 33), ("pr-warm/one-pass", 30))])
    _served(sd / "screen-b48-2layer", [("eagle3-2layer", 48, 0.0, f"p{i}", 31 + i % 2, 10) for i in range(4)])
    (sd / "headroom").mkdir()
    (sd / "headroom" / "eagle3.json").write_text(json.dumps({"pooled": {"acceptance": 0.465, "table7": None,
                                                                                "second_guess": {"outside_topk": 0.517}}}))
    table7 = {"recovered": [[0.1, 0.1, 0.1, 0.074], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0.07]]}
    (sd / "headroom" / "pr-warm.json").write_text(json.dumps({"pooled": {"acceptance": 0.457, "table7": table7,
                                                                                 "second_guess": {"recon_only": 0.0003}}}))
    row = regimes.gsm8k_row(tmp_path)
    assert row["seeds"] == {} and all(v is None for v in row["verdict"].values())  # no report serve: no verdict
    (cell,) = row["screening"][0]["cells"]
    assert cell["tau"] == {"eagle3": 3.0, "eagle3-2layer": 3.15, "eagle3-long": 3.0, "pr-warm": 3.3, "pr-warm/one-pass": 3.0}
    assert cell["pr-warm"]["gain_rel"] == pytest.approx(0.1) and cell["pr-warm/mechanism"]["gain_rel"] == pytest.approx(0.1)
    assert cell["pr-warm/one-pass"]["gain_rel"] == pytest.approx(0.0) and cell["eagle3-2layer"]["gain_rel"] == pytest.approx(0.05)
    c = row["conditions"]
    assert c["eagle3_tau"]["measured"] == {"seed0": {"value": 3.0, "from": "screening"}}
    assert c["two_layer_gain"]["measured"]["seed0"]["value"] == pytest.approx(0.05)
    assert c["mechanism_gain"]["measured"]["seed0 pr-warm"]["value"] == pytest.approx(0.1)  # each PR drafter's own
    assert c["one_pass_acceptance"]["measured"]["seed0"]["value"] == 0.465 and c["one_pass_acceptance"]["paper"] == 0.698
    assert c["recovered_low_cd"]["measured"]["seed0 pr-warm"]["value"] == 0.074
    assert c["misses_outside_top6"]["measured"]["seed0"]["value"] == 0.517 and c["recon_only"]["paper"] is None
    assert c["recon_only"]["measured"]["seed0 pr-warm"]["value"] == 0.0003
    text = regimes.render({"regimes": [row]})
    assert "### seed 0: screening split (chooses variants; not a verdict)" in text and "no verdict for this regime yet" in text
    assert "| pr-warm | 4 | 3.300 | eagle3-long | +10.0%" in text
    assert "| recon_only | seed0 pr-warm: 0.03% (headroom of pr-warm (held-out features)) | - (not reported;" in text

    # a report serve (B 48 at T 0 and T 1, B 24 at T 0) makes the seed's verdict cells; conditions then come from it
    _served(sd / "report-b48", [(d, 48, t, f"r{i}", a, 10) for i in range(3) for t in (0.0, 1.0)
                                for d, a in (("eagle3", 30), ("eagle3-long", 30), ("pr-warm", 31), ("pr-warm/one-pass", 30))])
    _served(sd / "report-b24", [(d, 24, 0.0, f"r{i}", a, 10) for i in range(3)
                                for d, a in (("eagle3", 25), ("eagle3-long", 25), ("pr-warm", 26), ("pr-warm/one-pass", 25))])
    row = regimes.gsm8k_row(tmp_path)
    assert [(c["budget"], c["temperature"]) for c in row["seeds"][0]["cells"]] == [(48, 0.0), (24, 0.0), (48, 1.0)]
    v = row["verdict"]["pr-warm"]
    assert v["seeds"][0]["mean_t0_gain"] == pytest.approx((31 / 30 + 26 / 25) / 2 - 1) and not v["wins"]  # one seed only
    text = regimes.render({"regimes": [row]})
    assert not v["decided"] and "- **pr-warm**: undecided (the verdict needs two seeds) (seed 0: mean T0 gain +3.7%)" in text
    # where the gain comes from, per T = 0 cell: all of it from reconsideration here (m = 0 equals the baseline)
    assert ("- **pr-warm**, its T0 gain split: seed 0: B 48: one-pass +0.0% [+0.0, +0.0], mechanism +3.3% [+3.3, +3.3], "
            "verified nodes a round proposed / repriced by reconsideration 0.000 / 0.00; B 24: one-pass +0.0% [+0.0, +0.0], "
            "mechanism +4.0% [+4.0, +4.0]") in text
    assert row["conditions"]["eagle3_tau"]["measured"]["seed0"]["from"] == "report"


def _exports_served(sd, folder, names):
    """An export per drafter under `sd/export/`, recorded in `folder`'s eval_config.json as the one that served."""
    from pr_specforge.export import export_fingerprints

    for name in names:
        (sd / "export" / name).mkdir(parents=True, exist_ok=True)
        (sd / "export" / name / "config.json").write_text("{}")
        (sd / "export" / name / "model.safetensors").write_bytes(name.encode())
    (folder / "eval_config.json").write_text(json.dumps(
        {"drafters": {n: export_fingerprints(str(sd / "export" / n))[0] for n in names}}))


def test_report_rounds_bring_every_folder_to_the_same_problems_before_any_goes_on(regimes, tmp_path):
    assert regimes.report_rounds(100, None) == [100] and regimes.report_rounds(100, 40) == [40, 80, 100]
    assert regimes.report_rounds(100, 50) == [50, 100] and regimes.report_rounds(30, 40) == [30]
    with pytest.raises(ValueError, match="--report-step must be at least 1"):
        regimes.report_rounds(100, 0)
    r = _regime(regimes, tmp_path, "--report-limit", "100", "--report-step", "40",
                "--drafters", "eagle3", "pr-warm", "eagle3-long", "eagle3-2layer")
    stages = r.report_stages(0)
    folders = ["report-b48", "report-b24", "report-b48-2layer", "report-bw9-b48"]
    assert [s.name for s in stages] == ([f"seed0 {f} to 40" for f in folders] + [f"seed0 {f} to 80" for f in folders]
                                        + [f"seed0 {f}" for f in folders])
    limits = [_value(r.build.eval_argv(out, **settings), "--limit") for lim in (40, 80) for _, out, settings in r.report_serves(0, lim)]
    assert limits == ["40"] * 4 + ["80"] * 4
    # a round is done once its folder's last finished run served that many problems in every cell
    b48 = tmp_path / "seed0" / "report-b48"
    assert not any(s.done() for s in stages)
    served = ("eagle3", "pr-warm", "pr-warm/one-pass", "eagle3-long")  # report-b48's cells: its drafters at T 0 and 1
    _served(b48, [(d, 48, t, f"r{i}", 30, 10) for i in range(45) for t in (0.0, 1.0) for d in served[:-1]],
            finished={f"r{i}" for i in range(40)})
    assert regimes.summary_prompts(b48) == 40
    assert not any(s.done() for s in stages)  # eagle3-long's cells are not served yet
    _served(b48, [(d, 48, t, f"r{i}", 30, 10) for i in range(45) for t in (0.0, 1.0) for d in served],
            finished={f"r{i}" for i in range(40)})
    _exports_served(tmp_path / "seed0", b48, ("eagle3", "pr-warm", "eagle3-long", "pr-paper"))
    assert [s.done() for s in stages if "report-b48 " in s.name + " "] == [True, False, False]
    # issue 63: a drafter exported again with other weights makes its served rounds not done (eval then refuses them)
    weights = tmp_path / "seed0" / "export" / "pr-warm" / "model.safetensors"
    weights.write_bytes(b"retrained")
    assert not stages[0].done()
    weights.write_bytes(b"pr-warm")
    assert stages[0].done()
    # a drafter added to a folder served before (pr-paper beside the kept rows) is served, not skipped as done
    more = _regime(regimes, tmp_path, "--report-limit", "100", "--report-step", "40", "--drafters", "eagle3", "pr-paper")
    (first, *_), cells = more.report_stages(0), regimes.served_cells(more.report_serves(0, 40)[0][2])
    assert first.name == "seed0 report-b48 to 40" and not first.done()
    assert cells == {(d, 48, t) for d in ("eagle3", "pr-paper", "pr-paper/one-pass") for t in (0.0, 1.0)}
    _served(b48, [(d, 48, t, f"r{i}", 30, 10) for i in range(40) for t in (0.0, 1.0)
                  for d in (*served, "pr-paper", "pr-paper/one-pass")])
    assert first.done() and regimes.summary_prompts(b48, cells) == 40


def test_the_report_reads_finished_rounds_only_and_counts_a_seed_once_it_has_the_report_limit(regimes, tmp_path):
    def serve(seed, n, finished, gain):
        sd = tmp_path / f"seed{seed}"
        _served(sd / "report-b48", [(d, 48, t, f"r{i}", a, 10) for i in range(n) for t in (0.0, 1.0)
                                    for d, a in (("eagle3-long", 30), ("pr-warm", 30 + gain), ("pr-warm/one-pass", 30))],
                finished={f"r{i}" for i in range(finished)})
        _served(sd / "report-b24", [(d, 24, 0.0, f"r{i}", a, 10) for i in range(finished)
                                    for d, a in (("eagle3-long", 25), ("pr-warm", 25 + gain), ("pr-warm/one-pass", 25))])

    serve(0, 5, 4, 1)  # the fifth problem's rows belong to a round still running
    serve(1, 4, 4, 1)
    row = regimes.gsm8k_row(tmp_path, report_limit=4)
    assert {s: v["problems"] for s, v in row["seeds"].items()} == {0: 4, 1: 4}
    assert all(p == 4 for c in row["seeds"][0]["cells"] for p in c["prompts"].values())
    v = row["verdict"]["pr-warm"]
    assert v["decided"] and v["wins"]  # +3.3% and +4% at T 0 in both seeds
    # a seed short of the report limit is shown, not counted
    row = regimes.gsm8k_row(tmp_path, report_limit=10)
    v = row["verdict"]["pr-warm"]
    assert not v["decided"] and not v["wins"] and not v["seeds"][0]["counts"]
    text = regimes.render({"regimes": [row]})
    assert "undecided (the verdict needs two seeds with 10 report problems each)" in text
    assert "on 4 of 10 problems, not counted yet" in text and "### seed 0: report split (4 problems in every cell)" in text
    # a folder with rows and no finished round is not read: its rows belong to a round still running
    _served(tmp_path / "seed1" / "report-b48-2layer", [("eagle3-2layer", 48, 0.0, "r0", 31, 10)], finished=[])
    row = regimes.gsm8k_row(tmp_path, report_limit=4)
    assert row["seeds"][1]["problems_by_folder"] == {"report-b48": 4, "report-b24": 4}
    assert "eagle3-2layer" not in row["seeds"][1]["cells"][0]["tau"] and row["verdict"]["pr-warm"]["wins"]
    # a folder behind the others shows its own problems and holds back neither the others' cells nor the verdict
    _served(tmp_path / "seed1" / "report-b48-2layer", [("eagle3-2layer", 48, 0.0, f"r{i}", 31, 10) for i in range(3)],
            finished={"r0", "r1"})
    row = regimes.gsm8k_row(tmp_path, report_limit=4)
    s1 = row["seeds"][1]
    assert s1["problems_by_folder"] == {"report-b48": 4, "report-b24": 4, "report-b48-2layer": 2} and s1["problems"] == 2
    b48 = s1["cells"][0]
    assert b48["prompts"] == {"eagle3-2layer": 2, "eagle3-long": 4, "pr-warm": 4, "pr-warm/one-pass": 4}
    assert row["verdict"]["pr-warm"]["seeds"][1] == {**row["verdict"]["pr-warm"]["seeds"][1], "problems": 4, "counts": True}
    assert row["verdict"]["pr-warm"]["decided"] and row["verdict"]["pr-warm"]["wins"]
    assert ("### seed 1: report split (problems per folder: report-b48 4, report-b24 4, report-b48-2layer 2; "
            "at least 2 in every cell)") in regimes.render({"regimes": [row]})


def test_save_keeps_rows_and_records_only_and_restore_puts_back_the_eval_folders(regimes, tmp_path):
    work, kept, fresh = tmp_path / "work", tmp_path / "kept", tmp_path / "fresh"
    files = {"data_settings.json": "{}", "features/manifest.json": "{}", "features/hidden_0.pt": "x",
             "target/model.safetensors": "x", "seed0/settings.json": "{}", "seed0/headroom/eagle3.json": "{}",
             "seed0/measures/pr-paper.json": "{}",
             "seed0/runs/eagle3/metrics.jsonl": '{"step": 1, "loss": 9.0}\n{"step": 250, "loss": 8.0, "eval/avg_loss": 7.5}\n',
             "seed0/runs/eagle3-long/metrics.jsonl": '{"step": 249, "eval/avg_loss": 7.0}\n{"step": 250, "loss": 7.1}\n',
             "seed0/runs/eagle3/eagle3-step500/model.safetensors": "x",
             "seed0/export/eagle3/model.safetensors": "x", "seed0/export/eagle3/config.json": "{}",
             "seed0/report-b48/results.jsonl": "row", "seed0/report-b48/eval_config.json": "{}",
             "seed0/screen-b48/summary.json": "{}", "regenerated.jsonl": "{}\n", "regenerated.done": "ok\n",
             "screen/regenerated.jsonl": "{}\n", "stage_times.json": "{}", "commands.log": "pr-specforge data x\n",
             "sittings.jsonl": '{"commit": "abc1234"}\n'}
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    saved = {str(p) for p in regimes.save_rows(work, kept)}
    assert saved == {"data_settings.json", "features/manifest.json", "seed0/settings.json", "seed0/headroom/eagle3.json",
                     "seed0/measures/pr-paper.json",
                     "seed0/runs/eagle3/heldout.jsonl", "seed0/runs/eagle3-long/heldout.jsonl", "seed0/report-b48/results.jsonl",
                     "seed0/report-b48/eval_config.json", "seed0/screen-b48/summary.json", "regenerated.jsonl",
                     "regenerated.done", "screen/regenerated.jsonl", "stage_times.json", "commands.log", "sittings.jsonl"}
    assert not list(kept.rglob("*.safetensors")) and not list(kept.rglob("*.pt"))
    # the loss curve of SpecForge's eval loop, not every step's row
    assert [json.loads(line) for line in (kept / "seed0/runs/eagle3/heldout.jsonl").read_text().splitlines()] == [
        {"step": 250, "eval/avg_loss": 7.5}]
    assert regimes.training_logs(kept)[1] == regimes.training_logs(work)[1] == {"seed0": {"eagle3": 250, "eagle3-long": 250}}
    assert json.loads((kept / "seed0/runs/eagle3-long/heldout.jsonl").read_text().splitlines()[-1]) == {"step": 250}
    assert regimes.training_logs(kept)[0] == regimes.training_logs(work)[0] == {
        "seed0": {"eagle3": [[250, 7.5, None]], "eagle3-long": [[249, 7.0, None]]}}
    # the report plots the curves that have an acceptance length, and links the plot only when it drew one
    out = tmp_path / "report" / "regimes"
    out.parent.mkdir()
    regimes.write_regimes_report(kept, out)
    assert not (tmp_path / "report" / "regimes-heldout.png").exists() and "held-out curves]" not in out.with_suffix(".md").read_text()
    (kept / "seed0/runs/eagle3/heldout.jsonl").write_text('{"step": 250, "eval/avg_loss": 7.5, "eval/simulated_acc_len": 0.6}\n')
    regimes.write_regimes_report(kept, out)
    assert (tmp_path / "report" / "regimes-heldout.png").read_bytes()[:4] == b"\x89PNG"
    assert "![held-out curves](regimes-heldout.png)" in out.with_suffix(".md").read_text()
    (fresh / "seed0" / "report-b48").mkdir(parents=True)
    (fresh / "seed0" / "report-b48" / "results.jsonl").write_text("newer")
    restored = {str(p) for p in regimes.restore_rows(kept, fresh)}
    # the regenerated text (a rerun skips regenerating what has its `.done`, resumes the rest), the eval folders, and
    # the stage times and command log the rebuilt workdir goes on adding to; the features and drafters rerun
    assert restored == {"seed0/report-b48/eval_config.json", "seed0/screen-b48/summary.json", "regenerated.jsonl",
                        "regenerated.done", "screen/regenerated.jsonl", "stage_times.json", "commands.log", "sittings.jsonl",
                        "data_settings.json", "seed0/settings.json"}  # the settings the next run compares its flags with
    assert (fresh / "seed0" / "report-b48" / "results.jsonl").read_text() == "newer"  # never overwritten
    with pytest.raises(FileNotFoundError, match="not a saved regime folder"):
        regimes.restore_rows(tmp_path / "nothing", fresh)
    assert regimes.main(["save", "--gsm8k", str(tmp_path / "nothing"), "--to", str(kept)]) == 1


def _sharegpt(regimes, tmp_path, *extra):
    args = regimes._parser().parse_args(["sharegpt", "--workdir", str(tmp_path), "--dry-run", *extra])
    return regimes.ShareGPTRegime(args)


def test_the_sharegpt_regime_keeps_the_prompts_a_stopped_regeneration_had_done(regimes, tmp_path):
    """The pilots' data: a regeneration (shortest prompt first, batches of 32) stopped after 672 conversations."""
    from pr_specforge.data.regenerate import _batches, usable_rows

    lengths = [50, 7, 3000, 20, 7, 90, 1, 40]  # 3000: over --max-prompt-chars; two prompts of 7 (ties keep input order)
    rows = [{"id": f"c{i}", "conversations": [{"role": "user", "content": "x" * n}]} for i, n in enumerate(lengths)]
    rows.append({"id": "c1", "conversations": [{"role": "user", "content": "dup"}]})  # a duplicate id is not usable
    pool, kept = tmp_path / "pool.jsonl", tmp_path / "conversations.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    regimes.keep_shortest(pool, kept, 4, 2000)
    assert [json.loads(line)["id"] for line in kept.read_text().splitlines()] == ["c1", "c3", "c4", "c6"]  # input order
    # the kept file's batches are the first batches the whole pool's regeneration runs
    full = [[r["id"] for r in b] for b in _batches(usable_rows(pool, 2000), 2)]
    assert [[r["id"] for r in b] for b in _batches(usable_rows(kept, 2000), 2)] == full[:2]
    with pytest.raises(ValueError, match=r"pool.jsonl: 7 usable conversations .* fewer than --keep 8"):
        regimes.keep_shortest(pool, kept, 8, 2000)


def test_the_sharegpt_regime_trains_by_steps_on_its_heldout_features_and_reports_the_final_prompts(regimes, tmp_path):
    r = _sharegpt(regimes, tmp_path, "--steps", "1000", "--warm-steps", "500")
    assert [s.name for s in r.data_stages()] == ["target", "conversations", "shortest", "regenerate", "features",
                                                 "heldout-conversations", "heldout-regenerate", "heldout-features"]
    recipes = {n: load_recipe(str(regimes.RECIPES / regimes.DRAFTERS[n][0]), r.train_overrides(0, n)) for n in r.args.drafters}
    assert {n: x.config.training.max_steps for n, x in recipes.items()} == {
        "eagle3": 1000, "eagle3-2layer": 1000, "pr-warm": 500, "eagle3-long": 500}
    assert {x.config.data.eval_hidden_states_path for x in recipes.values()} == {str(tmp_path / "heldout" / "features")}
    assert r.screen_stages(0) == []  # the variant was chosen on the pilots' prompts (40-49 of each set)
    serves = {name.split()[1]: r.build.eval_argv(out, **settings) for name, out, settings in r.report_serves(0)}
    assert set(serves) == {"report-b48", "report-b24", "report-b48-2layer", "report-bw9-b48"}
    for argv in serves.values():
        i = argv.index("--prompts")
        assert argv[i + 1:i + 4] == ["mtbench", "gsm8k", "humaneval"] and argv[i + 4] == "--limit"
        assert _value(argv, "--limit") == "10" and _value(argv, "--max-new-tokens") == "64"
    # --report-step: rounds of N prompts of each set, every folder through a round before the next
    stepped = [s.name for s in _sharegpt(regimes, tmp_path, "--report-step", "5").report_stages(0)]
    assert stepped == [f"seed0 {d} to 5" for d in serves] + [f"seed0 {d}" for d in serves]


def test_finished_prompts_of_a_serve_over_several_prompt_sets_are_each_sets_own(regimes, tmp_path):
    d = tmp_path / "report-b48"
    d.mkdir()
    cell = lambda draft, s, prompts: {"draft": draft, "budget": 48, "temperature": 0.0, "set": s, "prompts": len(prompts),
                                      "per_prompt_tau": {p: 2.0 for p in prompts}}
    (d / "summary.json").write_text(json.dumps({"results": [
        cell("eagle3", "mtbench", ["81", "82"]), cell("eagle3", "gsm8k", ["gsm8k-0", "gsm8k-1"]),
        cell("pr-warm", "mtbench", ["81"]), cell("pr-warm", "gsm8k", ["gsm8k-0", "gsm8k-1"])]}))
    assert regimes.finished_prompts([d]) == {"mtbench/81", "gsm8k/gsm8k-0", "gsm8k/gsm8k-1"}
    assert regimes.finished_prompts([tmp_path / "none"]) is None


def test_the_sharegpt_row_reads_its_workdir_and_keeps_part_ds_verdict_beside_it(regimes, tmp_path):
    sd = tmp_path / "seed0"
    _served(sd / "report-b48", [(d, 48, t, f"r{i}", a, 10) for i in range(3) for t in (0.0, 1.0)
                                for d, a in (("eagle3", 16), ("eagle3-long", 17), ("pr-warm", 17), ("pr-warm/one-pass", 17))])
    _served(sd / "report-b48-2layer", [("eagle3-2layer", 48, 0.0, f"r{i}", 17, 10) for i in range(3)])
    row = regimes.sharegpt_row(tmp_path)
    (cell,) = [c for c in row["seeds"][0]["cells"] if (c["budget"], c["temperature"]) == (48, 0.0)]
    assert cell["eagle3-2layer"]["gain_rel"] == pytest.approx(1 / 16) and cell["pr-warm"]["gain_rel"] == pytest.approx(0.0)
    assert row["conditions"]["two_layer_gain"]["measured"]["seed0"]["value"] == pytest.approx(1 / 16)
    assert row["part_d"]["verdict"]["pr-warm"]["decided"]
    text = regimes.render({"regimes": [row]})
    assert "- part D's **pr-warm**: does not win" in text and "| eagle3-2layer | 3 | 1.700 | eagle3 | +6.2%" in text
    assert "- **pr-warm**: undecided (the verdict needs two seeds)" in text
    # B 24 not served yet: the seed is shown, not counted
    assert not row["verdict"]["pr-warm"]["seeds"][0]["counts"]
    assert "(seed 0: mean T0 gain +0.0% in 1 T0 cell, not counted until every T0 cell is served)" in text
    _served(sd / "report-b24", [(d, 24, 0.0, f"r{i}", 15, 10) for i in range(3) for d in ("eagle3-long", "pr-warm", "pr-warm/one-pass")])
    row = regimes.sharegpt_row(tmp_path)
    assert row["verdict"]["pr-warm"]["seeds"][0]["counts"] and not row["verdict"]["pr-warm"]["decided"]
    # the regime's one verdict: part D's two seeds and the rebuilt seed
    rv = row["regime_verdict"]["pr-warm"]
    assert set(rv["seeds"]) == {"part D seed 0", "part D seed 1", "rebuilt seed 0"} and rv["decided"] and not rv["wins"]
    assert "- **pr-warm**: does not win (part D seed 0: mean T0 gain -0.4%" in regimes.render({"regimes": [row]})
    assert regimes.combined_verdict(None, {"seeds": {0: {"counts": False}}}) is None
    win = {"mean_t0_gain": 0.03, "cell_below_zero": False, "counts": True}
    assert regimes.combined_verdict({"seeds": {0: win}}, {"seeds": {0: win}})["wins"]
    assert not regimes.combined_verdict({"seeds": {0: win}}, {"seeds": {0: dict(win, cell_below_zero=True)}})["wins"]
    assert "not yet run" in regimes.render({"regimes": [regimes.sharegpt_row()]})


def test_a_regime_pr_wins_nowhere_names_the_missing_conditions_from_its_measured_rows(regimes):
    def cnd(paper, *values):
        return {"paper": paper, "paper_source": "-", "measured": {f"seed{i}": {"value": v, "from": "report"} for i, v in enumerate(values)}}

    lose = {"seeds": {}, "decided": True, "wins": False}
    row = {"regime": "r", "verdict": {"pr-warm": lose},
           "conditions": {"recovered_low_cd": cnd(0.288, 0.063, 0.066), "eagle3_tau": cnd(4.84, 2.75, 3.5),
                          "two_layer_gain": cnd(0.006, 0.005, 0.007), "bw9_gain": cnd(0.009, 0.0)}}
    reasons = {r["condition"]: r for r in regimes.with_reason(row)["reason"]}
    assert set(reasons) == {"recovered_low_cd", "eagle3_tau", "two_layer_gain"}
    assert reasons["recovered_low_cd"]["missing"] and not reasons["two_layer_gain"]["missing"]
    # the accepted path is tau - 1; one seed at or above half the paper's path keeps it present
    assert reasons["eagle3_tau"]["measured"] == pytest.approx([1.75, 2.5]) and not reasons["eagle3_tau"]["missing"]
    text = regimes.render({"regimes": [row]})
    assert "6.3% to 6.6% against the paper's 28.8% (0.22x to 0.23x): **missing**" in text
    assert "Missing here: the recoverable share." in text
    # undecided, or a win: no reason is given
    row.pop("reason")
    for v in ({"seeds": {}, "decided": False, "wins": False}, {"seeds": {}, "decided": True, "wins": True}):
        assert "reason" not in regimes.with_reason(dict(row, verdict={"pr-warm": v}))
    assert "Why PR does not win" not in regimes.render({"regimes": [dict(row, reason=None)]})


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "results")


def _committed_report_copy(tmp_path):
    """A copy of the committed regimes.{md,json} under tmp_path (what a bad `report` must leave alone)."""
    out = tmp_path / "results"
    out.mkdir()
    for suffix in (".md", ".json"):
        shutil.copy(os.path.join(RESULTS, "regimes" + suffix), out / ("regimes" + suffix))
    return out / "regimes"


def test_report_refuses_no_folder_a_folder_that_is_no_workdir_and_a_smaller_report(regimes, tmp_path, capsys):
    prefix = _committed_report_copy(tmp_path)
    before = {s: prefix.with_suffix(s).read_bytes() for s in (".md", ".json")}
    (tmp_path / "not-a-workdir").mkdir()
    (tmp_path / "not-a-workdir" / "results.jsonl").write_text("{}\n")
    # a kept GSM8K folder with seed 0 only: the committed report holds seeds 0 and 1 of it
    kept = tmp_path / "gsm8k"
    shutil.copytree(os.path.join(RESULTS, "regime-gsm8k"), kept, ignore=shutil.ignore_patterns("seed1"))
    cases = {"no folder": [], "not a workdir": ["--gsm8k", str(tmp_path / "not-a-workdir")],
             "no such folder": ["--gsm8k", str(tmp_path / "nothing")],
             "fewer seeds": ["--gsm8k", str(kept), "--sharegpt", os.path.join(RESULTS, "regime-sharegpt")],
             "no chat rows": ["--gsm8k", os.path.join(RESULTS, "regime-gsm8k")]}
    said = {}
    for case, argv in cases.items():
        assert regimes.main(["report", *argv, "--out", str(prefix)]) == 1, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("regimes: "), (case, err)
        said[case] = err[0]
        assert {s: prefix.with_suffix(s).read_bytes() for s in (".md", ".json")} == before, case
    assert "no regime folder given" in said["no folder"] and "nothing written" in said["no folder"]
    assert "not-a-workdir: not a regime workdir" in said["not a workdir"] and "nothing: not a regime" in said["no such folder"]
    assert "holds gsm8k-domain seed 1's report split, this report none" in said["fewer seeds"]
    assert "--replace-with-fewer" in said["fewer seeds"]
    assert "holds sharegpt-chat seed 0's report split" in said["no chat rows"]
    # told to in so many words, the smaller report is written
    assert regimes.main(["report", *cases["fewer seeds"], "--out", str(prefix), "--replace-with-fewer"]) == 0
    capsys.readouterr()
    assert list(json.loads(prefix.with_suffix(".json").read_text())["regimes"][1]["seeds"]) == ["0"]


def test_a_drafter_added_round_by_round_is_no_smaller_report_but_a_kept_drafter_losing_problems_is(regimes, tmp_path):
    from study.regime_render import report_shrinks

    def report(**prompts):  # one regime, seed 0, one cell (B 48, T 0): drafter -> problems
        return {"regimes": [{"regime": "gsm8k-domain", "seeds": {"0": {"problems": min(prompts.values()), "cells": [
            {"budget": 48, "temperature": 0.0, "prompts": prompts}]}}}]}

    old = tmp_path / "regimes.json"
    old.write_text(json.dumps(report(eagle3=100, **{"pr-warm": 100})))
    assert report_shrinks(old, report(eagle3=100, **{"pr-warm": 100, "pr-paper": 10})) == []  # pr-paper: new, 10 so far
    assert report_shrinks(old, report(eagle3=100, **{"pr-warm": 90})) == [
        "it holds gsm8k-domain seed 0 pr-warm at B 48, T 0 on 100 report problems, this report on 90"]
    assert report_shrinks(old, report(eagle3=100)) == [
        "it holds gsm8k-domain seed 0 pr-warm at B 48, T 0 on 100 report problems, this report on 0"]
    assert report_shrinks(tmp_path / "none.json", report(eagle3=1)) == []


def test_save_refuses_to_replace_kept_rows_with_fewer_unless_told(regimes, tmp_path, capsys):
    committed = os.path.join(RESULTS, "regime-gsm8k", "seed0", "report-b48", "results.jsonl")
    kept, work = tmp_path / "kept", tmp_path / "work"
    (kept / "seed0" / "report-b48").mkdir(parents=True)
    shutil.copy(committed, kept / "seed0" / "report-b48" / "results.jsonl")  # 800 rows or more (a drafter being added)
    rows = (kept / "seed0" / "report-b48" / "results.jsonl").read_text().splitlines(keepends=True)
    n = len(rows)
    assert n >= 800
    (work / "seed0" / "report-b48").mkdir(parents=True)
    (work / "data_settings.json").write_text("{}")
    (work / "seed0" / "report-b48" / "results.jsonl").write_text("".join(rows[:10]))
    (work / "seed0" / "settings.json").write_text("{}")
    argv = ["save", "--workdir", str(work), "--to", str(kept)]
    assert regimes.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"report-b48/results.jsonl: {n} rows kept" in err[0] and "has 10" in err[0], err
    assert len((kept / "seed0" / "report-b48" / "results.jsonl").read_text().splitlines()) == n
    assert not (kept / "data_settings.json").exists() and not (kept / "seed0" / "settings.json").exists()  # nothing written
    # so is the command log the provenance reads (the stage times are merged: see the test below)
    (work / "seed0" / "report-b48" / "results.jsonl").write_text("".join(rows))  # as many rows: not refused for these
    (kept / "commands.log").write_text("pr-specforge data a\npr-specforge train b\n")
    (work / "commands.log").write_text("pr-specforge data a\n")
    with pytest.raises(regimes.FewerRows, match=r"commands.log: 2 lines kept, .* has 1"):
        regimes.save_rows(work, kept)
    (work / "commands.log").write_text("pr-specforge data a\npr-specforge train b\npr-specforge eval c\n")
    # a training's held-out curve that would come out shorter is refused the same way
    (kept / "seed0" / "runs" / "eagle3").mkdir(parents=True)
    (kept / "seed0" / "runs" / "eagle3" / "heldout.jsonl").write_text('{"step": 250, "eval/avg_loss": 7.5}\n{"step": 500}\n')
    (work / "seed0" / "runs" / "eagle3").mkdir(parents=True)
    (work / "seed0" / "runs" / "eagle3" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(regimes.FewerRows, match=r"heldout.jsonl: 2 rows kept, .*metrics.jsonl gives 1"):
        regimes.save_rows(work, kept)
    # as many rows or more, or told to: saved
    (work / "seed0" / "runs" / "eagle3" / "metrics.jsonl").write_text('{"step": 250, "eval/avg_loss": 7.5}\n{"step": 500}\n')
    assert {str(p) for p in regimes.save_rows(work, kept)} >= {"seed0/report-b48/results.jsonl", "data_settings.json"}
    (work / "seed0" / "report-b48" / "results.jsonl").write_text("".join(rows[:10]))
    assert regimes.main([*argv, "--replace-with-fewer"]) == 0
    assert len((kept / "seed0" / "report-b48" / "results.jsonl").read_text().splitlines()) == 10


def test_the_provenance_is_a_table_from_structured_rows_and_a_bad_row_is_one_line(regimes, tmp_path, capsys):
    work = tmp_path / "chat"
    work.mkdir()
    (work / "data_settings.json").write_text("{}")
    (work / "stage_times.json").write_text(json.dumps({"seed0 report-b48 to 10": 600.0, "seed0 report-b48": 1200.0,
                                                       "seed0 eagle3: train": 99.0}))
    row = {"what": "seed 0: report-b48", "commit": "abc1234", "recorded_in": ["def5678"], "date": "2026-01-02",
           "machine": "2-core CPU #1", "threads": "1", "stages": ["seed0 report-b48*"]}
    (work / "provenance.json").write_text(json.dumps({"study": "chat", "rows": [row, dict(row, what="rebuilt", stages=[])],
                                                      "notes": ["a note"]}))
    extra = tmp_path / "more.json"
    extra.write_text(json.dumps({"study": "extra", "rows": [dict(row, stages=["nothing*"])]}))
    out = tmp_path / "out" / "regimes"
    out.parent.mkdir()
    assert regimes.main(["report", "--sharegpt", str(work), "--out", str(out), "--provenance", str(extra)]) == 0
    capsys.readouterr()
    text = out.with_suffix(".md").read_text()
    assert "| study | what | commit | recorded in | date | machine | threads | wall time |" in text
    assert "| chat | seed 0: report-b48 | abc1234 | def5678 | 2026-01-02 | 2-core CPU #1 | 1 | 30 min |" in text
    assert "| chat | rebuilt | abc1234 | def5678 | 2026-01-02 | 2-core CPU #1 | 1 | - |" in text
    assert "| extra | seed 0: report-b48 | abc1234 | def5678 | 2026-01-02 | 2-core CPU #1 | 1 | - |" in text
    assert "- chat: a note" in text
    stored = json.loads(out.with_suffix(".json").read_text())["provenance"]
    assert [s["study"] for s in stored] == ["chat", "extra"] and stored[0]["rows"][0]["wall_s"] == 1800.0
    for bad, said in (({"study": "x", "rows": [dict(row, commit="")]}, "row 0: 'commit' must be a non-empty string"),
                      ({"study": "x", "rows": [dict(row, stages="seed*")]}, "row 0: 'stages' must be a list of strings"),
                      (["a", "list"], "an object with 'study'")):
        extra.write_text(json.dumps(bad))
        assert regimes.main(["report", "--sharegpt", str(work), "--out", str(out), "--provenance", str(extra)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(extra) in err[0] and said in err[0], err
    extra.write_text("{not json")
    assert regimes.main(["report", "--sharegpt", str(work), "--out", str(out), "--provenance", str(extra)]) == 1
    assert "more.json: not JSON" in capsys.readouterr().err
    # the committed folders' provenance parses, and names no sitting and no machine's path
    for name in ("regime-gsm8k", "regime-sharegpt"):
        path = os.path.join(RESULTS, name, "provenance.json")
        data = regimes.read_provenance(Path(path))
        assert data["rows"] and all(len(r["commit"]) == 7 for r in data["rows"])
        assert "session" not in open(path).read().lower() and "/work/" not in open(path).read()


def _saved_gsm8k(tmp_path):
    """The committed GSM8K folder's records a save compares (settings, manifests, stage times), copied under tmp_path."""
    kept = tmp_path / "kept"
    for rel in ("data_settings.json", "seed0/settings.json", "features/manifest.json", "screen/features/manifest.json",
                "stage_times.json", "regenerated.jsonl", "regenerated.done"):
        (kept / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(RESULTS, "regime-gsm8k", rel), kept / rel)
    return kept


def test_save_never_replaces_a_manifest_with_a_less_complete_one_and_merges_the_stage_times(regimes, tmp_path, capsys):
    kept = _saved_gsm8k(tmp_path)
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    work = tmp_path / "regime-gsm8k"
    (work / "features").mkdir(parents=True)
    shutil.copy(kept / "data_settings.json", work / "data_settings.json")
    # a sitting cut off while it rebuilt the features: the manifest of a run just begun, with this machine's paths
    manifest = json.loads((kept / "features" / "manifest.json").read_text())
    manifest = dict(manifest, status="in_progress", counts=dict(manifest["counts"], written=0),
                    input=f"{work}/regenerated.jsonl", target=dict(manifest["target"], path=f"{work}/target"))
    manifest.pop("vocab_fingerprint")
    (work / "features" / "manifest.json").write_text(json.dumps(manifest))
    (work / "stage_times.json").write_text(json.dumps({"features": 12.0, "seed5 pr-paper: train": 30.0}))
    (work / "sittings.jsonl").write_text(json.dumps({"commit": "abc1234", "command": f"regimes.py gsm8k --workdir {work}"}) + "\n")
    assert regimes.main(["save", "--workdir", str(work), "--to", str(kept)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "features/manifest.json: complete with 400 rows written kept" in err[0], err
    assert "is not complete with 0 rows written" in err[0] and "nothing written" in err[0]
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before
    # complete again: saved, with the workdir's parent written $WORK; every kept stage time stays, the workdir's added
    (work / "features" / "manifest.json").write_text(json.dumps(dict(manifest, status="complete", counts=dict(
        manifest["counts"], written=400), vocab_fingerprint="d6b52059428c470d")))
    assert regimes.main(["save", "--workdir", str(work), "--to", str(kept)]) == 0
    saved = (kept / "features" / "manifest.json").read_text()
    assert str(tmp_path) not in saved and json.loads(saved)["input"] == "$WORK/regime-gsm8k/regenerated.jsonl"
    assert json.loads((kept / "sittings.jsonl").read_text())["command"] == "regimes.py gsm8k --workdir $WORK/regime-gsm8k"
    times = json.loads((kept / "stage_times.json").read_text())
    old = json.loads(before[kept / "stage_times.json"])
    assert times == {**old, "features": 12.0, "seed5 pr-paper: train": 30.0} and len(times) == len(old) + 1
    # told to in so many words, the less complete manifest replaces it
    (work / "features" / "manifest.json").write_text(json.dumps(manifest))
    assert regimes.main(["save", "--workdir", str(work), "--to", str(kept), "--replace-with-fewer"]) == 0
    assert json.loads((kept / "features" / "manifest.json").read_text())["status"] == "in_progress"


def test_restore_refuses_a_workdir_made_with_other_settings_and_writes_nothing(regimes, tmp_path, capsys):
    kept = _saved_gsm8k(tmp_path)
    work = tmp_path / "work"
    (work / "seed0").mkdir(parents=True)
    settings = json.loads((kept / "data_settings.json").read_text())
    (work / "data_settings.json").write_text(json.dumps(dict(settings, train_limit=200)))
    (work / "regenerated.jsonl").write_text('{"id": "own"}\n')
    argv = ["restore", "--from", str(kept), "--workdir", str(work)]
    assert regimes.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "work/data_settings.json differs from" in err[0] and "train_limit: 200 here, 400 kept" in err[0], err
    assert "nothing restored" in err[0] and not (work / "regenerated.done").exists() and not (work / "stage_times.json").exists()
    # a seed's settings are compared the same way
    (work / "data_settings.json").write_text(json.dumps(settings))
    seed = json.loads((kept / "seed0" / "settings.json").read_text())
    (work / "seed0" / "settings.json").write_text(json.dumps(dict(seed, epochs=1)))
    assert regimes.main(argv) == 1
    assert "seed0/settings.json differs" in capsys.readouterr().err
    # the same settings (a second sitting): restored beside the workdir's own files, which are left alone
    (work / "seed0" / "settings.json").write_text(json.dumps(seed))
    assert regimes.main(argv) == 0
    assert (work / "regenerated.done").exists() and (work / "regenerated.jsonl").read_text() == '{"id": "own"}\n'


def test_a_dry_run_writes_nothing_and_a_negative_seed_is_refused(regimes, tmp_path, capsys):
    work = tmp_path / "regime"
    for regime in ("gsm8k", "sharegpt"):
        assert regimes.main([regime, "--workdir", str(work), "--seeds", "0", "1", "--dry-run"]) == 0
        assert not work.exists(), regime
    capsys.readouterr()
    # a real run's settings are not written by a dry run with other flags, so they do not refuse it
    work.mkdir()
    (work / "data_settings.json").write_text(json.dumps({"max_new_tokens": 256, "max_length": 2048,
                                                          "draft_vocab_size": 8192, "train_limit": 400}))
    assert regimes.main(["gsm8k", "--workdir", str(work), "--train-limit", "50", "--dry-run"]) == 1  # still compared
    assert "train_limit: 400 -> 50" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["data_settings.json"]
    assert regimes.main(["gsm8k", "--workdir", str(tmp_path / "w2"), "--seeds", "0", "-1", "--dry-run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seeds: -1 is not a seed" in err[0], err
    assert not (tmp_path / "w2").exists()


def test_the_committed_report_equals_its_rendering_from_the_kept_rows(regimes, tmp_path, capsys):
    """The module docstring's re-render of benchmarks/results/regimes.{md,json}, into tmp_path: a renderer changed
    without a re-render (or rows changed without one) fails here."""
    prefix = _committed_report_copy(tmp_path)
    line = next(x for x in regimes.__doc__.splitlines() if "report --gsm8k benchmarks/results/regime-gsm8k" in x)
    argv = line.split("regimes.py", 1)[1].split()
    assert regimes.main([*argv, "--out", str(prefix)]) == 0
    capsys.readouterr()
    for suffix in (".md", ".json"):
        with open(os.path.join(RESULTS, "regimes" + suffix)) as f:
            assert prefix.with_suffix(suffix).read_text() == f.read(), f"benchmarks/results/regimes{suffix} is stale"


# ---- issue 63: the study tools compare settings before they copy, and check every number before any work
@pytest.mark.parametrize("argv, needle", [
    (["gsm8k", "--train-limit", "0"], "--train-limit must be at least 1, got 0"),
    (["gsm8k", "--train-limit", "-1"], "--train-limit must be at least 1, got -1"),
    (["gsm8k", "--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["gsm8k", "--lr", "-1"], "--lr must be a finite number above 0, got -1.0"),
    (["gsm8k", "--lr", "nan"], "--lr must be a finite number above 0, got nan"),
    (["gsm8k", "--seeds", "0", "0"], "--seeds: 0 is given twice"),
    (["gsm8k", "--report-step", "0"], "--report-step must be at least 1"),
    (["gsm8k", "--eval-interval", "-5"], "--eval-interval must be at least 0"),
    (["sharegpt", "--keep", "0"], "--keep must be at least 1"),
    (["sharegpt", "--steps", "-3"], "--steps must be at least 1"),
    (["report", "--report-limit", "0"], "--report-limit must be at least 1"),
])
def test_every_numeric_argument_is_range_checked_before_any_work(regimes, tmp_path, capsys, argv, needle):
    work = tmp_path / "w"
    extra = [] if argv[0] == "report" else ["--workdir", str(work)]
    assert regimes.main([*argv, *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not work.exists()


def test_restore_puts_the_settings_back_so_a_run_asking_for_others_is_refused(regimes, tmp_path, capsys):
    """Restoring into a fresh workdir used to leave nothing to compare: ShareGPT replies showed as GSM8K's `(done)`,
    and data made with --train-limit 400 as done for --train-limit 200."""
    fresh = tmp_path / "fresh"
    assert regimes.main(["restore", "--from", os.path.join(RESULTS, "regime-sharegpt"), "--workdir", str(fresh)]) == 0
    assert (fresh / "data_settings.json").is_file()
    assert regimes.main(["gsm8k", "--workdir", str(fresh), "--dry-run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "was made with other settings" in err[-1] and "new --workdir" in err[-1], err
    right = tmp_path / "right"
    assert regimes.main(["restore", "--from", os.path.join(RESULTS, "regime-gsm8k"), "--workdir", str(right)]) == 0
    assert regimes.main(["gsm8k", "--workdir", str(right), "--train-limit", "200", "--max-new-tokens", "128",
                         "--dry-run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "max_new_tokens: 256 -> 128" in err[-1] and "train_limit: 400 -> 200" in err[-1], err
    assert regimes.main(["gsm8k", "--workdir", str(right), "--train-limit", "400", "--seeds", "0", "1", "--dry-run"]) == 0


def test_save_compares_the_settings_before_copying(regimes, tmp_path, capsys):
    kept = tmp_path / "kept"
    shutil.copytree(os.path.join(RESULTS, "regime-gsm8k"), kept)
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    work = tmp_path / "work"
    shutil.copytree(kept, work)
    seed = json.loads((work / "seed0" / "settings.json").read_text())
    (work / "seed0" / "settings.json").write_text(json.dumps(dict(seed, lr=0.05, epochs=5)))
    assert regimes.main(["save", "--workdir", str(work), "--to", str(kept)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seed0/settings.json differs" in err[0] and "lr: 0.05 here, 0.0003 kept" in err[0], err
    assert "nothing written" in err[0]
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before


def test_report_refuses_a_folder_of_the_other_regime(regimes, tmp_path, capsys):
    prefix = _committed_report_copy(tmp_path)
    for flag, folder, other in (("--gsm8k", "regime-sharegpt", "--sharegpt"), ("--sharegpt", "regime-gsm8k", "--gsm8k")):
        assert regimes.main(["report", flag, os.path.join(RESULTS, folder), "--out", str(prefix)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pass it as {other}" in err[0], err
