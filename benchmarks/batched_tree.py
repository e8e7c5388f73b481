"""Drafting rounds for several running requests: the per-request tree builder vs the batched one.

    OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 python benchmarks/batched_tree.py --threads 1 --clock cpu \
        --repeats 21 --machine "quiet 2-core CPU" \
        --json benchmarks/results/batched_tree.json --md benchmarks/results/batched_tree.md

For each tree shape (`--shapes`: `paper` = k 6, B_w 6, m 3, gamma 8, B 48; `small` = k 2, B_w 2,
m 1, gamma 3, B 6) and each number of concurrent requests (`--requests`, default 1 and 4), times one
round for all the requests, interleaved, median of `--repeats`:
  per_request  `TensorTreeBuilder.build` once per request (a builder per request, one host read each);
  batched      `BatchedTreeBuilder.build` once for all of them (one host read for the batch).
Both run the rows through each request's own `DrafterRuntime` (`batched_tree.RuntimeRows`), so
the model compute is the same and the difference is the tree's bookkeeping: frontier, pool, Eq. 9,
cut and packing as one set of batched kernels instead of one per request, and host reads. Each
row also checks that both give the same trees (`equal`) and records the host reads per round.
The requests' contexts differ (`--context` + 17 i rows for request i). The PR gate's bias is set
so every forwarded node is pooled and m rows run every step (as in `draft_cost.py`).
Drafters: `smollm2` (SmolLM2-135M's shape, random weights, `draft_cost.smollm2_drafters`) or `tiny`
(hidden 64, a smoke check of the script, not a cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/draft_cost.py: drafters and the interleaved clock

import draft_cost  # noqa: E402

SHAPES = {"paper": dict(k=6, bw=6, m=3, gamma=8, budget=48), "small": dict(k=2, bw=2, m=1, gamma=3, budget=6)}
WAYS = ("per_request", "batched")


def tiny_drafter(max_depth: int):
    """A small random PR drafter (hidden 64, vocab 256, draft vocab 128): the script's smoke check."""
    from transformers import LlamaConfig

    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=256, draft_vocab_size=128, max_position_embeddings=2048,
                      architectures=["LlamaForCausalLMEagle3"])
    torch.manual_seed(0)
    return LlamaForCausalLMEagle3PR(build_pr_config(cfg, PRDraftSettings(max_depth=max_depth))).float().eval()


def make_drafter(name: str, max_depth: int, dtype: torch.dtype):
    if name == "tiny":
        drafter = tiny_drafter(max_depth).to(dtype)
    else:
        drafter = draft_cost.smollm2_drafters(max_depth, dtype)[1]
    with torch.no_grad():
        drafter.pr_halt_gate.linear.bias.fill_(-10.0)  # lambda ~ 0: every node pooled, m rows every step
    return drafter


def make_requests(drafter, n: int, context: int, device: str, dtype: torch.dtype):
    """n runtimes of the drafter with random committed contexts of different lengths: (runtime, root, feature)."""
    from pr_specforge.serving import DrafterRuntime

    g = torch.Generator().manual_seed(0)
    vocab, hidden = int(drafter.config.vocab_size), int(drafter.config.hidden_size)
    out = []
    for i in range(n):
        rows = context + 17 * i
        rt = DrafterRuntime(drafter)
        toks = torch.randint(0, vocab, (rows,), generator=g)
        feat = rt.extend(torch.randn(rows, 3 * hidden, generator=g).to(device, dtype), toks)[-1]
        out.append((rt, int(toks[-1]), feat))
    return out


def round_fns(reqs, cfg):
    """One round for all requests, each way: callables of a seed (request i draws from seed * 1000 + i)."""
    from pr_specforge.serving import BatchedTreeBuilder, BatchRequest, TensorTreeBuilder

    singles = [TensorTreeBuilder(rt, cfg) for rt, _, _ in reqs]
    batch = BatchedTreeBuilder(reqs[0][0], cfg)

    def per_request(seed):
        return [b.build(root, feat, torch.Generator().manual_seed(seed * 1000 + i))
                for i, (b, (_, root, feat)) in enumerate(zip(singles, reqs))]

    def batched(seed):
        return batch.build([BatchRequest(rt, root, feat, torch.Generator().manual_seed(seed * 1000 + i))
                            for i, (rt, root, feat) in enumerate(reqs)])

    return {"per_request": per_request, "batched": batched}


