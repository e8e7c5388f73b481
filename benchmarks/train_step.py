"""One training step of SpecForge's `eagle3` strategy vs the `pr` strategy, side by side.

    python benchmarks/train_step.py [--shape smollm2|llama3-8b] [--seq 512] [--prompt-frac 0.38] [--repeats 5]
                                    [--dtype bfloat16] [--device cpu|cuda] [--json out.json]

Drafter shaped like SmolLM2-135M's (hidden 576, 9 heads / 3 KV heads, intermediate
1536, vocab 49152, draft vocab 8192) or, with `--shape llama3-8b`, like Llama-3.1-8B's
(hidden 4096, 32 / 8 heads, intermediate 14336, vocab 128256, draft vocab 32000);
seq 512, TTT 7, R = 2, batch 1; identical
weights and inputs for both; a step = strategy.forward_loss + backward + AdamW
step. Reports the median of `--repeats` timed steps (after one warm-up step each),
interleaving the two strategies so machine noise hits both alike.

The first `--prompt-frac` of the sequence is a prompt (loss mask 0), as in chat data
(0.38 is the share of unscored tokens in the SmolLM2 experiment's features). PR runs
two ways: `pr` (the default: the mixed-cache rollout skips the rows that no TTT step
scores) and `pr_all_rows` (every row; `OnlinePRModel(skip_unscored_rows=False)`).

`work_ratio` = rows processed by the decoder layer in PR's step / in EAGLE-3's,
counted at run time with a hook on the layer's q projection. METHOD.md estimates
(7 + 2 + 6*3) / 7 = 3.86 for a faithful PR step over all rows at TTT 7, R 2. Target:
`pr_over_eagle3 <= 1.2 * work_ratio`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


# Drafter shapes: SmolLM2-135M's (the CPU experiment) and Llama-3.1-8B-Instruct's (recipes/llama3.1-8b-*.yaml).
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, draft_vocab_size=8192),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, draft_vocab_size=32000),
}


def build(args):
    from transformers import LlamaConfig

    from pr_specforge._specforge import LlamaForCausalLMEagle3, OnlineEagle3Model
    from pr_specforge.config import PRConfig
    from pr_specforge.training.registration import make_strategy
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
    from pr_specforge.training.objective.ttt import OnlinePRModel
    from pr_specforge._specforge import Eagle3TrainStrategy, install_cpu_loss

    cfg = LlamaConfig(
        **SHAPES[args.shape], num_hidden_layers=1, max_position_embeddings=max(2048, args.seq),
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, fc_norm=True,
        architectures=["LlamaForCausalLMEagle3"],
    )
    install_cpu_loss()  # SpecForge's loss is a Triton kernel: CPU runs take the same math in torch
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    eagle = LlamaForCausalLMEagle3(cfg)
    ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    eagle.t2d.zero_()
    eagle.t2d[ids] = True
    eagle.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
    eagle.freeze_embedding()
    drafts = {"eagle3": eagle.to(dtype)}
    for name in ("pr", "pr_all_rows"):
        pr = LlamaForCausalLMEagle3PR(build_pr_config(cfg, PRDraftSettings(max_depth=args.depth)))
        pr.load_state_dict(eagle.state_dict(), strict=False)
        pr.freeze_embedding()
        drafts[name] = pr.to(dtype)
    strategies = {
        "eagle3": Eagle3TrainStrategy(OnlineEagle3Model(drafts["eagle3"], length=args.ttt)),
        **{name: make_strategy(OnlinePRModel(drafts[name], length=args.ttt, pr=PRConfig(max_depth=args.depth),
                                             skip_unscored_rows=name == "pr"))
           for name in ("pr", "pr_all_rows")},
    }
    for s in strategies.values():  # before the optimizers, so their state lives on the device
        s.trainable_module().to(args.device)
    opts = {name: torch.optim.AdamW([p for p in s.trainable_module().parameters() if p.requires_grad], lr=1e-5)
            for name, s in strategies.items()}
    rows = {}
    for name, draft in drafts.items():
        rows[name] = [0]
        draft.midlayer.self_attn.q_proj.register_forward_hook(
            lambda m, inp, out, counter=rows[name]: counter.__setitem__(0, counter[0] + inp[0].shape[0] * inp[0].shape[1])
        )
    return cfg, strategies, opts, rows


def make_batch(cfg, seq, dtype, prompt_frac=0.0, device="cpu"):
    from pr_specforge._specforge import TrainBatch

    g = torch.Generator().manual_seed(1)
    loss_mask = torch.ones(1, seq, 1, dtype=torch.long)
    loss_mask[:, : int(prompt_frac * seq)] = 0
    tensors = {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, seq), generator=g),
        "attention_mask": torch.ones(1, seq, dtype=torch.long),
        "loss_mask": loss_mask,
        "hidden_state": torch.randn(1, seq, 3 * cfg.hidden_size, generator=g).to(dtype),
        "target": (torch.randn(1, seq, cfg.vocab_size, generator=g) * 4).to(dtype),
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}
    return TrainBatch(sample_ids=["bench"], strategy="eagle3", tensors=tensors, metadata={"target_repr": "logits"})


def step(strategy, opt, batch, sync=lambda: None):
    sync()
    t0 = time.perf_counter()
    out = strategy.forward_loss(batch)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES), help="drafter shape")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--prompt-frac", type=float, default=0.38, help="leading share of the sequence with loss mask 0")
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bf16 on CUDA or a CPU with native bf16 (AMX/AVX512-BF16), else fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N] (CUDA uses SpecForge's Triton loss kernel)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from pr_specforge.dtypes import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    import pr_specforge._specforge  # noqa: F401  (CPU-safe loss)

    cfg, strategies, opts, rows = build(args)
    batch = make_batch(cfg, args.seq, getattr(torch, args.dtype), args.prompt_frac, args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for name in strategies:  # warm-up (and row count of one step)
        rows[name][0] = 0
        step(strategies[name], opts[name], batch, sync)
    rows_per_step = {name: rows[name][0] for name in rows}
    times = {name: [] for name in strategies}
    for _ in range(args.repeats):
        for name in strategies:
            times[name].append(step(strategies[name], opts[name], batch, sync))
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "eagle3_step_s": med["eagle3"],
        "pr_step_s": med["pr"],
        "pr_all_rows_step_s": med["pr_all_rows"],
        "pr_over_eagle3": med["pr"] / med["eagle3"],
        "pr_all_rows_over_eagle3": med["pr_all_rows"] / med["eagle3"],
        "work_ratio": rows_per_step["pr"] / rows_per_step["eagle3"],
        "work_ratio_all_rows": rows_per_step["pr_all_rows"] / rows_per_step["eagle3"],
        "decoder_rows": rows_per_step,
        "settings": {"shape": args.shape, "seq": args.seq, "prompt_frac": args.prompt_frac, "ttt": args.ttt, "depth": args.depth, "dtype": args.dtype,
                     "repeats": args.repeats, "threads": torch.get_num_threads(), "device": args.device,
                     "torch": torch.__version__},
    }
    result["within_target"] = result["pr_over_eagle3"] <= 1.2 * result["work_ratio"]
    print(f"{'strategy':<10}{'median step (s)':>18}{'decoder rows/step':>20}")
    for name in strategies:
        print(f"{name:<10}{med[name]:>18.3f}{rows_per_step[name]:>20d}")
    print(f"pr/eagle3 time ratio {result['pr_over_eagle3']:.2f}  work ratio {result['work_ratio']:.2f}  "
          f"target <= {1.2 * result['work_ratio']:.2f}: {'met' if result['within_target'] else 'NOT met'}")
    print(f"pr_all_rows/eagle3 time ratio {result['pr_all_rows_over_eagle3']:.2f}  "
          f"work ratio {result['work_ratio_all_rows']:.2f}")
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
