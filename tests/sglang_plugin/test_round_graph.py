"""The PR round as one captured graph (`sglang_plugin.round_graph`, `PR_EAGLE3_ROUND_GRAPH`) and the guard that checks
it on this CPU (`serving.host_reads.NoHostReads`): the guard refuses each operation a CUDA graph cannot capture and
lets the rest through; the batched round's body (root readouts, every step, Eq. 9, the cut, the packing) runs under
it for the issue's shapes, its trees unchanged; the CPU row attention's fixed-width plan is host-free where the eager
one is not, and attends the same; what each switch value means where; a capture that cannot happen runs eagerly.
The live server through the captured path's metadata: tests/sglang_live/test_live_pr_eagle3_triton.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest, RuntimeRows
from pr_specforge.serving.host_reads import HostReadError, NoHostReads, host_reads_allowed, to_device
from pr_specforge.sglang_plugin.round_graph import RoundGraphs, resolve_round_graph
from pr_specforge.sglang_plugin.row_attention import attend_lists, gather_plan, row_kv_lists
from tests.serving.test_serving_batched_tree import PROMPTS, SHAPES, requests
from tests.serving.test_serving_tree import eager_gate, models  # noqa: F401 (models: a fixture)

T = torch.arange(6.0).view(2, 3)
REFUSED = {
    "item": lambda: T.sum().item(),
    "int": lambda: int(T[0, 0]),
    "branch": lambda: bool(T.sum() > 0),
    "bool mask": lambda: T[T > 2],
    "nonzero": lambda: torch.nonzero(T),
    "masked_select": lambda: torch.masked_select(T, T > 1),
    "unique": lambda: torch.unique(T),
    "host list": lambda: torch.tensor([1, 2, 3]),
    "repeat_interleave": lambda: torch.repeat_interleave(T.long()[0]),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_guard_refuses_what_a_graph_cannot_capture(name):
    with pytest.raises(HostReadError, match="a CUDA graph cannot capture it") as e:
        with NoHostReads("a test body"):
            REFUSED[name]()
    assert str(e.value).startswith("a test body: aten.") and "\n" not in str(e.value)


READ_METHODS = {  # host reads that bypass the dispatcher: Tensor methods the guard's function mode refuses
    "tolist": lambda: T.tolist(),
    "numpy": lambda: T.numpy(),
    "cpu": lambda: T.cpu(),
    "__array__": lambda: __import__("numpy").asarray(T),
}


@pytest.mark.parametrize("name", READ_METHODS)
def test_the_guard_refuses_host_reads_that_bypass_the_dispatcher(name):
    with pytest.raises(HostReadError, match="a CUDA graph cannot capture it") as e:
        with NoHostReads("a test body"):
            READ_METHODS[name]()
    assert str(e.value).startswith(f"a test body: Tensor.{name} reads") and "\n" not in str(e.value)


def test_a_draft_guard_lets_host_data_in_and_refuses_reads_except_where_allowed():
    """`host_data=True` (the draft's round start, checked live by `PR_EAGLE3_CHECK_HOST_READS`): host values come in
    (`to_device`), reads are refused as waiting for the device, and a part inside `host_reads_allowed()` reads
    unchecked; the guard is back on after it, and off after the guard."""
    with NoHostReads("a draft", host_data=True):
        slots = to_device([1, 2], "cpu")
        for read in (lambda: slots.tolist(), lambda: int(slots[0]), lambda: slots[slots > 1]):
            with pytest.raises(HostReadError, match="^a draft: .*: the host would wait for the device$"):
                read()
        with host_reads_allowed():
            with host_reads_allowed():
                assert slots.tolist() == [1, 2]
            assert int(slots.sum()) == 3
        with pytest.raises(HostReadError):
            slots.tolist()
        with host_reads_allowed(), pytest.raises(HostReadError, match="^a body: "):
            with NoHostReads("a body"):  # a guard entered inside an allowed part checks (a capture's warm-up)
                slots.tolist()
    assert slots.tolist() == [1, 2]


def test_to_device_brings_host_values_as_torch_tensor_would_and_is_refused_inside_a_capture():
    """`to_device`, the round start's way to bring host values (request slots, a group's members) to the device
    without waiting for it: the values and dtype `torch.tensor` gives; host data all the same, so the guard refuses
    it inside a captured body."""
    slots = to_device([3, 0, 7], "cpu")
    assert slots.dtype == torch.long and slots.tolist() == [3, 0, 7]
    pads = to_device([False, True], torch.device("cpu"), torch.bool)
    assert pads.dtype == torch.bool and pads.tolist() == [False, True]
    assert to_device([[4], [9]], "cpu").shape == (2, 1)
    with pytest.raises(HostReadError, match="brings host data in"):
        with NoHostReads("a test body"):
            to_device([1, 2], "cpu")


def test_the_guard_lets_fixed_shape_device_work_through():
    t = T.clone()
    with NoHostReads():
        t[:, 0] = 0  # a Python number: a constant
        top = torch.topk(t, 2, dim=-1)
        order = torch.sort(t, dim=-1, descending=True, stable=True).indices
        t.scatter_(1, order[:, :1], 1.0)
        picked = t[torch.arange(2)[:, None], order]  # indexing by integer tensors
        rep = torch.repeat_interleave(torch.ones(3, dtype=torch.long), output_size=3)
    assert top.values.shape == (2, 2) and picked.shape == (2, 3) and rep.numel() == 3


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"k{c.k}w{c.bw}m{c.m}g{c.gamma}B{c.budget}")
@pytest.mark.parametrize("m0", [False, True], ids=["m>0", "m0"])
def test_the_batched_rounds_body_has_no_host_read_and_the_same_trees(models, cfg, m0):
    """What a capture records, run under the guard: every op of four requests' round, its trees those of the round
    run plainly (the guard only watches)."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = dataclasses.replace(cfg, m=0) if m0 else cfg

    class Guarded(RuntimeRows):
        def run(self, tb, size, body):
            with NoHostReads("the batched round"):
                return body()

    reqs = requests(pr, target, PROMPTS)

    def build(rows):
        batch = [BatchRequest(rt, root, feat, torch.Generator().manual_seed(s)) for rt, root, feat, s in reqs]
        return BatchedTreeBuilder(reqs[0][0], cfg, rows=rows).build(batch)

    plain, guarded = build(RuntimeRows()), build(Guarded())
    assert [(t.tokens(), t.parents(), t.recon_rows) for t in guarded] == [(t.tokens(), t.parents(), t.recon_rows)
                                                                         for t in plain]
    assert (sum(t.recon_rows for t in plain) > 0) != m0


