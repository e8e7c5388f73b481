"""A CPU bridge for SGLang's EAGLE-3 speculative serving, 0.5.14 and 0.5.16+ (tests and `scripts/sglang_cpu_serve.sh`).

Not imported by `import pr_specforge`; shipped by the serving install (`serving/pyproject.toml`), and imports no
SpecForge (`tests/sglang_plugin/test_serving_import.py`). `child_env()` is the environment under which
`python -m sglang.launch_server --device cpu --attention-backend torch_native ...`
(or `sglang.Engine`) runs EAGLE-3 on a CPU: the bridge's import hook (`bridge.install`,
via `site/sitecustomize.py`, inherited by SGLang's subprocesses), `SGLANG_USE_CPU_ENGINE=1`,
`SGLANG_NATIVE_MOVE_KV_CACHE=1` and `TRITON_INTERPRET=1`. The server itself also needs
`--disable-cuda-graph`; `SERVER_FLAGS` also turn the overlap schedule off (it runs through the bridge too, but
nothing overlaps on a CPU and the benchmarks compare synchronous rounds), and `--sleep-on-idle` keeps an idle
scheduler from spinning a whole core (it waits on its sockets instead; measured: an idle server held ~95%
of one of this machine's two cores without it).
What is patched and why: `bridge`.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
#: the directory that holds the `pr_specforge` package: the repository, or site-packages of the serving install
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the launch_server flags the bridge assumes (CPU device, torch_native attention, no graphs, no overlap),
#: and an idle scheduler that sleeps on its sockets instead of polling a core
SERVER_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--disable-overlap-schedule", "--sleep-on-idle")


def child_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """`base` (default: os.environ) plus what an SGLang process needs to serve EAGLE-3 on this CPU."""
    env = dict(os.environ if base is None else base)
    path = [SITE_DIR, REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), PR_SPECFORGE_SGLANG_CPU="1", SGLANG_USE_CPU_ENGINE="1",
               SGLANG_NATIVE_MOVE_KV_CACHE="1", TRITON_INTERPRET="1")
    return env


#: the first SGLang line whose torch_native backend has no EAGLE draft decode (0.5.23 stops one with "EAGLE is not
#: supported in decode attention backend torch_native"): from it on, a speculative CPU server drafts on SGLang's own
#: Triton backend in Triton's interpreter (`TRITON_INTERPRET=1`, set by `child_env`), the `PR_EAGLE3` rows too
TRITON_DRAFT_FROM = (0, 5, 16)


def draft_attention(release: Tuple[int, ...]) -> Optional[str]:
    """The draft attention backend (`--speculative-draft-attention-backend`, and `PR_EAGLE3_ROW_ATTENTION`) a
    speculative CPU server takes on the SGLang `release`: `triton` from `TRITON_DRAFT_FROM` on, else None (the
    bridge's torch_native draft on 0.5.14)."""
    return "triton" if tuple(release) >= TRITON_DRAFT_FROM else None
