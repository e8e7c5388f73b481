"""A local SGLang server for a test or a benchmark: bound to 127.0.0.1, on a free port, stopped on exit.

  * `free_port()` - a free loopback port below 40000 (SGLang derives more ports from it);
  * `launch_command(model, port, *args)` - `python -m sglang.launch_server` with the CPU bridge's flags, or with
    `device="cuda"` a stock GPU launch (`GPU_SERVER_FLAGS`: Triton attention, no overlap schedule, CUDA graphs
    on or off); `server_env(device)` - the environment either needs (the bridge's `child_env` on a CPU only);
  * `serving(cmd, port, log_path, env)` - run a server command in its own process group until it answers on
    `port` (its `/health` and the "fired up" line of its log), yield, and stop the whole group on exit, also on
    failure; `ServerFailed` carries the end of the log when it exits or does not answer in time;
  * `post(port, path, body)` - one JSON request.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Dict, Iterator, Sequence

START_TIMEOUT = 300


class ServerFailed(RuntimeError):
    """The server exited before it answered, or did not answer in time; the message holds the end of its log."""


def free_port() -> int:
    """A free loopback port in 20000-40000 (SGLang derives more ports from it, up to +10000 and more)."""
    for port in random.Random(os.getpid() + time.time_ns()).sample(range(20000, 40000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-40000 on 127.0.0.1")


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


DEVICES = ("cpu", "cuda")
OVERLAP_OFF = "--disable-overlap-schedule"
#: a GPU launch: SGLang's Triton attention (the backend PR_EAGLE3's rows use there too), no overlap schedule
#: (PR_EAGLE3 drafts synchronously; EAGLE3 gets the same so the two compare), idle schedulers asleep
GPU_SERVER_FLAGS = ("--device", "cuda", "--attention-backend", "triton", "--disable-overlap-schedule", "--sleep-on-idle")


SGLANG_PYTHON_ENV = "PR_SPECFORGE_SGLANG_PYTHON"  # the interpreter whose SGLang serves (default: this one)


def check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    return device


def launch_command(model: str, port: int, *args: str, dtype: str = "float32", max_total_tokens: int = 4096,
                   device: str = "cpu", cuda_graph: bool = False, overlap: bool = False):
    """`launch_server` for `model` on 127.0.0.1:`port` with extra `args`: on `cpu` the CPU bridge's `SERVER_FLAGS`
    (no graphs), on `cuda` `GPU_SERVER_FLAGS` and SGLang's CUDA graphs when `cuda_graph`; with `overlap`, SGLang's
    overlap schedule (its default; both flag sets turn it off)."""
    from pr_specforge.sglang_cpu import SERVER_FLAGS

    if check_device(device) == "cpu":
        flags = SERVER_FLAGS
    else:
        flags = GPU_SERVER_FLAGS + (() if cuda_graph else ("--disable-cuda-graph",))
    if overlap:
        flags = tuple(f for f in flags if f != OVERLAP_OFF)
    python = os.environ.get(SGLANG_PYTHON_ENV) or sys.executable  # e.g. .venv-serve/bin/python: SGLang 0.5.23's servers
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--dtype", dtype, *flags,
            "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(max_total_tokens), *args]


def server_env(device: str, base: Dict[str, str]) -> Dict[str, str]:
    """`base` plus what a server on `device` needs: the CPU bridge (`child_env`) on a CPU, nothing more on CUDA."""
    from pr_specforge.sglang_cpu import child_env

    return child_env(base) if check_device(device) == "cpu" else dict(base)


@contextlib.contextmanager
def serving(cmd: Sequence[str], port: int, log_path, env: Dict[str, str],
            start_timeout: float = START_TIMEOUT, ready_text: str = "fired up") -> Iterator[subprocess.Popen]:
    """Run the server command `cmd` (in its own process group) until it answers on `port` and its log holds
    `ready_text` (SGLang's "fired up"; vLLM's "Application startup complete"); stop it on exit."""
    log = open(log_path, "w")
    proc = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + start_timeout
        while True:
            if proc.poll() is not None:
                raise ServerFailed(open(log_path).read()[-6000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200 and ready_text in open(log_path).read():
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise ServerFailed(f"no answer after {start_timeout:.0f} s:\n" + open(log_path).read()[-6000:])
            time.sleep(2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
