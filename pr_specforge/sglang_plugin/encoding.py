"""A drafted PR tree as the input of SGLang's `build_tree_kernel_efficient` (`parent_list`, `top_scores_index`).

SGLang names a draft node by a score id `s`; `s // w` is its group (`w` = the kernel's `topk`),
group 0 holds the root's children, and `parent_list[g]` is the score id of the node whose children
group `g` holds. With `w = 2k` a PR tree fits: every kept node with kept children gets a group, its
one-pass children at offsets `0..k-1` of it, the children reconsideration proposed for it at
`k..2k-1` (a node halts once, so it has at most k of each). Groups are given in the kept order
(parents before children), so a parent's score id always precedes its children's group. The kernel
then builds mask, positions and child/sibling links from the ancestors these ids spell.

`encode_tree` encodes one tree on the host (the `ours` row path); `encode_packed` the same for every request's
packed round at once on its device (the `sglang` row path: no Python per request, no host read).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from pr_specforge.serving.tensor_tree import PACKED_ROWS, packed_counts, packed_nodes


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


def encode_packed(packed: torch.Tensor, budget: int, k: int, width: int):
    """`encode_tree` for a batch of packed rounds on their device, no host read (`serving.tensor_tree.packed_nodes`):
    `packed [b, L]` -> `(parent_list [b, width], top_scores_index [b, B], draft_tokens [b, B], check [b, 3])`, the
    verify input's three tensors with the nodes in score-id order (as the worker's host path sorts them), and per
    request `(kept nodes, node groups used, most children of one kind under one node)`: `check_encoded` refuses a
    round that `encode_tree` would refuse, once the check is on the host."""
    nodes = packed_nodes(packed, budget)
    ok, token = nodes[:, PACKED_ROWS.index("ok")].bool(), nodes[:, PACKED_ROWS.index("token")]
    parent, via = nodes[:, PACKED_ROWS.index("parent")], nodes[:, PACKED_ROWS.index("via")]
    b, n = ok.shape
    j = torch.arange(n, device=packed.device)
    child = ok & (j > 0)
    par = torch.where(child, parent, n)  # column n: no parent
    first = torch.full((b, n + 1), n, dtype=torch.long, device=packed.device)
    first.scatter_reduce_(1, par, j.expand(b, n), "amin")  # each node's first child, in kept order
    first = first[:, :n]
    has = first < n
    # a node's group: the nodes with children whose first child comes before its own (the root's is node 1: group 0)
    group = ((first[:, None, :] < first[:, :, None]) & has[:, None, :]).sum(-1)
    same = (par[:, :, None] == par[:, None, :]) & (via[:, :, None] == via[:, None, :]) & child[:, None, :]
    at = (same & (j[None, :] < j[:, None])).sum(-1)  # earlier siblings of the same kind
    score = torch.where(child, group.gather(1, par.clamp(max=n - 1)) * (2 * k) + via * k + at, -1)
    parent_list = torch.full((b, width + 1), -1, dtype=torch.long, device=packed.device)
    parent_list.scatter_(1, torch.where(has, group.clamp(max=width), width), score)  # column `width`: discarded
    ids = score[:, 1:]
    order = torch.sort(ids, dim=-1).indices
    check = torch.stack([ok.sum(1), has.sum(1), torch.where(child, at + 1, 0).max(1).values], 1)
    return parent_list[:, :width], ids.gather(1, order), token[:, 1:].gather(1, order), check


def round_counts(packed: torch.Tensor, budget: int, k: int) -> torch.Tensor:
    """Per packed round, on its device: `[b, 3]` = reconsideration rows forwarded, kept nodes proposed by
    reconsideration, kept nodes repriced by Eq. 9 (a `TensorDraftTree`'s `recon_rows`, `recon_kept`, `repriced_kept`)."""
    nodes = packed_nodes(packed, budget)
    ok = nodes[:, PACKED_ROWS.index("ok")]
    counts = packed_counts(packed, budget, k)
    via, repriced = nodes[:, PACKED_ROWS.index("via")], nodes[:, PACKED_ROWS.index("repriced")]
    return torch.stack([counts[:, 0], (via * ok).sum(1), (repriced * ok).sum(1)], 1)


def check_encoded(check: Sequence[int], budget: int, k: int, width: int) -> None:
    """One request's `encode_packed` check on the host: the refusals of `encode_tree` and the worker (one line)."""
    kept, groups, most = check
    if kept != budget + 1:
        raise RuntimeError(f"PR_EAGLE3: a round kept {kept - 1} nodes, not B={budget}")
    if groups > width:
        raise ValueError(f"the tree needs more than {width} node groups")
    if most > k:
        raise ValueError(f"a node has more than k={k} children of one kind")


def trees_of_verify(draft_token: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
                    n: int) -> List[Tuple[List[int], List[int]]]:
    """The trees a verify input holds, on the host: per request `(tokens, parents)` in its node order (the root,
    then the kept nodes in score-id order, as `build_tree_kernel_efficient` lays them out), `parents[0] = -1`.
    Read from the verify's child links (`retrieve_next_token` = first child, `retrieve_next_sibling` = next
    sibling, local node indices): the inverse of the build, whatever order a kernel links siblings in. The round
    log's trees of a round SGLang's own draft made (`PR_EAGLE3_M0_DRAFT=sglang`)."""
    tokens = draft_token.reshape(-1, n).tolist()
    first, sibling = next_token.reshape(-1, n).tolist(), next_sibling.reshape(-1, n).tolist()
    out = []
    for toks, fc, sib in zip(tokens, first, sibling):
        parents = [-1] * n
        for i in range(n):
            c = fc[i]
            while c >= 0:
                if parents[c] != -1 or c == 0:
                    raise ValueError(f"verify tree: node {c} linked twice")
                parents[c] = i
                c = sib[c]
        if any(p < 0 for p in parents[1:]):
            raise ValueError("verify tree: a node no link reaches")
        out.append((toks, parents))
    return out
