"""Shared by the live `PR_EAGLE3` test modules: a PR server at one shape, our decoder at the same shape, and
the comparison (tolerance zero) of outputs, verify rounds, accepted drafts and every round's tree.

The server is SGLang 0.5.14's `launch_server` through the CPU bridge with our plugin (fp32, greedy,
127.0.0.1, a free port, stopped by `sglang_server` also on failure); the worker appends each round's tree
(tokens, parents) and counters to `PR_EAGLE3_ROUND_LOG`, keyed by the request id SGLang returns in
`meta_info["id"]`. The reference is `SpeculativeDecoder` (our evaluator's decoder, HF target and our PR
drafter from the `--to hf` export of the same run) with the same (k, B_w, m, gamma, B) and seed 0.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch

from tests.sglang_live.conftest import extra_rounds, post, server_file, sglang_server, shared_sglang, with_port

MAX_NEW = 24


@dataclass(frozen=True)
class Shape:
    k: int
    bw: int
    m: int
    gamma: int
    budget: int


def pr_args(draft: str, shape: Shape):
    return ("--speculative-algorithm", "PR_EAGLE3", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(shape.gamma), "--speculative-eagle-topk", str(shape.k),
            "--speculative-num-draft-tokens", str(shape.budget + 1))


def pr_server(live_run, log_dir, shape: Shape, times=None, env=None, args=(), overlap: bool = False):
    """`sglang_server` serving the PR export at `shape` (B_w and m through the environment); its round log.
    Every draft runs under the host-read check (`PR_EAGLE3_CHECK_HOST_READS=on`): a read that would wait for the
    device fails the request. With `times` (a path), the server also times its rounds there
    (`PR_EAGLE3_ROUND_TIMES`); `env` and `args`: more environment and launch flags; `overlap`: SGLang's overlap
    schedule."""
    rounds = log_dir / "rounds.jsonl"
    env = {"PR_EAGLE3_BW": str(shape.bw), "PR_EAGLE3_M": str(shape.m), "PR_EAGLE3_ROUND_LOG": str(rounds),
           "PR_EAGLE3_CHECK_HOST_READS": "on", **(env or {})}
    if times is not None:
        env["PR_EAGLE3_ROUND_TIMES"] = str(times)
    return sglang_server(live_run["target"], log_dir / "server.log", *pr_args(live_run["pr"], shape), *args,
                         env=env, overlap=overlap), rounds


def shared_pr(shared, live_run, shape: Shape, times: bool = False, env=None, args=(), overlap: bool = False,
              rounds: bool = True, python: str = "", name: str = ""):
    """The session's PR server of this launch (`pr_server`'s settings; `rounds`: with its round log; `python`: the
    interpreter whose SGLang serves): `(server, round log path or None, round times path or None)`. Modules that ask for
    the same launch share one server; the per-request settings (m, B_w, seeds) go through their requests."""
    files = (["PR_EAGLE3_ROUND_LOG"] if rounds else []) + (["PR_EAGLE3_ROUND_TIMES"] if times else [])
    base = {"PR_EAGLE3_BW": str(shape.bw), "PR_EAGLE3_M": str(shape.m), "PR_EAGLE3_CHECK_HOST_READS": "on"}
    if not rounds:
        base["PR_EAGLE3_ROUND_LOG"] = ""
    env = {**base, **(env or {})}
    name = name or f"pr-k{shape.k}-g{shape.gamma}-b{shape.budget}"
    server = shared_sglang(shared, name, live_run["target"], *pr_args(live_run["pr"], shape), *args, env=env,
                           overlap=overlap, python=python, files=files)
    return (server, server_file(server, "PR_EAGLE3_ROUND_LOG") if rounds else None,
            server_file(server, "PR_EAGLE3_ROUND_TIMES") if times else None)


def generate(port: int, ids, bw=None, m=None, seed=None) -> dict:
    """A greedy request (`seed`: its `sampling_seed`, which seeds the PR tree as our decoder's `seed` does)."""
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    if seed is not None:
        params["sampling_seed"] = seed
    if bw is not None or m is not None:
        params["custom_params"] = {"pr_eagle3": {k: v for k, v in (("bw", bw), ("m", m)) if v is not None}}
    return post(port, "/generate", {"input_ids": list(ids), "sampling_params": params})


def generate_together(port: int, prompts, **kw) -> List[dict]:
    """`generate` of every prompt at once: one thread each, released together by a barrier (a thread the OS starts
    late on a busy CPU would otherwise post after the others began decoding), so the server batches them."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(len(prompts))

    def one(ids):
        barrier.wait(timeout=120)
        return generate(port, ids, **kw)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def round_log(path) -> Dict[str, List[dict]]:
    by_rid = collections.defaultdict(list)
    if not path.exists():
        return by_rid
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_rid[row["rid"]].append(row)
    return by_rid


class Ours:
    """Our evaluator's decoder on the live run's target and drafter, recording every round's tree."""

    def __init__(self, live_run):
        from pr_specforge.eval.evaluator import load_target
        from pr_specforge.modeling import load_drafter

        self.target, _ = load_target(live_run["target"])
        self.drafter = load_drafter(live_run["hf"], "cpu", torch.float32)

    def decode(self, shape: Shape, prompts, seeds=None):
        """Each prompt decoded at `shape` with its seed (`seeds`, default 0 for each)."""
        from pr_specforge.serving import SpeculativeDecoder, TreeConfig

        dec = SpeculativeDecoder(self.target, self.drafter, TreeConfig(budget=shape.budget, k=shape.k, bw=shape.bw,
                                                                       gamma=shape.gamma, m=shape.m))
        draft, trees, out = dec.draft, [], []

        def recording(*args):
            tree = draft(*args)
            trees[-1].append((tree.tokens(), tree.parents()))
            return tree

        dec.draft = recording
        for p, seed in zip(prompts, seeds or [0] * len(prompts)):
            trees.append([])
            res = dec.generate(p, MAX_NEW, 0.0, seed, None)
            out.append({"tokens": res.tokens, "rounds": res.rounds, "accepted": sum(res.accept_lengths) - res.rounds,
                        "recon_kept": res.recon_kept, "recon_rows": res.recon_rows, "trees": trees[-1]})
        return out


def served_counts(out: dict, log: Dict[str, List[dict]], overlap: bool = False) -> dict:
    """What the server says about one request: its tokens, its own verify rounds and accepted drafts
    (`meta_info`), and the worker's trees and counters for it (the round log). Under SGLang's overlap schedule
    (`overlap`) a request is drafted once more after its last verify round (the scheduler learns that it finished one
    batch late and drops that round): the log may hold one round more than it verified, and the counts are taken
    over the verified rounds."""
    meta = out["meta_info"]
    rows = log[meta["id"]]
    extra = len(rows) - meta["spec_verify_ct"]
    assert extra in extra_rounds(overlap), f"{len(rows)} logged rounds, {meta['spec_verify_ct']} verified"
    rows = rows[: meta["spec_verify_ct"]]
    return {"tokens": out["output_ids"], "rounds": meta["spec_verify_ct"], "accepted": meta["spec_num_correct_drafts"],
            "recon_kept": sum(r["recon_kept"] for r in rows), "recon_rows": sum(r["recon_rows"] for r in rows),
            "trees": [(r["tokens"], r["parents"]) for r in rows]}


def assert_same(served: List[dict], reference: List[dict]) -> None:
    """Tolerance zero: every prompt's output, rounds, accepted drafts, counters, and each round's tree."""
    for i, (got, ref) in enumerate(zip(served, reference)):
        for key in ("tokens", "rounds", "accepted", "recon_kept", "recon_rows"):
            assert got[key] == ref[key], f"prompt {i}: {key} served {got[key]} vs ours {ref[key]}"
        assert len(got["trees"]) == got["rounds"], f"prompt {i}: the worker drafted {len(got['trees'])} trees"
        for r, (a, b) in enumerate(zip(got["trees"], ref["trees"])):
            assert a == b, f"prompt {i}, round {r}: served tree {a} vs ours {b}"


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
#: the 0.5.23 PR server's shape: small enough that SGLang's warm-up request in Triton's interpreter starts in CI's budget
SCRIPT_SHAPE = Shape(k=2, bw=2, m=1, gamma=3, budget=6)


def targeted_export(live_run, name: str, target: str) -> str:
    """The live run's checkpoint exported the way `make run` does (`export CKPT OUT --to sglang --target TARGET`), once
    per session (under the run's root)."""
    from pr_specforge.export import main as export_main
    from tests.live_pair import STEPS

    out = Path(live_run["root"]) / name
    if not out.exists():
        ckpt = str(Path(live_run["root"]) / "out" / f"specforge-run-step{STEPS}")
        assert export_main([ckpt, str(out), "--to", "sglang", "--target", target]) == 0
    return str(out)


def shared_pr_script_0523(shared, live_run):
    """The session's `PR_EAGLE3` server on SGLang 0.5.23: `scripts/sglang_cpu_serve_pr.sh` run by `.venv-serve`'s
    interpreter (SGLang's own environment with only the serving install, no SpecForge), with no test environment of
    ours but the plugin's per-server settings (B_w, m, its round log, the host-read check): no PYTHONPATH, no bridge
    environment (the script sets what it needs; its preflight gives the draft, and PR's rows, SGLang's Triton attention
    in Triton's interpreter). The export is made as `make run` makes it; the shape (k 2, gamma 3, B 6) follows PORT
    (later flags override the script's k 6, gamma 8, B 48). `(server, round log)`."""
    from pr_specforge.local_server import free_port, serving
    from tests.export.conftest import ENV
    from tests.serve_contract import serve_python

    python = serve_python()
    export = targeted_export(live_run, "pr-sglang-targeted", live_run["target"])
    shape = SCRIPT_SHAPE
    flags = ("--speculative-eagle-topk", str(shape.k), "--speculative-num-steps", str(shape.gamma),
             "--speculative-num-draft-tokens", str(shape.budget + 1))
    settings = {"PR_EAGLE3_BW": str(shape.bw), "PR_EAGLE3_M": str(shape.m), "PR_EAGLE3_CHECK_HOST_READS": "on"}
    key = {"engine": "sglang", "script": "sglang_cpu_serve_pr.sh", "python": python, "model": live_run["target"],
           "draft": export, "args": flags, "env": settings}

    def start(log):
        env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
        env.update(settings, HF_HUB_OFFLINE="1", PYTHON=python, PR_EAGLE3_ROUND_LOG=str(log) + ".PR_EAGLE3_ROUND_LOG")
        port = free_port()
        cmd = ["bash", str(SCRIPTS / "sglang_cpu_serve_pr.sh"), live_run["target"], export, str(port), *flags]
        # its start-up includes SGLang's warm-up request, minutes in Triton's interpreter on a small CPU
        # started outside the checkout (the registry's directory): the installed package serves (issue 74)
        return with_port(serving(cmd, port, log, env, start_timeout=1200, cwd=str(Path(log).parent)), port)

    server = shared.get("pr-script-0.5.23", key, start)
    return server, server_file(server, "PR_EAGLE3_ROUND_LOG")
