"""Issue 73, item 2: one writer per output (`pr_specforge.lock`). While another process writes an output (holds its
lock), every writing command naming that output is refused in one line naming the holder's PID (exit 2), before any
work; a lock a killed writer left is taken by the next writer; the first writer's output equals a lone run's.

Every holder is a real second process: a real command (`data conversations`, `train`) or, for the commands whose
own work is long, a process that takes the lock with the same helper and waits."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pr_specforge.lock import HOLD_ENV, lock_path
from tests.helpers import run_cli, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
HOLDER = ("import sys, time\nfrom pr_specforge.lock import output_lock\n"
          "with output_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(600)\n")
ROWS = [{"id": f"c{i}", "conversations": [{"role": "user", "content": f"question {i}?"},
                                          {"role": "assistant", "content": f"answer {i}."}]} for i in range(3)]


def _source(tmp_path):
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _wait_for_holder(proc, output, timeout=120):
    """Until `proc` holds `output`'s lock: the lock file names its PID."""
    deadline = time.time() + timeout
    path = lock_path(output)
    while not (path.exists() and path.read_text().strip() == str(proc.pid)):
        assert proc.poll() is None, "the first writer ended before it took the lock"
        assert time.time() < deadline, "the first writer never took the lock"
        time.sleep(0.05)


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _refused(rc, text, pid):
    lines = [x for x in text.splitlines() if f"PID {pid}" in x]
    assert rc == 2 and len(lines) == 1 and "one writer per output" in lines[0] and "Traceback" not in text, text


def test_a_second_data_command_is_refused_and_the_first_writes_what_a_lone_run_writes(tmp_path):
    src, out = _source(tmp_path), tmp_path / "convs.jsonl"
    argv = ["data", "conversations", "--source", src, "--output", out]
    first = subprocess.Popen([sys.executable, "-m", "pr_specforge.cli", *map(str, argv)],
                             env=dict(ENV, **{HOLD_ENV: "5"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_holder(first, out)
        rc, text = run_cli(*argv, cwd=tmp_path)
        _refused(rc, text, first.pid)
        assert not out.exists()  # the second wrote nothing; the first has not started its work yet
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            _kill(first)
    assert first.returncode == 0, stderr[-2000:]
    assert run_cli("data", "conversations", "--source", src, "--output", tmp_path / "lone.jsonl", cwd=tmp_path)[0] == 0
    assert out.read_text() == (tmp_path / "lone.jsonl").read_text()
    assert not lock_path(out).exists()  # a finished writer leaves no lock file


def test_a_lock_a_killed_writer_left_is_taken_by_the_next(tmp_path):
    src, out = _source(tmp_path), tmp_path / "convs.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    _kill(holder)  # kill -9: the kernel drops its flock, the lock file stays with its PID
    assert lock_path(out).read_text().strip() == str(holder.pid)
    rc, text = run_cli("data", "conversations", "--source", src, "--output", out, cwd=tmp_path)
    assert rc == 0 and str(holder.pid) not in text, text
    assert len(out.read_text().splitlines()) == len(ROWS) and not lock_path(out).exists()


def test_a_second_train_into_one_output_dir_is_refused(tmp_path):
    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=2)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "training.save_interval=0"]
    first = subprocess.Popen(cmd, env=dict(ENV, **{HOLD_ENV: "600"}), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        _wait_for_holder(first, out)
        second = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        _refused(second.returncode, second.stdout + second.stderr, first.pid)
        assert "output_dir" in second.stderr and not (out / "metrics.jsonl").exists()
    finally:
        _kill(first)


def _export(tmp_path, out):
    return ["export", tmp_path / "no-checkpoint", out, "--to", "sglang"]


def _export_vllm(tmp_path, out):
    return ["export", tmp_path / "no-checkpoint", out, "--to", "vllm", "--verifier", "x"]


#: each writer, its argv for an output (a run that would fail later for its own reasons: the refusal comes first)
WRITERS = {
    "run": lambda t, out: ["run", "--workdir", out, "--skip-control"],
    "experiment": lambda t, out: ["experiment", "--workdir", out, "--report", t / "report"],
    "export --to sglang": _export,
    "export --to vllm": _export_vllm,
    "data regenerate": lambda t, out: ["data", "regenerate", "--input", _source(t), "--output", out, "--server",
                                       "http://127.0.0.1:9"],
    "data hidden-states": lambda t, out: ["data", "hidden-states", "--input", _source(t), "--output", out,
                                          "--target", t / "no-target"],
    "data smollm2-target": lambda t, out: ["data", "smollm2-target", "--output", out],
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_is_refused_while_another_process_holds_its_output(tmp_path, writer):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, text = run_cli(*WRITERS[writer](tmp_path, out), cwd=tmp_path)
        _refused(rc, text, holder.pid)
        assert not out.exists()
    finally:
        _kill(holder)
