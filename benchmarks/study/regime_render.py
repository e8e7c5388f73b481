"""`benchmarks/results/regimes.{md,json}`: one section per regime (its served cells, verdicts, held-out curves, the
conditions the paper relies on and why PR does not win), the provenance table (`regime_provenance`) and the
held-out plot.

A report that would hold less than the one it replaces (a regime, a seed or report problems fewer) is refused
unless told to (`--replace-with-fewer`); so is one with no regime folder at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from pr_specforge.eval.experiment_report import format_gain

from .regime_keep import FewerRows
from .regime_provenance import collect, render_provenance
from .regime_measures import render_measures
from .regime_settings import BASELINE, DRAFTERS
from .regime_verdict import MISSING_SHARE, gsm8k_row, sharegpt_row


def condition_text(key: str, x: float, digits: int = 3) -> str:
    """A condition's value as the report writes it: `eagle3_tau` (and the path it gives) as a number, a gain as a
    signed percentage, a share as a percentage; `digits` for the number, one fewer for a share's percentage."""
    if key == "eagle3_tau":
        return f"{x:.{digits}f}"
    return f"{100 * x:+.1f}%" if "gain" in key else f"{100 * x:.{digits - 1}f}%"


def _reason_lines(reasons: List[dict]) -> List[str]:
    def fmt(key, x):
        return f"{x:.2f}x" if key == "share" else condition_text(key, x, digits=2)

    def span(key, xs):
        lo, hi = fmt(key, min(xs)), fmt(key, max(xs))
        return lo if lo == hi else f"{lo} to {hi}"

    lines = ["", "### Why PR does not win here, from the rows above", "",
             f"A condition counts as missing when every seed measures under {MISSING_SHARE:.0%} of the paper's figure.", ""]
    for r in reasons:
        k = r["condition"]
        lines.append(f"- {r['name']} ({r['what']}): {span(k, r['measured'])} against the paper's {fmt(k, r['paper'])} "
                     f"({span('share', r['shares'])}): **{'missing' if r['missing'] else 'present'}**.")
    missing = [r["name"] for r in reasons if r["missing"]]
    lines += ["", "Missing here: " + ("; ".join(missing) if missing else "none of these") + "."]
    return lines


#: rows of a served cell's table: drafter -> the comparison key whose gain it shows (None: tau only); each PR drafter
#: (`BASELINE`) with its one-pass tree after the controls
TABLE_ROWS = (("eagle3", None), ("eagle3@bw9", "eagle3@bw9"), ("eagle3-2layer", "eagle3-2layer"),
              ("eagle3-long", "eagle3-long"), *((row, key) for name in BASELINE for row, key in ((name, name), (f"{name}/one-pass", None))))


BASE_OF = {"eagle3@bw9": "eagle3", "eagle3-2layer": "eagle3", "eagle3-long": "eagle3", **BASELINE}


