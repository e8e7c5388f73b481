"""Labels for the parts of a drafting round, for the op counter (`sglang_plugin.op_counts`): off by default.

`part(name)` marks a stretch of the round (the pool, the bids, the repricing, ...) as
`torch.profiler.record_function("pr_ops::part:<name>")` while counting is on (`enable`, which the op counter calls
in a server started with `PR_EAGLE3_OP_COUNTS`), and is otherwise one shared no-op context: no call into torch, no
device work, no host read (the round stays graph-capturable and the host-read guard sees nothing of it).

Owns the switch and the label names (`PREFIX`, `PART`, `PHASE`); does not own the counting (`sglang_plugin.op_counts`).
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "pr_ops::"
PART = PREFIX + "part:"  # a part of a phase: `pr_ops::part:bids`
PHASE = PREFIX + "phase:"  # a phase of a round: `pr_ops::phase:draft`
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
    return torch.profiler.record_function(PART + name) if _on else _NULL
