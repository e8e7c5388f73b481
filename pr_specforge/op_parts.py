"""Labels for the parts of a drafting round, for the op counter (`sglang_plugin.op_counts`): off by default.

`part(name)` marks a stretch of the round (the pool, the bids, the repricing, ...) as
`torch.profiler.record_function("pr_ops::part:<name>")` while counting is on (`enable`, which the op counter calls
in a server started with `PR_EAGLE3_OP_COUNTS`), and is otherwise one shared no-op context: no call into torch, no
device work, no host read (the round stays graph-capturable and the host-read guard sees nothing of it).

`step()` marks one row step of the round the same way (`pr_ops::step`, the part labels inside it), so that
the counter can tell the ops each row step makes from those made once a round.

`stand_in(name)` marks a CPU stand-in of ONE device kernel (the CPU bridge's `build_tree` in place of sgl-kernel's,
which loops over the requests in torch ops): while counting, its call is one op, `kernel:<name>`, whatever it runs
inside (on a GPU it is one launch); otherwise the function runs as it is, behind one flag test.

Imports nothing heavy (torch only while counting): the CPU bridge imports it at every interpreter's start-up.
Owns the switch and the label names (`PREFIX`, `PART`, `PHASE`, `KERNEL`, `STEP`); does not own the counting
(`sglang_plugin.op_counts`).
"""

from __future__ import annotations

import contextlib
import functools

PREFIX = "pr_ops::"
PART = PREFIX + "part:"  # a part of a phase: `pr_ops::part:bids`
PHASE = PREFIX + "phase:"  # a phase of a round: `pr_ops::phase:draft`
KERNEL = PREFIX + "kernel:"  # a host stand-in for one device kernel, counted as one op: `pr_ops::kernel:build_tree`
STEP = PREFIX + "step"  # one row step of the round (its parts labelled inside): `pr_ops::step`
_NULL = contextlib.nullcontext()
_on = False


def enable(on: bool = True) -> None:
    """Turn the labels on (or off) in this process."""
    global _on
    _on = on


def enabled() -> bool:
    return _on


def part(name: str):
    """The context marking a part of the round named `name` for the op counter; a shared no-op while counting is off."""
    return _record(PART + name) if _on else _NULL


def step():
    """The context marking one row step of the round (the frontier's and reconsidered rows' forward and what follows),
    so that the op counter reports ops per row step apart from ops per round; a shared no-op while counting is off."""
    return _record(STEP) if _on else _NULL


def _record(label: str):
    import torch  # only while counting: this module stays importable without torch (the CPU bridge's start-up)

    return torch.profiler.record_function(label)


def stand_in(name: str):
    """Decorate a host stand-in of one device kernel (see the module doc): counted as one op named `name`."""

    def wrap(fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if not _on:
                return fn(*args, **kwargs)
            with _record(KERNEL + name):
                return fn(*args, **kwargs)

        return counted

    return wrap
