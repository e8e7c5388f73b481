"""Cost of one drafting round (Appendix A.1, Table 9) on SmolLM2-shaped drafters, both tree builders.

    OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 python benchmarks/draft_cost.py --threads 1 --clock cpu \
        --repeats 21 --json benchmarks/results/draft_cost.json --md benchmarks/results/draft_cost.md
    (add --dtype bfloat16 for the drafters in bf16, the evaluator's --dtype)

Times one drafting round (from the root feature to the global cut, the result on the host)
with each builder, `tensor` (`serving.tensor_tree`, the default) and `object` (`serving.tree`,
the reference), three ways, interleaved, median of `--repeats`:
  eagle        the EAGLE tree of an EAGLE-3 drafter (B_w rows per step);
  pr_coforward the PR drafter's tree, the m reconsideration rows in the SAME call of M;
  pr_serial    the same PR tree, the m rows in a separate call of M per step;
and the paper's two controls (Tables 3 and 4), EAGLE trees of EAGLE-3 drafters:
  eagle_2layer the two-layer EAGLE-3 drafter (`modeling.two_layer`: a second decoder layer on every row);
  eagle_bw9    the one-layer EAGLE-3 drafter with the grow width widened to B_w + m (the batch PR gets).
The top-level keys (`eagle_round_s`, `pr_coforward_round_s`, `coforward_over_eagle`,
`serial_over_eagle`) are the tensor builder's; `builders` holds both builders' numbers and
`over_object` each builder's round time relative to the object tree's. `forward_floor_s` is
the round's model compute alone (the calls of M and readouts over the same rows, and for PR the
self-query inputs and the gate; no tree logic): what no builder can beat.
Where the time goes: `breakdown` (a second interleaved pass with the runtime's model calls timed:
`model_s`, by call, and the rest, `bookkeeping_s`), `ops` (one round under torch.profiler:
top-level torch ops issued by the builder and inside the model calls, and `aten::item` host
reads), `rows_cost_s` (one call of M + its readout alone at B_w, B_w + m and 2 B_w rows: how the
drafter's step compute grows with the extra rows).
The PR gate bias is set so every forwarded node enters the pool and m rows run every step.
Random weights: hidden 576, 9 heads / 3 KV heads, intermediate 1536, vocab 49152, draft vocab
8192 (SmolLM2-135M's shape); the EAGLE-3 drafter has the PR drafter's EAGLE-3 weights; a
random committed context of `--context` rows. About 1 minute per dtype on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
from transformers import LlamaConfig

VARIANTS = {
    "eagle": dict(drafter="eagle", coforward=True),
    "pr_coforward": dict(drafter="pr", coforward=True),
    "pr_serial": dict(drafter="pr", coforward=False),
    "eagle_2layer": dict(drafter="eagle2", coforward=True),
    "eagle_bw9": dict(drafter="eagle", coforward=True, widen=True),
}
BUILDERS = ("tensor", "object")


def smollm2_drafters(max_depth: int, dtype: torch.dtype = torch.float32):
    """(EAGLE-3 drafter, PR drafter, two-layer EAGLE-3 drafter) with the same EAGLE-3 weights, SmolLM2-135M's shape."""
    from pr_specforge._specforge import LlamaForCausalLMEagle3
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        num_hidden_layers=1, vocab_size=49152, draft_vocab_size=8192, max_position_embeddings=8192,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, architectures=["LlamaForCausalLMEagle3"],
    )
    torch.manual_seed(0)
    pr = LlamaForCausalLMEagle3PR(build_pr_config(cfg, PRDraftSettings(max_depth=max_depth))).float().eval()
    with torch.no_grad():
        pr.pr_halt_gate.linear.bias.fill_(-10.0)  # lambda ~ 0: every node pooled, m rows every step
    eagle = LlamaForCausalLMEagle3(cfg).float().eval()
    one_pass = {k: v for k, v in pr.state_dict().items() if not k.startswith("pr_")}
    eagle.load_state_dict(one_pass)
    from pr_specforge.modeling import TWO_LAYER_ARCHITECTURE, LlamaForCausalLMEagle3TwoLayer

    cfg.architectures = [TWO_LAYER_ARCHITECTURE]
    two = LlamaForCausalLMEagle3TwoLayer(cfg).float().eval()
    two.load_state_dict(one_pass, strict=False)  # the second layer stays random
    return eagle.to(dtype), pr.to(dtype), two.to(dtype)


