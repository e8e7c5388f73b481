"""What a served round costs: PR_EAGLE3 against SGLang's EAGLE3, live, side by side in one run.

    TORCHDYNAMO_DISABLE=1 python benchmarks/serving_cost.py --target work/smollm2/target \
        --draft work/smollm2/export/pr-sglang --machine "quiet 2-core CPU" \
        --json benchmarks/results/serving_cost.json --md benchmarks/results/serving_cost.md

(`make run` makes the target and the export.) For each tree shape (`--shapes`: `paper` = k 6, gamma 8, B 48;
`small` = k 2, gamma 3, B 6; B_w = k) and each of `--repeats` repeats, a new pair of SGLang 0.5.14 servers runs
through the CPU bridge (or on a GPU: `--device cuda`, Triton attention, `--cuda-graph` for SGLang's graphs), fp32
(`--dtype`), greedy, each on 127.0.0.1 and stopped after its repeat, also on failure (a server process may run all
its compute a few percent slower than another, so each repeat samples a new pair; each pair's ratios are kept,
`per_server_pair`):
  eagle3  `--speculative-algorithm EAGLE3`, SGLang's own draft (the same export, read as plain EAGLE-3);
  pr      `--speculative-algorithm PR_EAGLE3`, our plugin; each request sets its m
          (`custom_params.pr_eagle3.m`): `pr_m0` (m = 0: every request of the batch at m = 0, so SGLang's own
          draft drafts it, `PR_EAGLE3_M0_DRAFT=sglang`; `--m0-draft pr`: the plugin's round with no reconsideration row)
          and `pr_m3` (m = `--m`, default 3: co-forwarded reconsideration rows every step).
Both servers sleep on idle, so the one not being asked does not take a core. For each number of concurrent
requests (`--requests`, default 1 and 4), in each repeat, the three ways are asked in turn (the order
rotating every repeat) with the same prompts (MT-Bench's first turns through the target's chat template,
`--max-new` tokens, `ignore_eos`). Each server times its rounds (`pr_specforge.sglang_plugin.timing`, the
same wrappers for both algorithms):
  round_s   one decode round of SGLang's V2 worker: draft + target verify + draft-extend;
  floor_s   the round's model compute alone: the target's and the draft model runner's forwards, and for PR
            our drafter's head and gate readouts (SGLang's EAGLE3 runs those inside its draft forward);
  the rest  (round_s - floor_s) is bookkeeping: the tree, SGLang's top-k selection, the verify input;
  draft_s, draft_floor_s  the draft phase alone and its model compute (the part the two algorithms differ in:
            verify and draft-extend are SGLang's in both).
`--readouts` sets the PR server's `PR_EAGLE3_READOUTS` (default `batched`: our drafter's heads and gate read every
request's rows of a step in one call); the result records it and what the server logged of its row invariance.
Rounds whose batch is not all of a cell's requests (requests finish at different rounds) are left out. Per
cell: the median round, floor and phases, tau (tokens per verify round) and tokens per second end to end
(output tokens of the cell's requests over the wall time from sending to the last answer, prefill included).
The ratios and the issue's targets: `m0_over_eagle3` (round time, target <= 1.05; and `m0_over_eagle3_per_target`,
each round over its own server's median target compute: the same forward in both servers, so this cancels a
server process that runs all its compute slower, which on a 2-core CPU swings the plain ratio by 10%), `m3_over_m0` against the
floor's own ratio (target, as we read "within 0.05x of the compute floor": m3_over_m0 <= m3_floor_over_m0_floor
+ 0.05 on a CPU; m3_over_m0 <= 1.05 on a GPU).
`--ops also|only`: each shape's device ops per round as well (also) or alone (only): one more pair of servers
with `PR_EAGLE3_OP_COUNTS` (`pr_specforge.sglang_plugin.op_counts`: each decode round under the torch profiler,
its outermost working torch operators counted, the kernel launches a GPU would make), each way asked once per
number of requests; per cell and way the ops of the round and of each phase (draft, verify, extend), what each PR
way adds to EAGLE3's draft per round, its draft per row step and once a round (the row steps its round labels,
`pr_specforge.op_parts.step`: dividing a round's ops by gamma would hide the per-round ones; SGLang's own draft
labels none), and its draft by part (`pr_specforge.op_parts`: load, tree, frontier, bids, row_inputs, rows,
readouts, pool, repricing, cut, pack, encoding, verify_input; `model`: the draft model's forwards). Counts do not
depend on the machine's load.
`--untimed`: no round timing (its wrappers synchronise the device after each phase), so only tau and tokens per
second, with their ratios pooled and per server pair; `--overlap` (implies it): SGLang's overlap schedule on both
servers, whose gain a synchronising timer would hide. On a CPU nothing overlaps; the pair is for a GPU
(`scripts/gpu_pr_eagle3_check.sh`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"paper": dict(k=6, gamma=8, budget=48), "small": dict(k=2, gamma=3, budget=6)}
PHASES = ("round_s", "floor_s", "draft_s", "verify_s", "extend_s", "target_compute_s", "draft_compute_s",
          "readout_compute_s")


def spec_args(algorithm: str, draft: str, shape: dict) -> List[str]:
    return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(shape["gamma"]), "--speculative-eagle-topk", str(shape["k"]),
            "--speculative-num-draft-tokens", str(shape["budget"] + 1)]


def prompt_ids(target: str, n: int) -> List[List[int]]:
    """The first turns of MT-Bench's first `n` prompts, through the target's chat template."""
    from transformers import AutoTokenizer

    from pr_specforge.data.prompts import load_prompts
    from pr_specforge.eval.evaluator import _encoder

    encode = _encoder(AutoTokenizer.from_pretrained(target))
    return [encode([{"role": "user", "content": p.turns[0]}]) for p in load_prompts("mtbench", limit=n)]


def ask(port: int, ids: List[List[int]], max_new: int, m=None) -> dict:
    """`len(ids)` concurrent requests; their answers and the wall time from sending to the last answer."""
    from pr_specforge.sglang_cpu.server import post

    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if m is not None:
        params["custom_params"] = {"pr_eagle3": {"m": m}}
    body = lambda p: {"input_ids": p, "sampling_params": params}  # noqa: E731
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(lambda p: post(port, "/generate", body(p)), ids))
    wall = time.perf_counter() - t0
    metas = [o["meta_info"] for o in outs]
    return {"wall_s": wall, "rids": [mt["id"] for mt in metas], "tokens": sum(len(o["output_ids"]) for o in outs),
            "rounds": sum(int(mt["spec_verify_ct"]) for mt in metas), "outputs": [o["output_ids"] for o in outs]}


def read_times(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def cell_summary(asks: List[dict], rounds: List[dict], n: int) -> dict:
    """A cell's medians from its asks (one per repeat) and the timed rounds of their requests."""
    rids = {rid for a in asks for rid in a["rids"]}
    full = [r for r in rounds if r["batch"] == n and set(r["rids"]) <= rids]
    if not full:
        raise RuntimeError(f"no timed round with all {n} requests of a cell: is PR_EAGLE3_ROUND_TIMES reaching the server?")
    out = {k: statistics.median(r.get(k, 0.0) for r in full) for k in PHASES}
    out["bookkeeping_s"] = statistics.median(r["round_s"] - r["floor_s"] for r in full)
    draft_floor = [r.get("draft.draft_compute_s", 0.0) + r.get("draft.readout_compute_s", 0.0) for r in full]
    out["draft_floor_s"] = statistics.median(draft_floor)
    out["draft_bookkeeping_s"] = statistics.median(r["draft_s"] - f for r, f in zip(full, draft_floor))
    out["rounds_timed"] = len(full)
    out.update(throughput(asks))
    return out


