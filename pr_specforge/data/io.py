"""Crash-safe file output and strict JSONL input for the data-prep steps.

Whole files are written atomically (temp file in the same directory, fsync,
`os.replace`), so a reader never sees half a file; the temp file a killed writer
left is removed by the next write of the same file (`remove_stale_temps`). Streams that are meant to be
resumed (conversation JSONL) are appended one row at a time with flush+fsync,
so an interrupted run loses at most the row in flight; a torn last line is
detected and cut off when the stream is reopened.

Resuming is safe only into an output made from the same inputs and settings:
every resumable writer (`data conversations`, `data regenerate`, `data
hidden-states`, `eval`) records a fingerprint of what decides its output
(`file_digest` of its input, the target's identity, the settings) and calls
`check_resume` before it skips anything already there; a mismatch is one
`ResumeMismatch` line naming the field that changed and the flag that starts
over. JSONL writers keep their fingerprint beside the output
(`resume_jsonl_output`: `<output>.resume.json`).

What a command may write is one rule, here, that every command applies to its output paths before any work
(`check_writable_file`, `check_output_dir`): it replaces only a file it recognises as its own by the marker it wrote
(`own_kind`), or one the user named with `--overwrite`; never one of its inputs, a read-only file or a symbolic
link; only in the format the extension names; and the replaced file keeps its mode.

It deliberately knows nothing about conversations, tensors' meaning or models
(`dir_fingerprint` hashes a model directory's files, not what they mean).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)


def brief(error: BaseException) -> str:
    """`Type: first sentence` of an exception, for a one-line message."""
    text = str(error).strip().split("\n")[0].split(". ")[0]
    return f"{type(error).__name__}: {text[:140]}"


class DataFormatError(ValueError):
    """Input data that cannot be parsed; the message names the file and line."""


def _load_json(path: str | os.PathLike, where: str, error: type) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{where}: not valid JSON ({brief(e)})") from None
    except OSError as e:
        raise error(f"{where}: cannot be read ({e.strerror or brief(e)})") from None


def read_json_object(path: str | os.PathLike, what: str = "", error: type = None) -> dict:
    """A JSON file that must hold one object (a manifest, a config, a provenance record): its mapping,
    or one `error` line (default `DataFormatError`) naming the file when it is not JSON or not an object."""
    error = error or DataFormatError
    where = f"{what} {path}" if what else str(path)
    value = _load_json(path, where, error)
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got a {type(value).__name__}; the file is damaged or not "
                    "the one this command reads")
    return value


class ResumeMismatch(ValueError):
    """An output holds work made from other inputs or settings than this run's; the message names
    the first field that differs and how to start over."""


#: what a fingerprint records for a field an older version of a writer did not record
UNRECORDED = "<not recorded>"


def file_digest(path: str | os.PathLike) -> str:
    """A short content hash (sha256) of a file: the fingerprint of a writer's input."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def dir_fingerprint(path: str, hash_weights: bool = True, ignore_keys: tuple = ()) -> str:
    """A short hash of a model directory: its config files' contents, and its weight files' contents
    (or, with `hash_weights=False`, their names and sizes: cheap for a large target).

    `ignore_keys`: top-level keys of a JSON file that say where the directory came from, not what it is; a
    file holding one is hashed as its content without them (`json.dumps(indent=2, sort_keys=True)`, the
    writers' own layout), so a file that never held them hashes as before."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        weights = name.endswith((".safetensors", ".bin", ".pt", ".pth"))
        if not weights and not name.endswith(".json"):
            continue
        h.update(name.encode())
        if weights and not hash_weights:
            h.update(str(os.path.getsize(full)).encode())
            continue
        if not weights and ignore_keys and (kept := _json_without(full, ignore_keys)) is not None:
            h.update(kept.encode())
            continue
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _json_without(path: str, keys: tuple) -> str | None:
    """The JSON object in `path` without `keys`, in the writers' layout; None when it holds none of them
    (or is not a JSON object): it is then hashed as its bytes."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(obj, dict) or not any(k in obj for k in keys):
        return None
    return json.dumps({k: v for k, v in obj.items() if k not in keys}, indent=2, sort_keys=True) + "\n"


