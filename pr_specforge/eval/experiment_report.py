"""The EAGLE-3 vs PR experiment's report: `benchmarks/results/smollm2-cpu{,-seedN}.{md,json}` and plots.

Owns: `build_report` (settings, commands, machine, commit, served results, the paired
comparisons per seed, the trainings' last logged steps, `diagnose` on held-out features,
stage times), its markdown (`render_markdown`, one function per section) and its plots.

Does not own: the statistics (`eval.statistics`), the evaluator's rows (`eval.evaluator`)
or running anything (`pr_specforge.experiment`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from pr_specforge.data.io import atomic_save_figure
from pr_specforge.eval.statistics import comparisons, seed_comparisons

REPO_ROOT = Path(__file__).resolve().parents[2]


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
                                                  "recon_rows_per_round", "recon_kept_per_round", "repriced_kept_per_round",
                                                  "decomposition")}
                           | {"speedup_vs_ar": r.get("speedup")})
    cells = comparisons(finished, args.bootstrap, args.seed)
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
        "comparisons": cells,
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
             *(f"{note}\n" for note in report.get("notes") or ()),
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
    lines += _md_seeds(report) + _md_decomposition(report) + _md_served(report) + _md_training(report) + _md_heldout(report)
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


def format_gain(stats: Optional[dict]) -> str:
    """`+1.2% [-0.3, +2.7]`: a relative gain and its 95% CI (`-` when absent)."""
    if not stats:
        return "-"
    lo, hi = stats["gain_rel_ci95"]
    return f"{100 * stats['gain_rel']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"


#: `eval --decompose` counters per round (`serving.decompose`) that reports show, in their order
DECOMPOSITION = ("frontier_recon", "displaced", "gained_proposal", "gained_repricing", "lost_lb")


def _md_decomposition(report: dict) -> List[str]:
    """Where PR's gain comes from (only when the PR drafter was also served at m = 0): per seed and
    cell, the one-pass part and the mechanism part; then `--decompose`'s counters per round."""
    seeds = report.get("seeds") or {str((report.get("settings") or {}).get("seed", 0)): report["comparisons"]}
    rows = [(s, c) for s, cs in seeds.items() for c in cs if c.get("one_pass")]
    if not rows:
        return []
    lines = ["", "## Where the gain comes from (95% paired bootstrap CIs)", "",
             "`one-pass`: the PR drafter served with reconsideration off (m = 0) over EAGLE-3, what training PR did "
             "to the one-pass drafter. `mechanism`: PR (m = 3) over the same drafter at m = 0, what reconsideration "
             "did. (1 + gain) = (1 + one-pass)(1 + mechanism).", "",
             "| seed | set | B | T | gain | one-pass | mechanism |", "|---|---|---|---|---|---|---|"]
    for s, c in sorted(rows, key=lambda r: (r[1]["budget"], r[1]["temperature"], r[1]["set"], r[0])):
        lines.append(f"| {s} | {c['set']} | {c['budget']} | {c['temperature']:g} | {format_gain(c)} | {format_gain(c['one_pass'])} | "
                     f"{format_gain(c['mechanism'])} |")
    counted = [r for r in report["results"] if r["draft"] == "pr" and r.get("decomposition")]
    if counted:
        lines += ["", "Per verification round (`eval --decompose`, this report's seed): `frontier_recon` forwarded "
                  "nodes on a reconsidered branch, `displaced` nodes of the m = 0 cut the PR cut dropped, `gained_*` "
                  "accepted tokens only the PR cut held (a reconsidered proposal, or a one-pass node repricing put "
                  "under the cut), `lost_lb` rounds the m = 0 cut would have accepted more (T = 0 only).", "",
                  "| set | B | T | " + " | ".join(DECOMPOSITION) + " |", "|---|---|---|" + "---|" * len(DECOMPOSITION)]
        for r in counted:
            d = r["decomposition"]
            lines.append(f"| {r['set']} | {r['budget']} | {r['temperature']:g} | "
                         + " | ".join(_f(d.get(f"{k}_per_round")) for k in DECOMPOSITION) + " |")
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
        for name, d in held.items():
            pr = d.get("pr") or {}
            if not pr:
                continue
            lines += ["", f"{name}: PR's mixed rollout on held-out positions, by depth-0 confidence:", "",
                      "| positions | share | halt past 0 | acc depth 0 | acc depth 1 | acc depth 2 | recovered share |",
                      "|---|---|---|---|---|---|---|"]
            lines.append(f"| all | 1.000 | {_f(pr.get('pr/halt_past_0'))} | {_f(pr.get('pr/acc_depth_0'))} | "
                         f"{_f(pr.get('pr/acc_depth_1'))} | {_f(pr.get('pr/acc_depth_2'))} | {_f(pr.get('pr/recovered_share'))} |")
            for b in CONFIDENCE_BAND_NAMES:
                lines.append(f"| {b} | {_f(pr.get(f'pr/conf_share_{b}'))} | {_f(pr.get(f'pr/halt_past_0_{b}'))} | "
                             + " | ".join(_f(pr.get(f"pr/acc_depth_{r}_{b}")) for r in range(3))
                             + f" | {_f(pr.get(f'pr/recovered_share_{b}'))} |")
    return lines


#: what `write_report` writes: PREFIX + each suffix
REPORT_FILES = (".json", ".md", "-tau.png", "-gate.png")


#: the marker (`data.io.own_kind`) of PREFIX.json: a run rewrites a report carrying it, and no other
EXPERIMENT_REPORT_KIND = "pr_specforge.experiment_report"


def check_report_prefix(prefix: Path) -> None:
    """`--report PREFIX`, before any stage: its files may be an earlier report of the experiment (PREFIX.json carries
    `EXPERIMENT_REPORT_KIND`: the committed reports carry it too), which every run rewrites from its workdir; any
    other file there (a user's notes, another JSON, a report without the marker), a read-only file, a directory or a
    path under a file is refused in one line naming it (`data.io.check_writable_file`)."""
    from pr_specforge.data.io import check_writable_file

    paths = [str(prefix) + suffix for suffix in REPORT_FILES]
    for path in paths:
        check_writable_file("--report", path)
    there = [path for path in paths if os.path.lexists(path)]
    if there:  # the .md and plots beside a report are the report's; without one, none of them is the experiment's
        check_writable_file("--report", paths[0] if os.path.lexists(paths[0]) else there[0], kind=EXPERIMENT_REPORT_KIND,
                            what="an earlier experiment report")


def write_report(report: dict, prefix: Path) -> None:
    from pr_specforge.data.io import atomic_write_json, atomic_write_text, own_kind

    prefix.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(str(prefix) + ".json", {**own_kind(EXPERIMENT_REPORT_KIND), **report})
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
        atomic_save_figure(fig, str(prefix) + "-tau.png", dpi=120)
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
        atomic_save_figure(fig, str(prefix) + "-gate.png", dpi=120)
        plt.close(fig)
