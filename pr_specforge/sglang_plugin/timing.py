"""Round timing inside a live SGLang server, for `benchmarks/serving_cost.py`: off unless `PR_EAGLE3_ROUND_TIMES` is set.

With `PR_EAGLE3_ROUND_TIMES=FILE` in a server's environment, the plugin's entry point (`register`, run in every
SGLang process) wraps, in that process and for timing only, the methods a speculative decode round is made of:

  * `EAGLEWorkerV2.forward_batch_generation` on a decode batch: the round (`round_s`), draft + verify +
    draft-extend; prefill batches are not timed;
  * the draft phase: `EagleDraftWorker.draft` (SGLang's EAGLE-3) and `PRDraftWorker.draft` (ours) (`draft_s`);
    `EAGLEWorkerV2.verify` (`verify_s`); `EagleDraftWorker._draft_extend_for_decode` (`extend_s`);
  * the model compute, the round's floor: `ModelRunner.forward`, split by runner (`target_compute_s`,
    `draft_compute_s`: the draft runner's forwards, in the draft phase and in draft-extend), the PR rows' forwards
    (`PR_EAGLE3_ROWS=sglang`: `rows.SGLangRows.forward_rows`, SGLang's draft model; `ours`: our runtime's
    `DrafterRuntime.forward_tree_rows`), as draft compute, and our PR drafter's readouts (`DrafterRuntime.log_probs`, `halt_probability`, `readout_and_halt`: the head and gate
    matmuls SGLang's EAGLE-3 runs inside its draft model's forward) as `readout_compute_s`.

Each timed round appends one JSON line to FILE: the batch size, the request ids, the times above, each
compute time also by the phase it ran in (`draft.draft_compute_s`, `draft.readout_compute_s`, `verify.target_compute_s`,
...), and `floor_s` = target + draft + readout compute. Whatever is not compute (tree bookkeeping, SGLang's top-k
selection, building the verify input, host reads) is `round_s - floor_s`. On CUDA each boundary
synchronises the device, so a timed server is slower than an untimed one; the ratios stay comparable. A round
replayed from a CUDA graph (`round_graph`) runs no Python inside: its draft phase is timed whole (`draft_s`), its
compute not split out (the round it was captured in counts the capture's Python time).
Both algorithms are timed in the same way, so a benchmark can read them side by side.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Callable, Dict, Optional

import torch

ENV = "PR_EAGLE3_ROUND_TIMES"
COMPUTE = ("target_compute_s", "draft_compute_s", "readout_compute_s")
_state = threading.local()
_installed = False


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # (never inside a capture: `round_graph` records the round there, nothing runs)


def _round() -> Optional[Dict[str, float]]:
    return getattr(_state, "round", None)


def _timed(key: str, fn: Callable, *, outermost: Optional[str] = None, phase: bool = False) -> Callable:
    """`fn`, adding its wall time to the current round's `key` (nothing outside a timed round). With
    `outermost`, only the outermost of nested calls sharing that name is counted (readouts call each other).
    A `phase` (draft, verify, extend) names the phase its compute is charged to as well: `draft.draft_compute_s`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _round()
        if rec is None or (outermost and getattr(_state, outermost, False)) or \
                (phase and getattr(_state, "phase", None)):  # a phase inside one (PR's draft calling SGLang's)
            return fn(*args, **kwargs)
        if outermost:
            setattr(_state, outermost, True)
        if phase:
            _state.phase = key[: -len("_s")]
        _sync()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            dt = time.perf_counter() - t0
            rec[key] = rec.get(key, 0.0) + dt
            if key in COMPUTE and getattr(_state, "phase", None):
                sub = f"{_state.phase}.{key}"
                rec[sub] = rec.get(sub, 0.0) + dt
            if outermost:
                setattr(_state, outermost, False)
            if phase:
                _state.phase = None

    wrapper.pr_timed = True
    return wrapper


def _timed_forward(fn: Callable) -> Callable:
    """`ModelRunner.forward`, its time charged to the target's or the draft's compute by the runner's role."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        key = "draft_compute_s" if getattr(self, "is_draft_worker", False) else "target_compute_s"
        return _timed(key, fn)(self, *args, **kwargs)

    wrapper.pr_timed = True
    return wrapper


def _timed_round(fn: Callable, path: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, batch, *args, **kwargs):
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False) \
                or _round() is not None:
            return fn(self, batch, *args, **kwargs)
        rec: Dict[str, float] = {}
        _state.round = rec
        _sync()
        t0 = time.perf_counter()
        try:
            return fn(self, batch, *args, **kwargs)
        finally:
            _sync()
            rec["round_s"] = time.perf_counter() - t0
            _state.round = None
            rec["floor_s"] = sum(rec.get(k, 0.0) for k in COMPUTE)
            line = {"pid": os.getpid(), "batch": len(batch.reqs), "rids": [r.rid for r in batch.reqs], **rec}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    wrapper.pr_timed = True
    return wrapper


def _wrap(cls, name: str, make: Callable) -> None:
    fn = cls.__dict__.get(name)
    if fn is not None and not getattr(fn, "pr_timed", False):
        setattr(cls, name, make(fn))


def install(path: Optional[str] = None) -> bool:
    """Wrap the round's methods (see the module doc) when `path` or `$PR_EAGLE3_ROUND_TIMES` names a file;
    once per process. Returns whether timing is on."""
    global _installed
    path = path or os.environ.get(ENV) or None
    if not path:
        return False
    if _installed:
        return True
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

    from pr_specforge.serving.drafter_runtime import DrafterRuntime
    from pr_specforge.sglang_plugin.rows import SGLangRows
    from pr_specforge.sglang_plugin.worker import PRDraftWorker

    _wrap(EAGLEWorkerV2, "forward_batch_generation", lambda fn: _timed_round(fn, path))
    _wrap(EAGLEWorkerV2, "verify", lambda fn: _timed("verify_s", fn, phase=True))
    _wrap(EagleDraftWorker, "draft", lambda fn: _timed("draft_s", fn, phase=True))
    _wrap(PRDraftWorker, "draft", lambda fn: _timed("draft_s", fn, phase=True))
    _wrap(EagleDraftWorker, "_draft_extend_for_decode", lambda fn: _timed("extend_s", fn, phase=True))
    _wrap(ModelRunner, "forward", _timed_forward)
    _wrap(DrafterRuntime, "forward_tree_rows", lambda fn: _timed("draft_compute_s", fn))  # rows path `ours`
    _wrap(SGLangRows, "forward_rows", lambda fn: _timed("draft_compute_s", fn))  # rows path `sglang`
    for name in ("log_probs", "halt_probability", "readout_and_halt"):
        _wrap(DrafterRuntime, name, lambda fn: _timed("readout_compute_s", fn, outermost="in_readout"))
    _installed = True
    return True
