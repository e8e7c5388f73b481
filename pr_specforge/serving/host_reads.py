"""A guard for code meant to run without waiting for the device: a CUDA graph's body, or a draft that SGLang's
overlap schedule runs ahead of the device. It raises on every operation that would wait.

Three things break a CUDA graph, and each goes through an aten operator that a `TorchDispatchMode` sees on any
device, this CPU included:
  * a host read of a tensor's value - `.item()`, `int(t)`, `float(t)`, `if t:` (`aten._local_scalar_dense`,
    `aten.is_nonzero`, `aten.equal`);
  * a result whose shape depends on values - `nonzero`, `masked_select`, `unique`, indexing by a bool mask,
    `repeat_interleave` without `output_size`;
  * host data entering mid-capture - `torch.tensor(...)` of Python values (`aten.lift_fresh`; a Python number,
    as in `t[i] = 0`, is a 0-dim one: a constant the capture records, allowed).
Host reads that bypass the dispatcher - `.tolist()`, `.numpy()`, `.cpu()`, `np.asarray(t)` - are Tensor methods a
`TorchFunctionMode` sees, and the guard refuses them too. (`.to("cpu")` is not refused: on this CPU it is also the
way to the device.)
`NoHostReads()` is that pair of modes: inside it, the first such operation raises `HostReadError` naming the
operator. Run on a CPU, it proves what the device would meet for the code path it ran (the operators, not the
kernels: a kernel that syncs inside, or a Python branch on a value read before the guard, is not seen).
`NoHostReads(host_data=True)` lets host data in (a draft's round start brings request slots and uniforms, without
waiting: `to_device`) and refuses the rest; parts that read the host by design run inside `host_reads_allowed()`,
which the guard passes unchecked (each such part says why).

Outside a capture, host data still has to reach the device each round (request slots, which requests a group
holds). `to_device` brings it without waiting: `torch.tensor(values, device=cuda)` copies with `non_blocking=False`,
which waits for all the work queued on the stream, the previous batch's included, so under SGLang's overlap schedule
the draft's launches would wait for the GPU instead of running ahead of it. Code that runs every round uses
`to_device`; tests/test_architecture.py refuses `torch.tensor(..., device=...)` in the serving plugin.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ops = torch.ops.aten
_HOST_READS = {_ops._local_scalar_dense.default, _ops.is_nonzero.default, _ops.equal.default}
_VALUE_SHAPED = {
    _ops.nonzero.default, _ops.masked_select.default, _ops.unique_consecutive.default, _ops._unique2.default,
    _ops.unique_dim.default, _ops.argwhere.default,
}
_HOST_DATA = {_ops.lift_fresh.default, _ops.lift_fresh_copy.default}
_HOST_READ_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu",
                      torch.Tensor.__array__: "__array__"}
_allowed = threading.local()
_BOOL_INDEXED = {_ops.index.Tensor, _ops.index_put.default, _ops.index_put_.default, _ops._index_put_impl_.default}


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python `values` as a tensor on `device`, without waiting for the device: built on the host, then copied with
    `non_blocking=True` (a copy from pageable host memory is staged before the call returns, so `values` may go at
    once; nothing queued on the stream is waited for). On the host it is the tensor itself."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostReadError(RuntimeError):
    """An operation inside `NoHostReads` that would wait for the device (one line, naming the operator)."""


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


def _depth() -> int:
    return getattr(_allowed, "depth", 0)


@contextmanager
def host_reads_allowed():
    """A part that reads the host by design, inside a `NoHostReads`: it runs unchecked by the guards around it (say
    why where it is used); a guard entered inside it checks as usual."""
    depth = _depth()
    _allowed.depth = depth + 1
    try:
        yield
    finally:
        _allowed.depth = depth


class _HostReadCalls(TorchFunctionMode):
    """The Tensor methods that read values on the host without an aten operator (`tolist`, `numpy`, `cpu`,
    `__array__`): refused for the `NoHostReads` that holds it."""

    def __init__(self, guard: "NoHostReads") -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _HOST_READ_METHODS.get(func) if self.guard.checking() else None
        if name:
            self.guard.refuse(f"Tensor.{name} reads a tensor's values on the host")
        return func(*args, **(kwargs or {}))


class NoHostReads(TorchDispatchMode):
    """Raise `HostReadError` on the first host read, value-shaped result or host tensor (see the module doc).
    `where`: what is being guarded, for the message; `host_data`: let host data in (a round start's `to_device`)."""

    def __init__(self, where: str = "a captured round", host_data: bool = False) -> None:
        super().__init__()
        self.where, self.host_data = where, host_data
        self.cost = "the host would wait for the device" if host_data else "a CUDA graph cannot capture it"
        self._calls = _HostReadCalls(self)

    def refuse(self, what: str) -> None:
        raise HostReadError(f"{self.where}: {what}: {self.cost}")

    def checking(self) -> bool:
        """False inside a `host_reads_allowed()` entered after this guard."""
        return _depth() <= self.depth

    def __enter__(self):
        self.depth = _depth()
        self._calls.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._calls.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._calls.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = self._why(func, args, kwargs) if self.checking() else None
        if why:
            self.refuse(f"{func} {why}")
        return func(*args, **kwargs)

    def _why(self, func, args, kwargs):
        """Why `func` would wait for the device, or None."""
        if func in _HOST_READS:
            return "reads a tensor's value on the host"
        if func in _VALUE_SHAPED or (func is _ops.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            return "gives a result whose shape depends on values"
        if func in _HOST_DATA and args[0].dim() and not self.host_data:  # a 0-dim one is a Python number: a constant
            return "brings host data in (torch.tensor of Python values)"
        if func in _BOOL_INDEXED and _bool_index(args):
            return "indexes by a bool mask (a result shaped by values)"
        return None