def host_copies(fn) -> int:
    """`Tensor.cpu` calls in one round (each builder's result reaches the host through one such copy)."""
    real, calls = torch.Tensor.cpu, []
    torch.Tensor.cpu = lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw)
    try:
        fn(1)
    finally:
        torch.Tensor.cpu = real
    return len(calls)


def measure(drafter, shape: str, n: int, args, sync, clock) -> dict:
    from pr_specforge.serving import TreeConfig

    cfg = TreeConfig(**SHAPES[shape])
    reqs = make_requests(drafter, n, args.context, args.device, getattr(torch, args.dtype))
    fns = round_fns(reqs, cfg)
    a, b = fns["per_request"](0), fns["batched"](0)
    equal = all((x.tokens(), x.parents(), x.scores, x.recon_kept) == (y.tokens(), y.parents(), y.scores, y.recon_kept)
                for x, y in zip(a, b))
    reads = {w: host_copies(fns[w]) for w in WAYS}
    times = draft_cost.time_all(fns, args.warmup, args.repeats, sync, clock)
    med = {w: statistics.median(times[w]) for w in WAYS}
    best = {w: min(times[w]) for w in WAYS}
    return {
        "shape": shape, "tree": SHAPES[shape], "requests": n,
        **{f"{w}_round_s": med[w] for w in WAYS}, **{f"{w}_round_s_min": best[w] for w in WAYS},
        "batched_over_per_request": med["batched"] / med["per_request"],
        "batched_over_per_request_min": best["batched"] / best["per_request"],
        "host_reads_per_round": reads,
        "recon_rows_per_round": sum(t.recon_rows for t in b), "equal": equal,
    }


def markdown(result) -> str:
    lines = [
        f"Drafting round for all requests, per-request vs batched tree builder; {result['drafter']} PR drafter, "
        f"contexts {result['context']} + 17 i rows, median of {result['repeats']} ({result['device']}, {result['dtype']}, "
        f"{result['threads']} threads, {result['clock']} clock; {result['machine']}).",
        "",
        "| shape (k, B_w, m, gamma, B) | requests | per-request ms | batched ms | batched / per-request | "
        "host reads (per-request, batched) | same trees |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t = r["tree"]
        lines.append(
            f"| {r['shape']} ({t['k']}, {t['bw']}, {t['m']}, {t['gamma']}, {t['budget']}) | {r['requests']} | "
            f"{1e3 * r['per_request_round_s']:.2f} | {1e3 * r['batched_round_s']:.2f} | "
            f"{r['batched_over_per_request']:.3f} | {r['host_reads_per_round']['per_request']}, "
            f"{r['host_reads_per_round']['batched']} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines + ["", f"Command: `{result['command']}`", ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["paper", "small"])
    p.add_argument("--requests", nargs="+", type=int, default=[1, 4])
    p.add_argument("--drafter", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--max-depth", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    draft_cost.add_run_arguments(p)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.requests) or args.repeats < 1 or args.context < 1:
        print("batched_tree: --requests, --repeats and --context must be >= 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = make_drafter(args.drafter, args.max_depth, getattr(torch, args.dtype)).to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    with torch.no_grad():
        rows = [measure(drafter, shape, n, args, sync, clock) for shape in args.shapes for n in args.requests]
    result = {
        "rows": rows, "drafter": args.drafter, "max_depth": args.max_depth, "context": args.context,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "device": args.device, "dtype": args.dtype,
        "clock": args.clock, "machine": args.machine, "command": "python " + " ".join(sys.argv),
    }
    table = markdown(result)
    print(table)
    draft_cost.write_outputs(result, table, args)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
