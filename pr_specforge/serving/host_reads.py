"""A guard for code meant to be captured as a CUDA graph: it raises on every operation a capture cannot record.

A CUDA graph records kernels with fixed shapes on fixed memory. Three things break it, and each goes through
an aten operator that a `TorchDispatchMode` sees on any device, this CPU included:
  * a host read of a tensor's value - `.item()`, `int(t)`, `float(t)`, `if t:` (`aten._local_scalar_dense`,
    `aten.is_nonzero`, `aten.equal`);
  * a result whose shape depends on values - `nonzero`, `masked_select`, `unique`, indexing by a bool mask,
    `repeat_interleave` without `output_size`;
  * host data entering mid-capture - `torch.tensor(...)` of Python values (`aten.lift_fresh`; a Python number,
    as in `t[i] = 0`, is a 0-dim one: a constant the capture records, allowed).
`NoHostReads()` is that mode: inside it, the first such operation raises `HostReadError` naming the operator.
Run on a CPU, it proves what the capture would meet on a GPU for the code path it ran (the operators, not the
kernels: a kernel that syncs inside, or a Python branch on a value read before the guard, is not seen).

Outside a capture, host data still has to reach the device each round (request slots, which requests a group
holds). `to_device` brings it without waiting: `torch.tensor(values, device=cuda)` copies with `non_blocking=False`,
which waits for all the work queued on the stream, the previous batch's included, so under SGLang's overlap schedule
the draft's launches would wait for the GPU instead of running ahead of it. Code that runs every round uses
`to_device`; tests/test_architecture.py refuses `torch.tensor(..., device=...)` in the serving plugin.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ops = torch.ops.aten
_HOST_READS = {_ops._local_scalar_dense.default, _ops.is_nonzero.default, _ops.equal.default}
_VALUE_SHAPED = {
    _ops.nonzero.default, _ops.masked_select.default, _ops.unique_consecutive.default, _ops._unique2.default,
    _ops.unique_dim.default, _ops.argwhere.default,
}
_HOST_DATA = {_ops.lift_fresh.default, _ops.lift_fresh_copy.default}
_BOOL_INDEXED = {_ops.index.Tensor, _ops.index_put.default, _ops.index_put_.default, _ops._index_put_impl_.default}


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python `values` as a tensor on `device`, without waiting for the device: built on the host, then copied with
    `non_blocking=True` (a copy from pageable host memory is staged before the call returns, so `values` may go at
    once; nothing queued on the stream is waited for). On the host it is the tensor itself."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostReadError(RuntimeError):
    """An operation inside `NoHostReads` that a CUDA graph cannot capture (one line, naming the operator)."""


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


class NoHostReads(TorchDispatchMode):
    """Raise `HostReadError` on the first host read, value-shaped result or host tensor (see the module doc).
    `where`: what is being guarded, for the message."""

    def __init__(self, where: str = "a captured round") -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = None
        if func in _HOST_READS:
            why = "reads a tensor's value on the host"
        elif func in _VALUE_SHAPED or (func is _ops.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            why = "gives a result whose shape depends on values"
        elif func in _HOST_DATA and args[0].dim():  # a 0-dim one is a Python number (`t[i] = 0`): a constant
            why = "brings host data in (torch.tensor of Python values)"
        elif func in _BOOL_INDEXED and _bool_index(args):
            why = "indexes by a bool mask (a result shaped by values)"
        if why:
            raise HostReadError(f"{self.where}: {func} {why}: a CUDA graph cannot capture it")
        return func(*args, **kwargs)
