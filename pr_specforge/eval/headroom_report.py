"""The `pr-specforge headroom` report: markdown beside the paper's figures, and the two PNGs.

Owns: the rendering of an `eval.headroom` report dict (no measurement here).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pr_specforge.data.io import atomic_save_figure

BAND_NAMES = ("<0.5", "0.5-0.9", ">=0.9")


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _delta(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.3f}"


def _fig1a(pooled: Dict[str, Any], steps: List[Dict[str, Any]], paper: Dict[str, Any]) -> List[str]:
    head = "| c_d bucket | paper | ours (pooled) | count | " + " | ".join(f"step {j}" for j in range(len(steps))) + " |"
    lines = ["## Figure 1(a): greedy acceptance by drafter confidence", "",
             "Acceptance = drafter top-1 equals the target token; pooled over TTT steps, then per step. "
             "The paper quotes three buckets only.", "", head, "|" + " --- |" * (4 + len(steps))]
    for i, row in enumerate(pooled["fig1a"]):
        quoted = paper["fig1a"].get(i, paper["fig1a"].get(str(i)))
        per_step = " | ".join(_pct(s["fig1a"][i]["acceptance"]) for s in steps)
        lines.append(f"| {row['bucket']} | {'-' if quoted is None else f'{quoted:.1f}%'} | {_pct(row['acceptance'])} | "
                     f"{row['count']:.0f} | {per_step} |")
    lines.append(f"| all | {100 - paper['reject_share']:.1f}% | {_pct(pooled['acceptance'])} | {pooled['scored']:.0f} | "
                 + " | ".join(_pct(s["acceptance"]) for s in steps) + " |")
    return lines


def _fig1b(pooled: Dict[str, Any], paper: Dict[str, Any]) -> List[str]:
    f = pooled["fig1b"]
    lines = ["## Figure 1(b): the reject pool by drafter x target confidence", "",
             f"Ours (paper) as % of the in-vocab reject pool: {f['pool']:.0f} of {f['rejects']:.0f} rejects; "
             f"{f['oov_rejects']:.0f} rejects ({_pct(f['oov_rejects'] / f['rejects'] if f['rejects'] else None)}) have "
             "their target token outside the draft vocab and are not in the grid.", "",
             "| drafter c_d \\ target c_t | " + " | ".join(BAND_NAMES) + " | all |", "| --- | --- | --- | --- | --- |"]
    for d in range(3):
        cells = [f"{_pct(f['shares'][d][t])} ({paper['fig1b'][d][t]:.1f}%)" for t in range(3)]
        lines.append(f"| {BAND_NAMES[d]} | " + " | ".join(cells)
                     + f" | {_pct(f['drafter_band_shares'][d])} ({sum(paper['fig1b'][d]):.1f}%) |")
    cols = [sum(paper["fig1b"][d][t] for d in range(3)) for t in range(3)]
    lines.append("| all | " + " | ".join(f"{_pct(f['target_band_shares'][t])} ({cols[t]:.1f}%)" for t in range(3)) + " | 100% |")
    return lines


def _second_guess(report: Dict[str, Any]) -> List[str]:
    k = report["k"]
    lines = ["## The second guess: where are the one-pass misses?", "",
             f"Among one-pass misses (drafter top-1 != target token); k = {k}. A wider tree already holds rank 2; "
             f"reconsideration pays on misses outside depth 0's top {k} that a reconsidered depth gets right.", "",
             "| step | misses | target is depth 0's rank 2 | outside depth 0's top k | a reconsidered depth's top-1 | only a reconsidered depth proposes it |",
             "| --- | --- | --- | --- | --- | --- |"]
    rows = [("pooled", report["pooled"])] + [(str(j), s) for j, s in enumerate(report["per_step"])]
    for name, s in rows:
        g = s["second_guess"]
        lines.append(f"| {name} | {g['misses']:.0f} | {_pct(g['rank2'])} | {_pct(g['outside_topk'])} | "
                     f"{_pct(g['recon_top1'])} | {_pct(g['recon_only'])} |")
    return lines


def _table7(pooled: Dict[str, Any], paper: Dict[str, Any]) -> List[str]:
    t = pooled["table7"]
    names = (*BAND_NAMES, "all")
    lines = ["## Table 7: what reconsideration recovers, by bucket", "",
             "Ours (paper): % of each bucket's rejects some reconsidered depth gets right at top-1 "
             "[the bucket's share of the pool]; steps where the mixed rollout runs.", "",
             "| drafter c_d \\ target c_t | " + " | ".join(names) + " |", "| --- | --- | --- | --- | --- |"]
    for d in range(4):
        cells = [f"{_pct(t['recovered'][d][c])} [{_pct(t['pool_shares'][d][c])}] "
                 f"({paper['table7_recovered'][d][c]:.1f}%)" for c in range(4)]
        lines.append(f"| {names[d]} | " + " | ".join(cells) + " |")
    lines += ["", "Mean change in top-1 probability against the position's own one-pass distribution, by target band:", "",
              "| | " + " | ".join(names) + " |", "| --- | --- | --- | --- | --- |"]
    for key, label in (("delta_recovered", "recovered"), ("delta_not_recovered", "not recovered")):
        lines.append(f"| {label} | " + " | ".join(f"{_delta(t[key][c])} ({paper['table7_' + key][c]:+.3f})"
                                                    for c in range(4)) + " |")
    return lines


def markdown(report: Dict[str, Any], paper: Dict[str, Any]) -> str:
    pooled = report["pooled"]
    sim = report.get("sim") or {}
    lines = [f"# Headroom of {report['drafter']}", "",
             f"- drafter: `{report['checkpoint']}` ({report['strategy']}, R = {report['max_depth']}); "
             f"features: `{report['features']}`; {report['batches']} batches, {pooled['scored']:.0f} scored positions "
             f"over {report['ttt_length']} TTT steps",
             "- simulated acceptance length (`training.simulate`): " + ", ".join(
                 f"{key.rsplit('acc_len_', 1)[1]} {value:.3f}" for key, value in sim.items()),
             f"- paper: {paper['source']}", ""]
    if report.get("note"):
        lines += [f"Note: {report['note']}.", ""]
    lines += _fig1a(pooled, report["per_step"], paper) + [""] + _fig1b(pooled, paper) + [""] + _second_guess(report)
    if pooled.get("table7"):
        lines += [""] + _table7(pooled, paper)
    return "\n".join(lines) + "\n"


def plot(report: Dict[str, Any], paper: Dict[str, Any], prefix: str) -> List[str]:
    """PREFIX-acceptance.png (Figure 1(a)) and PREFIX-reject-pool.png (Figure 1(b)), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = report["pooled"]
    centres = [0.05 + 0.1 * i for i in range(len(pooled["fig1a"]))]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for j, step in enumerate(report["per_step"]):
        ys = [r["acceptance"] for r in step["fig1a"]]
        ax.plot([x for x, y in zip(centres, ys) if y is not None], [y for y in ys if y is not None],
                linewidth=0.8, alpha=0.5, label=f"step {j}")
    ys = [r["acceptance"] for r in pooled["fig1a"]]
    ax.plot([x for x, y in zip(centres, ys) if y is not None], [y for y in ys if y is not None], "o-", color="black",
            linewidth=1.6, label="ours, pooled")
    quoted = sorted((int(i), v) for i, v in paper["fig1a"].items())
    ax.plot([centres[i] for i, _ in quoted], [v / 100 for _, v in quoted], "s", color="tab:red", label="paper (quoted)")
    ax.plot([0, 1], [0, 1], ":", color="grey", linewidth=0.8)
    ax.set_xlabel("drafter top-1 confidence c_d")
    ax.set_ylabel("greedy acceptance")
    ax.set_title("Figure 1(a): acceptance by drafter confidence", fontsize=10)
    ax.legend(fontsize=7)
    out = [_save(fig, prefix + "-acceptance.png", plt)]

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    grids = [(pooled["fig1b"]["shares"], "ours"), ([[v / 100 for v in row] for row in paper["fig1b"]], "paper")]
    for ax, (grid, name) in zip(axes, grids):
        values = [[0.0 if v is None else v for v in row] for row in grid]
        ax.imshow(values, cmap="Blues", vmin=0, vmax=max(0.3, max(max(r) for r in values)), origin="lower")
        for d in range(3):
            for t in range(3):
                ax.text(t, d, f"{100 * values[d][t]:.1f}%", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(3), BAND_NAMES)
        ax.set_yticks(range(3), BAND_NAMES)
        ax.set_xlabel("target confidence c_t")
        ax.set_ylabel("drafter confidence c_d")
        ax.set_title(f"Figure 1(b), {name}: % of the reject pool", fontsize=10)
    out.append(_save(fig, prefix + "-reject-pool.png", plt))
    return out


def _save(fig, path: str, plt) -> str:
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
