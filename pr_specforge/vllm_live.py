"""A local vLLM server (CPU build, `.venv-vllm`) for a test or a benchmark, and what it reports per request.

  * `vllm_server(target, export, log_path, ...)` - `scripts/vllm_cpu_serve.sh` (the documented launch) on 127.0.0.1
    and a free port, or with `model_alone` `--model EXPORT` (vLLM takes the verifier from the export); its process
    group is stopped when the context exits, also on failure (`local_server.serving`, ready on vLLM's
    "Application startup complete");
  * `spec_counters(port)` - vLLM's global spec-decode counters from `/metrics` (drafts, draft tokens, accepted);
  * `complete_one_at_a_time(port, prompts, max_new)` - each prompt's greedy output ids, wall time and, with a
    drafter, the counters its request added (they are global: requests go one at a time).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
from typing import Dict, Iterator, List, Optional, Sequence

from pr_specforge.local_server import free_port, post, serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
SERVE_SCRIPT = os.path.join(ROOT, "scripts", "vllm_cpu_serve.sh")
READY = "Application startup complete"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@contextlib.contextmanager
def vllm_server(target: str, export: str, log_path, *, env: Dict[str, str], python: str = VLLM_PYTHON,
                model_alone: bool = False) -> Iterator[int]:
    """Yield the port of a vLLM server of `target` with the drafter `export` ("-": none)."""
    port = free_port()
    env = dict(env, PYTHON=python)
    if model_alone:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", export, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--enforce-eager"]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        cmd = ["bash", SERVE_SCRIPT, target, export, str(port)]
    with serving(cmd, port, log_path, env, ready_text=READY):
        yield port


def spec_counters(port: int) -> Dict[str, int]:
    """vLLM's global spec-decode counters (`/metrics`), 0 before the first draft."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for name in COUNTERS:
        found = re.search(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = int(float(found.group(1))) if found else 0
    return out


def complete_one_at_a_time(port: int, prompts: Sequence[List[int]], max_new: int, spec: bool = True) -> List[dict]:
    """Per prompt: greedy `output_ids` (`max_new` tokens, EOS ignored), `wall_s`, and with `spec` the counters."""
    rows = []
    for ids in prompts:
        before: Optional[dict] = spec_counters(port) if spec else None
        t0 = time.perf_counter()
        out = post(port, "/v1/completions", {"prompt": list(ids), "max_tokens": max_new, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True})
        row = {"output_ids": out["choices"][0]["token_ids"], "wall_s": time.perf_counter() - t0}
        if before is not None:
            after = spec_counters(port)
            row.update({k: after[k] - before[k] for k in COUNTERS})
        rows.append(row)
    return rows