def test_the_cpu_row_attentions_fixed_plan_is_host_free_and_attends_the_same():
    g = torch.Generator().manual_seed(0)
    b, p, c, r, h, hkv, d = 2, 3, 6, 5, 4, 2, 16
    ctx_slots = torch.randperm(40, generator=g)[: b * c].view(b, c)
    visible = torch.rand(b, p, r, generator=g) < 0.5
    visible[..., 0] = True
    indptr, indices = row_kv_lists(ctx_slots, torch.tensor([4, 6]), 40 + torch.arange(b * r).view(b, r), visible)
    q, kb, vb = torch.randn(b * p, h, d, generator=g), torch.randn(60, hkv, d, generator=g), torch.randn(60, hkv, d)
    with pytest.raises(HostReadError, match="_local_scalar_dense"):  # the eager plan reads its longest list
        with NoHostReads():
            gather_plan(indptr, indices)
    with NoHostReads():
        fixed = gather_plan(indptr, indices, fixed=True)
    assert fixed[0].shape == (b * p, c + r)
    torch.testing.assert_close(attend_lists(q, kb, vb, *fixed, d ** -0.5),
                               attend_lists(q, kb, vb, *gather_plan(indptr, indices), d ** -0.5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode,device,sizes,want", [
    ("auto", "cuda", [1, 2, 4], "capture"), ("auto", "cuda", None, "off"), ("auto", "cpu", [1, 2], "off"),
    ("on", "cuda", None, "capture"), ("on", "cpu", None, "guard"), ("off", "cuda", [1, 2], "off"),
])
def test_what_each_switch_value_means_where(mode, device, sizes, want):
    assert resolve_round_graph(mode, device, sizes) == want


