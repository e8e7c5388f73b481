"""The positive control per recipe option set: which PR options learn a second pass?

    OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 python benchmarks/control.py --steps 400 \
        --json benchmarks/results/control.json --md benchmarks/results/control.md [--sets paper default ...]

For each option set, `pr_specforge.control` trains a tiny PR drafter (hidden 64, one head, R = 1, TTT 2,
a cycle of N = 6 symbols drawn per sample from a pool of 2 N, every symbol asked once, the answers hidden)
with the set's `pr:` options and measures on held-out samples the
accuracy of depth 0 and depth 1 on 1-hop queries (f(a): one attention pass answers them) and
2-hop queries (f(f(a)): they need two), and the gate's mean q per depth on each kind. Every
set but `default` and the README's recipes (`recipes/NAME.yaml`: each recipe's own `pr:` options, what
`pr-specforge control --recipe` tests) is `recipes/_base/paper-pr.yaml`'s options with the named change; the sets
that start from a trained EAGLE-3 drafter start from one trained on the task for as many steps.
Sets run with `--sets` are merged into an existing `--json` (the others are kept), and the
markdown is rendered from the JSON (`--render-only` re-renders it). Accuracies do not depend on
the machine's load; the wall times do (see `machine`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_RECIPE = os.path.join("recipes", "_base", "paper-pr.yaml")
#: name -> (what it changes, `pr:` overrides over the paper's options; None: PRConfig's defaults)
OPTION_SETS: Dict[str, Any] = {
    "paper": ("recipes/_base/paper-pr.yaml's options", {}),
    "default": ("PRConfig's defaults (shared head, per-minibatch balance)", None),
    "isolated+adapter": ("recon_grad isolated, rank-16 adapter", {"recon_grad": "isolated", "recon_adapter_rank": 16}),
    "warm isolated+adapter": ("the regimes' recipe: EAGLE-3 warm start, isolated, rank-16 adapter",
                              {"recon_grad": "isolated", "recon_adapter_rank": 16, "init_from": "control:eagle3"}),
    "warm full": ("EAGLE-3 warm start, full gradients", {"init_from": "control:eagle3"}),
    "freeze": ("EAGLE-3 warm start, one-pass drafter frozen", {"init_from": "control:eagle3", "freeze_one_pass": True}),
    "shared head": ("recon_head shared", {"recon_head": "shared"}),
    "per-minibatch balance": ("balance_norm per_minibatch", {"balance_norm": "per_minibatch"}),
    "one_pass_loss_on_mixed": ("one_pass_loss_on_mixed true", {"one_pass_loss_on_mixed": True}),
    "gate input not detached": ("gate_detach_input false", {"gate_detach_input": False}),
    "post-norm feedback": ("post_norm_feedback true (EAGLE-3.1)", {"post_norm_feedback": True}),
}
#: the README's PR recipes (its "Recipes" table), each tested with its own `pr:` options (`extends:` resolved), as
#: `pr-specforge control --recipe RECIPE` tests it: set name -> recipe path
RECIPES = ("smollm2-135m-cpu.yaml", "smollm2-135m-cpu-online.yaml", "llama3.1-8b-pr.yaml", "qwen3-8b-pr.yaml",
           "gemma3-12b-pr.yaml")
for _recipe in RECIPES:
    OPTION_SETS[f"recipes/{_recipe}"] = ("the README's recipe: its own pr: options", f"recipes/{_recipe}")


def option_set_pr(name: str):
    from pr_specforge.config import PRConfig
    from pr_specforge.control.cli import recipe_pr

    _, overrides = OPTION_SETS[name]
    if overrides is None:
        return PRConfig()
    if isinstance(overrides, str):  # a recipe: its own options
        return recipe_pr(os.path.join(ROOT, overrides))
    base = recipe_pr(os.path.join(ROOT, PAPER_RECIPE)).to_dict()
    return PRConfig.from_mapping({**base, **overrides})


def portable_command(command: str) -> str:
    """The command with every path argument cut to its file name (no machine's directories in a document)."""
    return " ".join(os.path.basename(w) if os.sep in w and not w.startswith(("benchmarks", "recipes")) else w
                    for w in command.split(" "))


def provenance(args, threads: int) -> Dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # the run's own outputs (--json, --md), rewritten after every set, are not changes to what measured them
    outputs = [f":(exclude){os.path.relpath(os.path.abspath(p), ROOT)}" for p in (args.json, args.md)]
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *outputs], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return {"commit": commit + ("+changes" if dirty else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), shared with other jobs: wall times are rough",
            "threads": threads,
            "command": portable_command("python benchmarks/control.py " + " ".join(sys.argv[1:]))}


def _pool(settings: Dict[str, Any]) -> int:
    """M: a JSON from before the pool existed drew every sample's symbols from N; `None` is 2 N."""
    if "pool" not in settings:
        return settings["symbols"]
    return settings["pool"] or 2 * settings["symbols"]


