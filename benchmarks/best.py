"""The full comparison of one PR recipe against its matched EAGLE-3, over training seeds (issue 16, part D).

    python benchmarks/best.py --workdir work/experiment --variant warm-isolated-separate-adapter16 --seeds 0 1
    python benchmarks/best.py --workdir work/experiment --variant baseline --seeds 0 1 --steps 7560 --dry-run

On a `pr-specforge experiment` workdir whose data stages are done. `--variant` is one of
`benchmarks/pilots.py`'s recipes, chosen on the pilots' served check (prompts 40.. of each set);
this run serves the final evaluation's prompts (the first `--limit` of each set), so the variant
is not chosen on the prompts it is reported on. Per seed:

  1. train       EAGLE-3 for `--steps`; a warm-start variant (`warm-*`) then trains `--warm-steps`
                 more from that checkpoint, and its baseline is the same EAGLE-3 checkpoint trained
                 on for as many steps (both with a fresh optimiser); any other variant trains
                 `--steps` from scratch against the EAGLE-3 drafter
  2. diagnose    both drafters on the held-out features
  3. export      HF directories
  4. serve       B = 48 at T = 0 and 1, B = 24 at T = 0 (k 6, B_w 6, gamma 8, m 3); the PR drafter
                 also at m = 0 (`--also-one-pass`) and decomposed (`--decompose`)

Every stage is resumable (rerun the same command). Layout under `--out` (default WORKDIR/best):
runs/{eagle3-base,eagle3,pr}-seedN, diagnose/, export/, eval-b{48,24}-seedN. The report
(`benchmarks/results/smollm2-cpu-best.{md,json}`) has the schema of `smollm2-cpu.json`
(`comparisons` of the first seed, `seeds` of all), each cell split into its one-pass and
mechanism parts.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/pilots.py (the variants), benchmarks/study

import pilots as PILOTS  # noqa: E402
from study.common import RECIPES, RESULTS, continue_from, tree_args  # noqa: E402
from pr_specforge.eval.experiment_report import build_report, render_markdown, write_report  # noqa: E402
from pr_specforge.stages import STAGE_ERRORS, Stage, StageBuilder, run_stages, train_command  # noqa: E402
from pr_specforge.training.preflight import latest_checkpoint  # noqa: E402

DRAFTERS = ("eagle3", "pr")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="work/experiment", help="a `pr-specforge experiment` workdir (its data stages done)")
    p.add_argument("--out", default=None, help="this comparison's directory (default WORKDIR/best)")
    p.add_argument("--variant", required=True, choices=[v for v in PILOTS.VARIANTS if PILOTS.is_pr(v)])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=1000, help="EAGLE-3 steps (and a non-warm variant's)")
    p.add_argument("--warm-steps", type=int, default=500, help="warm starts: steps on top of the EAGLE-3 checkpoint")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int, default=40, help="served prompts per set (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--report", default=str(RESULTS / "smollm2-cpu-best"))
    p.add_argument("--note", action="append", help="a line for the report's head (how this run was made; repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the training commands, run nothing")
    return p


class Best:
    """One variant against its matched EAGLE-3, every stage of every seed over one directory."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work = args, Path(args.workdir).resolve()
        self.out = Path(args.out).resolve() if args.out else self.work / "best"
        self.build = StageBuilder(self.work, log_file=self.out / "commands.log")
        self.warm = args.variant in PILOTS.WARM

    def run_dir(self, name: str, seed: int) -> Path:
        return self.out / "runs" / f"{name}-seed{seed}"

    def trainings(self, seed: int) -> Dict[str, tuple]:
        """name -> (recipe, overrides) of one seed's trainings, in order (`eagle3-base` only for warm starts)."""
        args, steps = self.args, self.args.warm_steps if self.warm else self.args.steps
        eagle_recipe = str(RECIPES / PILOTS.VARIANTS[PILOTS.EAGLE3][0])
        recipe, options = PILOTS.VARIANTS[args.variant]

        def common(name: str, n: int) -> List[str]:
            return [*self.build.feature_overrides(self.run_dir(name, seed), args.max_length), f"training.max_steps={n}",
                    f"training.learning_rate={args.lr}", f"training.seed={seed}", f"training.save_interval={n}"]

        base = latest_checkpoint(self.run_dir("eagle3-base", seed), required=False) or "<eagle3-base checkpoint>"
        out = {"eagle3-base": (eagle_recipe, common("eagle3-base", args.steps))} if self.warm else {}
        out["eagle3"] = (eagle_recipe, common("eagle3", steps) + ([continue_from(base, pr=False)] if self.warm else []))
        out["pr"] = (str(RECIPES / recipe), common("pr", steps) + list(options) + ([continue_from(base, pr=True)] if self.warm else []))
        return out

    def evals(self, seed: int) -> Dict[str, Path]:
        return {b: self.out / f"eval-{b}-seed{seed}" for b in ("b48", "b24")}

    def stages(self, seed: int) -> List[Stage]:
        build = self.build
        out: List[Stage] = [
            # overrides made when the stage runs: the warm starts need `eagle3-base`'s checkpoint
            build.train_stage(f"seed {seed}: train {name}", recipe, self.run_dir(name, seed),
                              lambda name=name: self.trainings(seed)[name][1])
            for name, (recipe, _) in self.trainings(seed).items()]
        for name in DRAFTERS:
            run, diag, export = self.run_dir(name, seed), self.diag(name, seed), self.export_dir(name, seed)
            out += [build.diagnose_stage(f"seed {seed}: diagnose {name}", run, self.work / "heldout" / "features", diag, seed),
                    Stage(f"seed {seed}: export {name}", export / "config.json",
                          lambda run=run, export=export: build.export(run, export, "hf"),
                          done=lambda run=run, export=export: build.export_done(run, export))]
        serve, evals = self.serve_settings(seed), self.evals(seed)
        return out + [build.eval_stage(f"seed {seed}: eval-b48", evals["b48"], budgets=[48], temperatures=[0.0, 1.0], **serve),
                      build.eval_stage(f"seed {seed}: eval-b24", evals["b24"], budgets=[24], temperatures=[0.0], **serve)]

    def serve_settings(self, seed: int) -> dict:
        """`StageBuilder.eval_stage` settings (but budgets and temperatures): the first `--limit` prompts of
        each set, both drafters, the PR drafter also at m = 0 and decomposed."""
        return dict(drafts={name: self.export_dir(name, seed) for name in DRAFTERS}, prompts=PILOTS.SETS,
                    limit=self.args.limit, max_new_tokens=self.args.max_new_tokens,
                    extra=[*tree_args(), "--seed", seed, "--no-progress",
                           "--also-one-pass", "--decompose"])

    def diag(self, name: str, seed: int) -> Path:
        return self.out / "diagnose" / f"{name}-seed{seed}.json"

    def export_dir(self, name: str, seed: int) -> Path:
        return self.out / "export" / f"{name}-seed{seed}"

    def run(self) -> dict:
        args = self.args
        (self.out / "diagnose").mkdir(parents=True, exist_ok=True)
        timings = run_stages([s for seed in args.seeds for s in self.stages(seed)], self.out / "stage_times.json")
        first = args.seeds[0]
        args.seed = first  # the report's headline comparisons (and bootstrap seed) are the first seed's
        trainings = {(name, seed): run for seed in args.seeds for name, run in self.trainings(seed).items()}
        runs = {f"{name}-seed{seed}": self.run_dir(name, seed) for name, seed in trainings}
        commands = {f"{name}-seed{seed}": train_command(*run) for (name, seed), run in trainings.items()}
        diags = {f"{name}-seed{seed}": self.diag(name, seed) for seed in args.seeds for name in DRAFTERS}
        report = build_report(args, self.out, runs, self.evals(first), timings, diags, train_commands=commands)
        report["notes"] = [
            f"**{args.variant}** against its matched EAGLE-3 (`eagle3`: " + (
                f"the same EAGLE-3 checkpoint of {args.steps} steps trained {args.warm_steps} more steps, as the PR drafter was"
                if self.warm else f"{args.steps} steps, as the PR drafter") + f"), training seeds {args.seeds}. "
            f"Served: the first {args.limit} prompts of each set, {args.max_new_tokens} new tokens; `pr/one-pass` is the PR "
            "drafter at m = 0. The evaluations ran with `--decompose` (an extra m = 0 tree per round), so their "
            "timings are not speed numbers.", *(args.note or [])]
        write_report(report, Path(args.report))
        return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    args.command = "python benchmarks/best.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    best = Best(args)
    if args.dry_run:
        for seed in args.seeds:
            for recipe, overrides in best.trainings(seed).values():
                print(train_command(recipe, overrides))
        return 0
    try:
        report = best.run()
    except STAGE_ERRORS as e:
        print(f"best: {e}", file=sys.stderr)
        return 1
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
