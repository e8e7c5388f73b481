"""Device ops per round inside a live SGLang server, for `benchmarks/serving_cost.py`: off unless `PR_EAGLE3_OP_COUNTS`
is set.

With `PR_EAGLE3_OP_COUNTS=FILE` in a server's environment, the plugin's entry point (`register`) wraps, in that
process, the round's methods that `timing` times: each decode round of SGLang's V2 worker
(`EAGLEWorkerV2.forward_batch_generation`, prefill batches left out) runs under `torch.profiler.profile` (CPU
activity), its phases labelled (`pr_ops::phase:draft` around `EagleDraftWorker.draft` and `PRDraftWorker.draft`,
`verify` around `EAGLEWorkerV2.verify`, `extend` around `EagleDraftWorker._draft_extend_for_decode`), the model
compute labelled as the part `model` (`ModelRunner.forward`, our rows' forwards `SGLangRows.forward_rows` and
`DrafterRuntime.forward_tree_rows`) and our drafter's head and gate readouts as `readouts`, and the labels
`pr_specforge.op_parts.part` puts around the PR round's own parts (`enable`d here): load, tree, frontier, bids, pool,
repricing, row_inputs, rows, readouts, cut, pack, encoding, verify_input.

What is counted: a device op is an operator of the profile (`aten::`, or another `namespace::`, such as a custom
kernel's) called from outside any other operator, that works on its tensors' device (`count_ops`), once:
  * one call from Python is one op, what it runs inside included (`aten::matmul` and its `aten::mm`, `aten::zeros`
    and its fill, `aten::to` and its copy): on a GPU, each such call launches its kernel (a few composites launch
    more: a sort, a boolean-mask index; so the count is a lower bound of a GPU's launches, the same bound for both
    algorithms; inside a CUDA graph the same ops are the graph's nodes);
  * an operator that only views or allocates, itself and all it calls (`NO_KERNEL`: views, reshapes of contiguous
    tensors, `empty`, `new_empty`, a `to` that has nothing to do), launches nothing and is not counted;
  * a host read (`aten::item`) is counted: on a GPU it is a device-to-host copy;
  * a CPU bridge's stand-in of one sgl-kernel kernel (`pr_specforge.op_parts.stand_in`: SGLang's tree build and greedy
    tree verify, its cache-location kernels, which loop over the requests in torch ops here) is one op,
    `kernel:<name>`: the one launch it is on a GPU;
  * so is each attention call of a model layer (`RadixAttention.forward`, `kernel:attention`), whatever its backend
    runs inside: SGLang's `torch_native` backend on a CPU loops over the requests (one `scaled_dot_product_attention`
    each, and per top-k branch in EAGLE3's draft), where a GPU backend launches one kernel for the batch (on a GPU,
    a Triton kernel launched from Python is not a torch operator and would not be seen at all).
(The CPU's kernels call other operators inside theirs, a sum its fill, an add with a number its scalar's copy, which
a GPU's kernels do not: counting the innermost operators would count those instead.)

Each counted round appends one JSON line to FILE: the batch size, the request ids, and `ops[phase][part]` (phase:
draft, verify, extend, or `other` for the round's ops outside them; part: the innermost label around the op, or
`other`), `names[phase][part]`: the ops counted by operator name, and `steps[phase]`: the row steps the phase ran
(`op_parts.step` scopes, PR's round only) and the ops inside them, in all and by part; the phase's other ops are
made once a round (so ops per row step and per round are reported apart: a round's ops over gamma would hide the
per-round ones). Profiling costs host time per op: a counted
server is slow, and its times are not the round's (`timing` and this are for separate runs).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import threading
from typing import Callable, Dict, Optional

import torch

from pr_specforge import op_parts
from pr_specforge.op_parts import KERNEL, PART, PHASE, STEP, stand_in

ENV = "PR_EAGLE3_OP_COUNTS"
PHASES = ("draft", "verify", "extend")
#: operators that launch no device work: views, reshapes, allocations, aliasing, metadata
NO_KERNEL = frozenset("aten::" + n for n in (
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view", "reshape",
    "as_strided", "slice", "select",
    "expand", "expand_as", "unsqueeze", "squeeze", "t", "transpose", "permute", "narrow", "detach", "detach_",
    "alias", "lift_fresh", "resolve_conj", "resolve_neg", "_reshape_alias", "unflatten", "flatten", "view_as",
    "split", "split_with_sizes", "chunk", "unbind", "unfold", "numpy_T", "_to_dense", "contiguous", "to",
    "set_", "resize_", "result_type", "is_nonzero", "size", "stride", "dim", "is_same_size", "real", "conj",
    "_has_compatible_shallow_copy_type", "indices", "values", "movedim", "swapaxes", "diagonal", "align_to",
    "record_stream", "_nested_tensor_from_mask_left_aligned", "is_pinned", "broadcast_tensors"))
_state = threading.local()
_installed = False


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith(op_parts.PREFIX) and not name.startswith("profiler::")


def _works(ev) -> bool:
    """Whether operator `ev` launches device work: it is not metadata-only (`NO_KERNEL`), or one of its callees is
    not."""
    return ev.name not in NO_KERNEL or any(_works(c) for c in ev.cpu_children)


def _walk(events):
    """Each device op of a profile as `(phase, part, name, in_step)`, and each row-step scope (`op_parts.step`) as
    `(phase, None, None, True)`: what `count_ops` and `count_steps` count (see the module doc)."""
    stack = [(ev, "other", "other", False) for ev in events if ev.cpu_parent is None]
    while stack:
        ev, phase, where, in_step = stack.pop()
        if ev.name.startswith(KERNEL):  # a host stand-in of one device kernel: one op, whatever it runs inside
            yield phase, where, ev.name[len(op_parts.PREFIX):], in_step
            continue
        if _is_op(ev.name):
            if _works(ev):
                yield phase, where, ev.name, in_step
            continue  # its callees are its own work, not ops of their own
        if ev.name.startswith(PHASE):
            phase, where = ev.name[len(PHASE):], "other"
        elif ev.name.startswith(PART):
            where = ev.name[len(PART):]
        elif ev.name == STEP:
            in_step = True
            yield phase, None, None, True
        stack.extend((c, phase, where, in_step) for c in ev.cpu_children)


def count_ops(events) -> Dict[str, Dict[str, collections.Counter]]:
    """The device ops of a profile (`events`: the profiler's function events, parents and children linked), as
    `{phase: {part: Counter(op name)}}` (see the module doc for what counts): each outermost operator that works
    once, under the innermost part label and the phase label around it."""
    out: Dict[str, Dict[str, collections.Counter]] = collections.defaultdict(lambda: collections.defaultdict(
        collections.Counter))
    for phase, where, name, _ in _walk(events):
        if name is not None:
            out[phase][where][name] += 1
    return out


def count_steps(events) -> Dict[str, dict]:
    """The row steps of a profile (`op_parts.step` scopes) per phase: `{phase: {"steps": scopes, "ops": device ops
    inside them, "parts": {part: ops inside them}}}`; the phase's other ops are made once a round. A phase with no
    step scope (SGLang's own EAGLE-3 draft labels none) is left out."""
    out: Dict[str, dict] = {}
    for phase, where, name, in_step in _walk(events):
        if not in_step:
            continue
        at = out.setdefault(phase, {"steps": 0, "ops": 0, "parts": collections.Counter()})
        if name is None:
            at["steps"] += 1
        else:
            at["ops"] += 1
            at["parts"][where] += 1
    return {ph: dict(at, parts=dict(at["parts"])) for ph, at in out.items()}


def summarise(found: Dict[str, Dict[str, collections.Counter]], steps: Optional[Dict[str, dict]] = None) -> dict:
    """`count_ops`' result as a round line's `ops` (totals per phase and part) and `names`, and `count_steps`' as
    its `steps` where given."""
    ops = {ph: {p: sum(c.values()) for p, c in parts.items()} for ph, parts in found.items()}
    names = {ph: {p: dict(c) for p, c in parts.items()} for ph, parts in found.items()}
    out = {"ops": ops, "names": names}
    if steps is not None:
        out["steps"] = steps
    return out


def _labelled(label: str, fn: Callable) -> Callable:
    """`fn` under `torch.profiler.record_function(label)` inside a counted round (as it is elsewhere)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_state, "prof", None) is None:
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    wrapper.pr_counted = True
    return wrapper


def _counted_as_one(fn: Callable) -> Callable:
    fn.pr_counted = True
    return fn


def _counted_round(fn: Callable, path: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, batch, *args, **kwargs):
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False) \
                or getattr(_state, "prof", None) is not None:
            return fn(self, batch, *args, **kwargs)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        rids = [r.rid for r in batch.reqs]
        _state.prof = prof
        prof.start()
        try:
            return fn(self, batch, *args, **kwargs)
        finally:
            prof.stop()
            _state.prof = None
            events = prof.events()
            line = {"pid": os.getpid(), "batch": len(rids), "rids": rids,
                    **summarise(count_ops(events), count_steps(events))}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    wrapper.pr_counted = True
    return wrapper


def _wrap(cls, name: str, make: Callable) -> None:
    fn = cls.__dict__.get(name)
    if fn is not None and not getattr(fn, "pr_counted", False):
        setattr(cls, name, make(fn))


def install(path: Optional[str] = None) -> bool:
    """Wrap the round's methods and turn `op_parts`' labels on (see the module doc) when `path` or
    `$PR_EAGLE3_OP_COUNTS` names a file; once per process. Returns whether counting is on."""
    global _installed
    path = path or os.environ.get(ENV) or None
    if not path:
        return False
    if _installed:
        return True
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

    from pr_specforge.serving.drafter_runtime import DrafterRuntime
    from pr_specforge.sglang_plugin.rows import SGLangRows
    from pr_specforge.sglang_plugin.worker import PRDraftWorker

    _wrap(EAGLEWorkerV2, "forward_batch_generation", lambda fn: _counted_round(fn, path))
    _wrap(EAGLEWorkerV2, "verify", lambda fn: _labelled(PHASE + "verify", fn))
    _wrap(EagleDraftWorker, "draft", lambda fn: _labelled(PHASE + "draft", fn))
    _wrap(PRDraftWorker, "draft", lambda fn: _labelled(PHASE + "draft", fn))
    _wrap(EagleDraftWorker, "_draft_extend_for_decode", lambda fn: _labelled(PHASE + "extend", fn))
    _wrap(ModelRunner, "forward", lambda fn: _labelled(PART + "model", fn))
    _wrap(RadixAttention, "forward", lambda fn: _counted_as_one(stand_in("attention")(fn)))
    _wrap(DrafterRuntime, "forward_tree_rows", lambda fn: _labelled(PART + "model", fn))
    _wrap(SGLangRows, "forward_rows", lambda fn: _labelled(PART + "model", fn))
    for name in ("log_probs", "halt_probability", "readout_and_halt"):
        _wrap(DrafterRuntime, name, lambda fn: _labelled(PART + "readouts", fn))
    op_parts.enable()
    _installed = True
    return True
