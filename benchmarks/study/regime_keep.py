"""`regimes.py save` and `restore`: a regime workdir's served rows, regenerated text and small records, kept in a
folder (the committed `benchmarks/results/regime-*`) and put back into a rebuilt workdir to resume its serves.

A save never replaces a kept row file with one holding fewer rows (a workdir rebuilt from less, or another
workdir), nor a kept features manifest with a less complete one (a sitting cut off while its features were rebuilt),
unless told to (`--replace-with-fewer`); it merges the stage times into the kept ones (every kept stage stays), and
writes the workdir's parent as `$WORK` in the records it keeps (no machine's path). A restore compares the settings
of a workdir that has its own with the kept ones, refusing on a mismatch, puts the kept settings files back (the next
run compares its flags with them), and never overwrites a file already there. A save compares the same settings
first: a workdir made otherwise is not saved over the kept folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


#: the target's regenerated replies (text, under 1 MB a regime), their resume records and `.done` markers: restored,
#: the 12-16 min regenerate stages are skipped on a new machine (the features manifest's `input` fingerprint names the
#: file it read)
DATA = ("regenerated.*", "screen/regenerated.*", "heldout/regenerated.*")
#: what `restore` puts back: the regenerated text, the eval folders, and the stage times, command log and the sittings'
#: provenance (`study/regime_paper.sh`: commit, date, machine, threads, command per sitting) (a rebuilt
#: workdir goes on adding to them, so the next `save` keeps the earlier runs' entries); the features, trainings,
#: diagnose and headroom stages rerun. A serve resumed from restored rows refuses a rebuilt drafter whose weights
#: differ (`eval`'s own drafter fingerprint)
RESTORE = (*DATA, "data_settings.json", "seed*/settings.json", "stage_times.json", "commands.log", "sittings.jsonl", "seed*/screen-b48*/*.json", "seed*/screen-b48*/*.jsonl", "seed*/report-*/*.json", "seed*/report-*/*.jsonl")
#: what `save` keeps of a workdir (relative globs): the served rows, the regenerated training text and the small
#: records, never a model or a feature
KEEP = ("splits/splits.json", "features/manifest.json",
        "screen/features/manifest.json", "heldout/features/manifest.json", "seed*/headroom/*.json", "seed*/diagnose/*.json",
        "seed*/measures/*.json", *RESTORE)


#: the records `save` writes with the workdir's parent as `$WORK` (manifests, settings, reports, the command log, the
#: sittings' provenance rows and any other JSON-lines record)
SCRUBBED = (".json", ".log", ".jsonl")


def _copy_tree(src: Path, dst: Path, globs: Sequence[str], overwrite: bool, scrub: bool = False) -> List[Path]:
    """Copy the files of `src` matching `globs` to the same relative paths under `dst` (atomically); returns them.
    `scrub`: `src`'s parent directory is written `$WORK` in the records (`SCRUBBED`)."""
    from pr_specforge.data.io import atomic_write_bytes

    parent = (str(src.resolve().parent).rstrip("/") + "/").encode()
    copied = []
    for pattern in globs:
        for f in sorted(src.glob(pattern)):
            rel = f.relative_to(src)
            if f.is_file() and (overwrite or not (dst / rel).exists()):
                data = f.read_bytes()
                atomic_write_bytes(dst / rel, data.replace(parent, b"$WORK/") if scrub and f.suffix in SCRUBBED else data)
                copied.append(rel)
    return copied


class FewerRows(ValueError):
    """A save (or a report) would replace kept rows with fewer."""


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def rows_held(path: Path) -> Optional[Tuple[int, str]]:
    """How much a kept record holds, and of what, where a smaller one would lose something: a row file's
    (`.jsonl`) or the command log's lines, an eval summary's served prompts, a features manifest's rows written
    (complete or not: `manifest_held`); None for the other records (settings, diagnose and headroom reports: replaced
    as they come; the stage times are merged, `merged_stage_times`)."""
    if path.suffix in (".jsonl", ".log"):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip()), "rows" if path.suffix == ".jsonl" else "lines"
    if path.name == "summary.json":
        data = _json(path)
        entries = data.get("results") if isinstance(data, dict) else None
        return (sum(e.get("prompts", 0) for e in entries if isinstance(e, dict)), "served prompts") if isinstance(entries, list) else None
    return None


def manifest_held(path: Path) -> Tuple[bool, int]:
    """A features manifest's completeness, in the order a save compares it: (status complete, rows written)."""
    data = _json(path)
    data = data if isinstance(data, dict) else {}
    counts = data.get("counts") if isinstance(data.get("counts"), dict) else {}
    written = counts.get("written")
    return data.get("status") == "complete", written if isinstance(written, int) else 0