def check_resume(where: str, recorded: dict | None, current: dict, fix: str, error: type = ResumeMismatch) -> None:
    """Refuse to resume an output whose recorded fingerprint differs from this run's.

    `recorded` and `current` map field names to JSON values; a field `current` has and
    `recorded` lacks (an older writer) counts as changed. One line: the first field that
    differs, its old and new value, how many more differ, and `fix`.
    """
    recorded = json.loads(json.dumps(recorded or {}))
    current = json.loads(json.dumps(current))
    changed = sorted((k for k in current if recorded.get(k, UNRECORDED) != current[k]),
                     key=lambda k: k not in recorded)  # a recorded value that differs first, then unrecorded ones
    if not changed:
        return
    key = changed[0]
    more = f" (and {len(changed) - 1} more: {', '.join(changed[1:])})" if len(changed) > 1 else ""
    raise error(f"{where}: field '{key}' is {recorded.get(key, UNRECORDED)!r} but this run's is "
                         f"{current[key]!r}{more}; {fix}")


def read_json_file(path: str | os.PathLike) -> Any:
    """A JSON file's content, of any shape; a file that is not JSON is a `DataFormatError` naming it (json's
    own message names only a line and column). `read_json_object` when it must hold one object."""
    return _load_json(path, str(path), DataFormatError)


class FewerRows(ValueError):
    """A writer of kept results would replace a file holding more rows with one holding fewer."""


def refuse_fewer_rows(path: str | os.PathLike, rows: int, count: Callable[[Any], int], flag: str) -> None:
    """Before replacing the JSON file `path` (results others read, often committed) with one of `rows`
    rows: refuse when it holds more (`count(its content)`), unless the caller passed `flag`, which
    says so in so many words. A file that is absent, unreadable or not of that shape is not protected."""
    try:
        before = count(read_json_file(path))
    except (OSError, DataFormatError, KeyError, TypeError, AttributeError):
        return
    if before > rows:
        raise FewerRows(f"{path} holds {before} rows and this run has {rows}: not replaced (pass {flag} to replace "
                        "it with fewer, or write to another path)")


def resume_record_path(output: str | os.PathLike) -> Path:
    """Where a JSONL writer keeps the fingerprint of `output`."""
    return Path(f"{output}.resume.json")


def resume_jsonl_output(output: str | os.PathLike, fingerprint: dict, start_over: bool,
                        flag: str = "--start-over", extra: tuple = (), write: bool = True) -> None:
    """Before a resumable JSONL writer appends to `output`: with `start_over` delete it (and `extra`
    paths: a sharded writer's parts), else refuse it when it holds rows made with another
    fingerprint; then record this run's fingerprint (when `write`: the one process that writes).
    An output without rows is not resumed, whatever its record says."""
    import shutil

    record = resume_record_path(output)
    if start_over:
        if write:
            for path in (Path(output), record, *map(Path, extra)):
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    elif any(os.path.exists(p) and os.path.getsize(p) > 0 for p in (output, *_jsonl_files(extra))):
        try:
            recorded = json.loads(record.read_text()) if record.exists() else None
        except json.JSONDecodeError:
            recorded = None
        check_resume(str(output), recorded, fingerprint,
                     f"its rows were made from other inputs or settings: rerun with {flag} to discard them, "
                     "or write to a new --output")
    if write:
        atomic_write_json(record, fingerprint)


def _jsonl_files(paths) -> list:
    out = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    return out