def round_fn(builder: str, rt, cfg, coforward: bool, root_token: int, root_feature):
    """A callable drafting one round with a fresh seed; the tensor builder is built once, as in decoding."""
    from pr_specforge.serving import TensorTreeBuilder, build_tree

    if builder == "tensor":
        b = TensorTreeBuilder(rt, cfg, coforward)
        return lambda seed: b.build(root_token, root_feature, torch.Generator().manual_seed(seed))
    return lambda seed: build_tree(rt, root_token, root_feature, cfg, torch.Generator().manual_seed(seed), coforward)


def forward_floor(rt, cfg, rows: int, root_feature, recon: int = 0):
    """The round's model compute alone: the root readout, then gamma - 1 calls of M over `rows`
    rows and their readouts; with `recon` reconsidered rows, also their self-query inputs (Eq. 3)
    and the gate on every row."""
    n_rows = 1 + (cfg.gamma - 1) * rows
    ctx = rt.length - 1
    rt.reserve(ctx + n_rows)
    mask = torch.zeros(rows, ctx + n_rows, device=rt.device, dtype=rt.dtype)
    emb = torch.zeros(rows, root_feature.shape[-1], device=rt.device, dtype=rt.dtype)
    pos = torch.full((rows,), ctx + 1, device=rt.device)

    def run(_seed):
        logp = rt.log_probs(root_feature[None], 0)
        hidden = root_feature[None].expand(rows, -1)
        for s in range(1, cfg.gamma):
            inputs = emb
            if recon:
                q_emb, _ = rt.reconsideration_inputs(hidden[-recon:])
                inputs = torch.cat([emb[:-recon], q_emb])
            feats = rt.forward_tree_rows(inputs, hidden, pos, ctx + 1 + (s - 1) * rows, mask, ctx + cfg.gamma)
            logp = rt.readout_and_halt(feats)[0] if recon else rt.log_probs(feats, 0)
            hidden = feats
        return logp

    return run


MODEL_CALLS = ("forward_tree_rows", "forward_rows", "log_probs", "halt_probability", "readout_and_halt",
               "reconsideration_inputs", "embed")


class ModelClock:
    """Times the runtime's model calls (the drafter's compute: calls of M, readouts, self-query, gate,
    embedding) by shadowing them on the instance; the rest of a round is the builder's bookkeeping."""

    def __init__(self, rt, sync, clock) -> None:
        self.rt, self.sync, self.clock = rt, sync, clock
        self.by_call = dict.fromkeys(MODEL_CALLS, 0.0)

    @property
    def spent(self) -> float:
        return sum(self.by_call.values())

    def reset(self) -> None:
        self.by_call = dict.fromkeys(MODEL_CALLS, 0.0)

    def __enter__(self):
        for name in MODEL_CALLS:
            setattr(self.rt, name, self._timed(name, getattr(self.rt, name)))
        return self

    def _timed(self, name, fn):
        def timed(*a, **kw):
            self.sync()
            t0 = self.clock()
            out = fn(*a, **kw)
            self.sync()
            self.by_call[name] += self.clock() - t0
            return out
        return timed

    def __exit__(self, *exc) -> None:
        for name in MODEL_CALLS:
            delattr(self.rt, name)


