"""A live SGLang 0.5.14 server on this CPU (through `pr_specforge.sglang_cpu`) and what it serves.

* `live_run`: a SmolLM2-shaped tiny target (Llama, tied embeddings, 8 layers so the three captured
  layers 1, 3, 4 are distinct, a byte-level BPE tokenizer with SmolLM2's chat template) and a PR
  drafter trained on the target's own greedy continuations (48 steps: it accepts most of what the
  target says on prompts of that distribution), exported `--to sglang` (PR), as EAGLE-3 (the PR
  tensors dropped) and `--to hf` (for our evaluator).
* `sglang_server(...)`: `python -m sglang.launch_server`, bound to 127.0.0.1 on a
  free port, stopped (its whole process group) when the context exits, also on failure
  (`pr_specforge.sglang_cpu.server`, which benchmarks/serving_cost.py uses too).
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

from pr_specforge.sglang_cpu.server import ServerFailed, free_port, launch_command, post, serving  # noqa: F401
from tests.export.conftest import ENV, train_workspace

STEPS = 48


def refused_launch(cmd, env) -> str:
    """Run a server launch that must be refused before it starts: its process group is killed after it (also on
    failure); it must exit non-zero and print no traceback. Returns its last non-empty line, the refusal."""
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
def sglang_server(model: str, log_path, *args: str, dtype: str = "float32", env=None, overlap: bool = False):
    """Yield the port of a live `launch_server` for `model` (extra CLI `args`, extra environment `env`; SGLang's
    overlap schedule with `overlap`) on `LIVE_DEVICE`; stop it on exit."""
    from pr_specforge.sglang_cpu.server import server_env

    port = free_port()
    cmd = launch_command(model, port, *args, dtype=dtype, device=LIVE_DEVICE, cuda_graph=LIVE_CUDA_GRAPH,
                         overlap=overlap)
    with serving(cmd, port, log_path, server_env(LIVE_DEVICE, dict(ENV, HF_HUB_OFFLINE="1", **(env or {})))):
        yield port


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


@pytest.fixture(scope="package")
def live_run(tmp_path_factory):
    from pr_specforge.export import export_checkpoint
    from tests.data.conftest import build_tokenizer

    root = tmp_path_factory.mktemp("live_run")
    tok = build_tokenizer()
    train_workspace(root, strategy="pr", steps=STEPS, n=8, seq=48, generated=True, pr_section={"max_depth": 2},
                    extra={"training": {"num_epochs": 6}}, target=dict(layers=8, vocab=len(tok), tie=True, tokenizer=tok))
    (root / "target" / "pr_specforge_target.json").write_text(json.dumps({"chat_template_name": "smollm2"}))
    ckpt = str(root / "out" / f"specforge-run-step{STEPS}")
    export_checkpoint(ckpt, str(root / "pr-sglang"), "sglang")
    export_checkpoint(ckpt, str(root / "hf"), "hf", target=str(root / "target"))
    eagle3 = root / "eagle3-ckpt" / f"specforge-run-step{STEPS}"  # the same run as an eagle3 checkpoint
    shutil.copytree(ckpt, eagle3)
    state = torch.load(eagle3 / "training_state.pt", weights_only=False)
    state["strategy"] = "eagle3"
    state["draft_state_dict"] = {k: v for k, v in state["draft_state_dict"].items() if not k.startswith("pr_")}
    torch.save(state, eagle3 / "training_state.pt")
    export_checkpoint(str(eagle3), str(root / "eagle3-sglang"), "sglang", draft_config=str(root / "draft.json"))
    prompts = [torch.load(root / "features" / "rows_0-2000" / f"data_{i}.ckpt")["input_ids"][:12].tolist()
               for i in range(3)]
    g = torch.Generator().manual_seed(7)
    prompts.append(torch.randint(3, len(tok), (10,), generator=g).tolist())  # off the training distribution
    return {"root": root, "target": str(root / "target"), "pr": str(root / "pr-sglang"),
            "eagle3": str(root / "eagle3-sglang"), "hf": str(root / "hf"), "prompts": prompts}


PLAIN_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve_plain.sh")


@pytest.fixture(scope="package")
def plain_server(live_run, tmp_path_factory):
    """The port of SGLang serving the target alone (plain greedy; with its tokenizer and chat template). Package-scoped:
    one start-up for every live module (its scheduler sleeps on idle, `--sleep-on-idle`). On a CPU it is the
    documented plain reference server, `scripts/sglang_cpu_serve_plain.sh`."""
    log = tmp_path_factory.mktemp("log") / "plain.log"
    if LIVE_DEVICE != "cpu":
        with sglang_server(live_run["target"], log) as port:
            yield port
        return
    from pr_specforge.sglang_cpu import child_env

    port = free_port()
    env = child_env(dict(ENV, HF_HUB_OFFLINE="1", PYTHON=sys.executable))
    with serving(["bash", PLAIN_SCRIPT, live_run["target"], str(port)], port, log, env):
        yield port


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


@pytest.fixture(scope="package")
def plain(live_run, plain_server):
    """Plain greedy serving's output ids for each live prompt."""
    from tests.sglang_live.eagle3 import MAX_NEW

    return [greedy(plain_server, p, MAX_NEW)["output_ids"] for p in live_run["prompts"]]
