"""`run_stages`: skip finished stages, account wall time across interruptions."""

import json
import time

import pytest

from pr_specforge.stages import Stage, run_stages


def test_finished_stages_are_skipped_and_wall_time_survives_a_failed_attempt(tmp_path):
    times = tmp_path / "stage_times.json"
    out_a, out_b = tmp_path / "a.done", tmp_path / "b.done"
    calls = []

    def stage_a():
        calls.append("a")
        out_a.write_text("ok")

    def failing_b():
        calls.append("b")
        time.sleep(0.2)
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError):
        run_stages([Stage("a", out_a, stage_a), Stage("b", out_b, failing_b)], times)
    first = json.loads(times.read_text())
    assert first["b"] >= 0.2  # the failed attempt's time is kept

    def stage_b():
        calls.append("b")
        time.sleep(0.1)
        out_b.write_text("ok")

    got = run_stages([Stage("a", out_a, stage_a), Stage("b", out_b, stage_b)], times)
    assert calls == ["a", "b", "b"]  # a was not rerun
    assert got["b"] >= first["b"] + 0.1 and got["a"] == first["a"]


def _saved(times, name):
    """`name`'s time in the stage-times file once a save has put one there (polled; 60 s at most)."""
    deadline = time.monotonic() + 60
    while not (times.exists() and name in json.loads(times.read_text())):
        assert time.monotonic() < deadline, f"no save of {name} in 60 s"
        time.sleep(0.01)
    return json.loads(times.read_text())[name]


def test_a_running_stage_saves_its_time_on_a_heartbeat(tmp_path):
    times = tmp_path / "stage_times.json"
    seen = []

    def slow():  # what a kill now would leave on disk: a heartbeat's save, made while the stage still runs
        seen.append(_saved(times, "slow"))
        (tmp_path / "slow.done").write_text("ok")

    got = run_stages([Stage("slow", tmp_path / "slow.done", slow)], times, heartbeat_s=0.05)
    assert 0 < seen[0] <= got["slow"]


def test_two_runners_over_one_workdir_keep_each_others_stage_times(tmp_path):
    """Two seeds' stage runners side by side write one stage_times.json; neither erases the other. Ordered by events,
    not by sleeps: a has saved a heartbeat before b starts, and a's last save comes after b has finished."""
    import threading

    times = tmp_path / "stage_times.json"
    times.write_text(json.dumps({"features": 87.0}))
    a_saved, b_finished, got = threading.Event(), threading.Event(), {}

    def long_a():
        _saved(times, "a")
        a_saved.set()
        assert b_finished.wait(60)
        (tmp_path / "a.done").write_text("ok")

    def short_b():
        (tmp_path / "b.done").write_text("ok")

    def runner(name, fn):
        got.update(run_stages([Stage(name, tmp_path / f"{name}.done", fn)], times, heartbeat_s=0.01))

    a = threading.Thread(target=runner, args=("a", long_a))
    a.start()
    assert a_saved.wait(60)
    runner("b", short_b)
    b_finished.set()
    a.join()
    assert json.loads(times.read_text()) == {"features": 87.0, "a": got["a"], "b": got["b"]}
    assert got["a"] > 0 and got["b"] >= 0


def test_old_workdirs_move_seeded_stage_times_to_seed0_once(tmp_path):
    """Before per-seed timing, a second seed's training time was added onto the first's."""
    from pr_specforge.experiment import migrate_stage_times

    shared, seed0 = tmp_path / "stage_times.json", tmp_path / "stage_times-seed0.json"
    shared.write_text(json.dumps({"features": 806.0, "train-eagle3": 5674.0, "eval-b48": 7656.0}))
    migrate_stage_times(shared, seed0, ["train-eagle3", "train-pr", "eval-b48"])
    assert json.loads(shared.read_text()) == {"features": 806.0}
    assert json.loads(seed0.read_text()) == {"train-eagle3": 5674.0, "eval-b48": 7656.0}
    # seed 1's stages then start from zero in their own file, and a second call changes nothing
    run_stages([Stage("train-eagle3", tmp_path / "t.done", lambda: (tmp_path / "t.done").write_text("ok"))],
               tmp_path / "stage_times-seed1.json")
    assert json.loads((tmp_path / "stage_times-seed1.json").read_text())["train-eagle3"] < 5.0
    migrate_stage_times(shared, seed0, ["train-eagle3"])
    assert json.loads(seed0.read_text())["train-eagle3"] == 5674.0


