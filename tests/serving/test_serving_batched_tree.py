"""The batched tree builder against the per-request one: the same trees bit for bit (fp32), whatever the
batch holds, with requests joining and leaving between rounds, and one host read per round for the batch."""

import dataclasses

import pytest
import torch

from pr_specforge.serving import SpeculativeDecoder, TensorTreeBuilder, TreeConfig
from pr_specforge.serving import batched_tree
from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest
from pr_specforge.serving.drafter_runtime import readouts_row_invariant
from tests.helpers import load_benchmark
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)

SHAPES = [  # (k, B_w, m, gamma, B) of the issue
    TreeConfig(budget=6, k=2, bw=2, m=1, gamma=3),
    TreeConfig(budget=16, k=4, bw=4, m=2, gamma=4),
    TreeConfig(budget=48, k=6, bw=6, m=3, gamma=8),  # the paper's
]
PROMPTS = [(5, 1), (9, 2), (13, 3), (7, 4)]  # (context rows, seed): four requests of different lengths


def assert_bitwise(ref, got):
    """Every field of the round (tokens, parents, scores, children order, one-pass proposals, counters), the mask
    and every node tensor of `state` exactly equal."""
    assert dataclasses.replace(got, mask=None, state=None) == dataclasses.replace(ref, mask=None, state=None)
    assert torch.equal(got.mask, ref.mask)
    assert got.state.keys() == ref.state.keys()
    for name, t in ref.state.items():
        assert torch.equal(got.state[name], t), name


def assert_same_trees(ref, got):
    """The same round but for the last bits of its scores (readouts whose kernel depends on the call's row count)."""
    assert (got.tokens(), got.parents(), got.recon_rows, got.recon_kept) == (ref.tokens(), ref.parents(),
                                                                                ref.recon_rows, ref.recon_kept)
    torch.testing.assert_close(got.state["score"], ref.state["score"], rtol=1e-6, atol=1e-6)


def requests(drafter, target, prompts, seed0=10):
    out = []
    for i, (n, seed) in enumerate(prompts):
        rt, root, feat = primed_runtime(drafter, target, n=n, seed=seed)
        out.append((rt, root, feat, seed0 + i))
    return out


def per_request(reqs, cfg, coforward=True):
    return [TensorTreeBuilder(rt, cfg, coforward).build(root, feat, torch.Generator().manual_seed(s), keep_state=True)
            for rt, root, feat, s in reqs]


