"""The regime study's verdict rules, read from a workdir or a folder `save` kept: each seed's served taus and paired
gains per cell, each PR drafter's verdict, the chat regime's verdict with part D's seeds, and the conditions the
paper's gain relies on, measured, beside the paper's figures (and which are missing where PR wins nowhere).

Owns: the rules. Does not own the statistics (`eval.statistics`) or how the report reads (`regime_render`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .common import REPO_ROOT, RESULTS
from .regime_serves import finished_by_drafter
from .regime_measures import read_measures
from .regime_settings import BASELINE, CELLS, REPORT_DIRS, SCREEN_CELLS, SPLITS


#: a PR drafter wins a regime when, in every seed, its mean T = 0 gain is at least this and no T = 0 cell's CI is below 0
WIN_GAIN = 0.02


def tau(rows: Optional[Dict[str, dict]]) -> Optional[float]:
    if not rows:
        return None
    return sum(r["accepted"] for r in rows.values()) / max(1, sum(r["rounds"] for r in rows.values()))


def seed_summary(sd: Path, n: int = 2000, split: str = "report") -> dict:
    """One seed's served taus per drafter and cell, and each comparison's paired gain (95% bootstrap CI).

    `split="report"`: the report serves (`report-*`; the verdict's cells). `split="screen"`: every
    `screen-b48*` folder (B 48, T 0; what variants are chosen on). Cells nothing was served in are left out.
    """
    from pr_specforge.eval.statistics import decompose_gain, served_rows

    if split == "report":
        # each folder, and each drafter in it, is read up to its own last finished round: a folder still behind (a
        # control served later) or a drafter added to a folder later shows fewer problems in its own cells without
        # holding the others back; comparisons pair by shared prompts
        rows, by_folder = {}, {}
        for out, *_, bw in REPORT_DIRS:
            finished = finished_by_drafter(sd / out)
            if not finished:
                continue  # nothing served, or no round finished yet: its rows belong to a round still running
            by_folder[out] = min(len(v) for v in finished.values())
            suffix = "@bw9" if bw == 9 else ""
            for k, v in served_rows([sd / out], suffix=suffix).items():
                done = finished.get(k[0][:len(k[0]) - len(suffix)], set())
                if kept := {p: r for p, r in v.items() if p in done}:
                    rows[k] = kept
        cells_served = CELLS
    else:
        rows = served_rows(sorted(d for d in sd.glob("screen-b48*") if d.is_dir()))
        cells_served = SCREEN_CELLS
    # comparison -> (served drafter, baseline, one-pass tree or None): split by `decompose_gain`, the experiment report's rule
    pairs = comparisons()
    cells = []
    for budget, temp in cells_served:
        cell: dict = {"budget": budget, "temperature": temp,
                      "tau": {d: tau(r) for (d, b, t), r in sorted(rows.items()) if (b, t) == (budget, temp)},
                      "prompts": {d: len(r) for (d, b, t), r in sorted(rows.items()) if (b, t) == (budget, temp)},
                      # a PR drafter's nodes in the tree sent to verification, per round, that a reconsidered feature
                      # proposed (`recon_kept`) or repriced (`repriced_kept`, Eq. 9): (0, 0) when its served trees
                      # are its one-pass trees
                      "recon_kept": {d: tuple(sum(x.get(f) or 0 for x in r.values()) / max(1, sum(x["rounds"] for x in r.values()))
                                              for f in ("recon_kept", "repriced_kept"))
                                     for (d, b, t), r in sorted(rows.items()) if (b, t) == (budget, temp) and d in BASELINE}}
        if not cell["tau"]:
            continue
        for name, (drafter, base, one_pass) in pairs.items():
            parts = decompose_gain(rows.get((base, budget, temp)), rows.get((drafter, budget, temp)),
                                   rows.get((one_pass, budget, temp)) if one_pass else None, n=n, seed=0)
            for part, key in (("gain", name), ("one_pass", f"{name}/one-pass"), ("mechanism", f"{name}/mechanism")):
                if part in parts:
                    cell[key] = parts[part]
        cells.append(cell)
    out: dict = {"cells": cells}
    if split == "report":
        out["problems_by_folder"] = by_folder  # each folder's finished problems (in every one of its cells)
        out["problems"] = min(by_folder.values(), default=0)  # the fewest: what every report cell holds at least
    return out


def comparisons() -> Dict[str, Tuple[str, str, Optional[str]]]:
    """comparison -> (served drafter, baseline, its one-pass tree or None): each PR drafter over its matched baseline
    (`BASELINE`), a warm start also over `eagle3` (`NAME@eagle3`), and the controls over `eagle3`."""
    out: Dict[str, Tuple[str, str, Optional[str]]] = {}
    for name, base in BASELINE.items():
        out[name] = (name, base, f"{name}/one-pass")
        if base != "eagle3":
            out[f"{name}@eagle3"] = (name, "eagle3", f"{name}/one-pass")
    return {**out, "eagle3-long": ("eagle3-long", "eagle3", None), "eagle3-2layer": ("eagle3-2layer", "eagle3", None),
            "eagle3@bw9": ("eagle3@bw9", "eagle3", None)}


def verdict(seeds: Dict[int, dict], drafter: str, need: Optional[int] = None, t0_cells: Optional[int] = None) -> Optional[dict]:
    """`drafter`'s regime verdict: per seed the mean T = 0 gain and whether a T = 0 cell's CI is entirely below 0.

    A seed counts once each of `drafter`'s T = 0 comparisons pairs `need` problems (a control folder still behind
    does not hold it back; without `need`, or without a count, every seed counts) and, when `t0_cells` is given,
    it has that many T = 0 cells (a report folder not served yet leaves its cell out); the verdict is decided by two
    or more counting seeds.
    """
    per_seed = {}
    for seed, summary in seeds.items():
        t0 = [c[drafter] for c in summary["cells"] if c["temperature"] == 0.0 and drafter in c]
        if t0:
            # the problems its own T = 0 comparisons pair (each over the prompts both sides served); the seed's
            # `problems` where a summary's gains carry no count
            paired = [c["prompts"] for c in t0 if "prompts" in c]
            problems = min(paired) if paired else summary.get("problems")
            per_seed[seed] = {"mean_t0_gain": sum(c["gain_rel"] for c in t0) / len(t0),
                              "cell_below_zero": any(c["gain_rel_ci95"][1] < 0 for c in t0), "cells": len(t0),
                              "problems": problems, "counts": (need is None or problems is None or problems >= need)
                              and (t0_cells is None or len(t0) >= t0_cells)}
    if not per_seed:
        return None
    return {"seeds": per_seed, **decide([v for v in per_seed.values() if v["counts"]]), "need": need}


def decide(counting: Sequence[dict]) -> dict:
    """The rule every verdict applies to its counting seeds: decided by two or more; a win needs each at least
    `WIN_GAIN` in mean T = 0 gain with no T = 0 cell's CI entirely below 0."""
    decided = len(counting) >= 2
    return {"wins": decided and all(v["mean_t0_gain"] >= WIN_GAIN and not v["cell_below_zero"] for v in counting),
            "decided": decided}