def test_resume_skips_a_checkpoint_killed_mid_save(tmp_path):
    from pr_specforge.training.preflight import latest_checkpoint

    assert latest_checkpoint(tmp_path, required=False) is None
    for step in (500, 1000, 1500):
        (tmp_path / f"run-step{step}").mkdir()
    for step in (500, 1000):
        (tmp_path / f"run-step{step}" / "training_state.pt").write_bytes(b"x")
    (tmp_path / "run-step1500" / "training_state.pt.tmp").write_bytes(b"x")  # the kill landed before the rename
    (tmp_path / "run-latest").mkdir()
    (tmp_path / "run-latest" / "training_state.pt").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "run-step1000")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        latest_checkpoint(tmp_path / "empty")


def test_an_unfinished_features_stage_is_not_done(tmp_path):
    """`data hidden-states` writes manifest.json (`in_progress`) first: its existence is no sign of a finished stage."""
    import json

    from pr_specforge.stages import features_done

    feats = tmp_path / "features"
    feats.mkdir()
    assert not features_done(feats)
    (feats / "manifest.json").write_text(json.dumps({"status": "in_progress"}))
    ran = []
    run_stages([Stage("features", feats / "manifest.json", lambda: ran.append(1), done=lambda: features_done(feats))])
    assert ran == [1]  # rerun: resumes the interrupted stage
    (feats / "manifest.json").write_text(json.dumps({"status": "complete"}))
    run_stages([Stage("features", feats / "manifest.json", lambda: ran.append(2), done=lambda: features_done(feats))])
    assert ran == [1]


def _record_commands(monkeypatch):
    """Every stage command a StageBuilder would run (entry functions and training replaced by recorders)."""
    import pr_specforge.training.preflight as preflight
    import pr_specforge.training.train as train
    from pr_specforge.stages import StageBuilder

    calls = []
    monkeypatch.setattr(StageBuilder, "call", lambda self, command, main, argv: calls.append([command, *map(str, argv)]))
    monkeypatch.setattr(train, "run_train", lambda recipe, overrides: calls.append(["train", "-c", recipe, *overrides]) or 0)
    monkeypatch.setattr(preflight, "latest_checkpoint", lambda run_dir, required=True: f"{run_dir}/CKPT" if required else None)
    return calls


def test_run_builds_its_stage_commands_through_the_stage_builder(tmp_path, monkeypatch):
    from pr_specforge import pipeline
    from pr_specforge.stages import StageBuilder

    calls = _record_commands(monkeypatch)
    (tmp_path / "runs" / "pr").mkdir(parents=True)
    args = pipeline._parser().parse_args(["--workdir", str(tmp_path), "training.learning_rate=1e-4"])
    stages = pipeline.stages(args, StageBuilder(tmp_path))
    run_stages(stages)
    w = str(tmp_path)
    held = ["--holdout-prompts", "mtbench", "--holdout-prompts", "gsm8k", "--holdout-prompts", "humaneval"]
    assert [s.name for s in stages] == ["target", "conversations", "regenerate", "features", "train", "export", "evaluate",
                                        "control"]
    assert calls == [
        ["data", "smollm2-target", "--output", f"{w}/target"],
        ["data", "conversations", "--source", "sharegpt-package", "--output", f"{w}/conversations.jsonl", "--limit", "256",
         "--max-turns", "1", *held],
        ["data", "regenerate", "--target", f"{w}/target", "--input", f"{w}/conversations.jsonl", "--output",
         f"{w}/regenerated.jsonl", "--max-new-tokens", "96", "--batch-size", "16", "--temperature", "0", "--max-prompt-chars", "2000"],
        ["data", "hidden-states", "--target", f"{w}/target", "--input", f"{w}/regenerated.jsonl", "--output", f"{w}/features",
         "--max-length", "512", "--draft-vocab-size", "8192"],
        ["data", "validate", f"{w}/features", "--target", f"{w}/target"],
        ["train", "-c", args.recipe, f"model.target_model_path={w}/target",
         f"model.vocab_mapping_path={w}/features/vocab_mapping/vocab_mapping.pt", f"data.hidden_states_path={w}/features",
         "data.max_length=512", f"output_dir={w}/runs/pr", "training.max_steps=300", "training.learning_rate=1e-4"],
        ["export", f"{w}/runs/pr/CKPT", f"{w}/export/pr-sglang", "--to", "sglang", "--target", f"{w}/target", "--overwrite"],
        ["export", f"{w}/runs/pr/CKPT", f"{w}/export/pr-hf", "--to", "hf", "--target", f"{w}/target", "--overwrite"],
        ["eval", "--target", f"{w}/target", "--draft", f"pr={w}/export/pr-hf", "--prompts", "mtbench", "--limit", "3",
         "--budget", "24", "--temperature", "0", "--max-new-tokens", "32", "--also-one-pass", "--out-dir", f"{w}/eval",
         "--json", f"{w}/eval/summary.json"],
        ["control", "--recipe", args.recipe, "--json", f"{w}/control.json", "--overwrite"],  # pr.* overrides only: none here
    ]
    assert (tmp_path / "regenerated.done").exists() and (tmp_path / "runs" / "pr" / "train.done").exists()