def throughput(asks: List[dict]) -> dict:
    """A cell's tau (tokens per verify round) and median tokens per second end to end, from its asks alone."""
    return {"tau": sum(a["tokens"] for a in asks) / max(1, sum(a["rounds"] for a in asks)),
            "tokens_per_s": statistics.median(a["tokens"] / a["wall_s"] for a in asks)}


def throughput_ratios(cells: Dict[str, dict]) -> dict:
    """An untimed run's ratios: tokens per second of m = 0 over EAGLE3's and of m = 3 over m = 0's."""
    e, m0, m3 = (cells[w] for w in WAYS)
    return {"m0_tokens_per_s_over_eagle3": m0["tokens_per_s"] / e["tokens_per_s"],
            "m3_tokens_per_s_over_m0": m3["tokens_per_s"] / m0["tokens_per_s"]}


def ratios(cells: Dict[str, dict], gpu: bool) -> dict:
    e, m0, m3 = (cells[w] for w in WAYS)
    r = {"m0_over_eagle3": m0["round_s"] / e["round_s"], "m0_floor_over_eagle3_floor": m0["floor_s"] / e["floor_s"],
         "m3_over_m0": m3["round_s"] / m0["round_s"], "m3_floor_over_m0_floor": m3["floor_s"] / m0["floor_s"],
         "draft_m0_over_eagle3": m0["draft_s"] / e["draft_s"], "draft_m3_over_m0": m3["draft_s"] / m0["draft_s"],
         "draft_floor_m3_over_m0": m3["draft_floor_s"] / m0["draft_floor_s"]}
    r["target_m0_within_1.05_of_eagle3"] = r["m0_over_eagle3"] <= 1.05
    if e.get("target_compute_s") and m0.get("target_compute_s"):  # each round in its own server's target forwards
        r["m0_over_eagle3_per_target"] = (m0["round_s"] / m0["target_compute_s"]) / (e["round_s"] / e["target_compute_s"])
        r["target_m0_within_1.05_of_eagle3_per_target"] = r["m0_over_eagle3_per_target"] <= 1.05
    if gpu:
        r["target_m3_within_1.05_of_m0"] = r["m3_over_m0"] <= 1.05
    else:
        r["target_m3_within_0.05_of_floor_ratio"] = r["m3_over_m0"] <= r["m3_floor_over_m0_floor"] + 0.05
    return r