def render_cells(cells: List[dict]) -> List[str]:
    """One table per served cell: each drafter's tau, its gain over its baseline, and PR's decomposition."""
    lines = []
    for c in cells:
        lines += [f"B {c['budget']}, T {c['temperature']:g}:", "",
                  "| drafter | prompts | tau | gain over | gain [95% CI] | one-pass part | mechanism | nodes verified per round: proposed / repriced by reconsideration |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, key in TABLE_ROWS:
            if c["tau"].get(name) is None:
                continue
            extra = ""
            if c.get(f"{name}@eagle3"):  # a warm start over the eagle3 it started from, too
                extra = f"; over eagle3: {format_gain(c[f'{name}@eagle3'])}"
            lines.append(f"| {name} | {c['prompts'].get(name, '-')} | {c['tau'][name]:.3f} | {BASE_OF.get(name, '-') if key else '-'} | "
                         f"{format_gain(c.get(key)) if key else '-'}{extra} | {format_gain(c.get(f'{key}/one-pass')) if key else '-'} | "
                         f"{format_gain(c.get(f'{key}/mechanism')) if key else '-'} | "
                         f"{' / '.join(f'{x:.3f}' for x in kept) if (kept := (c.get('recon_kept') or {}).get(name)) else '-'} |")
        lines.append("")
    return lines


def _seed_verdict(seed, x: dict, need: Optional[int]) -> str:
    """One seed's part of a verdict line (`seed`: its number, or a label such as "part D seed 0")."""
    text = f"{seed if isinstance(seed, str) else f'seed {seed}'}: mean T0 gain {100 * x['mean_t0_gain']:+.1f}%{', a T0 cell below 0' if x['cell_below_zero'] else ''}"
    if x.get("counts", True):
        return text
    if need and (x.get("problems") or 0) < need:
        return f"{text} on {x['problems']} of {need} problems, not counted yet"
    return f"{text} in {x['cells']} T0 cell{'s' * (x['cells'] != 1)}, not counted until every T0 cell is served"


def _verdict_lines(verdicts: dict, whose: str = "") -> List[str]:
    """One line per drafter's verdict (`verdict`)."""
    lines = []
    for name, v in verdicts.items():
        if v:
            per = "; ".join(_seed_verdict(s, x, v.get("need")) for s, x in sorted(v["seeds"].items()))
            need = f" with {v['need']} report problems each" if v.get("need") else ""
            said = ("WINS" if v["wins"] else "does not win") if v["decided"] else f"undecided (the verdict needs two seeds{need})"
            lines.append(f"- {whose}**{name}**: {said} ({per}).")
    return lines


def _split_lines(row: dict) -> List[str]:
    """Per PR drafter with a verdict, where its T = 0 gain comes from, per seed and cell: the one-pass part (its
    m = 0 tree over the baseline), the mechanism (m = 3 over m = 0) and the verified nodes a reconsidered feature
    proposed or repriced per round (0 proposed: its served trees held only what its one-pass tree proposed)."""
    lines = []
    for name, v in (row.get("verdict") or {}).items():
        per_seed = []
        for seed, summary in sorted((row.get("seeds") or {}).items()):
            cells = []
            for c in summary["cells"]:
                if c["temperature"] != 0.0 or name not in c:
                    continue
                one, mech = c.get(f"{name}/one-pass"), c.get(f"{name}/mechanism")
                kept = (c.get("recon_kept") or {}).get(name)
                text = f"B {c['budget']}: one-pass {format_gain(one) if one else '-'}, mechanism {format_gain(mech) if mech else '-'}"
                if kept:
                    text += f", verified nodes a round proposed / repriced by reconsideration {kept[0]:.3f} / {kept[1]:.2f}"
                cells.append(text)
            if cells:
                per_seed.append(f"seed {seed}: " + "; ".join(cells))
        if v and per_seed:
            lines.append(f"- **{name}**, its T0 gain split: " + " | ".join(per_seed) + ".")
    return lines


def _served_line(summary: dict) -> str:
    """A seed's report heading's count: one number when every folder has served the same problems, else each
    folder's (a folder still behind shows fewer problems in its own cells)."""
    if summary.get("problems") is None:
        return ""
    folders = summary.get("problems_by_folder") or {}
    if len(set(folders.values())) <= 1:
        return f" ({summary['problems']} problems in every cell)"
    each = ", ".join(f"{name} {n}" for name, n in folders.items())
    return f" (problems per folder: {each}; at least {summary['problems']} in every cell)"


def render(report: dict) -> str:
    lines = ["# Regimes (issue 27): where can PR pay?", "",
             "GSM8K is the 1,319-problem test split, cut by index: training 40-1039, screening 1040-1159 "
             "(variants are chosen here only), report 1160-1318 (served for the report tables only).", ""]
    for row in report["regimes"]:
        lines += [f"## {row['regime']}", ""]
        if row.get("part_d"):
            pd = row["part_d"]
            lines += [f"Part D (issue 16; drafters gone): EAGLE-3 tau (B 48, T 0, mean over sets) {pd['eagle3_tau_b48_t0']:.3f}; "
                      f"source {pd['source']}" + (f"; {row['controls']}." if row.get("controls") else "."), ""]
            lines += _verdict_lines(pd["verdict"], "part D's ") + [""]
        if "seeds" in row:
            d = row.get("data") or {}
            if d:
                lines += [f"Training data: {d.get('samples', '?')} {row.get('data_what', 'samples')}, {d.get('tokens', 0):,} tokens "
                          f"({d.get('loss_tokens', 0):,} loss tokens).", ""]
            for seed, summary in sorted((row.get("screening") or {}).items()):
                lines += [f"### seed {seed}: screening split (chooses variants; not a verdict)", ""] + render_cells(summary["cells"])
            for seed, summary in sorted((row.get("seeds") or {}).items()):
                served = _served_line(summary)
                lines += [f"### seed {seed}: report split{served}", ""] + render_cells(summary["cells"])
            if not row.get("seeds"):
                lines += ["No report-split serve has finished: no verdict for this regime yet.", ""]
            for sd, curves in sorted((row.get("heldout") or {}).items()):
                lines += [f"Held-out curves, {sd} (SpecForge's eval loop on the held-out features; step: loss / "
                          "simulated acceptance length; a warm start's steps count from its start):", ""]
                lines += [f"- {name}: " + ", ".join(f"{st}: {loss:.2f} / {acc:.3f}" if acc is not None else f"{st}: {loss:.2f}"
                                                     for st, loss, acc in curve) for name, curve in sorted(curves.items())]
                lines.append("")
            rc = row.get("round_cost")
            if rc and rc.get("two_layer_over_eagle"):
                lines += [f"Drafting-round cost over EAGLE-3's (SmolLM2 shape, B 48, {rc['dtype']}, {rc['threads']} thread, "
                          f"{rc['machine']}; `{rc['file']}`): two-layer {rc['two_layer_over_eagle']:.2f}x, "
                          f"B_w 9 {rc['bw9_over_eagle']:.2f}x, PR co-forwarded {rc['coforward_over_eagle']:.2f}x.", ""]
        lines += (_verdict_lines(row.get("verdict") or {}) + _split_lines(row)) if "seeds" in row else []
        if any((row.get("regime_verdict") or {}).values()):
            lines += ["", "The regime's verdict (part D's seeds and every rebuilt seed that has served each cell):", ""]
            lines += _verdict_lines(row["regime_verdict"])
        lines += ([""] + render_measures(row["measures"])) if row.get("measures") else []
        if row.get("conditions"):
            lines += ["", "### The conditions the paper's gain relies on, measured here", "",
                      "| condition | measured | paper |", "|---|---|---|"]
            for key, cnd in row["conditions"].items():
                meas = "; ".join(f"{sd}: {condition_text(key, m['value'])} ({m['from']})" for sd, m in sorted(cnd["measured"].items()))
                paper = "-" if cnd["paper"] is None else condition_text(key, cnd["paper"])
                lines.append(f"| {key} | {meas} | {paper} ({cnd['paper_source']}) |")
        if row.get("reason"):
            lines += _reason_lines(row["reason"])
        lines.append("")
    lines += render_provenance(report.get("provenance") or [])
    return "\n".join(lines) + "\n"


def report_shrinks(old_path: Path, report: dict) -> List[str]:
    """What the report at `old_path` holds that `report` does not: a regime, a seed of its report split, or a
    drafter's problems in a cell (one line each; [] when there is no report there). A drafter the report at
    `old_path` did not hold is no loss, however few problems it has served yet (a drafter being added round by round)."""
    if not old_path.exists():
        return []
    try:
        old = json.loads(old_path.read_text())
        old_rows = {r["regime"]: r for r in old["regimes"]}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{old_path}: not a regimes report ({e}); move it away to write a new one") from None
    new_rows = {r["regime"]: r for r in report["regimes"]}
    out = []
    for name, row in old_rows.items():
        new_seeds = {str(k): v for k, v in ((new_rows.get(name) or {}).get("seeds") or {}).items()}
        if name not in new_rows:
            out.append(f"it holds the {name} regime, this report none")
        for seed, summary in sorted((row.get("seeds") or {}).items()):
            if str(seed) not in new_seeds:
                out.append(f"it holds {name} seed {seed}'s report split, this report none")
                continue
            now = {(c["budget"], c["temperature"]): c.get("prompts") or {} for c in new_seeds[str(seed)].get("cells") or []}
            for c in summary.get("cells") or []:
                for drafter, had in sorted((c.get("prompts") or {}).items()):
                    has = now.get((c["budget"], c["temperature"]), {}).get(drafter, 0)
                    if has < had:
                        out.append(f"it holds {name} seed {seed} {drafter} at B {c['budget']}, T {c['temperature']:g} on "
                                   f"{had} report problems, this report on {has}")
    return out


#: the marker (`data.io.own_kind`) of PREFIX.json: `report` rewrites a report carrying it (the committed one does);
#: any other file there only with `--overwrite`
REGIMES_REPORT_KIND = "pr_specforge.regimes_report"


def report_files(prefix: Path) -> List[Path]:
    """What `write_regimes_report` writes: PREFIX.json (first), PREFIX.md and the held-out plot."""
    return [prefix.with_suffix(".json"), prefix.with_suffix(".md"), prefix.with_name(prefix.name + "-heldout.png")]


def check_report_out(prefix: Path, overwrite: bool = False, inputs=()) -> None:
    """`report --out PREFIX`, before any work (`data.io.check_writable_file`): its files may be an earlier regimes
    report (PREFIX.json carries `REGIMES_REPORT_KIND`), which `report` rewrites, with its .md and plot; any other file
    there (a user's own PREFIX.md, another JSON) only with `--overwrite`, never an input (a regime folder, the
    `--provenance` file), a read-only file or a path under a file: one line naming it."""
    from pr_specforge.data.io import check_writable_file

    paths = report_files(prefix)
    for path in paths:
        check_writable_file("--out", path, inputs=inputs)
    there = [path for path in paths if path.exists() or path.is_symlink()]
    if there:
        check_writable_file("--out", paths[0] if paths[0].exists() else there[0], overwrite, kind=REGIMES_REPORT_KIND,
                            what="an earlier regimes report")


def write_regimes_report(gsm8k_work: Optional[Path], prefix: Path, provenance: Optional[Path] = None,
                         report_limit: Optional[int] = None, sharegpt_work: Optional[Path] = None,
                         replace_with_fewer: bool = False) -> dict:
    """`prefix`.{json,md} (and the held-out plot) from the regime folders given, with their provenance tables
    (`regime_provenance.collect`; `provenance` adds a file). Refuses, before writing anything, a report without a
    regime folder and one that would hold less than the report there (`report_shrinks`) unless `replace_with_fewer`.
    What may be written at `prefix` is checked before (`check_report_out`)."""
    from pr_specforge.data.io import atomic_write_json, atomic_write_text, own_kind

    if gsm8k_work is None and sharegpt_work is None:
        raise ValueError("no regime folder given (--gsm8k, --sharegpt: a workdir or a folder `regimes.py save` kept); "
                         "nothing written")
    for work in (gsm8k_work, sharegpt_work):
        if work is not None and not (work / "data_settings.json").is_file():
            raise FileNotFoundError(f"{work}: not a regime workdir or a folder `regimes.py save` kept "
                                    "(no data_settings.json); nothing written")
    report = {"regimes": [sharegpt_row(sharegpt_work)] + ([gsm8k_row(gsm8k_work, report_limit)] if gsm8k_work else []),
              "provenance": collect([sharegpt_work, gsm8k_work], provenance)}
    less = [] if replace_with_fewer else report_shrinks(prefix.with_suffix(".json"), report)
    if less:
        more = f" (and {len(less) - 1} more)" if len(less) > 1 else ""
        raise FewerRows(f"{prefix.with_suffix('.json')}: {less[0]}{more}; nothing written (give every regime folder, "
                        "or --replace-with-fewer to write the smaller report)")
    atomic_write_json(prefix.with_suffix(".json"), {**own_kind(REGIMES_REPORT_KIND), **report})
    plot = plot_heldout(report, report_files(prefix)[2])
    atomic_write_text(prefix.with_suffix(".md"), render(report) + (f"\n![held-out curves]({plot.name})\n" if plot else ""))
    return report


def plot_heldout(report: dict, path: Path) -> Optional[Path]:
    """One panel per regime: each seed's and drafter's held-out simulated acceptance length against its steps (a
    warm start's from its own start). None (and no file) when no regime has a curve."""
    rows = [r for r in report["regimes"] if any(acc is not None for curves in (r.get("heldout") or {}).values()
                                                for curve in curves.values() for _, _, acc in curve)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pr_specforge.data.io import atomic_save_figure

    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 3.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for sd, curves in sorted(row["heldout"].items()):
            for name, curve in sorted(curves.items()):
                # a warm start goes on from its base's last step (shown from 0 where that is not known)
                base = DRAFTERS.get(name, (None, None, None))[2]
                start = (row.get("last_step") or {}).get(sd, {}).get("eagle3", 0) if base else 0
                pts = [(start + st, acc) for st, _, acc in curve if acc is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, linestyle="--" if base else "-",
                            label=f"{sd} {name}" + (" (on eagle3)" if base else ""))
        ax.set_title(f"{row['regime']}: held-out simulated acceptance length", fontsize=9)
        ax.set_xlabel("training step (a warm start's counted on from eagle3's last)", fontsize=8)
        ax.set_ylabel("simulated acceptance length", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