def test_experiment_builds_its_stage_commands_through_the_stage_builder(tmp_path, monkeypatch):
    from pr_specforge.experiment import Experiment, _parser

    calls = _record_commands(monkeypatch)
    (tmp_path / "runs" / "eagle3-seed0").mkdir(parents=True)
    (tmp_path / "runs" / "pr-seed0").mkdir(parents=True)
    (tmp_path / "heldout").mkdir()
    exp = Experiment(_parser().parse_args(["--workdir", str(tmp_path), "--seed", "0"]))
    shared, seeded = exp.shared_stages(), exp.seeded_stages()
    assert [s.name for s in shared + seeded] == [
        "target", "conversations", "regenerate", "features", "heldout-conversations", "heldout-regenerate",
        "heldout-features", "train-eagle3", "train-pr", "diagnose", "export", "eval-b48", "eval-b24"]
    run_stages(shared + seeded)
    w = str(tmp_path)
    by_command = {}
    for call in calls:
        by_command.setdefault(call[0], []).append(call[1:])
    assert ["validate", f"{w}/features", "--target", f"{w}/target"] in by_command["data"]
    assert not any(c[:2] == ["validate", f"{w}/heldout/features"] for c in by_command["data"])  # held-out: not validated
    assert ["conversations", "--source", "sharegpt-package", "--output", f"{w}/heldout/conversations.jsonl", "--limit", "200",
            "--max-turns", "1", "--exclude-ids", f"{w}/conversations.jsonl", "--holdout-prompts", "mtbench",
            "--holdout-prompts", "gsm8k", "--holdout-prompts", "humaneval"] in by_command["data"]
    for (flag, recipe, *overrides), name in zip(by_command["train"], ("eagle3", "pr")):
        assert recipe.endswith("smollm2-135m-cpu-eagle3.yaml" if name == "eagle3" else "smollm2-135m-cpu.yaml")
        assert overrides == [*exp.build.feature_overrides(tmp_path / "runs" / f"{name}-seed0", 2048), "training.num_epochs=2",
                             "training.learning_rate=0.0003", "training.seed=0", "training.save_interval=500",
                             f"data.eval_hidden_states_path={w}/heldout/features", "training.eval_interval=2000"]
    assert [c[2] for c in by_command["diagnose"]] == [f"{w}/heldout/features"] * 2
    assert by_command["export"] == [[f"{w}/runs/{n}-seed0/CKPT", f"{w}/export/{n}-seed0", "--to", "hf", "--target", f"{w}/target",
                                     "--overwrite"] for n in ("eagle3", "pr")]
    b48 = by_command["eval"][0]
    assert b48[b48.index("--temperature") + 1: b48.index("--temperature") + 3] == ["0.0", "1.0"]
    assert ["--draft", f"eagle3={w}/export/eagle3-seed0", "--draft", f"pr={w}/export/pr-seed0"] == b48[2:6]
    assert b48[b48.index("--k"): b48.index("--k") + 11] == ["--k", "6", "--bw", "6", "--gamma", "8", "--m", "3", "--seed", "0",
                                                            "--no-progress"]
    import torch

    # the thread count is part of a training's command (bitwise reproducible at the same count only)
    assert (tmp_path / "commands.log").read_text().count(f"OMP_NUM_THREADS={torch.get_num_threads()} pr-specforge train -c") == 2


