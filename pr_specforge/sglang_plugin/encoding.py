"""A drafted PR tree as the input of SGLang's `build_tree_kernel_efficient` (`parent_list`, `top_scores_index`).

SGLang names a draft node by a score id `s`; `s // w` is its group (`w` = the kernel's `topk`),
group 0 holds the root's children, and `parent_list[g]` is the score id of the node whose children
group `g` holds. With `w = 2k` a PR tree fits: every kept node with kept children gets a group, its
one-pass children at offsets `0..k-1` of it, the children reconsideration proposed for it at
`k..2k-1` (a node halts once, so it has at most k of each). Groups are given in the kept order
(parents before children), so a parent's score id always precedes its children's group. The kernel
then builds mask, positions and child/sibling links from the ancestors these ids spell.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


def encode_tree(parents: Sequence[int], via_recon: Sequence[bool], k: int, width: int) -> Tuple[List[int], List[int]]:
    """`parents[j]` (kept index, -1 for the root at 0) and `via_recon[j]` of the kept nodes ->
    `(parent_list [width], score_ids [n - 1] of nodes 1..n-1)`; unused groups hold -1."""
    w = 2 * k
    parent_list = [-1] * width
    group = {0: 0}
    used = {}  # (group, reconsidered?) -> children placed so far
    score = [-1] * len(parents)
    for j in range(1, len(parents)):
        p = parents[j]
        if p not in group:
            g = len(group)
            if g >= width:
                raise ValueError(f"the tree needs more than {width} node groups")
            group[p] = g
            parent_list[g] = score[p]
        key = (group[p], bool(via_recon[j]))
        at = used.get(key, 0)
        if at >= k:
            raise ValueError(f"node {p} has more than k={k} {'reconsidered' if key[1] else 'one-pass'} children")
        used[key] = at + 1
        score[j] = group[p] * w + (k if key[1] else 0) + at
    return parent_list, score[1:]
