"""One live server per (engine line, target, drafter, launch arguments, environment) per test session.

Every live module (SGLang 0.5.14 and 0.5.23 through the CPU bridge, vLLM's CPU build) asks this registry for its
server instead of starting its own: `shared.get(name, key, start)` returns the running `Server` of that key, starting
it the first time (`start(log_path)` is a context manager that yields the port: `sglang_server`, or `serving` through
`with_port`). vLLM's modules start their own: each of their launches is a different export. The key is the server's whole launch (interpreter, target, drafter, flags, environment), so two
modules never share a server whose settings differ; what the plugin takes per request (m, B_w, the refusals) goes
through requests. A server is stopped (its process group, also on failure) when the session ends, or earlier when
more than `keep` servers are up (the least recently used goes: the suite's modules are ordered so that none is
started twice, and the start-up count says so).

Each server's log is one file; every test's own lines of every server it used are attached to that test's report
when it fails (`mark` / `grown`, called by the hooks in tests/conftest.py), so a failure still shows its own lines.

`PR_SPECFORGE_SERVER_STARTS` (set for the session here) makes `pr_specforge.local_server.serving` record each
server start in a file, the benchmarks' servers and the tests' fresh starts (a start-up refusal, a fault) included:
the session's summary prints the count.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

from pr_specforge.local_server import STARTS_ENV  # noqa: F401 (tests/conftest.py reads it from here)


@dataclass
class Server:
    name: str
    key: Tuple
    port: int
    log: Path
    marks: Dict[str, int] = field(default_factory=dict)


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return str(value)


class Registry:
    def __init__(self, root: Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep
        self._alive: "collections.OrderedDict[Tuple, Tuple[Server, contextlib.ExitStack]]" = collections.OrderedDict()
        self.started: List[str] = []

    def get(self, name: str, key: dict, start: Callable[[Path], ContextManager[int]]) -> Server:
        """The running server of `key` (a dict of everything its launch depends on), started with `start` if none."""
        frozen = _frozen(key)
        if frozen in self._alive:
            self._alive.move_to_end(frozen)
            return self._alive[frozen][0]
        while len(self._alive) >= self.keep:
            self._stop(next(iter(self._alive)))
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
        log = self.root / f"{len(self.started):02d}-{safe}.log"
        stack = contextlib.ExitStack()
        try:
            port = stack.enter_context(start(log))
        except BaseException:
            stack.close()
            raise
        server = Server(name, frozen, port, log)
        self._alive[frozen] = (server, stack)
        self.started.append(name)
        return server

    def _stop(self, frozen) -> None:
        _, stack = self._alive.pop(frozen)
        stack.close()

    def close(self) -> None:
        while self._alive:
            self._stop(next(reversed(self._alive)))

    # per-test log slices
    def mark(self, test: str) -> None:
        for server, _ in self._alive.values():
            server.marks[test] = _size(server.log)

    def forget(self, test: str) -> None:
        for server, _ in self._alive.values():
            server.marks.pop(test, None)

    def grown(self, test: str) -> List[Tuple[str, str]]:
        """(server name, its log's lines written since `mark(test)`) for each server alive now whose log grew."""
        out = []
        for server, _ in self._alive.values():
            start = server.marks.pop(test, 0)
            if _size(server.log) > start:
                with open(server.log, errors="replace") as f:
                    f.seek(start)
                    out.append((server.name, f.read()[-12000:]))
        return out


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def starts(path: Optional[str]) -> List[str]:
    """The server starts `pr_specforge.local_server.serving` recorded in `path` (one line each)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def start_counts(lines: List[str]) -> Dict[str, int]:
    """How many of the recorded `lines` each kind of start (`serve`, `refused`) has."""
    return dict(collections.Counter(line.split("\t", 1)[0] for line in lines))