def batched(builder, reqs):
    return builder.build([BatchRequest(rt, root, feat, torch.Generator().manual_seed(s)) for rt, root, feat, s in reqs],
                         keep_state=True)


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"k{c.k}w{c.bw}m{c.m}g{c.gamma}B{c.budget}")
@pytest.mark.parametrize("reconsider", [True, False], ids=["m>0", "m0"])
@pytest.mark.parametrize("readouts", batched_tree.READOUTS)
def test_batched_tree_equals_the_per_request_trees(models, cfg, reconsider, readouts):
    """Batches of 4 and of 1 (different prompts and lengths), gates that open: bit for bit the per-request trees,
    the readouts read request by request, or in one call for the batch where this machine's probe says a row's
    readout does not depend on its call (elsewhere: the same trees, scores within float rounding)."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = cfg if reconsider else dataclasses.replace(cfg, m=0)
    reqs = requests(pr, target, PROMPTS)
    refs = per_request(reqs, cfg)
    builder = BatchedTreeBuilder(reqs[0][0], cfg, rows=batched_tree.RuntimeRows(readouts))
    same = assert_bitwise if readouts == "request" or readouts_row_invariant(reqs[0][0]) else assert_same_trees
    for ref, got in zip(refs, batched(builder, reqs)):
        same(ref, got)
    for i in (0, 2):  # alone in the batch: the same tree again
        same(refs[i], batched(builder, reqs[i : i + 1])[0])
    if reconsider:  # reconsidered nodes survive the cut, so the equality covers Eq. 9 and new children
        assert all(t.recon_rows > 0 for t in refs) and sum(t.recon_kept for t in refs) > 0
        assert sum(t.repriced_kept for t in refs) > sum(t.recon_kept for t in refs)
    else:
        assert all(t.recon_rows == 0 for t in refs)


def test_eagle_drafter_and_the_serial_baseline(models):
    """An EAGLE-3 drafter (no pool), and a PR drafter whose carried rows run in their own call of M."""
    target, eagle, pr = models
    eager_gate(pr, -2.0)
    cfg = SHAPES[1]
    for drafter, coforward in ((eagle, True), (pr, False)):
        reqs = requests(drafter, target, PROMPTS[:3])
        got = batched(BatchedTreeBuilder(reqs[0][0], cfg, coforward=coforward), reqs)
        for ref, tree in zip(per_request(reqs, cfg, coforward), got):
            assert_bitwise(ref, tree)


def test_requests_join_and_leave_between_rounds(models):
    """Four requests, each with its own generator and context, over four rounds of changing batches: each tree is the
    one its request's own per-request builder drafts in that round."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = SHAPES[1]
    reqs = requests(pr, target, PROMPTS)
    builder = BatchedTreeBuilder(reqs[0][0], cfg)
    gens = [torch.Generator().manual_seed(s) for *_, s in reqs]  # the batched side's, carried across rounds
    ref_gens = [torch.Generator().manual_seed(s) for *_, s in reqs]
    ref_builders = [TensorTreeBuilder(rt, cfg) for rt, *_ in reqs]
    roots = [(root, feat) for _, root, feat, _ in reqs]
    g = torch.Generator().manual_seed(7)
    recon_kept = 0
    for batch in ([0, 1], [2, 0, 1], [1, 2], [3], [3, 1, 0, 2]):  # 2 joins, 0 leaves, 3 joins alone, all together
        refs = [ref_builders[i].build(*roots[i], ref_gens[i], keep_state=True) for i in batch]
        got = builder.build([BatchRequest(reqs[i][0], *roots[i], gens[i]) for i in batch], keep_state=True)
        for ref, tree in zip(refs, got):
            assert_bitwise(ref, tree)
            recon_kept += tree.recon_kept
        for i in batch:  # commit a few rows: contexts grow by different amounts, as after verification
            rt, n = reqs[i][0], 1 + i % 3
            aux = torch.randn(n, 3 * target.config.hidden_size, generator=g)
            toks = torch.randint(1, target.config.vocab_size, (n,), generator=g)
            roots[i] = (int(toks[-1]), rt.extend(aux, toks)[-1])
    assert recon_kept > 0 and sorted(builder._batches) == [1, 2, 3, 4]  # one buffer set per batch size


def test_one_host_read_per_round_for_the_whole_batch(models, monkeypatch):
    """Nothing is read back on the host (item, tolist, bool, int, float, index, cpu, numpy) before the batch's one copy."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    reqs = requests(pr, target, PROMPTS)
    builder = BatchedTreeBuilder(reqs[0][0], SHAPES[2])
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    seen = []
    real_unpack = batched_tree.unpack_round
    monkeypatch.setattr(batched_tree, "unpack_round", lambda *a: seen.append(list(reads)) or real_unpack(*a))
    for rnd in (1, 2):
        seen.clear()
        reads.clear()
        trees = builder.build([BatchRequest(rt, root, feat, torch.Generator().manual_seed(s)) for rt, root, feat, s in reqs])
        assert seen[0] == ["cpu"] and len(seen) == len(reqs)  # the copy, then host-side unpacking only
        assert builder.host_reads == rnd and all(t.recon_rows > 0 for t in trees)


@pytest.mark.parametrize("n", [1, 4])
def test_a_counted_round_labels_each_of_its_row_steps(models, n):
    """Under the op counter (`op_parts` on, the torch profiler), a round runs gamma - 1 row-step scopes, one per step
    after the root, and every draft op is inside one or is the round's own (load, root, cut, pack)."""
    from pr_specforge import op_parts
    from pr_specforge.sglang_plugin.op_counts import count_ops, count_steps

    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = SHAPES[1]
    reqs = requests(pr, target, PROMPTS[:n])
    builder = BatchedTreeBuilder(reqs[0][0], cfg)
    op_parts.enable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function(op_parts.PHASE + "draft"):
                builder.build_packed([BatchRequest(rt, root, feat, torch.Generator().manual_seed(s))
                                      for rt, root, feat, s in reqs])
    finally:
        op_parts.enable(False)
    events = prof.events()
    steps = count_steps(events)["draft"]
    parts = {p: sum(c.values()) for p, c in count_ops(events)["draft"].items()}
    assert steps["steps"] == cfg.gamma - 1
    assert 0 < steps["ops"] < sum(parts.values())  # the rest: once a round
    assert all(steps["parts"].get(p, 0) <= parts[p] for p in steps["parts"])
    for p in ("load", "cut", "pack"):  # made once a round, outside every step
        assert parts[p] > 0 and p not in steps["parts"]
    for p in ("frontier", "bids", "repricing"):  # made in every row step
        assert steps["parts"][p] == parts[p] and parts[p] % (cfg.gamma - 1) == 0