def honour_umask(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a `tempfile.mkstemp` file (0600) or `mkdtemp` directory (0700) the mode an ordinary
    `open` / `mkdir` would have: 0666 / 0777 less the umask (usually 0644 / 0755), so that what
    the atomic writers rename into place is readable by whoever can read its neighbours."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)


def honour_umask_tree(path: str | os.PathLike) -> None:
    """`honour_umask` for a finished temp directory and everything under it (safetensors, which
    `save_pretrained` uses, writes its files 0600)."""
    honour_umask(path, directory=True)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            honour_umask(os.path.join(root, name), directory=True)
        for name in files:
            honour_umask(os.path.join(root, name))


def _temp_prefix(path: Path) -> str:
    """The temp-file prefix of this host's writes of `path` (the writer's pid follows it)."""
    import socket

    return f".{path.name}.{socket.gethostname()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid: leave its file alone
    return True


def remove_stale_temps(path: str | os.PathLike) -> list:
    """Delete the temp files a killed writer (kill -9, power loss) of `path` left on this host: those whose
    writer pid is gone. A live writer's, and other hosts' (a shared file system), are kept. Returns them."""
    path = Path(path)
    prefix, removed = _temp_prefix(path), []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split(".", 1)[0]
        if name.startswith(prefix) and name.endswith(".tmp") and pid.isdigit() and not _pid_alive(int(pid)):
            try:
                os.unlink(path.parent / name)
                removed.append(name)
            except OSError:
                pass
    return removed


def _atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if path.is_file():  # a replaced file keeps its mode (a read-only one is refused before: check_writable_file)
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            honour_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text), "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data), "wb")


# ------------------------------------------------------------------ ownership of output files
# The one rule for every file and directory a command writes, checked before any work (`check_writable_file`,
# `check_output_dir`): a command replaces a file only when it can recognise it as its own (`own_kind`: a marker
# written into the JSON it writes) or when the user said `--overwrite`; never one of its own inputs, `--overwrite`
# or not; never a read-only file, a symbolic link or a path whose directory it cannot write; and only in the format
# the file's extension names. The atomic writers keep the mode of a file they replace.

#: the marker every JSON output a command may rewrite without `--overwrite` carries: `"kind": KIND` and its version
KIND_KEY, KIND_VERSION_KEY = "kind", "kind_version"


def own_kind(kind: str, version: int = 1) -> dict:
    """The marker (`{"kind": kind, "kind_version": version}`) a writer puts into a JSON object it may later rewrite."""
    return {KIND_KEY: kind, KIND_VERSION_KEY: version}


def file_kind(path: str | os.PathLike) -> tuple | None:
    """`(kind, version)` of a JSON object file carrying `own_kind`'s marker; None for anything else."""
    try:
        value = read_json_object(path)
    except DataFormatError:
        return None
    kind, version = value.get(KIND_KEY), value.get(KIND_VERSION_KEY)
    return (kind, version) if isinstance(kind, str) and isinstance(version, int) else None


def is_read_only(path: str | os.PathLike) -> bool:
    """No write permission bit at all, or none for this process (root may write there, but the owner said no)."""
    return not (os.stat(path).st_mode & 0o222) or not os.access(path, os.W_OK)


def _within(path: Path, other: Path) -> bool:
    try:
        path.relative_to(other)
    except ValueError:
        return False
    return True