def combined_verdict(earlier: Optional[dict], rebuilt: Optional[dict]) -> Optional[dict]:
    """The chat regime's one verdict: part D's seeds (the same recipe at the same data scale, drafters gone) and the
    rebuilt workdir's counting seeds together, under `verdict`'s rule (two or more counting seeds, each at least
    `WIN_GAIN` with no T = 0 cell's CI below 0). Seeds are keyed "part D seed N" and "rebuilt seed N"."""
    seeds = {f"part D seed {s}": x for s, x in ((earlier or {}).get("seeds") or {}).items() if x.get("counts", True)}
    seeds.update({f"rebuilt seed {s}": x for s, x in ((rebuilt or {}).get("seeds") or {}).items() if x.get("counts")})
    return {"seeds": seeds, **decide(list(seeds.values())), "need": None} if seeds else None


def regime_row(work: Path, regime: str, report_limit: Optional[int] = None) -> dict:
    """A regime's row from its workdir or a folder `save` kept (whatever stages have finished): the data, each seed's
    screening and report cells, the verdicts, the headroom and the conditions the paper's gain relies on."""
    manifest = work / "features" / "manifest.json"
    feats = json.loads(manifest.read_text()) if manifest.exists() else {}
    seed_dirs = [sd for sd in sorted(work.glob("seed*")) if sd.name[4:].isdigit()]
    seeds = {int(sd.name[4:]): seed_summary(sd) for sd in seed_dirs}
    seeds = {s: v for s, v in seeds.items() if v["cells"]}
    screening = {int(sd.name[4:]): seed_summary(sd, split="screen") for sd in seed_dirs}
    headroom = {}
    for sd in seed_dirs:
        for f in sorted((sd / "headroom").glob("*.json")):
            headroom.setdefault(f.stem, {})[sd.name] = json.loads(f.read_text()).get("pooled")
    row = {"regime": regime, "workdir": str(work),
           "data": {k: v for k, v in (feats.get("counts") or feats).items() if k in ("samples", "tokens", "loss_tokens")},
           "seeds": seeds, "screening": {s: v for s, v in screening.items() if v["cells"]},
           "verdict": {d: verdict(seeds, d, report_limit, t0_cells=sum(t == 0.0 for _, t in CELLS)) for d in BASELINE},
           "headroom": headroom, "measures": read_measures(work)}
    row["conditions"] = conditions(row)
    row["round_cost"] = round_cost()
    row["heldout"], row["last_step"] = training_logs(work)
    return row