def breakdown(fns, runtimes, repeats: int, sync, clock):
    """Per variant: the median round and its model part, timed with `ModelClock` (a separate pass, so the
    main timing runs without the wrappers; interleaved like it)."""
    clocks = {name: ModelClock(rt, sync, clock) for name, (rt, _) in runtimes.items()}
    runs = {key: fn for key, fn in fns.items() if key[0] != "floor"}
    rounds, model = {key: [] for key in runs}, {key: [] for key in runs}
    for mc in clocks.values():
        mc.__enter__()
    try:
        for rep in range(repeats + 2):
            for (b, v), fn in runs.items():
                mc = clocks[VARIANTS[v]["drafter"]]
                mc.reset()
                sync()
                t0 = clock()
                fn(rep)
                sync()
                if rep >= 2:
                    rounds[(b, v)].append(clock() - t0)
                    model[(b, v)].append(mc.by_call)
    finally:
        for mc in clocks.values():
            mc.__exit__()
    out = {}
    for (b, v), ts in rounds.items():
        i = sorted(range(len(ts)), key=ts.__getitem__)[len(ts) // 2]  # the median round, whole
        spent = sum(model[(b, v)][i].values())
        out[f"{b}/{v}"] = {"round_s": ts[i], "model_s": spent, "bookkeeping_s": ts[i] - spent,
                           "model_s_by_call": {k: t for k, t in model[(b, v)][i].items() if t}}
    return out


def op_counts(fns, runtimes):
    """Per variant, one round under torch.profiler: top-level torch ops issued by the builder (outside the
    model calls) and inside the model calls, and host reads that dispatch (`aten::item`; `tolist` does not)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out = {}
    for (b, v), fn in fns.items():
        if b == "floor":
            continue
        rt = runtimes[VARIANTS[v]["drafter"]][0]
        for name in MODEL_CALLS:
            real = getattr(rt, name)
            setattr(rt, name, lambda *a, _r=real, **kw: _ranged(_r, a, kw, record_function))
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn(0)
        finally:
            for name in MODEL_CALLS:
                delattr(rt, name)
        events = prof.events()
        top = [e for e in events if e.cpu_parent is None]
        model = [e for e in top if e.name == "model_call"]
        out[f"{b}/{v}"] = {
            "bookkeeping_ops": len(top) - len(model),
            "model_ops": sum(len(e.cpu_children) for e in model),
            "model_calls": len(model),
            "item_reads": sum(e.name == "aten::item" for e in events),
        }
    return out


def _ranged(fn, a, kw, record_function):
    with record_function("model_call"):
        return fn(*a, **kw)


def rows_cost(rt, rows_list, repeats: int, sync, clock):
    """One call of M over N tree rows plus their readout, alone (the drafter's per-step compute), for each N,
    interleaved, median: how the drafter's compute grows with the rows of a step."""
    ctx = rt.length
    rt.reserve(ctx + max(rows_list))
    d = rt.drafter.config.hidden_size
    g = torch.Generator().manual_seed(1)
    calls = {}
    for n in rows_list:
        emb, hidden = (torch.randn(n, d, generator=g).to(rt.device, rt.dtype) for _ in range(2))
        pos = torch.full((n,), ctx, device=rt.device)
        mask = torch.zeros(n, ctx + n, device=rt.device, dtype=rt.dtype)
        calls[n] = {"layer": lambda e=emb, h=hidden, p=pos, m=mask: rt.forward_tree_rows(e, h, p, ctx, m, ctx + 1),
                    "readout": lambda h=hidden: rt.log_probs(h, 0)}
    times = {(n, part): [] for n in rows_list for part in ("layer", "readout")}
    with torch.no_grad():
        for rep in range(repeats + 3):
            for (n, part) in times:
                sync()
                t0 = clock()
                calls[n][part]()
                sync()
                if rep >= 3:
                    times[(n, part)].append(clock() - t0)
    return {str(n): {part: statistics.median(times[(n, part)]) for part in ("layer", "readout")} for n in rows_list}


def time_all(fns, warmup: int, repeats: int, sync, clock):
    times = {name: [] for name in fns}
    for rep in range(warmup + repeats):
        for name, fn in fns.items():  # interleaved, so drift and neighbours' load hit all alike
            sync()
            t0 = clock()
            fn(rep)
            sync()
            if rep >= warmup:
                times[name].append(clock() - t0)
    return times


def summarise(times, recon_rows, args):
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}
    builders = {}
    for b in BUILDERS:
        row = {}
        for stat, src in (("", med), ("_min", best)):
            row.update({f"{v}_round_s{stat}": src[(b, v)] for v in VARIANTS})
            row[f"coforward_over_eagle{stat}"] = src[(b, "pr_coforward")] / src[(b, "eagle")]
            row[f"serial_over_eagle{stat}"] = src[(b, "pr_serial")] / src[(b, "eagle")]
            row[f"two_layer_over_eagle{stat}"] = src[(b, "eagle_2layer")] / src[(b, "eagle")]
            row[f"bw9_over_eagle{stat}"] = src[(b, "eagle_bw9")] / src[(b, "eagle")]
        row["recon_rows_per_round"] = recon_rows[b]
        builders[b] = row
    tensor = builders["tensor"]
    return {
        **{k: tensor[k] for k in ("eagle_round_s", "pr_coforward_round_s", "pr_serial_round_s",
                                  "coforward_over_eagle", "serial_over_eagle", "two_layer_over_eagle", "bw9_over_eagle")},
        "builder": "tensor",
        "builders": builders,
        "over_object": {b: {v: med[(b, v)] / med[("object", v)] for v in VARIANTS} for b in BUILDERS},
        "over_object_min": {b: {v: best[(b, v)] / best[("object", v)] for v in VARIANTS} for b in BUILDERS},
        "forward_floor_s": {name[1]: med[name] for name in times if name[0] == "floor"},
        "floor_pr_over_eagle": med[("floor", "pr")] / med[("floor", "eagle")],
        "recon_rows_per_round": recon_rows["tensor"],
        "batched_forwards_per_round": args.gamma - 1,
        "shape": {"budget": args.budget, "k": args.k, "bw": args.bw, "gamma": args.gamma, "m": args.m,
                  "max_depth": args.max_depth, "context": args.context},
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "clock": args.clock,
        "machine": args.machine,
        "command": "python " + " ".join(sys.argv),
    }


def markdown(result) -> str:
    s = result["shape"]
    lines = [
        f"One drafting round, B={s['budget']} k={s['k']} B_w={s['bw']} gamma={s['gamma']} m={s['m']} R={s['max_depth']}, "
        f"context {s['context']}, median of {result['repeats']} ({result['device']}, {result['dtype']}, {result['threads']} threads, "
        f"{result['clock']} clock; "
        f"{result['machine']}).",
        "",
        "| builder | variant | round ms | x eagle (same builder) | x object tree |",
        "|---|---|---|---|---|",
    ]
    for b in BUILDERS:
        row = result["builders"][b]
        for v in VARIANTS:
            lines.append(f"| {b} | {v} | {1e3 * row[f'{v}_round_s']:.2f} | "
                         f"{row[f'{v}_round_s'] / row['eagle_round_s']:.3f} | {result['over_object'][b][v]:.3f} |")
    floor = result["forward_floor_s"]
    lines += ["", "The model's compute alone (calls of M, readouts; self-query and gate for PR; no tree logic): "
              + ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in floor.items())
              + f", PR / EAGLE {result['floor_pr_over_eagle']:.3f}.",
        f"Reconsideration rows per round: {result['recon_rows_per_round']} over "
        f"{result['batched_forwards_per_round']} batched forwards."]
    lines += breakdown_markdown(result) + ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def breakdown_markdown(result) -> list:
    """Where a round's time goes (model calls vs the builder's bookkeeping), op counts, and the rows probe."""
    lines = ["", "Where a round goes (a separate pass with the model calls timed; ops: top-level torch ops of one round "
             "under torch.profiler; item: host reads that dispatch, `tolist` does not):", "",
             "| builder | variant | round ms | model ms | bookkeeping ms | bookkeeping ops | model ops | model calls | item |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, t in result["breakdown"].items():
        ops = result["ops"][key]
        b, v = key.split("/")
        lines.append(f"| {b} | {v} | {1e3 * t['round_s']:.2f} | {1e3 * t['model_s']:.2f} | {1e3 * t['bookkeeping_s']:.2f} | "
                     f"{ops['bookkeeping_ops']} | {ops['model_ops']} | {ops['model_calls']} | {ops['item_reads']} |")
    lines += ["", "Model ms by call (the same rounds): " + "; ".join(
        f"{key}: " + ", ".join(f"{name} {1e3 * x:.2f}" for name, x in t["model_s_by_call"].items())
        for key, t in result["breakdown"].items() if key.startswith("tensor/")) + "."]
    rows = result["rows_cost_s"]
    first = min(rows, key=int)
    lines += ["", "The PR drafter's step compute alone vs rows per call (one call of M + readout, median ms; x the "
              f"{first}-row step): " + ", ".join(
                  f"{n} rows: M {1e3 * r['layer']:.3f} + readout {1e3 * r['readout']:.3f} = "
                  f"{1e3 * (r['layer'] + r['readout']):.3f} "
                  f"(x{(r['layer'] + r['readout']) / (rows[first]['layer'] + rows[first]['readout']):.3f})"
                  for n, r in rows.items()) + "."]
    return lines


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every cost benchmark shares: threads, device, dtype, clock, the machine's label, outputs."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the drafters' compute dtype (the evaluator's --dtype)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter; cpu: the process's CPU time, which leaves out the time a busy "
                        "machine's scheduler gives to others (use with --threads 1 on a CPU)")
    p.add_argument("--machine", default="quiet machine", help="a label for the JSON, e.g. 'busy 2-core CPU'")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)


