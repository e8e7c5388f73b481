"""`run_stages`: skip finished stages, account wall time across interruptions."""

import json
import time

import pytest

from pr_specforge.pipeline import Stage, run_stages


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


def test_a_running_stage_saves_its_time_on_a_heartbeat(tmp_path):
    times = tmp_path / "stage_times.json"
    seen = []

    def slow():
        time.sleep(0.5)
        seen.append(json.loads(times.read_text()).get("slow", 0.0))  # what a kill now would leave on disk
        (tmp_path / "slow.done").write_text("ok")

    run_stages([Stage("slow", tmp_path / "slow.done", slow)], times, heartbeat_s=0.1)
    assert seen[0] >= 0.3


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
    from pr_specforge.pipeline import latest_checkpoint

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

    from pr_specforge.pipeline import features_done

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
