"""A regime's held-out measures, one stage per seed and drafter after its training, diagnose and headroom: what a
drafter computes on the held-out features before it is served (issue 40).

`seedN/measures/NAME.json` holds the training's held-out curve (SpecForge's eval loop every `--eval-interval` steps:
loss and simulated acceptance length), whether it had flattened (`FLAT_GAIN`), and for a PR drafter, from `diagnose`
and `headroom` on the same features: `||f^r - f^0|| / ||f^0||` (how far depth r's feature moved from depth 0's),
how often depth r's top-1 is depth 0's, the share of depth-0 misses some depth >= 1 gets right (the mixed rollout's
top-1) and Table 7's share of c_d < 0.5 rejects a reconsidered depth recovers (`headroom`).

Owns: the measures file and its table in the report. Does not own the metrics (`pr-specforge diagnose`, `headroom`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

#: the held-out curve counts as flattened when its last interval raised the simulated acceptance length by less than
#: this share (the project's choice; the paper says "until convergence")
FLAT_GAIN = 0.01


def heldout_curve(run: Path) -> List[list]:
    """[[step, held-out loss, simulated acceptance length]] of a training's `metrics.jsonl` eval rows."""
    from pr_specforge.data.io import read_jsonl_rows

    rows = read_jsonl_rows(run / "metrics.jsonl", repair=False) if (run / "metrics.jsonl").exists() else []
    return [[r["step"], r["eval/avg_loss"], r.get("eval/simulated_acc_len")] for r in rows if "eval/avg_loss" in r]


def flattening(curve: List[list]) -> dict:
    """The last interval's relative gain in simulated acceptance length and whether it is under `FLAT_GAIN`
    (None for both with fewer than two points)."""
    accs = [acc for _, _, acc in curve if acc is not None]
    if len(accs) < 2 or not accs[-2]:
        return {"last_gain": None, "flattened": None}
    gain = accs[-1] / accs[-2] - 1.0
    return {"last_gain": gain, "flattened": gain < FLAT_GAIN}


def last_step(run: Path) -> Optional[int]:
    """The step a training ended at (its `metrics.jsonl`'s last row): the checkpoint that is exported and served."""
    from pr_specforge.data.io import read_jsonl_rows

    rows = read_jsonl_rows(run / "metrics.jsonl", repair=False) if (run / "metrics.jsonl").exists() else []
    return rows[-1].get("step") if rows else None


def measures(run: Path, diagnose_json: Path, headroom_json: Path) -> dict:
    """The measures file's content (see the module docstring) from a run and its diagnose and headroom reports. `steps`
    is the step that is served (the training's last), `curve_steps` the held-out curve's last point."""
    curve = heldout_curve(run)
    pr = (json.loads(diagnose_json.read_text()).get("pr") or {}) if diagnose_json.exists() else {}
    pooled = (json.loads(headroom_json.read_text()).get("pooled") or {}) if headroom_json.exists() else {}
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in pr if k.startswith("pr/feature_change_depth_"))
    table7 = pooled.get("table7") or {}
    return {"curve": curve, "steps": last_step(run), "curve_steps": curve[-1][0] if curve else None, **flattening(curve),
            "feature_change": {str(r): pr[f"pr/feature_change_depth_{r}"] for r in depths},
            "argmax_agree": {str(r): pr.get(f"pr/argmax_agree_depth_{r}") for r in depths},
            **depth_use(pr), "recovered_share": pr.get("pr/recovered_share"),
            "recovered_low_cd": table7["recovered"][0][3] if table7.get("recovered") else None}


def depth_use(pr: dict) -> dict:
    """From `diagnose`'s `pr` metrics: each depth's top-1 accuracy (`acc_depth`, depth 0 first) and the share of
    positions whose sampled halt depth is 0 (`halt_at_0`: the gate's verdict on every reconsidered depth)."""
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in pr if k.startswith("pr/acc_depth_") and k.rsplit("_", 1)[1].isdigit())
    return {"acc_depth": {str(r): pr[f"pr/acc_depth_{r}"] for r in depths}, "halt_at_0": pr.get("pr/halt_share_depth_0")}


