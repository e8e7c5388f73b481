"""Markdown tables and plots from an evaluation summary (`Evaluator.run` / `summarize`).

Owns: `markdown_table` (tau, timings, speedup, losslessness per drafter x set x B x T),
`recovery_table` (Table 7's layout), and `write_report` (report.md + PNG plots:
tau per benchmark and method; one-pass top-1 acceptance by drafter confidence, as
Figure 1a; recovered share of one-pass misses by drafter x target confidence).
Does not own: running anything (`evaluator`).
"""

from __future__ import annotations

import os
from typing import Dict, List

from pr_specforge.data.io import atomic_save_figure, atomic_write_text

BAND_NAMES = ("<0.5", "0.5-0.9", ">=0.9")


def markdown_table(summary: dict) -> str:
    head = (
        "| drafter | set | B | T | tau | rounds | tokens | draft ms/round | verify ms/round "
        "| tok/s | AR tok/s | speedup | lossless |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for e in summary["results"]:
        lossless = {True: "yes", False: "NO", None: "n/a"}[e["lossless"]]
        lines.append(
            f"| {e['draft']} | {e['set']} | {e['budget']} | {e['temperature']:g} | {e['tau']:.3f} | {e['rounds']} "
            f"| {e['tokens']} | {1e3 * e['draft_s_per_round']:.1f} | {1e3 * e['verify_s_per_round']:.1f} "
            f"| {e['tokens_per_s']:.1f} | {e['ar_tokens_per_s']:.1f} | {e['speedup']:.2f}x | {lossless} |"
        )
    return head + "\n".join(lines) + "\n"


def _merge_recover(entries: List[dict]) -> List[List[List[int]]]:
    out = [[[0, 0] for _ in range(3)] for _ in range(3)]
    for e in entries:
        for i in range(3):
            for j in range(3):
                for c in range(2):
                    out[i][j][c] += e["recover"][i][j][c]
    return out


def recovery_table(summary: dict) -> str:
    """Per drafter: % of one-pass misses recovered by reconsideration (share of the miss pool)."""
    by_draft: Dict[str, List[dict]] = {}
    for e in summary["results"]:
        by_draft.setdefault(e["draft"], []).append(e)
    parts = []
    for draft, entries in by_draft.items():
        rec = _merge_recover(entries)
        total = sum(rec[i][j][0] for i in range(3) for j in range(3))
        parts.append(f"**{draft}** ({total} one-pass misses)\n")
        parts.append("| drafter c_d \\ target c_t | " + " | ".join(BAND_NAMES) + " | all |\n|---|---|---|---|---|\n")
        for i, name in enumerate(BAND_NAMES):
            cells = []
            for j in range(3):
                n, r = rec[i][j]
                cells.append(f"{100 * r / n:.1f}% ({100 * n / max(1, total):.1f}%)" if n else "-")
            n_row, r_row = sum(rec[i][j][0] for j in range(3)), sum(rec[i][j][1] for j in range(3))
            cells.append(f"{100 * r_row / n_row:.1f}%" if n_row else "-")
            parts.append(f"| {name} | " + " | ".join(cells) + " |\n")
        parts.append("\n")
    return "".join(parts)


DECOMPOSITION_COLUMNS = ("frontier_slots", "frontier_recon", "frontier_repriced", "displaced", "accepted",
                         "gained_proposal", "gained_repricing", "lost_lb")


def decomposition_table(summary: dict) -> str:
    """Per drafter x set x B x T: `serving.decompose`'s counters per round ('' when none was recorded)."""
    entries = [e for e in summary["results"] if e.get("decomposition")]
    if not entries:
        return ""
    head = "| drafter | set | B | T | " + " | ".join(DECOMPOSITION_COLUMNS) + " |\n|" + "---|" * (4 + len(DECOMPOSITION_COLUMNS)) + "\n"
    lines = []
    for e in entries:
        cells = [f"{e['decomposition'].get(c + '_per_round', 0.0):.3f}" for c in DECOMPOSITION_COLUMNS]
        lines.append(f"| {e['draft']} | {e['set']} | {e['budget']} | {e['temperature']:g} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def write_report(summary: dict, out_dir: str) -> List[str]:
    """Write report.md and the plots into `out_dir`; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(out_dir, exist_ok=True)
    entries = summary["results"]
    drafts = sorted({e["draft"] for e in entries})
    written = [_plot_tau(entries, drafts, out_dir), _plot_acceptance(entries, drafts, out_dir),
               _plot_recovered(entries, drafts, out_dir)]
    md = ["# Acceptance-length evaluation\n", markdown_table(summary), "\n## Recovered one-pass misses (Table 7 layout)\n"]
    md.append(
        "A one-pass miss is a verified position whose emitted token is not among the node's one-pass top-k "
        "proposals; it is recovered when that token was accepted through a child proposed by reconsideration.\n\n"
    )
    md.append(recovery_table(summary))
    decomposition = decomposition_table(summary)
    if decomposition:
        md.append("\n## Decomposition against the m = 0 tree (per round; `pr_specforge/serving/decompose.py`)\n\n")
        md.append(decomposition)
    md.append("\n![tau](tau.png)\n![acceptance](acceptance_by_confidence.png)\n![recovered](recovered_by_bucket.png)\n")
    path = os.path.join(out_dir, "report.md")
    atomic_write_text(path, "".join(md))
    written.append(path)
    return written


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    atomic_save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def _plot_tau(entries, drafts, out_dir: str) -> str:
    """tau per benchmark and method, one panel per (B, T)."""
    import matplotlib.pyplot as plt

    configs = sorted({(e["budget"], e["temperature"]) for e in entries})
    sets = sorted({e["set"] for e in entries})
    fig, axes = plt.subplots(1, max(1, len(configs)), figsize=(4 * max(1, len(configs)), 3.2), squeeze=False)
    width = 0.8 / max(1, len(drafts))
    for ax, (b, t) in zip(axes[0], configs):
        for di, d in enumerate(drafts):
            ys = [next((e["tau"] for e in entries if (e["draft"], e["set"], e["budget"], e["temperature"]) == (d, s, b, t)), 0.0) for s in sets]
            ax.bar([x + di * width for x in range(len(sets))], ys, width, label=d)
        ax.set_xticks([x + width * (len(drafts) - 1) / 2 for x in range(len(sets))], sets)
        ax.set_title(f"B={b}, T={t:g}")
        ax.set_ylabel("acceptance length tau")
    axes[0][0].legend(fontsize=7)
    return _save(fig, out_dir, "tau.png")


def _plot_acceptance(entries, drafts, out_dir: str) -> str:
    """Figure 1a: one-pass top-1 acceptance by drafter confidence."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for d in drafts:
        hist = [[0, 0] for _ in range(10)]
        for e in entries:
            if e["draft"] == d:
                for b in range(10):
                    hist[b][0] += e["conf_hist"][b][0]
                    hist[b][1] += e["conf_hist"][b][1]
        xs = [(b + 0.5) / 10 for b in range(10) if hist[b][0]]
        ys = [hist[b][1] / hist[b][0] for b in range(10) if hist[b][0]]
        ax.plot(xs, ys, marker="o", label=d)
    ax.plot([0, 1], [0, 1], ls=":", color="gray")
    ax.set_xlabel("drafter top-1 confidence c_d")
    ax.set_ylabel("top-1 acceptance rate")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "acceptance_by_confidence.png")


def _plot_recovered(entries, drafts, out_dir: str) -> str:
    """Table 7 as heatmaps: recovered share of one-pass misses."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(drafts), figsize=(3.6 * len(drafts), 3.2), squeeze=False)
    for ax, d in zip(axes[0], drafts):
        rec = _merge_recover([e for e in entries if e["draft"] == d])
        grid = [[(rec[i][j][1] / rec[i][j][0]) if rec[i][j][0] else 0.0 for j in range(3)] for i in range(3)]
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for i in range(3):
            for j in range(3):
                ax.text(j, i, f"{100 * grid[i][j]:.0f}%\n(n={rec[i][j][0]})", ha="center", va="center", fontsize=7, color="w")
        ax.set_xticks(range(3), BAND_NAMES)
        ax.set_yticks(range(3), BAND_NAMES)
        ax.set_xlabel("target confidence c_t")
        ax.set_ylabel("drafter confidence c_d")
        ax.set_title(d, fontsize=9)
    fig.suptitle(RECOVERED_TITLE, fontsize=9)
    return _save(fig, out_dir, "recovered_by_bucket.png")


RECOVERED_TITLE = ("one-pass misses a reconsidered depth gets right (top-1), by drafter x target confidence "
                   "(the paper's Table 7)")
