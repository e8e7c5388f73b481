"""Crash-safe file output and strict JSONL input for the data-prep steps.

Whole files are written atomically (temp file in the same directory, fsync,
`os.replace`), so a reader never sees half a file. Streams that are meant to be
resumed (conversation JSONL) are appended one row at a time with flush+fsync,
so an interrupted run loses at most the row in flight; a torn last line is
detected and cut off when the stream is reopened.

It deliberately knows nothing about conversations, tensors' meaning or models.
"""

from __future__ import annotations

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


def _atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text), "w")


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
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataFormatError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            yield lineno, row


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


def read_jsonl_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of an append-mode JSONL file (after cutting a torn last line); [] if it is absent."""
    if not os.path.exists(path):
        return []
    repair_jsonl_tail(path)
    return [row for _, row in iter_jsonl(path)]


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
