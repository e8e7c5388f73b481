"""`regimes.py migrate`: a kept drafter's fingerprint, recorded the old way (its export's files as they were, the
target's absolute path inside), carried over to the directory-independent one of a rebuild that serves the same rows.

The kept eval folders (`benchmarks/results/regime-*/seedN/*/eval_config.json`) name each drafter that served their
rows by a fingerprint. Folders served before issue 63 hold `export_fingerprints`' legacy one, which no rebuild in
another directory can reproduce (the path is inside it). A migration accepts a rebuilt export for them only on
evidence: its rows, served again into a scratch `eval --out-dir` (`--check`), equal the kept rows of the same
(drafter, budget, temperature, set, prompt, seed) in every field both rows hold but the timings (`*_s`), in every
folder that recorded that legacy fingerprint, was served with the check's settings (`eval_config.json`'s `shared`:
k, B_w, gamma, m, new tokens, dtype, target...) and holds such a row. A legacy fingerprint is one set of files, so
a folder served with other settings (a B_w 9 control) under a checked fingerprint is migrated with it. Then, and
only then:

* `seedN/fingerprints/NAME.json` records the rebuild's fingerprint, the legacy ones it stands for, the folders, the
  compared rows and fields, and the commit, date and machine of the check;
* `seedN/fingerprints/NAME-recheck.jsonl` keeps the re-served rows (the evidence, as rows);
* each folder recorded with a checked legacy fingerprint names the drafter by the rebuild's fingerprint, and keeps
  the legacy one beside it (`drafters_migrated`), so a record committed before stays readable and checkable.

After it, the study's kept-fingerprint stage and `eval` resuming those folders accept any rebuild of that drafter,
in any directory, whose fingerprint is the recorded one. A legacy fingerprint no folder's rows were checked for is
left as it is: nothing is migrated on the strength of a name.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Tuple

#: what identifies a served row (`eval`'s results.jsonl)
ROW_KEY = ("draft", "budget", "temperature", "set", "prompt", "seed")
#: where migrated folders keep the fingerprint they recorded before (eval_config.json)
MIGRATED = "drafters_migrated"


class MigrationRefused(ValueError):
    """A migration that the evidence does not support (one line: what differs, where)."""


def _rows(path: Path, where: str) -> Dict[Tuple, dict]:
    """`eval`'s rows of `path` by `ROW_KEY` ({} if absent); a line that is no JSON object is `data.io`'s one line."""
    from pr_specforge.data.io import read_jsonl_rows

    rows: Dict[Tuple, dict] = {}
    for lineno, row in enumerate(read_jsonl_rows(path, repair=False), 1):
        if any(k not in row for k in ROW_KEY):
            raise MigrationRefused(f"{where}, row {lineno}: not an eval row (it lacks one of {', '.join(ROW_KEY)})")
        rows[tuple(row[k] for k in ROW_KEY)] = row
    return rows


def compared_fields(kept: dict, new: dict) -> List[str]:
    """The fields of two rows of one key that must be equal: every one both hold, less the timings (`*_s`)."""
    return sorted(k for k in set(kept) & set(new) if not k.endswith("_s"))


def first_difference(kept: dict, new: dict) -> str:
    """The first compared field whose values differ, '' when the rows are equal."""
    return next((f for f in compared_fields(kept, new) if kept[f] != new[f]), "")


def _config(folder: Path) -> dict:
    return json.loads((folder / "eval_config.json").read_text())


def plan(seed_dir: Path, name: str, fingerprint: str, check: Path) -> Tuple[Dict[str, str], Dict[str, int], List[dict]]:
    """`(folders, checked, rows)`: each kept folder of `seed_dir` recorded with a legacy fingerprint of `name` whose
    rows were checked (folder -> that fingerprint), how many rows checked each legacy fingerprint, and the re-served
    rows of `name`. Refuses in one line where a re-served row differs from a kept one, or where nothing was checked."""
    served = {k: r for k, r in _rows(check / "results.jsonl", f"--check {check / 'results.jsonl'}").items()
              if r["draft"] == name}
    if not served:
        raise MigrationRefused(f"--check {check}: no row of drafter {name!r} in its results.jsonl "
                               f"(serve the rebuilt export there under that name first)")
    shared = _config(check).get("shared") if (check / "eval_config.json").is_file() else None
    if not shared:
        raise MigrationRefused(f"--check {check}: no eval_config.json with its settings (not an `eval --out-dir`)")
    recorded: Dict[str, str] = {}
    checked: Dict[str, int] = {}
    for cfg in sorted(seed_dir.glob("*/eval_config.json")):
        config = _config(cfg.parent)
        fp = (config.get("drafters") or {}).get(name)
        if fp is None or fp == fingerprint:
            continue
        recorded[cfg.parent.name] = fp
        if config.get("shared") != shared:
            continue  # served with other settings (B_w, max_new_tokens, ...): its rows are not the check's to compare
        kept = _rows(cfg.parent / "results.jsonl", str(cfg.parent / "results.jsonl"))
        for key, row in served.items():
            if key in kept:
                if diff := first_difference(kept[key], row):
                    raise MigrationRefused(
                        f"{cfg.parent / 'results.jsonl'}: drafter {name!r}, {key[3]} {key[4]} at B {key[1]}, T {key[2]}: "
                        f"the re-served row has {diff} = {row[diff]!r}, the kept one {kept[key][diff]!r}; "
                        f"the rebuild is not the drafter that served these rows: nothing migrated")
                checked[fp] = checked.get(fp, 0) + 1
    if not recorded:
        raise MigrationRefused(f"{seed_dir}: no kept folder records drafter {name!r} by another fingerprint than "
                               f"{fingerprint}: nothing to migrate")
    if not checked:
        raise MigrationRefused(f"--check {check}: none of its {name!r} rows is a row a kept folder of {seed_dir} holds "
                               f"with the same settings (serve the same set, prompts, budget, temperature and eval "
                               f"settings): nothing migrated")
    return {f: fp for f, fp in recorded.items() if fp in checked}, checked, list(served.values())


def migrate(seed_dir: Path, name: str, export: Path, check: Path, machine: str) -> dict:
    """Carry `name`'s kept legacy fingerprints in `seed_dir` over to the fingerprint of the rebuilt `export`, on the
    evidence of the rows served again into `check` (module docstring). Returns the record written."""
    from serving_cost import commit  # benchmarks/, on the path wherever `study` imports

    from pr_specforge.data.io import atomic_write_json, atomic_write_text
    from pr_specforge.export import export_fingerprints

    if not (export / "config.json").is_file():
        raise MigrationRefused(f"--export {export}: not an export directory (no config.json)")
    fingerprint = export_fingerprints(str(export))[0]
    folders, checked, rows = plan(seed_dir, name, fingerprint, check)
    record = {
        "drafter": name, "fingerprint": fingerprint, "stands_for": sorted(checked), "folders": folders,
        "checked_by": {"rows": f"{name}-recheck.jsonl", "rows_compared": checked,
                       "fields": compared_fields(rows[0], rows[0]), "ignored": "timings (fields ending in _s)",
                       "commit": commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "machine": machine or platform.machine()},
    }
    out = seed_dir / "fingerprints"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(out / f"{name}-recheck.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_json(str(out / f"{name}.json"), record)
    for folder, legacy in folders.items():
        cfg = _config(seed_dir / folder)
        cfg["drafters"][name] = fingerprint
        cfg.setdefault(MIGRATED, {})[name] = {"from": legacy, "record": f"../fingerprints/{name}.json"}
        atomic_write_json(str(seed_dir / folder / "eval_config.json"), cfg)
    return record