def render(report: Dict[str, Any]) -> str:
    s = report["settings"]
    lines = ["# The positive control per option set", "",
             f"Does the PR objective learn a second pass? A tiny PR drafter (hidden {s['hidden']}, R = {s['max_depth']}, "
             f"TTT {s['ttt_length']}, {s['heads']} attention head(s)) sees the shuffled pairs of a random cycle f over "
             f"N = {s['symbols']} symbols (drawn per sample from a pool of {_pool(s)}) and is "
             f"asked f(a) (1-hop: one attention pass answers it) or f(f(a)) (2-hop: it needs two); {s['steps']} steps of "
             f"batch {s['batch']}, {s['eval_samples']} held-out samples. One pass can rule out a, f(a) and the symbol "
             f"before a, so its bound on 2-hop queries is 1/(N-3) = {1 / max(1, s['symbols'] - 3):.1%}. "
             "A set learns the second pass when depth 1 beats depth 0 on 2-hop queries by "
             f"{report['min_accuracy_gain']:.0%} and the gate's mean depth on 2-hop queries exceeds the 1-hop one by "
             f"{report['min_routing_gap']:.2f}. Rendered from `control.json` by `benchmarks/control.py`.", "",
             *([f"Note: {report['note']}", ""] if report.get("note") else []),
             "| option set | change | 1-hop d0 | 1-hop d1 | 2-hop d0 | 2-hop d1 | q 1-hop (d0, d1) | q 2-hop (d0, d1) | learns 2nd pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["sets"].items():
        one, two = row["result"]["one_hop"], row["result"]["two_hop"]
        q = lambda k: "(" + ", ".join(f"{x:.2f}" for x in k["q"]) + ")"  # noqa: E731
        lines.append(f"| {name} | {row['change']} | {one['accuracy'][0]:.1%} | {max(one['accuracy'][1:]):.1%} | "
                     f"{two['accuracy'][0]:.1%} | {max(two['accuracy'][1:]):.1%} | {q(one)} | {q(two)} | "
                     f"{'yes' if row['verdict']['learns_second_pass'] else 'no'} |")
    lines += ["", "Provenance (per set: the run that measured it):", "",
              "| option set | commit | date | machine | threads | wall time (rough, shared machine) |", "|---|---|---|---|---|---|"]
    for name, row in report["sets"].items():
        p = row["provenance"]
        lines.append(f"| {name} | {p['commit']} | {p['date']} | {p['machine']} | {p['threads']} | {row['train_seconds']:.0f} s |")
    commands = sorted({row["provenance"]["command"] for row in report["sets"].values()})
    lines += ["", "Commands:", ""] + [f"    {c}" for c in commands] + [""]
    return "\n".join(lines)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", nargs="*", default=list(OPTION_SETS), choices=list(OPTION_SETS), metavar="SET",
                   help=f"option sets to run (default all): {', '.join(OPTION_SETS)}")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--symbols", type=int, default=6)
    p.add_argument("--note", default="", help="a line recorded in the JSON (e.g. why the steps differ from the issue's)")
    p.add_argument("--merge", nargs="*", default=[], help="JSON files of earlier runs (same settings) whose sets join --json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "control.json"))
    p.add_argument("--md", default=os.path.join(ROOT, "benchmarks", "results", "control.md"))
    p.add_argument("--render-only", action="store_true", help="re-render --md from --json (after --merge) and stop")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(list(sys.argv[1:] if argv is None else argv))
    if args.render_only or args.merge:
        with open(args.json) as f:
            report = json.load(f)
        for path in args.merge:
            with open(path) as f:
                other = json.load(f)
            if other["settings"] != report["settings"]:
                print(f"control: {path} was measured with other settings than {args.json}", file=sys.stderr)
                return 2
            report["sets"].update(other["sets"])
        for row in report["sets"].values():
            row["provenance"]["command"] = portable_command(row["provenance"]["command"])
        report["sets"] = {k: report["sets"][k] for k in OPTION_SETS if k in report["sets"]}
        _write(args.json, json.dumps(report, indent=1) + "\n")
        _write(args.md, render(report))
        return 0
    import torch

    from pr_specforge.control.run import MIN_ACCURACY_GAIN, MIN_ROUTING_GAP, ControlSettings, run_control

    torch.set_num_threads(args.threads)
    settings = ControlSettings(steps=args.steps, symbols=args.symbols, queries=args.symbols, seed=args.seed)
    report: Dict[str, Any] = {"sets": {}}
    if os.path.isfile(args.json):
        with open(args.json) as f:
            report = json.load(f)
        if report.get("settings") != vars(settings):
            print(f"control: {args.json} was measured with other settings; start a new file", file=sys.stderr)
            return 2
    report.update(settings=vars(settings), note=args.note or report.get("note", ""), min_accuracy_gain=MIN_ACCURACY_GAIN, min_routing_gap=MIN_ROUTING_GAP)
    cache: Dict[Any, Any] = {}
    for name in args.sets:
        out = run_control(option_set_pr(name), settings, warm_cache=cache)
        report["sets"][name] = {"change": OPTION_SETS[name][0], **out, "provenance": provenance(args, args.threads)}
        report["sets"] = {k: report["sets"][k] for k in OPTION_SETS if k in report["sets"]}
        _write(args.json, json.dumps(report, indent=1) + "\n")
        _write(args.md, render(report))
        v = out["verdict"]
        print(f"{name}: 2-hop gain {v['two_hop_gain']:+.1%}, routing gap {v['routing_gap']:+.2f}, "
              f"learns={v['learns_second_pass']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
