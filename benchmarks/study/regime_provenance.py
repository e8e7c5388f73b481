"""The regime report's provenance table: where each part of a study ran (commit, date, machine, threads) and how long
its stages took, from structured rows.

A regime folder keeps its rows in `provenance.json` (the committed `benchmarks/results/regime-*/provenance.json`;
`save` never touches it); `regimes.py report --provenance FILE` adds a file of the same form. The form:

    {"study": "gsm8k-domain",
     "rows": [{"what": "seed 0: report problems 1-10", "commit": "b27bf89", "recorded_in": ["148e1c0"],
               "date": "2026-12-02", "machine": "2-core CPU #1", "threads": "2, one job",
               "stages": ["seed0 report-* to 10"]}, ...],
     "notes": ["a sentence the table needs", ...]}

`stages` (optional) are `fnmatch` patterns of the folder's `stage_times.json` names: the row's wall time is the sum of
the stages they match. `recorded_in` (optional): the commits that added the row's results.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import List, Optional

FILE = "provenance.json"
ROW_FIELDS = ("what", "commit", "date", "machine", "threads")
COLUMNS = ("study", "what", "commit", "recorded in", "date", "machine", "threads", "wall time")
LEGEND = ("`commit`: the checkout a row's stages ran from; `recorded in`: the commits that added its rows to the regime's "
          "folder (a..b: a, b and the commits between them); `date`: the last of those commits' dates; `wall time`: the "
          "sum of the row's stages in the folder's stage_times.json, where a stage's time adds up every run of it, "
          "later sittings' runs of a stage of that name included.")


def _strings(value, where: str, field: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: '{field}' must be a list of strings, not {value!r}")
    return value


def read_provenance(path: Path) -> dict:
    """A provenance file, checked: one line naming the file, row and field for anything malformed."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise FileNotFoundError(f"{path}: cannot read the provenance file ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("study"), str) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: a provenance file is an object with 'study' (a name) and 'rows' (a list)")
    for i, row in enumerate(data["rows"]):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: must be an object")
        for field in ROW_FIELDS:
            if not isinstance(row.get(field), str) or not row[field]:
                raise ValueError(f"{where}: '{field}' must be a non-empty string")
        for field in ("recorded_in", "stages"):
            if field in row:
                _strings(row[field], where, field)
    _strings(data.get("notes", []), str(path), "notes")
    return data


def wall_seconds(patterns: List[str], stage_times: dict) -> Optional[float]:
    """The summed stage times of the stages `patterns` match (None when they match none)."""
    times = [t for name, t in stage_times.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    return sum(times) if times else None


def study_provenance(path: Path, work: Optional[Path] = None) -> dict:
    """A provenance file's rows, each with its `wall_s` from `work`'s (default: the file's folder's) stage times."""
    data = read_provenance(path)
    times_path = (work or path.parent) / "stage_times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    rows = [dict(r, wall_s=wall_seconds(r["stages"], times) if r.get("stages") else None) for r in data["rows"]]
    return {"study": data["study"], "rows": rows, "notes": list(data.get("notes", []))}


def collect(works: List[Optional[Path]], extra: Optional[Path] = None) -> List[dict]:
    """The provenance of each regime folder that keeps a `provenance.json`, then `extra`'s (`--provenance`)."""
    out = [study_provenance(w / FILE, w) for w in works if w is not None and (w / FILE).exists()]
    return out + ([study_provenance(extra)] if extra is not None else [])


def _wall(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def render_provenance(studies: List[dict]) -> List[str]:
    """The provenance section: one table row per part of each study, then each study's notes."""
    if not studies:
        return []
    lines = ["## Provenance", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for s in studies:
        for r in s["rows"]:
            cells = (s["study"], r["what"], r["commit"], ", ".join(r.get("recorded_in") or []) or "-", r["date"],
                     r["machine"], r["threads"], _wall(r.get("wall_s")))
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", LEGEND, ""]
    for s in studies:
        lines += [f"- {s['study']}: {note}" for note in s["notes"]]
    return lines + [""]