def _tables():
    """benchmarks/serving_cost_tables.py (the markdown), loaded from this file's folder (benchmarks are no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_cost_tables", Path(__file__).with_name("serving_cost_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_T = _tables()
WAYS, PART_ORDER = _T.WAYS, _T.PART_ORDER
markdown, ops_markdown, timed_markdown, throughput_markdown = (_T.markdown, _T.ops_markdown, _T.timed_markdown,
                                                               _T.throughput_markdown)
per_target, device_note, m0_note, readouts_note = _T.per_target, _T.device_note, _T.m0_note, _T.readouts_note



def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    return f"{platform.processor() or platform.machine()} x {os.cpu_count()}"


def check_inputs(args) -> None:
    for name, path, need in (("--target", args.target, "config.json"), ("--draft", args.draft, "config.json")):
        if not os.path.isfile(os.path.join(path, need)):
            raise SystemExit(f"serving_cost: {name} {path}: no {need} there (make run makes "
                             "work/smollm2/target and work/smollm2/export/pr-sglang)")
    if not any(str(k).startswith("pr_") for k in json.load(open(os.path.join(args.draft, "config.json")))):
        raise SystemExit(f"serving_cost: --draft {args.draft}: not a PR export (no pr_* field in config.json)")
    for s in args.shapes:
        if s not in SHAPES:
            raise SystemExit(f"serving_cost: --shapes: {s!r} is not one of {', '.join(SHAPES)}")


def run_shape(args, shape_name: str, prompts, work: str, log) -> Dict[str, dict]:
    """One shape's cells. Each repeat starts its own pair of servers (EAGLE3 and PR_EAGLE3, new processes) and stops
    them after its asks: one server process may run all its compute some percent slower than another, so the
    repeats sample that spread instead of keeping one pair's luck."""
    asks, rounds = {}, []
    out = count_shape(args, shape_name, prompts, work, log) if args.ops else {}
    if args.ops == "only":
        return out
    for rep in range(args.repeats):
        times = {a: os.path.join(work, f"{shape_name}-{a}-rounds-{rep + 1}.jsonl") for a in ("eagle3", "pr")}
        with server_pair(args, shape_name, prompts, work, f"repeat {rep + 1}/{args.repeats}", str(rep + 1),
                         None if args.untimed else ("PR_EAGLE3_ROUND_TIMES", times), log) as call:
            for n in args.requests:
                order = WAYS[rep % 3:] + WAYS[: rep % 3]
                for w in order:
                    a = call[w](prompts[rep * n % len(prompts):][:n] if len(prompts) >= n else prompts[:n])
                    asks.setdefault((n, w), []).append(a)
                    log(f"{shape_name} n={n} {w} repeat {rep + 1}/{args.repeats}: {a['tokens']} tokens in "
                        f"{a['wall_s']:.1f} s, tau {a['tokens'] / max(1, a['rounds']):.2f}")
        rounds.append({"eagle3": read_times(times["eagle3"]), "pr": read_times(times["pr"])})
    readouts = served_readouts(os.path.join(work, f"{shape_name}-pr-1.log"))
    pooled = {alg: [r for rep in rounds for r in rep[alg]] for alg in ("eagle3", "pr")}
    for n in args.requests:
        same = all(a["outputs"] == b["outputs"] for w in WAYS[1:] for a, b in zip(asks[(n, "eagle3")], asks[(n, w)]))
        if args.untimed:  # tau and tokens/s only
            cells = {w: throughput(asks[(n, w)]) for w in WAYS}
            ratio = throughput_ratios(cells)
            per_pair = [throughput_ratios({w: throughput([asks[(n, w)][rep]]) for w in WAYS})
                        for rep in range(args.repeats)]
        else:
            cells = {w: cell_summary(asks[(n, w)], pooled[_alg(w)], n) for w in WAYS}
            ratio = ratios(cells, gpu=args.device == "cuda")
            per_pair = [pair_ratios({w: (asks[(n, w)][rep], rounds[rep][_alg(w)]) for w in WAYS}, n,
                                    args.device == "cuda") for rep in range(args.repeats)]
        out.setdefault(f"{shape_name}/{n}", {}).update(
            {"ways": cells, "ratios": ratio, "per_server_pair": per_pair, "outputs_equal_eagle3": same,
             "readouts": readouts})
    return out


