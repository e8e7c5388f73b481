"""A local SGLang server for a test or a benchmark: bound to 127.0.0.1, on a free port, stopped on exit.

  * `free_port()` - a free loopback port below 40000 (SGLang derives more ports from it);
  * `launch_command(model, port, *args)` - `python -m sglang.launch_server` with the CPU bridge's flags, or with
    `device="cuda"` a stock GPU launch (`GPU_SERVER_FLAGS`: Triton attention, no overlap schedule, CUDA graphs
    on or off); `server_env(device)` - the environment either needs (the bridge's `child_env` on a CPU only);
  * `serving(cmd, port, log_path, env)` - run a server command in its own process group until it answers on
    `port` (its `/health` and the "fired up" line of its log), yield, and stop the whole group on exit, also on
    failure; `ServerFailed` carries the end of the log when it exits or does not answer in time;
  * `post(port, path, body)` - one JSON request.
(`free_port`, `post`, `serving` and `ServerFailed` live in `pr_specforge.local_server`, which vLLM's live tests use
too; they are re-exported here.)
"""

from __future__ import annotations

import os
import sys
from typing import Dict

from pr_specforge.local_server import START_TIMEOUT, ServerFailed, free_port, post, serving  # noqa: F401 (re-exported)

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
                   device: str = "cpu", cuda_graph: bool = False, overlap: bool = False, python: str = ""):
    """`launch_server` for `model` on 127.0.0.1:`port` with extra `args`: on `cpu` the CPU bridge's `SERVER_FLAGS`
    (no graphs), on `cuda` `GPU_SERVER_FLAGS` and SGLang's CUDA graphs when `cuda_graph`; with `overlap`, SGLang's
    overlap schedule (its default; both flag sets turn it off); `python`: the interpreter whose SGLang serves (default:
    `PR_SPECFORGE_SGLANG_PYTHON`, else this one)."""
    from pr_specforge.sglang_cpu import SERVER_FLAGS

    if check_device(device) == "cpu":
        flags = SERVER_FLAGS
    else:
        flags = GPU_SERVER_FLAGS + (() if cuda_graph else ("--disable-cuda-graph",))
    if overlap:
        flags = tuple(f for f in flags if f != OVERLAP_OFF)
    python = python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable  # e.g. .venv-serve/bin/python: SGLang 0.5.23's servers
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--dtype", dtype, *flags,
            "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(max_total_tokens), *args]


def server_env(device: str, base: Dict[str, str]) -> Dict[str, str]:
    """`base` plus what a server on `device` needs: the CPU bridge (`child_env`) on a CPU, nothing more on CUDA."""
    from pr_specforge.sglang_cpu import child_env

    return child_env(base) if check_device(device) == "cpu" else dict(base)
