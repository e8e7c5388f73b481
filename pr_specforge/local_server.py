"""A local server process for a test or a benchmark, SGLang's or vLLM's: bound to 127.0.0.1, on a free port, stopped
on exit (no engine imported here: `sglang_cpu.server` builds SGLang's launch, `vllm_live` vLLM's).

  * `free_port()` - a free loopback port below 40000 (SGLang derives more ports from it);
  * `serving(cmd, port, log_path, env, ready_text=...)` - run a server command in its own process group until it
    answers on `port` (`/health`) and its log holds `ready_text`, yield, and stop the whole group on exit, also on
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
import time
import urllib.request
from typing import Dict, Iterator, Sequence

START_TIMEOUT = 300
#: a file (set by the test suite) where each server start is recorded, one line each: the suite counts its start-ups
STARTS_ENV = "PR_SPECFORGE_SERVER_STARTS"


def record_start(cmd: Sequence[str], how: str = "serve") -> None:
    """Append one line (`how`, then the command) to the file `PR_SPECFORGE_SERVER_STARTS` names, if it is set."""
    path = os.environ.get(STARTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(how + "\t" + " ".join(str(c) for c in cmd).replace("\n", " ") + "\n")


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


@contextlib.contextmanager
def serving(cmd: Sequence[str], port: int, log_path, env: Dict[str, str],
            start_timeout: float = START_TIMEOUT, ready_text: str = "fired up", cwd=None) -> Iterator[subprocess.Popen]:
    """Run the server command `cmd` (in its own process group; in `cwd` if given) until it answers on `port` and its
    log holds `ready_text` (SGLang's "fired up"; vLLM's "Application startup complete"); stop it on exit."""
    record_start(cmd)
    log = open(log_path, "w")
    proc = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
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