@contextlib.contextmanager
def server_pair(args, shape_name: str, prompts, work: str, what: str, tag: str, record, log):
    """An EAGLE3 and a PR_EAGLE3 server at `shape_name` (new processes, stopped on exit, also on failure), each warmed
    up with one request of each way it serves; yields `{way: ask(ids)}`. `record`: None, or (environment switch,
    {alg: file}): the file each server records its rounds in (`PR_EAGLE3_ROUND_TIMES`, `PR_EAGLE3_OP_COUNTS`)."""
    from pr_specforge.sglang_cpu.server import free_port, launch_command, server_env, serving

    shape = SHAPES[shape_name]
    ports = {}
    with contextlib.ExitStack() as stack:
        for alg, name in (("eagle3", "EAGLE3"), ("pr", "PR_EAGLE3")):
            port = free_port()
            env = dict(os.environ, HF_HUB_OFFLINE="1", PR_EAGLE3_BW=str(shape["k"]), PR_EAGLE3_M=str(args.m),
                       PR_EAGLE3_READOUTS=args.readouts, PR_EAGLE3_M0_DRAFT=args.m0_draft)
            for switch in RECORDERS:
                env.pop(switch, None)
            if record is not None:
                env[record[0]] = record[1][alg]
            env = server_env(args.device, env)
            log(f"{shape_name} {what}: starting {name} on 127.0.0.1:{port} ({args.device}, "
                f"CUDA graphs {'on' if args.cuda_graph else 'off'}, overlap schedule {'on' if args.overlap else 'off'})")
            cmd = launch_command(args.target, port, *spec_args(name, args.draft, shape), dtype=args.dtype,
                                 max_total_tokens=args.max_total_tokens, device=args.device,
                                 cuda_graph=args.cuda_graph, overlap=args.overlap)
            stack.enter_context(serving(cmd, port, os.path.join(work, f"{shape_name}-{alg}-{tag}.log"), env))
            ports[alg] = port
        call = {"eagle3": lambda ids: ask(ports["eagle3"], ids, args.max_new),
                "pr_m0": lambda ids: ask(ports["pr"], ids, args.max_new, m=0),
                "pr_m3": lambda ids: ask(ports["pr"], ids, args.max_new, m=args.m)}
        for w in WAYS:  # warm-up: one request each, not recorded in a cell
            call[w](prompts[:1])
        yield call