def write_outputs(result: dict, table: str, args) -> None:
    """The JSON (`--json`) and the markdown table (`--md`), each written atomically, where asked."""
    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    if args.json:
        atomic_write_json(args.json, result)
    if args.md:
        atomic_write_text(args.md, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=48)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--bw", type=int, default=6)
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--m", type=int, default=3)
    p.add_argument("--max-depth", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pr_specforge.serving import DrafterRuntime, TreeConfig

    cfg = TreeConfig(budget=args.budget, k=args.k, bw=args.bw, gamma=args.gamma, m=args.m)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(args.context, 3 * 576, generator=g)
    toks = torch.randint(0, 49152, (args.context,), generator=g)
    runtimes = {}
    for name, drafter in zip(("eagle", "pr", "eagle2"), smollm2_drafters(args.max_depth, getattr(torch, args.dtype))):
        rt = DrafterRuntime(drafter.to(args.device))
        runtimes[name] = (rt, rt.extend(aux.to(getattr(torch, args.dtype)), toks)[-1])
    fns = {}
    for b in BUILDERS:
        for v, kw in VARIANTS.items():
            rt, feat = runtimes[kw["drafter"]]
            shape = dataclasses.replace(cfg, bw=args.bw + args.m) if kw.get("widen") else cfg
            fns[(b, v)] = round_fn(b, rt, shape, kw["coforward"], int(toks[-1]), feat)
    for name, rows, recon in (("eagle", args.bw, 0), ("pr", args.bw + args.m, args.m)):
        rt, feat = runtimes[name]
        fns[("floor", name)] = forward_floor(rt, cfg, rows, feat, recon)
    recon_rows = {b: fns[(b, "pr_coforward")](0).recon_rows for b in BUILDERS}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    result = summarise(time_all(fns, args.warmup, args.repeats, sync, clock), recon_rows, args)
    result["breakdown"] = breakdown(fns, runtimes, args.repeats, sync, clock)
    result["ops"] = op_counts(fns, runtimes)
    probe = sorted({args.bw, args.bw + args.m, 2 * args.bw})
    result["rows_cost_s"] = rows_cost(runtimes["pr"][0], probe, 3 * args.repeats, sync, clock)
    table = markdown(result)
    print(table)
    write_outputs(result, table, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
