"""The op counter's rules (`pr_specforge.sglang_plugin.op_counts`) on a real profile of real torch ops, and the part
labels (`pr_specforge.op_parts`): nothing at all while counting is off, labels under the profiler when on.
(The counter inside live servers: tests/sglang_live/test_live_op_counts.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pr_specforge import op_parts
from pr_specforge.serving.host_reads import NoHostReads
from pr_specforge.sglang_plugin.op_counts import count_ops, count_steps, summarise


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@op_parts.stand_in("build_tree")
def _looping_stand_in(x):
    return [row.cumsum(0) for row in x]


def test_a_stand_in_runs_as_it_is_while_counting_is_off():
    x = torch.ones(2, 3)
    with _Seen() as seen:
        out = _looping_stand_in(x)
    assert [o.tolist() for o in out] == [[1.0, 2.0, 3.0]] * 2 and seen.ops.count("aten.cumsum.default") == 2


@pytest.fixture
def labels_on():
    op_parts.enable()
    yield
    op_parts.enable(False)


def test_a_part_label_is_nothing_while_counting_is_off():
    assert not op_parts.enabled() and op_parts.part("bids") is op_parts.part("pool")  # one shared no-op context
    x = torch.ones(3)
    with _Seen() as seen, NoHostReads("a labelled round"):
        with op_parts.part("bids"):
            x.add_(1)
    assert seen.ops == ["aten.add_.Tensor"]  # the label dispatched nothing of its own


def test_each_outermost_working_op_counts_once_under_its_innermost_part_and_its_phase(labels_on):
    x = torch.arange(12.0).reshape(3, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(op_parts.PHASE + "draft"):
            torch.matmul(x, x.T)  # one op: aten::matmul (its aten::mm inside is not counted again)
            with op_parts.part("bids"):
                torch.zeros(3)  # its fill inside: one op
                x.to(torch.float64)  # a copy: one op
                x.to(torch.float32)  # nothing to do: no op
                x[:, 1:].reshape(-1)  # a slice is a view; the reshape of a non-contiguous view copies: one op
                x.view(-1)  # a view: no op
                x.new_empty(3), torch.empty_like(x)  # allocations alone: no op
                with op_parts.part("pool"):
                    torch.topk(x, 2, dim=-1)
                    x.sum().item()  # the sum, and the host read (a device-to-host copy on a GPU)
            with op_parts.part("encoding"):
                _looping_stand_in(x)  # a host stand-in of one device kernel: one op, whatever it loops over
        x + 1  # outside any phase
    found = summarise(count_ops(prof.events()))
    assert found["ops"] == {"draft": {"other": 1, "bids": 3, "pool": 3, "encoding": 1}, "other": {"other": 1}}
    assert found["names"]["draft"]["encoding"] == {"kernel:build_tree": 1}
    assert found["names"]["draft"]["bids"] == {"aten::zeros": 1, "aten::to": 1, "aten::reshape": 1}
    assert found["names"]["draft"]["pool"] == {"aten::topk": 1, "aten::sum": 1, "aten::item": 1}
    assert found["names"]["draft"]["other"] == {"aten::matmul": 1}


def test_ops_inside_row_steps_are_counted_apart_from_the_rounds_own(labels_on):
    """`op_parts.step` scopes: per phase, how many row steps ran and the ops inside them, in all and by part; the
    phase's other ops are the round's own (a round's ops over gamma would mix the two)."""
    assert op_parts.step() is not op_parts.part("x")
    x = torch.arange(12.0).reshape(3, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(op_parts.PHASE + "draft"):
            with op_parts.part("load"):
                x.clone()  # once a round
            for _ in range(3):
                with op_parts.step():
                    x.add(1)  # unlabelled, inside the step
                    with op_parts.part("bids"):
                        torch.sort(x, dim=-1)
                        x.new_empty(2)  # an allocation: no op, in or out of a step
            with op_parts.part("cut"):
                torch.topk(x, 2)  # once a round
        with torch.profiler.record_function(op_parts.PHASE + "verify"):
            x.mul(2)  # a phase without step scopes
    events = prof.events()
    steps = count_steps(events)
    assert steps == {"draft": {"steps": 3, "ops": 6, "parts": {"other": 3, "bids": 3}}}
    found = count_ops(events)
    total = sum(sum(c.values()) for c in found["draft"].values())
    assert total - steps["draft"]["ops"] == 2  # the load's clone and the cut's top-k: the round's own
    assert summarise(found, steps)["steps"] == steps and "steps" not in summarise(found)


def test_the_step_label_is_nothing_while_counting_is_off():
    assert not op_parts.enabled() and op_parts.step() is op_parts.part("bids")  # the shared no-op context