def test_bad_batches(models):
    target, eagle, pr = models
    rt, root, feat = primed_runtime(pr, target)
    builder = BatchedTreeBuilder(rt, SHAPES[0])
    assert builder.build([]) == []
    other, root2, feat2 = primed_runtime(eagle, target)
    with pytest.raises(ValueError, match="request 1: its runtime wraps another drafter"):
        builder.build([BatchRequest(rt, root, feat), BatchRequest(other, root2, feat2)])
    empty = type(rt)(pr, target)
    with pytest.raises(ValueError, match="request 0: the drafter context is empty"):
        builder.build([BatchRequest(empty, root, feat)])


def test_the_benchmark_script_runs_and_checks_its_trees(tmp_path):
    """`benchmarks/batched_tree.py` at a tiny size (a smoke check, no cost): the table, the JSON, one host read for
    the batch, the same trees both ways."""
    import json

    bench = load_benchmark("batched_tree")
    out = tmp_path / "bt.json"
    argv = ["--drafter", "tiny", "--shapes", "small", "--requests", "1", "3", "--context", "8", "--repeats", "1",
            "--warmup", "0", "--json", str(out), "--md", str(tmp_path / "bt.md")]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["requests"] for r in rows] == [1, 3] and all(r["equal"] and r["recon_rows_per_round"] > 0 for r in rows)
    assert [r["host_reads_per_round"] for r in rows] == [{"per_request": 1, "batched": 1}, {"per_request": 3, "batched": 1}]
    assert "| small (2, 2, 1, 3, 6) | 3 |" in (tmp_path / "bt.md").read_text()
    assert bench.main(argv[:-4] + ["--requests", "0"]) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_many_decodes_each_prompt_as_generate_does(models, temperature):
    """Three prompts of different lengths decoded together (trees drafted as one batch, sequences leaving as they
    finish): each result is `generate`'s for that prompt and seed, round for round."""
    target, _, pr = models
    eager_gate(pr, -2.0)
    dec = SpeculativeDecoder(target, pr, SHAPES[1])
    prompts, seeds, limits = [[5, 17, 33, 2, 9], [4, 8], [60, 3, 3, 71, 12, 40, 9, 1]], [3, 0, 5], [20, 7, 13]
    many = dec.generate_many(prompts, limits, temperature=temperature, seeds=seeds)
    for prompt, seed, limit, got in zip(prompts, seeds, limits, many):
        ref = dec.generate(prompt, limit, temperature=temperature, seed=seed)
        assert (got.tokens, got.accept_lengths, got.tree_sizes, got.diagnostics) == (
            ref.tokens, ref.accept_lengths, ref.tree_sizes, ref.diagnostics)
        assert (got.recon_rows, got.recon_kept, got.repriced_kept) == (ref.recon_rows, ref.recon_kept, ref.repriced_kept)
    assert len({r.rounds for r in many}) > 1 and sum(r.recon_kept for r in many) > 0  # they leave at different rounds
    assert dec.batch_builder.host_reads == max(r.rounds for r in many)  # one host read per round for the batch
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        dec.generate_many(prompts[:2], 4, seeds=[0])
    with pytest.raises(ValueError, match="2 prompts but 3 max_new_tokens"):
        dec.generate_many(prompts[:2], limits)
    with pytest.raises(ValueError, match="batched tensor builder"):
        SpeculativeDecoder(target, pr, SHAPES[1], tree_builder="object").generate_many(prompts, 4)


def test_the_readouts_are_batched_by_default_and_a_bad_mode_is_refused():
    assert batched_tree.RuntimeRows().readouts == "batched"
    with pytest.raises(ValueError, match="readouts='grouped' is not one of batched, request$"):
        batched_tree.RuntimeRows("grouped")
