"""`data regenerate` / `data hidden-states` under real torchrun (2 ranks, gloo, CPU):
the output equals a one-rank run's, and a rank killed with SIGKILL resumes its own shard."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import CONVERSATIONS, write_jsonl

from pr_specforge.data.hidden_states import BATCH_SLEEP_ENV, prepare_hidden_states
from pr_specforge.data.io import read_jsonl_rows

ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1")
pytestmark = pytest.mark.slow  # launches torchrun
ROWS = [dict(r, id=f"{r['id']}{k}") for k in range(4) for r in CONVERSATIONS]  # 20 rows, 5 lengths


def torchrun(*args, env=None, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "pr_specforge.cli", "data", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def hidden_args(src, out, target, batch_size):
    return ["hidden-states", "--input", str(src), "--output", str(out), "--target", str(target),
            "--dtype", "float32", "--batch-size", str(batch_size), "--draft-vocab-size", "40"]


def one_rank_features(tmp_path, target, tokenizer, batch_size):
    from transformers import AutoModelForCausalLM

    from pr_specforge.data.hidden_states import TransformersCapture, default_aux_layers

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    src = write_jsonl(tmp_path / "conv.jsonl", ROWS)
    out = tmp_path / f"one-b{batch_size}"
    prepare_hidden_states(src, out, str(target), "smollm2", capture=TransformersCapture(model, default_aux_layers(8)),
                          tokenizer=tokenizer, draft_vocab_size=40, batch_size=batch_size, progress=False)
    return src, out


def assert_same_features(a, b):
    files = sorted(p.relative_to(a) for p in a.rglob("*.ckpt"))
    assert len(files) == len(ROWS) and files == sorted(p.relative_to(b) for p in b.rglob("*.ckpt"))
    for rel in files:
        x, y = torch.load(a / rel, weights_only=True), torch.load(b / rel, weights_only=True)
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), f"{rel}:{key}"
    for rel in ["vocab_mapping/vocab_mapping.pt"]:
        x, y = torch.load(a / rel, weights_only=True), torch.load(b / rel, weights_only=True)
        assert all(torch.equal(x[k], y[k]) for k in ("t2d", "d2t"))
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert mb["status"] == ma["status"] == "complete" and mb["ranks"] == 2
    return ma, mb


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == parent and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def test_two_ranks_with_one_killed_mid_shard_resume_to_the_one_rank_features(tmp_path, tiny_target, tokenizer):
    src, ref = one_rank_features(tmp_path, tiny_target, tokenizer, batch_size=2)
    out = tmp_path / "killed"
    args = hidden_args(src, out, tiny_target, 2)
    proc = torchrun(*args, env=dict(ENV, **{BATCH_SLEEP_ENV: "0.3"}), wait=False)
    deadline = time.time() + 120
    victim = None
    while victim is None or len(list(out.rglob("data_*.ckpt"))) < 4:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() else "timeout"
        victim = victim or _rank_pid(proc.pid, 1)
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    written = list(out.rglob("data_*.ckpt"))
    assert 0 < len(written) < len(ROWS)
    for path in written:  # nothing torn: every file that exists loads whole
        assert torch.load(path, weights_only=True)["aux_hidden_state"].shape[-1] == 3 * 32
    assert json.loads((out / "manifest.json").read_text())["status"] == "in_progress"
    assert not (out / "vocab_mapping").exists()  # rank 0 waits for every shard before the vocab map

    resumed = torchrun(*args)
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed"] == len(written) and summary["written"] == len(ROWS) - len(written)
    ma, mb = assert_same_features(ref, out)  # bitwise: same batches as one rank, kill or not
    for key in ("rows", "samples", "tokens", "loss_tokens", "skipped"):  # rank 0 summed both shards
        assert mb["counts"][key] == ma["counts"][key], key


def test_two_rank_regeneration_with_the_default_batch_size_writes_the_one_rank_file(tmp_path, tiny_target):
    """16 rows of 5 prompt lengths, `--batch-size` left at its default (8): both ranks form the one-rank
    run's length-sorted batches and take every other one, so padding, replies and row order are the same."""
    from pr_specforge.data.cli import main

    src = write_jsonl(tmp_path / "conv.jsonl", ROWS[:16])
    args = ["regenerate", "--input", str(src), "--target", str(tiny_target), "--dtype", "float32", "--max-new-tokens", "6"]
    assert main([*args, "--output", str(tmp_path / "one.jsonl")]) == 0
    two = tmp_path / "two.jsonl"
    torchrun(*args, "--output", str(two))
    assert not os.path.exists(f"{two}.parts")  # merged, parts removed
    assert [r["id"] for r in read_jsonl_rows(two)] == [r["id"] for r in ROWS[:16]]  # input order
    assert two.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
