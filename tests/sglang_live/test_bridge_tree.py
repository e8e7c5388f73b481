"""The bridge's CPU tree builder and greedy verifier on a hand-made SGLang draft (no server)."""

import pytest
import torch

from pr_specforge.sglang_cpu.tree import InvalidDraftTree, build_tree, verify_tree_greedy


def _tree(sel, seq_len=2):
    # topk 2, 2 steps: score ids 0-1 are the root's children, 2-5 the children of frontier slots 1-2
    parent_list = torch.tensor([[-1, 0, 1]])
    return build_tree(torch.tensor([10]), parent_list, torch.tensor([sel]), torch.tensor([[11, 12, 13]]),
                      torch.tensor([seq_len]), seq_len, 2, 2, 4)


def test_mask_positions_and_links_follow_the_kept_nodes_ancestors():
    mask, pos, index, first_child, sibling, tokens = _tree([0, 1, 2])  # node 3 (score 2) is a child of node 1
    assert tokens.tolist() == [10, 11, 12, 13]
    tree = mask.view(4, 2 + 4)
    assert tree[:, :2].all()  # the prefix is visible to every node
    assert tree[:, 2:].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert pos.tolist() == [2, 3, 3, 4]
    assert index.tolist() == [[0, 1, 2, 3]]
    assert first_child.tolist() == [[1, 3, -1, -1]] and sibling.tolist() == [[-1, 2, -1, -1]]


def test_a_node_kept_without_its_parent_is_refused():
    with pytest.raises(InvalidDraftTree):
        _tree([1, 2, 3])  # score 2's parent (score 0) was cut


def test_greedy_verify_takes_the_matching_sibling_and_the_bonus_after_it():
    _, _, index, first_child, sibling, tokens = _tree([0, 1, 2])
    predicts = torch.zeros(4, dtype=torch.int32)
    accept = torch.full((1, 3), -1, dtype=torch.int32)
    count = torch.full((1,), -7, dtype=torch.int32)  # a sentinel the kernel must overwrite (never torch.empty's bytes)
    target = torch.tensor([[12, 99, 77, 98]])  # the target says 12 after the root (node 2), then 77
    verify_tree_greedy(predicts, accept, count, tokens.view(1, 4), index, first_child, sibling, target)
    assert accept.tolist() == [[0, 2, -1]] and count.tolist() == [1]
    assert predicts.tolist() == [12, 0, 77, 0]
