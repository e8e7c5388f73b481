"""Live SGLang servers on this CPU (through `pr_specforge.sglang_cpu`) and what they serve.

* `live_run` (tests/conftest.py, tests/live_pair.py): the session's tiny target and trained PR drafter, with its
  `--to sglang` (PR), EAGLE-3 (the PR tensors dropped) and `--to hf` (our evaluator) exports.
* `sglang_server(...)`: `python -m sglang.launch_server`, bound to 127.0.0.1 on a free port, stopped (its whole
  process group) when the context exits, also on failure (`pr_specforge.sglang_cpu.server`, which
  benchmarks/serving_cost.py uses too).
* `shared_sglang(shared, name, model, *args, ...)`: the session's one server of that launch (tests/live_servers.py):
  started by the first module that asks for it, shared by every module that asks for the same launch, stopped at the
  end of the live packages. A test that checks a fresh start (a refusal, a fault) starts its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from pr_specforge.local_server import record_start
from pr_specforge.sglang_cpu.server import ServerFailed, free_port, launch_command, post, serving  # noqa: F401
from tests.export.conftest import ENV
from tests.live_pair import STEPS  # noqa: F401 (the live modules read it from here)


def refused_launch(cmd, env) -> str:
    """Run a server launch that must be refused before it starts: its process group is killed after it (also on
    failure); it must exit non-zero and print no traceback. Returns its last non-empty line, the refusal."""
    record_start(cmd, "refused")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]  # one line, not a traceback through SGLang's launch path
    return [line for line in out.splitlines() if line.strip()][-1]


def _free_port() -> int:
    return free_port()


def greedy(port: int, ids, max_new_tokens: int) -> dict:
    return post(port, "/generate", {"input_ids": list(ids), "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})


#: where the live servers run: this CPU through the bridge (the default), or with `PR_SPECFORGE_LIVE_DEVICE=cuda` a
#: GPU (`scripts/gpu_pr_eagle3_check.sh`; `PR_SPECFORGE_LIVE_CUDA_GRAPH=1` turns SGLang's CUDA graphs on)
LIVE_DEVICE = os.environ.get("PR_SPECFORGE_LIVE_DEVICE", "cpu")
LIVE_CUDA_GRAPH = os.environ.get("PR_SPECFORGE_LIVE_CUDA_GRAPH") == "1"


@contextlib.contextmanager
def sglang_server(model: str, log_path, *args: str, dtype: str = "float32", env=None, overlap: bool = False,
                  python: str = ""):
    """Yield the port of a live `launch_server` for `model` (extra CLI `args`, extra environment `env`; SGLang's
    overlap schedule with `overlap`; `python`: the interpreter whose SGLang serves, default this one) on
    `LIVE_DEVICE`; stop it on exit."""
    from pr_specforge.sglang_cpu.server import server_env

    port = free_port()
    cmd = launch_command(model, port, *args, dtype=dtype, device=LIVE_DEVICE, cuda_graph=LIVE_CUDA_GRAPH,
                         overlap=overlap, python=python)
    with serving(cmd, port, log_path, server_env(LIVE_DEVICE, dict(ENV, HF_HUB_OFFLINE="1", **(env or {})))):
        yield port


def shared_sglang(shared, name: str, model: str, *args: str, env=None, overlap: bool = False, python: str = "",
                  files=()):
    """The session's server of this launch (`sglang_server`'s arguments), started by the first caller. `files`: names
    of environment variables that hold a path of the server's own (its round log, its round times): each is set to a
    file beside the server's log (`<log>.<VAR>`), so every caller of the same launch reads the same files."""
    from pr_specforge.sglang_cpu.server import SGLANG_PYTHON_ENV

    python = python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
    key = {"engine": "sglang", "python": python, "model": model, "args": args, "env": env or {}, "overlap": overlap,
           "files": sorted(files), "device": LIVE_DEVICE, "graph": LIVE_CUDA_GRAPH}

    def start(log):
        paths = {var: str(log) + "." + var for var in files}
        return sglang_server(model, log, *args, env={**(env or {}), **paths}, overlap=overlap, python=python)

    return shared.get(name, key, start)


def server_file(server, var: str):
    """The path `shared_sglang` gave the server's environment variable `var`."""
    import pathlib

    return pathlib.Path(str(server.log) + "." + var)


def extra_rounds(overlap: bool) -> tuple:
    """How many more rounds than verify rounds a request may be drafted (and logged, and timed): one under SGLang's
    overlap schedule (the scheduler learns one batch late that the request finished, and drops that round), else
    none."""
    return (0, 1) if overlap else (0,)