def gsm8k_row(work: Path, report_limit: Optional[int] = None) -> dict:
    """The GSM8K domain regime's row (`regime_row`), with its splits."""
    row = regime_row(work, "gsm8k-domain", report_limit)
    row["splits"] = {k: [v.start, v.stop - 1] for k, v in SPLITS.items()}
    row["data_what"] = "solutions of the training split"
    return with_reason(row)


def part_d() -> dict:
    """The ShareGPT chat regime's earlier verdict: the committed part D report (`smollm2-cpu-best.json`; its drafters
    are gone), per-set cells averaged."""
    best = json.loads((RESULTS / "smollm2-cpu-best.json").read_text())
    seeds = {int(k): {"cells": v} for k, v in (best.get("seeds") or {}).items()}
    t0 = [c for c in best.get("comparisons", []) if c["temperature"] == 0.0 and c["budget"] == 48]
    return {"source": "benchmarks/results/smollm2-cpu-best.json (warm-isolated-separate-adapter16)",
            "eagle3_tau_b48_t0": sum(c["tau_eagle3"] for c in t0) / len(t0) if t0 else None,
            "verdict": {"pr-warm": verdict({s: {"cells": [dict(c, **{"pr-warm": c}) for c in v["cells"]]} for s, v in seeds.items()},
                                           "pr-warm")}}


def sharegpt_row(work: Optional[Path] = None) -> dict:
    """The ShareGPT chat regime's row: its rebuilt workdir's (`regime_row`; the controls beside PR, every seed that has
    finished its report serves counts) when given, and part D's earlier verdict beside it."""
    if work is None:
        return {"regime": "sharegpt-chat", "part_d": part_d(), "controls": "two-layer and B_w 9 not yet run at this scale"}
    row = regime_row(work, "sharegpt-chat")
    row["part_d"] = part_d()
    row["data_what"] = "regenerated ShareGPT conversations"
    row["regime_verdict"] = {"pr-warm": combined_verdict(row["part_d"]["verdict"].get("pr-warm"), row["verdict"].get("pr-warm"))}
    return with_reason(row)


def training_logs(work: Path) -> Tuple[Dict[str, Dict[str, List[list]]], Dict[str, Dict[str, int]]]:
    """Each training's log, read once: its held-out curve, seedN -> drafter -> [[step, held-out loss, simulated
    acceptance length]] of SpecForge's eval loop on the held-out features, and its last logged step, seedN -> drafter ->
    step (where a warm start on it begins). Read from a workdir's `runs/NAME/metrics.jsonl` or a saved folder's
    `runs/NAME/heldout.jsonl` (whose last row is the run's last step)."""
    from pr_specforge.data.io import read_jsonl_rows

    curves: Dict[str, Dict[str, List[list]]] = {}
    last: Dict[str, Dict[str, int]] = {}
    for run in sorted(p for p in work.glob("seed*/runs/*") if p.is_dir()):
        path = next((run / f for f in ("heldout.jsonl", "metrics.jsonl") if (run / f).exists()), None)
        rows = read_jsonl_rows(path, repair=False) if path else []
        seed = run.parent.parent.name
        if rows:
            last.setdefault(seed, {})[run.name] = rows[-1]["step"]
        curve = [[r["step"], r["eval/avg_loss"], r.get("eval/simulated_acc_len")] for r in rows if "eval/avg_loss" in r]
        if curve:
            curves.setdefault(seed, {})[run.name] = curve
    return curves, last


def round_cost(path: Path = RESULTS / "draft_cost_controls.json") -> Optional[dict]:
    """The controls' drafting-round cost over EAGLE's, measured side by side (`benchmarks/draft_cost.py`)."""
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    return {"file": str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path),
            "machine": d.get("machine"), "dtype": d.get("dtype"), "threads": d.get("threads"),
            **{k: d.get(k) for k in ("two_layer_over_eagle", "bw9_over_eagle", "coforward_over_eagle")}}


#: the paper's figures for the conditions PR relies on (Llama-3.1-8B unless said; GSM8K where the paper has it)
PAPER_CONDITIONS = {
    "eagle3_tau": (4.84, "Table 3, EAGLE-3.1 on GSM8K, B 48, T 0"),
    "two_layer_gain": (0.006, "Table 3, GSM8K (+2.0% averaged over three sets)"),
    "bw9_gain": (0.009, "Table 4, Gemma-3-12B, GSM8K, T 1"),
    "one_pass_acceptance": (0.698, "Sec. 2.2, EAGLE-3.1 held-out top-1 acceptance"),
    "recovered_low_cd": (0.288, "Table 7, share of c_d < 0.5 rejects a reconsidered depth gets right"),
    "misses_outside_top6": (None, "not reported; what only a second guess could add to a width-6 tree"),
    "recon_only": (None, "not reported; one-pass misses only a reconsidered depth proposes (outside depth 0's top 6)"),
    "mechanism_gain": (0.096, "Table 4, PR over PR m = 0, averaged"),
}