def check_not_input(flag: str, path: str | os.PathLike, inputs=()) -> None:
    """Refuse an output that is one of the command's `inputs` (the same file by resolved real path or inode), or an
    existing file inside an input directory (a checkpoint's, a feature directory's), `--overwrite` or not."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    for given in inputs:
        if given is None or not os.path.lexists(given):
            continue
        other = Path(os.path.realpath(given))
        same = real == other or (path.exists() and os.path.samefile(path, other))
        if same or (other.is_dir() and path.exists() and _within(real, other)):
            what = "itself" if same else f"a file of the input {given}"
            raise DataFormatError(f"{flag} {path}: is an input of this command ({what}); it is never written over, "
                                  "--overwrite or not: name another path")


def check_output_parent(flag: str, path: Path) -> None:
    """The nearest existing directory above `path` is a directory this process may write."""
    parent = Path(os.path.abspath(path)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DataFormatError(f"{flag} {path}: {parent} is a file, not a directory")
    if is_read_only(parent):
        raise DataFormatError(f"{flag} {path}: the directory {parent} is not writable; make it writable, or name "
                              "another path")


#: the file names of each format a command writes; a name ending in another format's is refused (`check_format`)
FORMATS = {"JSON": (".json",), "PNG": (".png",), "Markdown": (".md",), "YAML": (".yaml", ".yml"), "JSONL": (".jsonl",),
           "PDF": (".pdf",), "JPEG": (".jpg", ".jpeg"), "SVG": (".svg",), "CSV": (".csv",), "a torch file": (".pt", ".ckpt"),
           "safetensors": (".safetensors",), "gzip": (".gz",)}
#: formats whose files must carry their own extension (binary: a viewer goes by the name); text formats (JSON) may
#: carry none, or one that names no format here
STRICT_FORMATS = ("PNG",)


def check_format(flag: str, path: str | os.PathLike, fmt: str) -> None:
    """`path` names a file of format `fmt` (a key of `FORMATS`): refused in one line when its extension names another
    format (`diagnose --json x.png`, `plot -o x.pdf`), or, for a `STRICT_FORMATS` one, is not its own."""
    name = str(path).lower()
    own = FORMATS[fmt]
    other = next((f for f, ends in FORMATS.items() if f != fmt and name.endswith(ends)), None)
    if (other or fmt in STRICT_FORMATS) and not name.endswith(own):
        named = f" ({other}, by its name)" if other else ""
        raise DataFormatError(f"{flag} {path}: this command writes {fmt} only{named}; name a file ending in "
                              f"{' or '.join(own)}")


def check_writable_file(flag: str, path: str | os.PathLike, overwrite: bool | None = None, *, kind: str | None = None,
                        version: int = 1, what: str = "", inputs=(), fmt: str | None = None,
                        own_dir: str | os.PathLike | None = None) -> None:
    """The ownership rule for an output file, before any work; one `DataFormatError` line naming `flag` and the path.

    Refused: a directory, a path under a file or in a directory that cannot be written, one of `inputs`
    (`check_not_input`), a symbolic link (replacing it would cut the link and leave its target stale), a name that
    does not say the format `fmt` written (`check_format`), and a file that exists when it may not be replaced:
    - `kind` given (a JSON output the command rewrites on a rerun, `what` naming it): a file carrying that marker
      (`own_kind`) at `version` or below is replaced (a newer version's file is not); a file without it is the command's own only inside `own_dir` (a directory the command
      owns by its own record there: files an earlier version wrote before the marker); any other file only with
      `overwrite` True;
    - else with `overwrite` False (a command with `--overwrite`): refused unless the user passed it; `overwrite`
      None: a companion file whose owner its caller checked (e.g. a report's .md beside its marked .json);
    - in every case a read-only file (the atomic writer would replace it with a writable one)."""
    path = Path(path)
    if path.is_dir():
        raise DataFormatError(f"{flag} {path}: is a directory; name a file")
    check_output_parent(flag, path)
    check_not_input(flag, path, inputs)
    if fmt is not None:
        check_format(flag, path, fmt)
    if path.is_symlink():
        raise DataFormatError(f"{flag} {path}: is a symbolic link (to {os.readlink(path)}); replacing it would cut the "
                              "link: name the file itself, or a new one")
    if not path.exists():
        return
    if kind is not None:
        found = file_kind(path)
        own = (found is not None and found[0] == kind) or (
            found is None and own_dir is not None and _within(Path(os.path.realpath(path)), Path(os.path.realpath(own_dir))))
        if own and found is not None and found[1] > version and not overwrite:
            raise DataFormatError(f"{flag} {path}: written by a newer version of this command (kind_version {found[1]}, "
                                  f"this one writes {version}); not replaced: name a new file, or update")
        if not own and not overwrite:
            fix = "pass --overwrite to replace it, " if overwrite is False else ""
            marker = f"its kind is {found[0]!r}" if found else f'it carries no "kind": "{kind}" marker'
            raise DataFormatError(f"{flag} {path}: exists and is not {what or kind} ({marker}; this command replaces "
                                  f"only its own); {fix}name a new file, or move this one")
    elif overwrite is False:
        raise DataFormatError(f"{flag} {path}: exists; pass --overwrite to replace it, or name a new file")
    if is_read_only(path):
        raise DataFormatError(f"{flag} {path}: is read-only; it is not replaced (make it writable to replace it, or "
                              "name a new file)")


def check_output_dir(flag: str, path: str | os.PathLike, inputs=()) -> None:
    """The ownership rule for an output directory, before any work: not a file, not under a file, not one of
    `inputs`, and writable (it, or the nearest directory above it that exists); one `DataFormatError` line."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataFormatError(f"{flag} {path}: is a file, not a directory; name a directory")
    check_output_parent(flag, path)
    check_not_input(flag, path, inputs)
    if path.is_dir() and is_read_only(path):
        raise DataFormatError(f"{flag} {path}: the directory is not writable; make it writable, or name another one")


def atomic_save_figure(fig: Any, path: str | os.PathLike, dpi: int = 100) -> None:
    """A matplotlib figure as PNG bytes (the format every plot's `.png` name says), written whole or not at all."""
    import io

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    atomic_write_bytes(path, png.getvalue())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    _atomic_write(path, lambda f: torch.save(obj, f), "wb")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, row)` for each non-blank line (`.gz` files are read
    compressed); bad JSON raises `DataFormatError` naming the file and the
    1-based line number."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, _jsonl_row(path, lineno, line)


def _jsonl_row(path, lineno: int, line: str) -> dict:
    """One JSONL line as a dict; bad JSON or a non-object raises `DataFormatError` naming the file and line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row


@dataclass
class StageStats:
    """Row counts of a resumable data stage: read, written, resumed (already done), skipped by reason."""

    read: int = 0
    written: int = 0
    resumed: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"read": self.read, "written": self.written, "resumed": self.resumed, "skipped": dict(self.skipped)}


def repair_jsonl_tail(path: str | os.PathLike) -> int:
    """Cut a torn last line (a crash mid-write) off an append-mode JSONL file.

    Returns the number of bytes removed. Only the final line may be torn: the
    writer fsyncs every row, so earlier lines are complete by construction.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        end = len(data)
        keep = data.rfind(b"\n") + 1
        tail = data[keep:]
        if tail.strip():
            try:
                json.loads(tail)
                f.write(b"\n")  # complete row without its newline: keep it
                return 0
            except json.JSONDecodeError:
                pass
        f.truncate(keep)
    removed = end - keep
    if removed:
        logger.warning("%s: dropped a torn last line (%d bytes) left by an interrupted run", path, removed)
    return removed


def read_jsonl_rows(path: str | os.PathLike, repair: bool = True) -> list[dict]:
    """Every row of an append-mode JSONL file (after cutting a torn last line); [] if it is absent.

    `repair=False` reads another process's live file: the file is left as it is, and a last line without its
    newline (a row being appended right now, or torn) is not read. Only the file's own writer should repair it.
    """
    if not os.path.exists(path):
        return []
    if repair:
        repair_jsonl_tail(path)
        return [row for _, row in iter_jsonl(path)]
    with open(path, "rb") as f:
        data = f.read()
    lines = data[:data.rfind(b"\n") + 1].decode("utf-8").splitlines()
    return [_jsonl_row(path, lineno, line) for lineno, line in enumerate(lines, 1) if line.strip()]


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one row, flushed and fsynced (see `JsonlAppender` for many rows)."""
    with JsonlAppender(path) as out:
        out.write(row)


def read_done_ids(path: str | os.PathLike) -> set[str]:
    """Ids already present in an output JSONL (after repairing a torn tail)."""
    if not os.path.exists(path):
        return set()
    repair_jsonl_tail(path)
    return {str(row["id"]) for _, row in iter_jsonl(path) if "id" in row}


class JsonlAppender:
    """Append rows to a JSONL file, each flushed and fsynced before returning."""

    def __init__(self, path: str | os.PathLike, truncate: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not truncate:
            repair_jsonl_tail(self.path)
        self._f = open(self.path, "w" if truncate else "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