def _manifest_text(held: Tuple[bool, int]) -> str:
    return f"{'complete' if held[0] else 'not complete'} with {held[1]} rows written"


def merged_stage_times(kept: Path, work: Path) -> Dict[str, float]:
    """The stage times a save keeps: every kept stage, each with the workdir's time where the workdir has one (a
    stage's last run; a restored workdir goes on from the kept times)."""
    old, new = (_json(kept) if kept.is_file() else {}), _json(work)
    if not isinstance(new, dict):
        raise ValueError(f"{work}: not a stage times file (a JSON object of stage -> seconds); nothing written")
    return {**(old if isinstance(old, dict) else {}), **new}


def heldout_curves(work: Path) -> Dict[Path, str]:
    """Each training's held-out loss curve as `save` keeps it, relative path (`seedN/runs/NAME/heldout.jsonl`) ->
    text: its `metrics.jsonl` rows of SpecForge's eval loop, and its last step (where a warm start on it begins)."""
    from pr_specforge.data.io import read_jsonl_rows

    out = {}
    for metrics in sorted(work.glob("seed*/runs/*/metrics.jsonl")):
        rows = read_jsonl_rows(metrics, repair=False)
        curve = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in rows if any(k.startswith("eval/") for k in r)]
        if rows and (not curve or curve[-1]["step"] != rows[-1]["step"]):
            curve.append({"step": rows[-1]["step"]})
        out[metrics.parent.relative_to(work) / "heldout.jsonl"] = "".join(json.dumps(r) + "\n" for r in curve)
    return out


def fewer_rows(work: Path, to: Path, curves: Dict[Path, str]) -> List[str]:
    """What a save of `work` would replace in `to` with less (`rows_held`), one line each."""
    out = []
    for pattern in KEEP:
        for f in sorted(work.glob(pattern)):
            rel = f.relative_to(work)
            if not (f.is_file() and (to / rel).is_file()):
                continue
            if f.name == "manifest.json" and (new_m := manifest_held(f)) < (kept_m := manifest_held(to / rel)):
                out.append(f"{to / rel}: {_manifest_text(kept_m)} kept, {f} is {_manifest_text(new_m)}")
            elif (kept := rows_held(to / rel)) and (new := rows_held(f)) and new[0] < kept[0]:
                out.append(f"{to / rel}: {kept[0]} {kept[1]} kept, {f} has {new[0]}")
    for rel, text in curves.items():
        rows = text.count("\n")
        if (to / rel).is_file() and (kept := rows_held(to / rel)) and rows < kept[0]:
            out.append(f"{to / rel}: {kept[0]} rows kept, {work / rel.parent / 'metrics.jsonl'} gives {rows}")
    return out


def save_rows(work: Path, to: Path, replace_with_fewer: bool = False) -> List[Path]:
    """Keep `work`'s served rows and small records (`KEEP`) in `to`, replacing what an earlier save kept there, and
    each training's held-out loss curve (`heldout_curves`); the stage times are merged (`merged_stage_times`).
    Refuses (`FewerRows`, before writing anything) to replace a kept row file with one of fewer rows, or a kept
    features manifest with a less complete one, unless `replace_with_fewer`."""
    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    if not (work / "data_settings.json").exists():
        raise FileNotFoundError(f"{work}: not a regime workdir (no data_settings.json)")
    if differ := settings_differ(to, work):
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ValueError(f"save: {differ[0]}{more}; nothing written (save into a new --to folder: the kept rows were "
                         "made with the kept settings)")
    curves = heldout_curves(work)
    times = merged_stage_times(to / "stage_times.json", work / "stage_times.json") \
        if (work / "stage_times.json").is_file() else None
    if not replace_with_fewer and (fewer := fewer_rows(work, to, curves)):
        more = f" (and {len(fewer) - 1} more)" if len(fewer) > 1 else ""
        raise FewerRows(f"save would replace kept rows with fewer: {fewer[0]}{more}; nothing written "
                        "(--replace-with-fewer to replace them)")
    copied = _copy_tree(work, to, [g for g in KEEP if g != "stage_times.json"], overwrite=True, scrub=True)
    if times is not None:
        atomic_write_json(to / "stage_times.json", times)
        copied.append(Path("stage_times.json"))
    for rel, text in curves.items():
        atomic_write_text(to / rel, text)
        copied.append(rel)
    return copied