#: the servers' recording switches (`pr_specforge.sglang_plugin.timing`, `op_counts`): one at most per server
RECORDERS = ("PR_EAGLE3_ROUND_TIMES", "PR_EAGLE3_OP_COUNTS")


def count_shape(args, shape_name: str, prompts, work: str, log) -> Dict[str, dict]:
    """One shape's op counts (`--ops`): one pair of servers that count their rounds' device ops
    (`PR_EAGLE3_OP_COUNTS`, `pr_specforge.sglang_plugin.op_counts`; the counts do not depend on the machine's load, so
    one pair is enough), each way asked with each number of requests -> `{"shape/n": {"ops": {way: cell_ops},
    "ops_ratios": ops_ratios}}`."""
    files = {a: os.path.join(work, f"{shape_name}-{a}-ops.jsonl") for a in ("eagle3", "pr")}
    asks = {}
    with server_pair(args, shape_name, prompts, work, "op counts", "ops", ("PR_EAGLE3_OP_COUNTS", files), log) as call:
        for n in args.requests:
            for w in WAYS:
                asks[(n, w)] = a = call[w](prompts[:n])
                log(f"{shape_name} n={n} {w} op counts: {a['tokens']} tokens, {a['rounds']} rounds")
    rounds = {a: read_times(f) for a, f in files.items()}
    gamma, out = SHAPES[shape_name]["gamma"], {}
    for n in args.requests:
        ops = {w: cell_ops([asks[(n, w)]], rounds[_alg(w)], n) for w in WAYS}
        out[f"{shape_name}/{n}"] = {"ops": ops, "ops_ratios": ops_ratios(ops, gamma)}
    return out