def write_measures(run: Path, diagnose_json: Path, headroom_json: Path, out: Path) -> None:
    from pr_specforge.data.io import atomic_write_json

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, measures(run, diagnose_json, headroom_json))


def read_measures(work: Path) -> Dict[str, Dict[str, dict]]:
    """seedN -> drafter -> its measures file, from a workdir or a folder `save` kept."""
    out: Dict[str, Dict[str, dict]] = {}
    for f in sorted(work.glob("seed*/measures/*.json")):
        m = json.loads(f.read_text())
        if "acc_depth" not in m and (diag := f.parent.parent / "diagnose" / f"{f.stem}.json").exists():
            m.update(depth_use(json.loads(diag.read_text()).get("pr") or {}))  # a file written before they were kept
        if "curve_steps" not in m:  # written when `steps` was the curve's last point, not the served step
            m["curve_steps"] = m.get("steps")
            kept = f.parent.parent / "runs" / f.stem
            m["steps"] = last_step(kept) or _kept_last_step(kept / "heldout.jsonl") or m.get("steps")
        out.setdefault(f.parent.parent.name, {})[f.stem] = m
    return out


def _kept_last_step(path: Path) -> Optional[int]:
    """The last step a kept curve (`save`'s `heldout.jsonl`: its last row is the training's last step) names."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]).get("step") if lines else None


def _steps(m: dict) -> str:
    """The served step, and the held-out curve's last point where it ends earlier (the last gain is measured there)."""
    served, curve = m.get("steps"), m.get("curve_steps")
    if served is None:
        return "-"
    return f"{served} (curve to {curve})" if curve is not None and curve != served else f"{served}"


def _pct(x: Optional[float], signed: bool = False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%")


def render_measures(per_seed: Dict[str, Dict[str, dict]]) -> List[str]:
    """The report's table of the held-out measures (nothing when none was measured)."""
    if not per_seed:
        return []
    lines = ["### Held-out measures before serving", "",
             "The step that served (the training's last; the held-out curve's last point in brackets where it is earlier). "
             f"The curve's last interval's gain in held-out simulated acceptance length; flattened below +{FLAT_GAIN:.0%}. "
             "Top-1 accuracy per depth, and the share of positions the gate halts at depth 0 (diagnose's sampled halt depths); "
             "||f^r-f^0||/||f^0|| and the top-1 agreement with depth 0 per reconsidered depth r; recovered: the share of "
             "depth-0 misses some depth >= 1 gets right (diagnose); c_d < 0.5: Table 7's recovered rejects (headroom).", "",
             "| seed | drafter | served step | last gain | flattened | accuracy, depth 0 / 1 / ... | halts at depth 0 | "
             "||f^r-f^0||/||f^0|| | top-1 = depth 0's | recovered | c_d < 0.5 recovered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for sd, drafters in sorted(per_seed.items()):
        for name, m in sorted(drafters.items()):
            flat = "-" if m.get("flattened") is None else ("yes" if m["flattened"] else "no")
            change = " / ".join(f"{v:.3f}" for v in (m.get("feature_change") or {}).values()) or "-"
            agree = " / ".join(_pct(v) for v in (m.get("argmax_agree") or {}).values()) or "-"
            lines.append(f"| {sd} | {name} | {_steps(m)} | "
                         f"{_pct(m.get('last_gain'), signed=True)} | {flat} | "
                         f"{' / '.join(_pct(v) for v in (m.get('acc_depth') or {}).values()) or '-'} | {_pct(m.get('halt_at_0'))} | "
                         f"{change} | {agree} | "
                         f"{_pct(m.get('recovered_share'))} | {_pct(m.get('recovered_low_cd'))} |")
    return lines + [""]