def test_a_bad_switch_value_is_refused_in_one_line(monkeypatch):
    from pr_specforge.sglang_plugin.checks import PRServeError, check_round_graph

    monkeypatch.setenv("PR_EAGLE3_ROUND_GRAPH", "always")
    with pytest.raises(PRServeError, match=r"^PR_EAGLE3: PR_EAGLE3_ROUND_GRAPH='always' is not one of auto, off, on$"):
        check_round_graph()
    monkeypatch.setenv("PR_EAGLE3_ROUND_GRAPH", " ON ")
    assert check_round_graph() == "on"
    with pytest.raises(ValueError, match="kind 'off'"):
        RoundGraphs("off")


def graph_args(backend, bs) -> SimpleNamespace:
    """Server arguments with SGLang's decode graph config (`backend`, sizes `bs`), as `round_graph` reads them."""
    return SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend=backend, bs=bs)))


def test_sglangs_decode_graph_sizes_decide_auto():
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from pr_specforge.sglang_plugin.round_graph import decode_graphs

    assert decode_graphs(graph_args(Backend.FULL, [4, 1, 2])) == [1, 2, 4]
    assert decode_graphs(graph_args(Backend.DISABLED, [1, 2])) is None and decode_graphs(SimpleNamespace()) is None


def test_a_captured_rounds_batch_is_padded_to_sglangs_graph_sizes():
    """Captured: SGLang's decode graph sizes; guarded: those it would capture (set with its graphs off too); a batch
    goes to the smallest that holds it, and stays as it is past the largest (it runs eagerly) or without sizes."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from pr_specforge.sglang_plugin.round_graph import padded_size, round_sizes

    assert round_sizes(graph_args(Backend.FULL, [8, 2, 4]), "capture") == [2, 4, 8]
    assert round_sizes(graph_args(Backend.DISABLED, [8, 2]), "capture") is None
    assert round_sizes(graph_args(Backend.DISABLED, [8, 2]), "guard") == [2, 8]
    assert round_sizes(SimpleNamespace(), "guard") is None
    assert [padded_size(n, [2, 4, 8]) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, 9]
    assert padded_size(3, None) == 3


def test_a_round_that_cannot_be_captured_runs_eagerly_once_logged(caplog):
    """On this CPU a capture fails where CUDA is needed: the round runs eagerly, one warning line, no retry."""
    graphs, calls = RoundGraphs("capture"), []

    def body():
        calls.append(1)
        return (torch.ones(2), torch.zeros(1))

    with caplog.at_level(logging.WARNING, logger="pr_specforge.sglang_plugin.round_graph"):
        first, second = graphs.run("B_w 2, m 1, batch 1", body), graphs.run("B_w 2, m 1, batch 1", body)
    assert torch.equal(first[0], torch.ones(2)) and torch.equal(second[0], torch.ones(2)) and len(calls) == 2
    assert graphs.last == "eager" and graphs.graphs == {"B_w 2, m 1, batch 1": None}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "runs eagerly, its capture failed" in warnings[0] and "\n" not in warnings[0]


def test_a_captured_rounds_context_width_is_a_power_of_two_bucket_within_the_table():
    """A captured round's lists are `rows x (width + tree rows)` entries: the width follows the longest context in
    powers of two (one graph per bucket), never the whole table's width unless the context needs it."""
    from pr_specforge.sglang_plugin.rows import context_bucket

    assert [context_bucket(n, 131072) for n in (0, 1, 128, 129, 1000, 4096, 4097)] == [128, 128, 128, 256, 1024,
                                                                                         4096, 8192]
    assert context_bucket(5000, 4608) == 4608 and context_bucket(10, 64) == 64