def cell_ops(asks: List[dict], rounds: List[dict], n: int) -> dict:
    """A cell's device ops per round (medians over the counted rounds whose batch is all of its requests): the
    round's, each phase's, the draft phase's by part, and one such round's draft ops by operator name."""
    rids = {rid for a in asks for rid in a["rids"]}
    full = [r for r in rounds if r["batch"] == n and set(r["rids"]) <= rids]
    if not full:
        raise RuntimeError(f"no counted round with all {n} requests of a cell: is PR_EAGLE3_OP_COUNTS reaching the "
                           "server?")
    total = lambda r, ph: sum(r["ops"].get(ph, {}).values())  # noqa: E731
    out = {"round": statistics.median(sum(total(r, ph) for ph in r["ops"]) for r in full)}
    for ph in OP_PHASES:
        out[ph] = statistics.median(total(r, ph) for r in full)
    parts = sorted({p for r in full for p in r["ops"].get("draft", {})})
    out["draft_parts"] = {p: statistics.median(r["ops"].get("draft", {}).get(p, 0) for r in full) for p in parts}
    out["draft_names"] = full[len(full) // 2]["names"].get("draft", {})
    steps = [r.get("steps", {}).get("draft") for r in full]
    if all(steps):  # rounds that label their row steps (`op_parts.step`: PR's round, counted since 2026-12-08)
        out["draft_row_steps"] = statistics.median(st["steps"] for st in steps)
        out["draft_in_row_steps"] = statistics.median(st["ops"] for st in steps)
        in_parts = sorted({p for st in steps for p in st["parts"]})
        out["draft_parts_in_row_steps"] = {p: statistics.median(st["parts"].get(p, 0) for st in steps)
                                           for p in in_parts}
    out["rounds_counted"] = len(full)
    return out


#: a round's phases as the op counter labels them (`other`: the round's ops outside the three)
OP_PHASES = ("draft", "verify", "extend", "other")


def ops_ratios(ops: Dict[str, dict], gamma: int) -> dict:
    """Per round, what each PR way adds to EAGLE3's draft ops; where the counted rounds label their row steps
    (`row_split`), each way's draft ops per row step (the ops inside the steps over the steps) and per round (the
    rest: load, root, cut, pack, encoding), by part too. Also, as before, the draft phase's ops over its gamma steps
    (`*_per_step`: an average that spreads the per-round ops over the steps, kept for comparison with older
    results; the reports print the split instead)."""
    e = ops["eagle3"]
    r = {"eagle3_draft_ops_per_step": e["draft"] / gamma}
    for w in WAYS[1:]:
        c = ops[w]
        r[f"{w}_draft_ops_per_step"] = c["draft"] / gamma
        r[f"{w}_added_ops_per_step"] = (c["draft"] - e["draft"]) / gamma
        r[f"{w}_added_ops_per_round"] = c["draft"] - e["draft"]
        r[f"{w}_round_ops_over_eagle3"] = c["round"] / e["round"]
        r[f"{w}_parts_per_step"] = {p: v / gamma for p, v in c["draft_parts"].items()}
    for w in WAYS:
        split = row_split(ops[w])
        if split is not None:
            r[f"{w}_row_split"] = split
    return r


def row_split(c: dict) -> Optional[dict]:
    """One way's draft ops split into its row steps' and its round's own, from a cell's counts whose rounds label
    their row steps (None otherwise, or where the draft ran no labelled step: SGLang's own EAGLE-3 draft labels
    none): `row_steps`, `ops_per_row_step`, `ops_per_round` (outside the steps), and by part each part's ops per
    row step and per round."""
    steps = c.get("draft_row_steps")
    if not steps:
        return None
    inside = c["draft_parts_in_row_steps"]
    parts = {p: {"per_row_step": inside.get(p, 0) / steps, "per_round": v - inside.get(p, 0)}
             for p, v in c["draft_parts"].items()}
    return {"row_steps": steps, "ops_per_row_step": c["draft_in_row_steps"] / steps,
            "ops_per_round": c["draft"] - c["draft_in_row_steps"], "parts": parts}


def pair_ratios(by_way: Dict[str, tuple], n: int, gpu: bool) -> dict:
    """One server pair's ratios (`PAIR_RATIOS`) from each way's ask and its server's timed rounds; {} where a way had
    no round with all `n` requests in that pair."""
    try:
        r = ratios({w: cell_summary([a], rounds, n) for w, (a, rounds) in by_way.items()}, gpu)
    except RuntimeError:
        return {}
    return {k: r[k] for k in PAIR_RATIOS if k in r}


def _alg(way: str) -> str:
    return "eagle3" if way == "eagle3" else "pr"


#: the ratios kept per repeat (per server pair)
PAIR_RATIOS = ("m0_over_eagle3", "m0_over_eagle3_per_target", "m3_over_m0", "m3_floor_over_m0_floor")


def served_readouts(log_path: str) -> dict:
    """What the PR server said at start-up (the worker's `READY_LINE`): its readouts, whether a row's readouts were
    call-independent there, its rows' attention and round graph."""
    import re

    from pr_specforge.sglang_plugin.worker import READY_LINE

    pattern = re.escape(READY_LINE).replace("%s", "(\\w+)")
    found = re.search(pattern, open(log_path).read())
    if not found:
        raise RuntimeError(f"{log_path}: the PR_EAGLE3 server did not log its readouts")
    attention, mode, graph, same = found.groups()
    return {"mode": mode, "row_invariant": same == "True", "attention": attention, "graph": graph}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="work/smollm2/target")
    p.add_argument("--draft", default="work/smollm2/export/pr-sglang", help="a PR export (`--to sglang`)")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["paper", "small"])
    p.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--m", type=int, default=3, help="the reconsideration rows per step of the pr_m3 way")
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--readouts", choices=("batched", "request"), default="batched",
                   help="PR_EAGLE3_READOUTS of the PR server: the heads and gate in one call per step for the batch "
                        "(batched) or one per request")
    p.add_argument("--m0-draft", choices=("sglang", "pr"), default="sglang",
                   help="PR_EAGLE3_M0_DRAFT of the PR server: who drafts the pr_m0 way's batches (all at m = 0): "
                        "SGLang's own draft (sglang, the plugin's default) or PR's round with no reconsideration row")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: through the CPU bridge; cuda: a stock GPU launch (Triton attention, PR rows on Triton)")
    p.add_argument("--cuda-graph", action="store_true", help="on --device cuda: SGLang's CUDA graphs on (default off)")
    p.add_argument("--untimed", action="store_true",
                   help="no round timing (its wrappers synchronise the device): tau and tokens/s only")
    p.add_argument("--overlap", action="store_true",
                   help="SGLang's overlap schedule on both servers (implies --untimed)")
    p.add_argument("--ops", choices=("also", "only"), default=None,
                   help="count each round's device ops (one more server pair per shape, `PR_EAGLE3_OP_COUNTS`): "
                        "also (beside the timed repeats) or only (no timed repeats)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--machine", default="quiet machine")
    p.add_argument("--work", default=None, help="where the servers' logs and round times go (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    args.untimed = args.untimed or args.overlap
    check_inputs(args)
    if min(args.requests) < 1 or args.repeats < 1 or args.max_new < 2 or args.m < 1:
        raise SystemExit("serving_cost: --requests, --repeats and --m must be >= 1, --max-new >= 2")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("serving_cost: --device cuda: torch sees no CUDA device here")
    if args.device == "cpu" and args.cuda_graph:
        raise SystemExit("serving_cost: --cuda-graph needs --device cuda (the CPU bridge runs without graphs)")

    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    prompts = prompt_ids(args.target, max(args.requests) * args.repeats)
    work = args.work or tempfile.mkdtemp(prefix="serving_cost-")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    cells = {}
    for s in args.shapes:
        cells.update(run_shape(args, s, prompts, work, log))
    result = {"machine": args.machine, "cpu": cpu_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
              "threads": torch.get_num_threads(), "dtype": args.dtype, "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "cuda_graph": args.cuda_graph,
              "timed": not args.untimed, "overlap": args.overlap,
              "target_name": os.path.basename(os.path.normpath(args.target)),
              "draft_name": os.path.basename(os.path.normpath(args.draft)), "max_new": args.max_new,
              "repeats": args.repeats, "m": args.m, "shapes": {s: SHAPES[s] for s in args.shapes},
              "readouts": args.readouts, "m0_draft": args.m0_draft, "ops": args.ops,
              "wall_s": time.time() - t0, "cells": cells,
              "command": "python benchmarks/serving_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:])}
    table = markdown(result)
    print(table)
    if args.json:
        atomic_write_json(args.json, result)
    if args.md:
        atomic_write_text(args.md, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
