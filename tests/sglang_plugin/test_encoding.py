"""PR trees (our tensor builder) through the 2k-wide encoding into SGLang's `build_tree` contract (the CPU
bridge's implementation of it): every node's token, position, ancestors and parent come back unchanged.
No server; the issue's three shapes plus a tight one, gates that reconsider a lot and a little."""

import pytest
import torch

from pr_specforge.serving import TensorTreeBuilder
from pr_specforge.sglang_cpu.tree import build_tree
from pr_specforge.sglang_plugin.checks import PRServeShape
from pr_specforge.sglang_plugin.encoding import encode_tree
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)

SHAPES = [PRServeShape(k=2, bw=2, m=1, gamma=3, budget=6), PRServeShape(k=4, bw=4, m=2, gamma=4, budget=16),
          PRServeShape(k=6, bw=6, m=3, gamma=8, budget=48), PRServeShape(k=3, bw=6, m=3, gamma=4, budget=12)]


def through_sglang(tree, shape: PRServeShape, seq_len: int):
    """The kept tree as SGLang's verify sees it: (tokens, positions, mask, parent) in SGLang's node order,
    and `order[i]` = the kept index of SGLang's node i."""
    width = shape.parent_width()
    parents, scores = encode_tree(tree.parents(), tree.via_recon_list, shape.k, width)
    order = sorted(range(shape.budget), key=scores.__getitem__)
    toks = tree.tokens()
    mask, pos, _, first, sib, tokens = build_tree(
        torch.tensor([toks[0]]), torch.tensor([parents]), torch.tensor([[scores[i] for i in order]]),
        torch.tensor([[toks[i + 1] for i in order]]), torch.tensor([seq_len]), seq_len, 2 * shape.k,
        shape.kernel_steps(), shape.budget + 1)
    n = shape.budget + 1
    parent = [-1] * n
    for node in range(n):  # walk the child / sibling links
        child = int(first[0, node])
        while child != -1:
            parent[child] = node
            child = int(sib[0, child])
    return tokens.tolist(), pos.tolist(), mask.view(n, seq_len + n)[:, seq_len:], parent, [0] + [i + 1 for i in order]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"k{s.k}w{s.bw}m{s.m}g{s.gamma}B{s.budget}")
def test_a_pr_tree_survives_the_encoding_node_for_node(models, shape):
    target, _, pr = models
    recon = 0
    for bias, seed in ((-2.0, 0), (0.0, 1), (-2.0, 2)):
        eager_gate(pr, bias)
        rt, root, feat = primed_runtime(pr, target)
        tree = TensorTreeBuilder(rt, shape.tree_config()).build(root, feat, torch.Generator().manual_seed(seed))
        assert len(tree.tokens()) == shape.budget + 1
        tokens, pos, mask, parent, kept = through_sglang(tree, shape, seq_len=rt.length)
        assert tokens == [tree.tokens()[j] for j in kept]
        assert pos == [rt.length + tree.depths()[j] for j in kept]
        assert torch.equal(mask.bool(), tree.tree_mask()[kept][:, kept].bool())
        assert [kept[p] if p >= 0 else -1 for p in parent] == [tree.parents()[j] for j in kept]
        recon += tree.recon_kept
    if shape.budget >= 12:  # the tight k 2, B 6 cut keeps none of them with these drafters
        assert recon > 0, "some reconsidered node should be kept, or the k..2k-1 offsets go untested"


def test_the_guaranteed_node_count_is_a_lower_bound_and_refuses_short_shapes():
    from pr_specforge.sglang_plugin.checks import PRServeError, check_shape

    assert PRServeShape(k=2, bw=2, m=1, gamma=3, budget=6).guaranteed_nodes() == 2 + 4 + 4
    assert PRServeShape(k=2, bw=4, m=0, gamma=3, budget=6).guaranteed_nodes() == 2 + 4 + 8  # frontier 2 then 4
    check_shape(PRServeShape(k=2, bw=2, m=1, gamma=3, budget=10))
    with pytest.raises(PRServeError, match="holds only 10 nodes for sure, fewer than B=11"):
        check_shape(PRServeShape(k=2, bw=2, m=1, gamma=3, budget=11))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"k{s.k}w{s.bw}m{s.m}g{s.gamma}B{s.budget}")