def assert_round_times(path, outs, overlap: bool = False) -> None:
    """`PR_EAGLE3_ROUND_TIMES` (`pr_specforge.sglang_plugin.timing`) for requests that ran one at a time (`outs`,
    their responses): one line per verify round of each (under the overlap schedule, `overlap`, one more may follow:
    `extra_rounds`), with phases that fit inside the round and compute
    inside its phases."""
    lines = [json.loads(x) for x in open(path) if x.strip()]
    for out in outs:
        rid, rounds = out["meta_info"]["id"], out["meta_info"]["spec_verify_ct"]
        mine = [t for t in lines if t["rids"] == [rid]]
        assert len(mine) - rounds in extra_rounds(overlap), \
            f"{len(mine)} timed rounds for a request of {rounds} verify rounds"
        for t in mine:
            assert t["batch"] == 1 and t["round_s"] > 0 and t["verify.target_compute_s"] > 0
            assert t["draft_s"] + t["verify_s"] + t["extend_s"] <= t["round_s"]
            assert 0 < t["floor_s"] <= t["round_s"]
            assert t["floor_s"] == pytest.approx(sum(t.get(k, 0.0) for k in
                                                     ("target_compute_s", "draft_compute_s", "readout_compute_s")))
            assert t["verify.target_compute_s"] <= t["verify_s"] and t["draft.draft_compute_s"] > 0
            assert t["draft.draft_compute_s"] + t.get("draft.readout_compute_s", 0.0) <= t["draft_s"]
            assert 0 < t["extend.draft_compute_s"] <= t["extend_s"]


def spec_args(draft: str, steps: int, topk: int, draft_tokens: int):
    return ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens))


def edit_export(src, dst, edit):
    """A copy of the `--to sglang` export `src` whose tensors went through `edit(dict)`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


PLAIN_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve_plain.sh")


@pytest.fixture(autouse=True, scope="package")
def _stop_this_packages_servers(shared):
    """The live SGLang servers live as long as this package's tests: none outlives it into the rest of the suite."""
    yield
    shared.close()


def plain_sglang(shared, live_run) -> int:
    """The port of SGLang 0.5.14 serving the target alone (plain greedy; with its tokenizer and chat template): one
    start-up for the session (its scheduler sleeps on idle, `--sleep-on-idle`). On a CPU it is the documented plain
    reference server, `scripts/sglang_cpu_serve_plain.sh`."""
    if LIVE_DEVICE != "cpu":
        return shared_sglang(shared, "plain", live_run["target"]).port
    from pr_specforge.sglang_cpu import child_env

    def start(log):
        port = free_port()
        env = child_env(dict(ENV, HF_HUB_OFFLINE="1", PYTHON=sys.executable))
        return with_port(serving(["bash", PLAIN_SCRIPT, live_run["target"], str(port)], port, log, env), port)

    key = {"engine": "sglang", "script": "sglang_cpu_serve_plain.sh", "python": sys.executable,
           "model": live_run["target"]}
    return shared.get("plain-0.5.14", key, start).port


@contextlib.contextmanager
def with_port(ctx, port: int):
    """`serving(cmd, port, ...)` as a context that yields `port` (what `Registry.get` expects of a start)."""
    with ctx:
        yield port


@pytest.fixture
def plain_server(shared, live_run):
    """`plain_sglang`'s port (asked for per test, so the registry sees it in use)."""
    return plain_sglang(shared, live_run)


@pytest.fixture(scope="package")
def our_decoder(live_run):
    """`decode(steps, k=1, budget=None, prompts=None)`: our evaluator's m = 0 decode of the live prompts (B_w = k)."""
    from pr_specforge.eval.evaluator import load_target
    from pr_specforge.modeling import load_drafter
    from pr_specforge.serving import SpeculativeDecoder, TreeConfig
    from tests.sglang_live.eagle3 import MAX_NEW

    target, _ = load_target(live_run["target"])
    drafter = load_drafter(live_run["hf"], "cpu", torch.float32)

    def decode(steps, k=1, budget=None, prompts=None):
        dec = SpeculativeDecoder(target, drafter, TreeConfig(budget=budget or steps, k=k, bw=k, gamma=steps, m=0))
        return [dec.generate(p, MAX_NEW, 0.0, 0, None) for p in prompts or live_run["prompts"]]

    return decode


@pytest.fixture(scope="session")
def plain(live_run, shared):
    """Plain greedy serving's output ids for each live prompt."""
    from tests.sglang_live.eagle3 import MAX_NEW

    port = plain_sglang(shared, live_run)
    return [greedy(port, p, MAX_NEW)["output_ids"] for p in live_run["prompts"]]
