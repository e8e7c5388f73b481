"""Pilot screening of PR recipe options (issue 16, part C) on an existing `pr-specforge experiment` workdir.

    python benchmarks/pilots.py --workdir work/experiment --steps 2000                 # every variant
    python benchmarks/pilots.py --workdir work/experiment --variants eagle3 isolated-separate --dry-run

For each variant: a short training on the experiment's features (`--steps`, same recipe, data, lr
and seed as the experiment otherwise), `pr-specforge diagnose` on the held-out features, an HF
export, and a short served check (`--limit` prompts per set from item `--skip` on, B = 48, T = 0,
with the PR drafter also served at m = 0) on prompts DISJOINT from the final evaluation's first
40. Every stage is resumable (rerun the same command); the table goes to
`benchmarks/results/smollm2-cpu-pilots.md` (and `.json`), ranked by mean served tau.

Warm-start variants (`warm-*`) start from the EAGLE-3 pilot's weights, so `eagle3` runs first;
they train `--steps` more steps with a fresh optimiser, and their baseline is the EAGLE-3 pilot
trained on for as many steps the same way (`eagle3-long`, SpecForge's `model.draft_checkpoint_path`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/study: what the studies share

from study.common import ISOLATED_SEPARATE_ADAPTER16, RECIPES, RESULTS, SETS, continue_from  # noqa: E402
from pr_specforge.eval.experiment_report import DECOMPOSITION, format_gain  # noqa: E402
from pr_specforge.stages import STAGE_ERRORS, Stage, StageBuilder, run_stages  # noqa: E402
from pr_specforge.training.preflight import latest_checkpoint  # noqa: E402

EAGLE3 = "eagle3"
#: variant -> (recipe, `pr.` overrides). Warm starts read the `eagle3` pilot's checkpoint (filled in at run time).
VARIANTS: Dict[str, tuple] = {
    "eagle3": ("smollm2-135m-cpu-eagle3.yaml", []),
    "baseline": ("smollm2-135m-cpu.yaml", []),
    "separate": ("smollm2-135m-cpu.yaml", ["pr.recon_head=separate"]),
    "per-position": ("smollm2-135m-cpu.yaml", ["pr.balance_norm=per_position"]),
    "separate-bias-1": ("smollm2-135m-cpu.yaml", ["pr.recon_head=separate", "pr.gate_init_bias=-1.0"]),
    "isolated-separate": ("smollm2-135m-cpu.yaml", ["pr.recon_grad=isolated", "pr.recon_head=separate"]),
    "isolated-separate-adapter16": ("smollm2-135m-cpu.yaml", list(ISOLATED_SEPARATE_ADAPTER16)),
    "warm-frozen-separate-adapter16": ("smollm2-135m-cpu.yaml", ["pr.freeze_one_pass=true", "pr.recon_head=separate",
                                                                  "pr.recon_adapter_rank=16"]),
    "warm-isolated-separate-adapter16": ("smollm2-135m-cpu.yaml", list(ISOLATED_SEPARATE_ADAPTER16)),
    # the isolated warm start's second head lags the one-pass head it was copied from (it trains at weight
    # ~q(r) while the one-pass head keeps training on l^0): read depths >= 1 through the current one-pass
    # head, or train the second head at full weight
    "warm-isolated-shared-adapter16": ("smollm2-135m-cpu.yaml", ["pr.recon_grad=isolated", "pr.recon_head=shared",
                                                                  "pr.recon_adapter_rank=16"]),
    "warm-isolated-separate-adapter16-uniform": ("smollm2-135m-cpu.yaml", [
        "pr.recon_grad=isolated", "pr.recon_head=separate", "pr.recon_adapter_rank=16", "pr.reconsider_weight=uniform"]),
    "eagle3-long": ("smollm2-135m-cpu-eagle3.yaml", []),
}
WARM = tuple(name for name in VARIANTS if name.startswith("warm-")) + ("eagle3-long",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="work/experiment", help="a `pr-specforge experiment` workdir (its data stages done)")
    p.add_argument("--out", default=None, help="pilot dir (default WORKDIR/pilots)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warm-steps", type=int, default=None,
                   help="steps of the warm starts on the EAGLE-3 pilot (and of `eagle3-long`); default --steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--skip", type=int, default=40, help="served check starts after the final evaluation's prompts")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128, help="served check: new tokens per prompt")
    p.add_argument("--budget", type=int, default=48, help="served check: tree budget B")
    p.add_argument("--decompose", action="store_true",
                   help="served check with `eval --decompose` (issue 16 part A counters per PR pilot; object tree builder)")
    p.add_argument("--report", default=str(RESULTS / "smollm2-cpu-pilots"))
    p.add_argument("--dry-run", action="store_true", help="print the stage commands, run nothing")
    return p


def is_pr(name: str) -> bool:
    """A PR pilot (any recipe other than the EAGLE-3 pilots')."""
    return VARIANTS[name][0] != VARIANTS[EAGLE3][0]


def warm_steps(args) -> int:
    return args.warm_steps or args.steps


def train_overrides(args, work: Path, name: str, run: Path) -> List[str]:
    steps = warm_steps(args) if name in WARM else args.steps
    out = [*StageBuilder(work).feature_overrides(run, args.max_length),
           f"training.max_steps={steps}", f"training.learning_rate={args.lr}", f"training.seed={args.seed}",
           f"training.save_interval={steps}", *VARIANTS[name][1]]
    if name in WARM:  # continue from the EAGLE-3 pilot's weights for `--warm-steps` more steps (fresh optimiser, both)
        ckpt = latest_checkpoint(Path(args.out) / "runs" / EAGLE3, required=not args.dry_run) or "<eagle3 pilot checkpoint>"
        out.append(continue_from(ckpt, pr=name != "eagle3-long"))
    return out


def serve_settings(args, name: str, export: Path) -> dict:
    """`StageBuilder.eval_argv` settings of a pilot's served check (PR pilots also at m = 0, and decomposed if asked)."""
    pr = is_pr(name)
    return dict(drafts={name: export}, prompts=SETS, limit=args.limit, budgets=[args.budget], temperatures=[0],
                max_new_tokens=args.max_new_tokens,
                extra=["--skip", args.skip, "--seed", args.seed, "--no-progress", *(["--also-one-pass"] if pr else []),
                       *(["--decompose"] if args.decompose and pr else [])])


def serve_argv(args, work: Path, name: str, export: Path, ev: Path) -> List[str]:
    """`pr-specforge eval` arguments of a pilot's served check."""
    return StageBuilder(work).eval_argv(ev, **serve_settings(args, name, export))


def stages(args, work: Path, name: str) -> List[Stage]:
    pilots = Path(args.out)
    run, export, ev = pilots / "runs" / name, pilots / "export" / name, pilots / "eval" / name
    diag = pilots / "diagnose" / f"{name}.json"
    recipe = str(RECIPES / VARIANTS[name][0])
    build = StageBuilder(work, log_file=pilots / "commands.log")
    return [
        # overrides made when the stage runs, not earlier: warm starts need the eagle3 pilot
        build.train_stage(f"{name}: train", recipe, run, lambda: train_overrides(args, work, name, run)),
        build.diagnose_stage(f"{name}: diagnose", run, work / "heldout" / "features", diag, args.seed),
        Stage(f"{name}: export", export / "config.json", lambda: build.export(run, export, "hf"),
              done=lambda: build.export_done(run, export)),
        build.eval_stage(f"{name}: serve", ev, **serve_settings(args, name, export)),
    ]


def row(name: str, diag: Optional[dict], summary: Optional[dict]) -> dict:
    """One table row: held-out diagnostics and served tau (per set and mean; m = 0 for PR)."""
    out: dict = {"variant": name}
    if diag:
        acc = diag.get("one_pass_acc") or []
        out["one_pass_acc0"] = acc[0] if acc else None
        out["sim_acc_len"] = diag.get("simulated_acc_len")
        pr = diag.get("pr") or {}
        for key in ("pr/acc_depth_0", "pr/acc_depth_1", "pr/acc_depth_2", "pr/recovered_share", "pr/recovered_outside_topk"):
            out[key.split("/", 1)[1]] = pr.get(key)
    decomp: Dict[str, List[float]] = {}
    for entry in (summary or {}).get("results", []):
        suffix = "_m0" if entry["draft"].endswith("/one-pass") else ""
        out[f"tau_{entry['set']}{suffix}"] = entry["tau"]
        if not suffix:
            for key, value in (entry.get("decomposition") or {}).items():
                decomp.setdefault(key, []).append(value)
    for key in DECOMPOSITION:  # per round, mean over the sets (only PR pilots served with --decompose)
        if decomp.get(key + "_per_round"):
            out[key] = sum(decomp[key + "_per_round"]) / len(decomp[key + "_per_round"])
    for suffix in ("", "_m0"):
        taus = [out[f"tau_{s}{suffix}"] for s in SETS if f"tau_{s}{suffix}" in out]
        out[f"tau_mean{suffix}"] = sum(taus) / len(taus) if taus else None
    return out


def matched_baseline(name: str) -> Optional[str]:
    """The EAGLE-3 pilot a PR pilot is compared with: trained as many total steps on the same data."""
    if not is_pr(name):
        return None
    return "eagle3-long" if name in WARM else EAGLE3


def comparisons(out: Path, names: Sequence[str], n: int = 2000, seed: int = 0) -> List[dict]:
    """Per PR pilot, paired over the served prompts of every set (95% bootstrap CI of the relative tau gain):
    `gain` PR (m = 3) over its matched EAGLE-3 = `one_pass` (its m = 0 tree over that EAGLE-3: what sharing the
    layer did to the one-pass drafter) combined with `mechanism` (m = 3 over m = 0: what reconsideration did);
    `eval.statistics.decompose_gain`'s rule for missing rows, the experiment report's too."""
    from pr_specforge.data.io import read_jsonl_rows
    from pr_specforge.eval.statistics import decompose_gain

    cache: Dict[str, Dict[str, Dict[str, dict]]] = {}

    def served(name: str) -> Dict[str, Dict[str, dict]]:
        """A pilot's served rows, draft -> "set/prompt" -> row (read once; baselines serve several pilots)."""
        if name not in cache:
            path = out / "eval" / name / "results.jsonl"
            cache[name] = {}
            for r in (read_jsonl_rows(path) if path.exists() else []):
                cache[name].setdefault(r["draft"], {})[f"{r['set']}/{r['prompt']}"] = r
        return cache[name]

    cells = []
    for name in names:
        base = matched_baseline(name)
        if base is None:
            continue
        pr, eagle = served(name), served(base).get(base)
        m3, m0 = pr.get(name), pr.get(f"{name}/one-pass")
        cells.append({"variant": name, "baseline": base, **decompose_gain(eagle, m3, m0, n=n, seed=seed)})
    return cells


def render_comparisons(cells: Sequence[dict]) -> List[str]:
    lines = ["", "## Against the matched EAGLE-3 pilot (paired over every served prompt, 95% bootstrap CI)", "",
             "`gain` = PR served at m = 3 over its baseline; it splits into `one-pass` (the PR drafter's m = 0 tree "
             "over the baseline: what training PR did to the one-pass drafter) and `mechanism` (m = 3 over m = 0).", "",
             "| variant | baseline | prompts | gain | one-pass | mechanism |", "|---|---|---|---|---|---|"]
    for c in cells:
        n = (c.get("gain") or c.get("mechanism") or {}).get("prompts", "-")
        lines.append(f"| {c['variant']} | {c['baseline']} | {n} | {format_gain(c.get('gain'))} | {format_gain(c.get('one_pass'))} | "
                     f"{format_gain(c.get('mechanism'))} |")
    return lines


def render(rows: Sequence[dict], args, cells: Sequence[dict] = ()) -> str:
    cols = ["variant", "tau_mean", "tau_mean_m0", *[f"tau_{s}" for s in SETS], "one_pass_acc0", "sim_acc_len",
            "acc_depth_0", "acc_depth_1", "acc_depth_2", "recovered_share", "recovered_outside_topk", *DECOMPOSITION]
    ranked = sorted(rows, key=lambda r: -(r.get("tau_mean") or 0.0))
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["# SmolLM2 pilots (issue 16, part C)", "",
             f"{args.steps} steps per pilot (warm starts: {warm_steps(args)} more on the EAGLE-3 pilot; their baseline is "
             f"`eagle3-long`). Served: B = {args.budget}, T = 0, {args.max_new_tokens} new tokens, prompts "
             f"{args.skip}..{args.skip + args.limit - 1} of each set "
             "(disjoint from the final evaluation's first 40); `tau_mean_m0` serves the PR drafter with m = 0. "
             "Held-out: `pr-specforge diagnose`. Ranked by served mean tau. Decomposition columns (per round, "
             "mean over sets; `--decompose`): `frontier_recon` forwarded nodes on a reconsidered branch, "
             "`displaced` nodes of the m = 0 cut the PR cut dropped, `gained_*` accepted tokens only the PR cut "
             "held, `lost_lb` rounds the m = 0 cut would have accepted more.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in ranked]
    lines += render_comparisons(cells) if cells else []
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    work = Path(args.workdir)
    args.out = args.out or str(work / "pilots")
    order = sorted(args.variants, key=lambda n: (n in WARM, n != EAGLE3))  # eagle3 first, warm starts last
    if args.dry_run:
        for name in order:
            print(f"{name}: pr-specforge train -c recipes/{VARIANTS[name][0]} " + " ".join(train_overrides(args, work, name, Path(args.out) / "runs" / name)))
        return 0
    try:
        run_stages([s for name in order for s in stages(args, work, name)], Path(args.out) / "stage_times.json")
    except STAGE_ERRORS as e:
        print(f"pilots: {e}", file=sys.stderr)
        return 1
    rows = []
    for name in order:
        diag_path, summ_path = Path(args.out) / "diagnose" / f"{name}.json", Path(args.out) / "eval" / name / "summary.json"
        rows.append(row(name, json.loads(diag_path.read_text()) if diag_path.exists() else None,
                        json.loads(summ_path.read_text()) if summ_path.exists() else None))
    cells = comparisons(Path(args.out), order, seed=args.seed)
    Path(args.report + ".json").write_text(json.dumps({"steps": args.steps, "warm_steps": warm_steps(args), "rows": rows,
                                                       "comparisons": cells}, indent=1) + "\n")
    table = render(rows, args, cells)
    Path(args.report + ".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