def test_the_device_encoding_of_a_batch_equals_the_host_encoding_of_each_tree(models, shape):
    """`encode_packed` (the `sglang` row path: every request's packed round at once, on its device, no host read)
    gives each request the `encode_tree` input the host path gives, and its check passes, and `round_counts` its
    tree's counters; a round short of B nodes,
    or a node with too many children of a kind, is refused as on the host."""
    from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest
    from pr_specforge.serving.host_reads import NoHostReads
    from pr_specforge.serving.tensor_tree import PACKED_ROWS, packed_nodes
    from pr_specforge.sglang_plugin.encoding import check_encoded, encode_packed, round_counts

    target, _, pr = models
    width = shape.parent_width()
    recon = 0
    for bias in (-2.0, 0.0):
        eager_gate(pr, bias)
        runs = [primed_runtime(pr, target, n=n, seed=s) for n, s in ((5, 1), (9, 2), (13, 3))]
        builder = BatchedTreeBuilder(runs[0][0], shape.tree_config())
        packed, kept = builder.build_packed([BatchRequest(rt, root, feat, torch.Generator().manual_seed(7 + i))
                                             for i, (rt, root, feat) in enumerate(runs)])
        with NoHostReads("encode_packed"):
            parent_list, ids, tokens, check = encode_packed(packed, shape.budget, shape.k, width)
        trees = builder.unpack(packed, kept, [rt.length for rt, _, _ in runs])
        for b, tree in enumerate(trees):
            parents, scores = encode_tree(tree.parents(), tree.via_recon_list, shape.k, width)
            order = sorted(range(shape.budget), key=scores.__getitem__)
            assert parent_list[b].tolist() == parents
            assert ids[b].tolist() == [scores[i] for i in order]
            assert tokens[b].tolist() == [tree.tokens()[i + 1] for i in order]
            check_encoded(check[b].tolist(), shape.budget, shape.k, width)
            assert round_counts(packed, shape.budget, shape.k)[b].tolist() == [tree.recon_rows, tree.recon_kept,
                                                                               tree.repriced_kept]
            recon += tree.recon_kept
    if shape.budget >= 12:
        assert recon > 0
    short = packed.clone()
    packed_nodes(short, shape.budget)[0, PACKED_ROWS.index("ok"), -1] = 0
    with pytest.raises(RuntimeError, match=f"a round kept {shape.budget - 1} nodes, not B={shape.budget}"):
        check_encoded(encode_packed(short, shape.budget, shape.k, width)[3][0].tolist(), shape.budget, shape.k, width)
    crowded = packed.clone()
    nodes = packed_nodes(crowded, shape.budget)[0]
    nodes[PACKED_ROWS.index("parent"), 1:] = 0  # every node a one-pass child of the root
    nodes[PACKED_ROWS.index("via"), 1:] = 0
    with pytest.raises(ValueError, match=f"more than k={shape.k} children of one kind"):
        check_encoded(encode_packed(crowded, shape.budget, shape.k, width)[3][0].tolist(), shape.budget, shape.k, width)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"k{s.k}w{s.bw}m{s.m}g{s.gamma}B{s.budget}")
def test_the_round_log_reads_a_verify_inputs_trees_back_node_for_node(models, shape):
    """`trees_of_verify` (the round log of a round SGLang's own draft made) inverts `build_tree`: every node's token
    and parent, in SGLang's node order, for a batch of two requests."""
    from pr_specforge.sglang_plugin.encoding import trees_of_verify

    target, _, pr = models
    width, n = shape.parent_width(), shape.budget + 1
    built, expected = [], []
    for bias, seed in ((-2.0, 0), (0.0, 1)):
        eager_gate(pr, bias)
        rt, root, feat = primed_runtime(pr, target)
        tree = TensorTreeBuilder(rt, shape.tree_config()).build(root, feat, torch.Generator().manual_seed(seed))
        parents, scores = encode_tree(tree.parents(), tree.via_recon_list, shape.k, width)
        order = sorted(range(shape.budget), key=scores.__getitem__)
        toks = tree.tokens()
        built.append((toks[0], parents, [scores[i] for i in order], [toks[i + 1] for i in order], rt.length))
        kept = [0] + [i + 1 for i in order]  # SGLang's node i is kept node kept[i]
        at = {j: i for i, j in enumerate(kept)}
        expected.append(([toks[j] for j in kept], [-1] + [at[tree.parents()[j]] for j in kept[1:]]))
    bonus, parent_list, score_ids, drafts, lens = (torch.tensor(list(col)) for col in zip(*built))
    _, _, _, first, sib, tokens = build_tree(bonus, parent_list, score_ids, drafts, lens, int(lens.sum()), 2 * shape.k,
                                             shape.kernel_steps(), n)
    assert trees_of_verify(tokens, first, sib, n) == expected


def test_a_verify_input_whose_links_reach_a_node_twice_or_never_is_refused():
    from pr_specforge.sglang_plugin.encoding import trees_of_verify

    tokens = torch.arange(3)
    with pytest.raises(ValueError, match="no link reaches"):
        trees_of_verify(tokens, torch.tensor([1, -1, -1]), torch.tensor([-1, -1, -1]), 3)
    with pytest.raises(ValueError, match="linked twice"):
        trees_of_verify(tokens, torch.tensor([1, 2, -1]), torch.tensor([-1, 2, -1]), 3)
