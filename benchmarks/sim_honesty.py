"""Is the acceptance simulator honest? (issue 26, item 3)

For each drafter variant, the gain over the EAGLE-3 baseline that training's `sim/` keys
predict, against the gain the lossless evaluator measures when the drafters are served:

    python benchmarks/sim_honesty.py --baseline eagle3=DIAG_EAGLE3.json \\
        --variant pr-warm=DIAG_PR.json --variant eagle3-long=DIAG_LONG.json ... \\
        --served EVAL_DIR [EVAL_DIR ...] --budget 48 --temperature 0 --out benchmarks/results/sim-honesty

`DIAG_*.json` are `pr-specforge diagnose --json` outputs on the same held-out features (they
carry the `sim/` figures); `EVAL_DIR`s are `pr-specforge eval --out-dir` folders whose
`results.jsonl` hold the served rows (PR drafters with `--also-one-pass`, so `NAME/one-pass`
rows exist). Names are the eval's `--draft NAME=...` names.

The simulated chain length `L` is an expected count of accepted draft tokens, so its tau is
`1 + L`; a simulated gain is `(1 + L_variant) / (1 + L_baseline) - 1`, the served gain is
`tau_variant / tau_baseline - 1` with a 95% paired bootstrap CI over prompts
(`pr_specforge.eval.statistics.paired_bootstrap_gain`). A PR variant gives three points:
its whole gain (`acc_len_pr` over the baseline's `acc_len_one_pass`), its one-pass part
(its own `acc_len_one_pass`, served as `NAME/one-pass`) and its mechanism (its `acc_len_pr`
over its own `acc_len_one_pass`, served as NAME over NAME/one-pass); where the diagnose file has
the width-6 rules, the mechanism is read a second way (`mechanism_width6`: `acc_len_width6_pr`
over `acc_len_width6`), summarised apart. An EAGLE-3-like variant gives one point. The simulator is a teacher-forced 7-step top-1 chain; the server grows a
B-node tree, so the absolute lengths differ by design (compared: the gains, not the lengths).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence


class SimHonestyError(ValueError):
    """Bad input, reported as one line."""


def _named(pairs: Sequence[str], flag: str) -> Dict[str, Path]:
    out = {}
    for item in pairs:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SimHonestyError(f"{flag} {item!r}: expected NAME=DIAGNOSE.json")
        out[name] = Path(path)
    return out


def load_sim(path: Path) -> Dict[str, float]:
    """The `sim/` figures of one `pr-specforge diagnose --json` file."""
    not_diag = f"{path}: not a `pr-specforge diagnose --json` output"
    try:
        sim = json.loads(path.read_text())["sim"]
    except FileNotFoundError:
        raise SimHonestyError(f"{path}: no such diagnose file") from None
    except IsADirectoryError:
        raise SimHonestyError(f"{path}: a directory, not a diagnose file (give its --json output)") from None
    except OSError as e:
        raise SimHonestyError(f"{path}: cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise SimHonestyError(f"{not_diag} (no `sim` figures)") from None
    if not isinstance(sim, dict):
        raise SimHonestyError(f"{not_diag}: its `sim` is {json.dumps(sim)}, not a table of figures")
    out = {}
    for k, v in sim.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SimHonestyError(f"{path}: sim figure {k!r} is {json.dumps(v)}, not a finite number")
        out[k.split("/", 1)[-1]] = float(v)
    if "acc_len_one_pass" not in out:
        raise SimHonestyError(f"{path}: its `sim` figures lack acc_len_one_pass")
    return out


def _rel(a: float, b: float) -> float:
    """tau gain of a chain length b over a chain length a."""
    return (1.0 + b) / (1.0 + a) - 1.0


def points(baseline: str, sims: Dict[str, Dict[str, float]], served: Dict[str, Dict[str, dict]],
           n: int = 2000, seed: int = 0) -> List[dict]:
    """One row per (variant, part): its simulated gain, its served gain with CI, and the error.

    `sims[name]` are the diagnose figures (baseline included); `served[draft][prompt]` the served
    rows of one cell (budget x temperature). A part whose served rows are missing is left out.
    """
    from pr_specforge.eval.statistics import paired_bootstrap_gain

    if baseline not in served:
        raise SimHonestyError(f"baseline {baseline!r} was not served in this cell (served: {sorted(served) or 'none'})")
    base = sims[baseline]["acc_len_one_pass"]
    rows = []
    for name, sim in sims.items():
        if name == baseline:
            continue
        parts = []
        if "acc_len_pr" in sim:
            parts = [("gain", baseline, name, _rel(base, sim["acc_len_pr"])),
                     ("one_pass", baseline, f"{name}/one-pass", _rel(base, sim["acc_len_one_pass"])),
                     ("mechanism", f"{name}/one-pass", name, _rel(sim["acc_len_one_pass"], sim["acc_len_pr"]))]
            if "acc_len_width6_pr" in sim:  # the width-aware reading of the same served mechanism
                parts.append(("mechanism_width6", f"{name}/one-pass", name, _rel(sim["acc_len_width6"], sim["acc_len_width6_pr"])))
        else:
            parts = [("gain", baseline, name, _rel(base, sim["acc_len_one_pass"]))]
        for part, a, b, sim_gain in parts:
            if a not in served or b not in served or not set(served[a]) & set(served[b]):
                continue
            g = paired_bootstrap_gain(served[a], served[b], n=n, seed=seed)
            lo, hi = g["gain_rel_ci95"]
            rows.append({"variant": name, "part": part, "served_pair": [a, b], "prompts": g["prompts"],
                         "sim_gain": sim_gain, "served_gain": g["gain_rel"], "served_ci95": [lo, hi],
                         "error": sim_gain - g["gain_rel"], "sim_in_ci": lo <= sim_gain <= hi,
                         "tau": [g["tau_eagle3"], g["tau_pr"]]})
    return rows


def pearson(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Pearson's r, or None with fewer than 3 points or a constant side."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


#: parts that read a served gain a second way; summarised apart so no served gain counts twice
ALTERNATIVE_PARTS = ("mechanism_width6",)


def summarise(rows: List[dict]) -> dict:
    """Correlation, largest and mean absolute error, sign agreement, share of sims inside the served CI."""
    if not rows:
        return {"points": 0}
    worst = max(rows, key=lambda r: abs(r["error"]))
    sims, served = [r["sim_gain"] for r in rows], [r["served_gain"] for r in rows]
    return {"points": len(rows), "pearson_r": pearson(sims, served),
            "largest_error": {"variant": worst["variant"], "part": worst["part"], "error": worst["error"]},
            "mean_abs_error": sum(abs(r["error"]) for r in rows) / len(rows),
            "sign_agrees": sum((s > 0) == (v > 0) for s, v in zip(sims, served)),
            "sim_in_served_ci": sum(r["sim_in_ci"] for r in rows)}


def served_cell(eval_dirs: Sequence[Path], budget: int, temperature: float) -> Dict[str, Dict[str, dict]]:
    """draft -> prompt -> row for one cell, over the eval directories' results.jsonl (`eval.statistics.served_rows`)."""
    from pr_specforge.eval.statistics import served_rows

    from pr_specforge.data.io import DataFormatError

    for d in eval_dirs:
        if not (d / "results.jsonl").is_file():
            raise SimHonestyError(f"{d}: no results.jsonl (not a `pr-specforge eval --out-dir` folder)")
    try:
        cells = served_rows(eval_dirs)
    except DataFormatError as e:
        raise SimHonestyError(str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SimHonestyError(f"{', '.join(map(str, eval_dirs))}: a results.jsonl row is not an eval row "
                              f"({type(e).__name__}: {e})") from None
    out = {draft: rows for (draft, b, t), rows in cells.items() if (b, t) == (budget, float(temperature))}
    for draft, rows in out.items():
        for prompt, row in rows.items():
            for field in ("accepted", "rounds"):
                v = row.get(field)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or (field == "rounds" and v <= 0):
                    raise SimHonestyError(f"results.jsonl row {draft} {prompt} (B {budget}, T {temperature:g}): "
                                          f"field {field!r} is {json.dumps(v)}, not a {'positive ' if field == 'rounds' else ''}number")
    return out


def render(report: dict) -> str:
    s = report["summary"]
    pct = lambda x: f"{100 * x:+.1f}%"  # noqa: E731
    lines = [f"# Is the acceptance simulator honest? (B {report['budget']}, T {report['temperature']:g})", "",
             report.get("title", ""), "",
             "| variant | part | served as | prompts | simulated gain | served gain (95% CI) | error | sim in CI |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["points"]:
        lo, hi = r["served_ci95"]
        lines.append(f"| {r['variant']} | {r['part']} | {r['served_pair'][1]} over {r['served_pair'][0]} | {r['prompts']} | "
                     f"{pct(r['sim_gain'])} | {pct(r['served_gain'])} ({pct(lo)}, {pct(hi)}) | {pct(r['error'])} | "
                     f"{'yes' if r['sim_in_ci'] else 'no'} |")
    if s["points"]:
        r = s["pearson_r"]
        lines += ["", f"{s['points']} points: Pearson r = {'n/a' if r is None else f'{r:.2f}'}; largest error "
                      f"{pct(s['largest_error']['error'])} ({s['largest_error']['variant']}, {s['largest_error']['part']}); "
                      f"mean |error| {100 * s['mean_abs_error']:.1f} points; sign agrees on {s['sign_agrees']}/{s['points']}; "
                      f"the simulated gain lies inside the served CI on {s['sim_in_served_ci']}/{s['points']}."]
    else:
        lines += ["", "No point: no variant was served beside the baseline in this cell."]
    for part, a in (report.get("alternative") or {}).items():
        if a.get("points"):
            lines += ["", f"`{part}` (the same served mechanism read with the width-6 rules, `sim/acc_len_width6_pr` over "
                          f"`sim/acc_len_width6`; not in the summary above): {a['points']} points, mean |error| "
                          f"{100 * a['mean_abs_error']:.1f} points, largest {pct(a['largest_error']['error'])} "
                          f"({a['largest_error']['variant']}), inside the served CI on {a['sim_in_served_ci']}/{a['points']}."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="NAME=DIAGNOSE.json of the EAGLE-3 baseline")
    p.add_argument("--variant", action="append", default=[], help="NAME=DIAGNOSE.json (repeat)")
    p.add_argument("--served", nargs="+", required=True, type=Path, help="pr-specforge eval --out-dir folders")
    p.add_argument("--budget", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--title", default="", help="a line saying what was served on which split")
    p.add_argument("--out", type=Path, required=True, help="output prefix: PREFIX.md and PREFIX.json")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--replace-with-fewer", action="store_true",
                   help="replace an existing PREFIX.json that holds more points than this run makes (refused without it)")
    return p


def check_names(baseline: str, variant_args: Sequence[str]) -> Dict[str, Path]:
    """The variants by name; one named like the baseline, or two alike, would replace the other's figures."""
    variants = _named(variant_args, "--variant")
    if not variants:
        raise SimHonestyError("give at least one --variant NAME=DIAGNOSE.json")
    names = [a.partition("=")[0] for a in variant_args]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SimHonestyError(f"--variant {twice[0]!r} given twice; each variant needs its own name")
    if baseline in variants:
        raise SimHonestyError(f"--variant {baseline!r} has the baseline's name: it would replace the baseline's figures; "
                              "give the variant another name")
    return variants


def write_report(out: Path, report: dict, replace_with_fewer: bool) -> str:
    """PREFIX.json and PREFIX.md, atomically; refused over a PREFIX.json of more points (`refuse_fewer_rows`)."""
    from pr_specforge.data.io import FewerRows, atomic_write_json, atomic_write_text, refuse_fewer_rows

    json_path = Path(f"{out}.json")
    try:
        if not replace_with_fewer:
            refuse_fewer_rows(json_path, len(report["points"]), lambda old: len(old["points"]), "--replace-with-fewer")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(json_path, report)
        text = render(report)
        atomic_write_text(f"{out}.md", text)
    except FewerRows as e:
        raise SimHonestyError(str(e)) from None
    except OSError as e:
        raise SimHonestyError(f"--out {out}: cannot write there ({e.strerror}: {e.filename or out})") from None
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        (baseline, base_path), = _named([args.baseline], "--baseline").items()
        variants = check_names(baseline, args.variant)
        sims = {baseline: load_sim(base_path), **{n: load_sim(p) for n, p in variants.items()}}
        rows = points(baseline, sims, served_cell(args.served, args.budget, args.temperature), n=args.bootstrap)
        main_rows = [r for r in rows if r["part"] not in ALTERNATIVE_PARTS]
        report = {"budget": args.budget, "temperature": args.temperature, "title": args.title, "baseline": baseline,
                  "sims": sims, "points": rows, "summary": summarise(main_rows),
                  "alternative": {p: summarise([r for r in rows if r["part"] == p]) for p in ALTERNATIVE_PARTS
                                  if any(r["part"] == p for r in rows)},
                  "served": [str(d) for d in args.served]}
        text = write_report(args.out, report, args.replace_with_fewer)
    except SimHonestyError as e:
        print(f"sim_honesty: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