def conditions(row: dict) -> dict:
    """What the paper's gain relies on, measured in this regime (the report split where served, else screening).

    Each entry: the measured value per seed, where it came from, and the paper's figure beside it.
    """
    def cells_of(summary_by_seed, source):
        return [(seed, source, c) for seed, s in sorted(summary_by_seed.items()) for c in s["cells"]
                if (c["budget"], c["temperature"]) == (48, 0.0)]

    cells = cells_of(row.get("seeds") or {}, "report") or cells_of(row.get("screening") or {}, "screening")
    out: dict = {}

    def put(key, seed, source, value):
        if value is not None:
            out.setdefault(key, {"paper": PAPER_CONDITIONS[key][0], "paper_source": PAPER_CONDITIONS[key][1],
                                 "measured": {}})["measured"][f"seed{seed}"] = {"value": value, "from": source}

    for seed, source, c in cells:
        put("eagle3_tau", seed, source, c["tau"].get("eagle3"))
        put("two_layer_gain", seed, source, (c.get("eagle3-2layer") or {}).get("gain_rel"))
        put("bw9_gain", seed, source, (c.get("eagle3@bw9") or {}).get("gain_rel"))
        for name in BASELINE:  # each PR drafter's own: keyed "N NAME" (the seed and the drafter)
            put("mechanism_gain", f"{seed} {name}", source, (c.get(f"{name}/mechanism") or {}).get("gain_rel"))
    for name, per_seed in (row.get("headroom") or {}).items():
        for sd, pooled in per_seed.items():
            if not pooled:
                continue
            guess = pooled.get("second_guess") or {}
            if name == "eagle3":
                put("one_pass_acceptance", sd[4:], "headroom (held-out features)", pooled.get("acceptance"))
                put("misses_outside_top6", sd[4:], "headroom of eagle3 (held-out features)", guess.get("outside_topk"))
            if name in BASELINE:
                put("recon_only", f"{sd[4:]} {name}", f"headroom of {name} (held-out features)", guess.get("recon_only"))
                if pooled.get("table7"):
                    put("recovered_low_cd", f"{sd[4:]} {name}", f"headroom of {name} (held-out features)",
                        pooled["table7"]["recovered"][0][3])
    return out
#: a condition the paper relies on counts as missing when every seed measures under this share of the paper's figure
MISSING_SHARE = 0.5


#: the conditions the issue names, in the order the reason gives them:
#: (key, name, what it measures, measured value -> compared value)
REASON_CONDITIONS = (
    ("recovered_low_cd", "the recoverable share", "c_d < 0.5 rejects a reconsidered depth gets right", lambda v: v),
    ("eagle3_tau", "the accepted path", "EAGLE-3's accepted draft tokens per round, tau - 1, B 48, T 0", lambda v: v - 1.0),
    ("two_layer_gain", "the two-layer control's gain", "what more compute per position buys", lambda v: v),
)


def with_reason(row: dict) -> dict:
    """`row` with its `reason` (`missing_conditions`) once its verdict is decided and PR wins nowhere in it."""
    if _no_win(row):
        row["reason"] = missing_conditions(row)
    return row


def missing_conditions(row: dict) -> List[dict]:
    """Which of the conditions the paper's gain relies on this regime lacks, from its measured rows (`conditions`):
    for each of `REASON_CONDITIONS` measured here, every seed's value beside the paper's, and `missing` when every
    seed is under `MISSING_SHARE` of it."""
    out = []
    for key, name, what, value_of in REASON_CONDITIONS:
        cnd = (row.get("conditions") or {}).get(key)
        if not cnd or not cnd["measured"] or not cnd["paper"]:
            continue
        paper = value_of(cnd["paper"])
        values = [value_of(m["value"]) for _, m in sorted(cnd["measured"].items())]
        shares = [v / paper for v in values]
        out.append({"condition": key, "name": name, "what": what, "measured": values, "paper": paper, "shares": shares,
                    "missing": all(x < MISSING_SHARE for x in shares)})
    return out


def _no_win(row: dict) -> bool:
    """Every decided verdict of the regime (its one verdict where it has one) says PR does not win, and one is decided."""
    verdicts = [v for v in (row.get("regime_verdict") or row.get("verdict") or {}).values() if v]
    return any(v["decided"] for v in verdicts) and not any(v["wins"] for v in verdicts)