def test_run_passes_only_pr_overrides_to_its_control_stage_and_can_leave_it_out(tmp_path, monkeypatch):
    from pr_specforge import pipeline
    from pr_specforge.stages import StageBuilder

    calls = _record_commands(monkeypatch)
    args = pipeline._parser().parse_args(["--workdir", str(tmp_path), "--skip-eval", "training.learning_rate=1e-4",
                                          "pr.gate_init_bias=-1"])
    control = [s for s in pipeline.stages(args, StageBuilder(tmp_path)) if s.name == "control"]
    control[0].run()
    assert calls == [["control", "--recipe", args.recipe, "pr.gate_init_bias=-1", "--json", f"{tmp_path}/control.json", "--overwrite"]]
    args = pipeline._parser().parse_args(["--workdir", str(tmp_path), "--skip-control"])
    assert "control" not in [s.name for s in pipeline.stages(args, StageBuilder(tmp_path))]


def test_the_summary_prints_the_controls_verdict_and_what_to_change_when_the_gate_halts_at_depth_0(tmp_path):
    """A real control run (few steps) is read into the summary; the hint appears only where q_0 >= 90%."""
    import json

    from pr_specforge import pipeline
    from pr_specforge.control.cli import main as control

    out = tmp_path / "control.json"
    rc = control(["--recipe", str(pipeline.DEFAULT_RECIPE), "--steps", "3", "--json", str(out)])
    verdict = json.loads(out.read_text())["verdict"]
    assert rc == (0 if verdict["learns_second_pass"] else 1)
    halted = {"step": 300, "pr/depth_marginal_0": 0.98, "pr/depth_marginal_1": 0.01, "pr/depth_marginal_2": 0.01}
    lines = pipeline.control_lines(out, halted)
    assert lines[0].startswith("control ") and str(pipeline.DEFAULT_RECIPE) in lines[0]
    assert lines[1].strip().startswith("verdict: ") and f"{verdict['two_hop_gain']:+.1%}" in lines[1]
    assert "to see reconsideration run" in lines[2] and "98% of positions after 300 steps" in lines[2]
    working = {**halted, "pr/depth_marginal_0": 0.5, "pr/depth_marginal_1": 0.25, "pr/depth_marginal_2": 0.25}
    assert len(pipeline.control_lines(out, working)) == 2
    assert pipeline.control_lines(tmp_path / "none.json", {}) == []  # no control run, an EAGLE-3 run: nothing


def test_experiment_report_never_replaces_a_file_that_is_not_an_earlier_report(tmp_path, capsys):
    """issue 58 item 6: --report PREFIX where a file the report writes exists and PREFIX.json is not an experiment
    report (a user's notes, another JSON object) is one line naming it, before any stage (no workdir made), the file
    left as it was; an earlier report there is rewritten, as every run rewrites it from its workdir."""
    from pr_specforge.eval.experiment_report import check_report_prefix
    from pr_specforge.experiment import main

    work = tmp_path / "work"
    notes, other = tmp_path / "notes.md", tmp_path / "other.json"
    notes.write_text("a user's notes\n")
    other.write_text(json.dumps({"results": []}))  # no settings: not a report of the experiment
    for prefix, mine in ((tmp_path / "notes", notes), (tmp_path / "other", other)):
        assert main(["--workdir", str(work), "--report", str(prefix)]) == 2  # bad input: 2, as every command (issue 65)
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pr-specforge experiment:")]
        assert len(lines) == 1 and f"--report {mine}: exists" in lines[0] and "not an earlier experiment report" in lines[0], lines
    assert notes.read_text() == "a user's notes\n" and json.loads(other.read_text()) == {"results": []}
    assert not work.exists()
    (tmp_path / "d.md").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        check_report_prefix(tmp_path / "d")
    (tmp_path / "r.json").write_text(json.dumps({"kind": "pr_specforge.experiment_report", "kind_version": 1,
                                                 "settings": {"seed": 0}, "results": []}))
    (tmp_path / "r.md").write_text("# the earlier report\n")
    check_report_prefix(tmp_path / "r")  # an earlier report (its marker): rewritten by the run
    (tmp_path / "u.json").write_text(json.dumps({"settings": {"seed": 0}, "results": []}))
    with pytest.raises(ValueError, match="no \"kind\": \"pr_specforge.experiment_report\" marker"):
        check_report_prefix(tmp_path / "u")  # the shape of a report without its marker is not enough
    check_report_prefix(tmp_path / "new")
