"""Cost of co-forwarding reconsideration rows (Appendix A.1, Table 9) on a SmolLM2-shaped drafter.

    OMP_NUM_THREADS=2 TORCHDYNAMO_DISABLE=1 python benchmarks/draft_cost.py --json draft_cost.json

Times one drafting round (`pr_specforge.serving.build_tree`, from the root feature to
the global cut) three ways, median of `--repeats`:
  eagle        the plain EAGLE tree (B_w rows per step);
  pr_coforward the PR tree, the m reconsideration rows in the SAME call of M (B_w + m rows);
  pr_serial    the same PR tree, the m rows in a separate call of M per step.
The gate bias is set so every forwarded node enters the pool and m rows run every step.
Random weights: hidden 576, 9 heads / 3 KV heads, intermediate 1536, vocab 49152,
draft vocab 8192 (SmolLM2-135M's shape); a random committed context of `--context` rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig


def smollm2_drafter(max_depth: int):
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        num_hidden_layers=1, vocab_size=49152, draft_vocab_size=8192, max_position_embeddings=8192,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, architectures=["LlamaForCausalLMEagle3"],
    )
    torch.manual_seed(0)
    drafter = LlamaForCausalLMEagle3PR(build_pr_config(cfg, PRDraftSettings(max_depth=max_depth))).float().eval()
    with torch.no_grad():
        drafter.pr_halt_gate.linear.bias.fill_(-10.0)  # lambda ~ 0: every node pooled, m rows every step
    return drafter


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
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from pr_specforge.serving import DrafterRuntime, TreeConfig, build_tree

    drafter = smollm2_drafter(args.max_depth).to(args.device)
    rt = DrafterRuntime(drafter)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(args.context, 3 * 576, generator=g)
    toks = torch.randint(0, 49152, (args.context,), generator=g)
    root_feature = rt.extend(aux, toks)[-1]
    cfg = TreeConfig(budget=args.budget, k=args.k, bw=args.bw, gamma=args.gamma, m=args.m)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    variants = {
        "eagle": dict(reconsider=False, coforward=True),
        "pr_coforward": dict(reconsider=True, coforward=True),
        "pr_serial": dict(reconsider=True, coforward=False),
    }
    times = {name: [] for name in variants}
    recon_rows = {}
    for rep in range(args.warmup + args.repeats):
        for name, kw in variants.items():  # interleaved, so drift hits all three alike
            sync()
            t0 = time.perf_counter()
            tree = build_tree(rt, int(toks[-1]), root_feature, cfg, generator=torch.Generator().manual_seed(rep), **kw)
            sync()
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            recon_rows[name] = tree.recon_rows
    med = {name: statistics.median(ts) for name, ts in times.items()}
    steps = args.gamma - 1
    result = {
        "eagle_round_s": med["eagle"],
        "pr_coforward_round_s": med["pr_coforward"],
        "pr_serial_round_s": med["pr_serial"],
        "coforward_over_eagle": med["pr_coforward"] / med["eagle"],
        "serial_over_eagle": med["pr_serial"] / med["eagle"],
        "recon_rows_per_round": recon_rows["pr_coforward"],
        "batched_forwards_per_round": steps,
        "threads": torch.get_num_threads(),
        "device": args.device,
    }
    print(f"one drafting round, B={args.budget} k={args.k} B_w={args.bw} gamma={args.gamma} m={args.m} R={args.max_depth}, "
          f"context {args.context}, median of {args.repeats} ({args.device}, {torch.get_num_threads()} threads)")
    print("| variant | round ms | x eagle |\n|---|---|---|")
    for name in variants:
        print(f"| {name} | {1e3 * med[name]:.2f} | {med[name] / med['eagle']:.3f} |")
    print(f"reconsideration rows per round: {recon_rows['pr_coforward']} over {steps} batched forwards")
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