def settings_differ(src: Path, work: Path) -> List[str]:
    """Where `work` was made with other settings than the folder `src` kept: its `data_settings.json` and each
    seed's `settings.json` that both hold, compared on the keys both name; one line each."""
    out = []
    for pattern in ("data_settings.json", "seed*/settings.json"):
        for f in sorted(src.glob(pattern)):
            rel = f.relative_to(src)
            if not (work / rel).is_file():
                continue
            kept, own = _json(f), _json(work / rel)
            if not (isinstance(kept, dict) and isinstance(own, dict)):
                out.append(f"{work / rel} or {f}: not a JSON object")
                continue
            if changed := sorted(k for k in kept.keys() & own.keys() if kept[k] != own[k]):
                out.append(f"{work / rel} differs from {f} (" +
                           ", ".join(f"{k}: {own[k]!r} here, {kept[k]!r} kept" for k in changed) + ")")
    return out


def restore_rows(src: Path, work: Path) -> List[Path]:
    """Put `save`'s settings files, regenerated text, eval folders, stage times and command log back into `work` (files
    already there are left alone). Refuses, before writing anything, a workdir whose own settings differ from the kept
    ones (`settings_differ`): its regenerated text and rows would be merged with others made otherwise. The restored
    settings files are what the regime's next run compares its flags with (`check_settings`), so a run asking for
    other settings over restored data is refused, not shown as done."""
    if not (src / "data_settings.json").exists():
        raise FileNotFoundError(f"{src}: not a saved regime folder (no data_settings.json)")
    if differ := settings_differ(src, work):
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ValueError(f"restore: {differ[0]}{more}; nothing restored (restore into a new --workdir, or one made "
                         "with the kept settings)")
    work.mkdir(parents=True, exist_ok=True)
    return _copy_tree(src, work, RESTORE, overwrite=False)


#: what tells the regimes' folders apart: the GSM8K regime's data settings record its index splits, ShareGPT's do not
REGIME_MARKS = {"gsm8k": "splits", "sharegpt": "keep"}


def check_regime_folder(flag: str, path: Path, regime: str) -> None:
    """`report --gsm8k DIR` / `--sharegpt DIR`: DIR is a workdir or kept folder of that regime (its `data_settings.json`
    names the regime's own settings), else one line before any work."""
    settings = _json(path / "data_settings.json") if (path / "data_settings.json").is_file() else None
    if not isinstance(settings, dict):
        raise FileNotFoundError(f"{flag} {path}: not a regime workdir or kept folder (no data_settings.json)")
    other = next((name for name, mark in REGIME_MARKS.items() if name != regime and mark in settings), None)
    if other and REGIME_MARKS[regime] not in settings:
        raise ValueError(f"{flag} {path}: a {other} regime's folder (its data_settings.json has no "
                         f"{REGIME_MARKS[regime]!r}); pass it as --{other}")


def fingerprint_checked(out: Path, export: Path) -> bool:
    """The kept-fingerprint stage is done when its record names the export as it is now (a re-export of a retrained
    drafter is checked again)."""
    from pr_specforge.export import export_fingerprints

    record = _json(out) if out.is_file() else None
    return isinstance(record, dict) and export.is_dir() and record.get("fingerprint") in export_fingerprints(str(export))


def kept_fingerprint_check(seed_dir: Path, name: str, export: Path, out: Path) -> None:
    """Before any serve: `name`'s export (`export`) against the fingerprint every eval folder of `seed_dir` recorded for
    the drafter of that name that served its kept rows (`eval_config.json`). Writes `out` when each one matches (or no
    folder names it); refuses in one line otherwise, before hours of training and serving on top of it are spent
    (the serve itself would refuse the folder)."""
    from pr_specforge.data.io import atomic_write_json
    from pr_specforge.export import export_fingerprints, matches_export
    from pr_specforge.stages import StageFailed

    prints = export_fingerprints(str(export))  # (current, as the files are): rows kept before exports recorded
    fp = prints[0]                             # their target by name hold the second, with the target's path inside
    kept = {}
    for cfg in sorted(seed_dir.glob("*/eval_config.json")):
        if (want := (json.loads(cfg.read_text()).get("drafters") or {}).get(name)) is not None:
            kept[cfg.parent.name] = want
    if bad := {folder: want for folder, want in kept.items() if not matches_export(want, prints)}:
        folder, want = next(iter(bad.items()))
        raise StageFailed(f"{export}: drafter {name!r} rebuilt with fingerprint {fp}, but {seed_dir / folder}'s kept rows "
                          f"were served by {want}: rebuild it at the thread count it was trained with "
                          "(docs/results/regimes.md); if its rows equal the kept ones, `regimes.py migrate` records its "
                          "fingerprint for them; or serve those folders again (eval --start-over)")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, {"drafter": name, "fingerprint": fp, "kept": kept})
