"""`benchmarks/draft_cost.py`'s breakdown on tiny drafters: the model calls' time and the bookkeeping add up
to the round, the op counts see the tensor builder's one host read and the object tree's many, and the
rows probe times every row count it is asked for."""

import pytest
import torch

from pr_specforge.serving import TreeConfig
from tests.helpers import load_benchmark
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("draft_cost")


def test_breakdown_ops_and_rows_probe(bench, models):
    target, eagle, pr = models
    eager_gate(pr, -2.0)
    cfg = TreeConfig(budget=12, k=3, bw=3, gamma=4, m=2)
    from tests.modeling.test_two_layer import two_layer_drafter

    two = two_layer_drafter()[1]
    runtimes = {name: primed_runtime(d, target)[0::2] for name, d in (("eagle", eagle), ("pr", pr), ("eagle2", two))}
    root = primed_runtime(pr, target)[1]
    fns = {(b, v): bench.round_fn(b, runtimes[kw["drafter"]][0], cfg, kw["coforward"], root, runtimes[kw["drafter"]][1])
           for b in bench.BUILDERS for v, kw in bench.VARIANTS.items()}
    sync, clock = (lambda: None), __import__("time").perf_counter
    times = bench.breakdown(fns, runtimes, 2, sync, clock)
    assert set(times) == {f"{b}/{v}" for b in bench.BUILDERS for v in bench.VARIANTS}
    for t in times.values():
        assert t["model_s"] > 0 and t["bookkeeping_s"] > 0
        assert t["model_s"] + t["bookkeeping_s"] == pytest.approx(t["round_s"])
        assert t["model_s"] == pytest.approx(sum(t["model_s_by_call"].values()))
    assert "reconsideration_inputs" in times["tensor/pr_coforward"]["model_s_by_call"]
    assert "reconsideration_inputs" not in times["tensor/eagle"]["model_s_by_call"]
    for name, (rt, _) in runtimes.items():  # the wrappers are gone
        assert all(m not in vars(rt) for m in bench.MODEL_CALLS), name
    ops = bench.op_counts(fns, runtimes)
    assert ops["tensor/pr_coforward"]["item_reads"] <= 1 < ops["object/pr_coforward"]["item_reads"]
    # the root's readout with the gate, then per step: embedding, self-query, ONE call of M, one readout with the gate
    assert ops["tensor/pr_coforward"]["model_calls"] == 1 + 4 * (cfg.gamma - 1)
    assert ops["tensor/pr_serial"]["model_calls"] == 1 + 5 * (cfg.gamma - 1)
    rows = bench.rows_cost(runtimes["pr"][0], [3, 5], 2, sync, clock)
    assert set(rows) == {"3", "5"} and all(r["layer"] > 0 and r["readout"] > 0 for r in rows.values())
