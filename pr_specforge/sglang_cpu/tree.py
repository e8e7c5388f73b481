"""The draft tree and greedy tree verification of SGLang 0.5.14's EAGLE path, on CPU.

SGLang builds the verify tree and walks it with sgl-kernel CUDA ops
(`build_tree_kernel_efficient`, `verify_tree_greedy`) that it imports only on
CUDA/HIP/MUSA; on CPU the first is an undefined name and the second silently
does nothing. These are our own implementations of the same contracts, in
plain torch on small host tensors:

* `build_tree` (replaces `eagle_utils.build_tree_kernel_efficient`): from the
  kept draft nodes (`top_scores_index`, ascending score-list ids) and the
  per-step parent ids (`parent_list`), the node order [root, kept...], each
  node's parent and depth, the FULL_MASK attention mask (per request a
  [N, seq_len + N] block: the whole prefix, then the root, the node's
  ancestors and itself), positions `seq_len + depth`, and the child/sibling
  links (`retrieve_next_token` = first child, `retrieve_next_sibling` = next
  child, in node order) that verification walks.
* `verify_tree_greedy` (replaces `eagle_utils.verify_tree_greedy_func`): from
  the root, repeatedly descend into the first child whose token equals the
  target's argmax at the current node; records the accepted node ids, their
  count (drafts only) and, for every accepted node, the target token that
  follows it (the last one is the bonus token).
"""

from __future__ import annotations

from typing import List

import torch

from pr_specforge.op_parts import stand_in


class InvalidDraftTree(RuntimeError):
    """A kept draft node whose parent was cut (SGLang's 'invalid eagle tree')."""


def _parents(sel: List[int], parent_ids: List[int], topk: int) -> List[int]:
    """Tree parent (node index, 0 = root) of each node 1..N-1; node i is score-list entry sel[i-1]."""
    where = {score_id: i + 1 for i, score_id in enumerate(sel)}
    out = [-1]
    for score_id in sel:
        slot = score_id // topk  # 0: a child of the root; else the frontier entry it expanded
        if slot == 0:
            out.append(0)
            continue
        parent = where.get(parent_ids[slot])
        if parent is None:
            raise InvalidDraftTree(f"draft node {score_id} kept without its parent {parent_ids[slot]}")
        out.append(parent)
    return out


@stand_in("build_tree")
def build_tree(bonus_tokens, parent_list, top_scores_index, draft_tokens, seq_lens, seq_lens_sum, topk,
               spec_steps, num_verify_tokens, tree_mask_mode=0, tree_mask_buf=None, position_buf=None):
    """Same arguments and return values as SGLang's `build_tree_kernel_efficient` (FULL_MASK mode)."""
    if int(tree_mask_mode) != 0:
        raise NotImplementedError(f"the CPU bridge builds FULL_MASK trees only, got tree_mask_mode={tree_mask_mode}")
    n = num_verify_tokens
    bs = seq_lens.numel()
    tokens = torch.cat([bonus_tokens.reshape(bs, 1), draft_tokens.reshape(bs, -1)], dim=1).flatten()
    lens = seq_lens.tolist()
    masks, positions = [], torch.empty(bs * n, dtype=torch.long)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    for b in range(bs):
        parent = _parents(top_scores_index[b].tolist(), parent_list[b].tolist() if parent_list.numel() else [], topk)
        mask = torch.zeros(n, lens[b] + n, dtype=torch.bool)
        mask[:, : lens[b] + 1] = True  # the prefix and the root
        for i in range(1, n):
            depth, j = 0, i
            while j > 0:
                mask[i, lens[b] + j] = True
                depth, j = depth + 1, parent[j]
            positions[b * n + i] = lens[b] + depth
            siblings = [c for c in range(1, i) if parent[c] == parent[i]]
            if siblings:
                retrieve[2, b, siblings[-1]] = i
            else:
                retrieve[1, b, parent[i]] = i
        positions[b * n] = lens[b]
        retrieve[0, b] = torch.arange(b * n, (b + 1) * n)
        masks.append(mask.flatten())
    tree_mask = torch.cat(masks)
    if tree_mask_buf is not None:
        tree_mask_buf[: tree_mask.numel()].copy_(tree_mask)
        tree_mask = tree_mask_buf
    if position_buf is not None:
        position_buf.copy_(positions)
        positions = position_buf
    dev = seq_lens.device
    return (tree_mask.to(dev), positions.to(dev), retrieve[0].to(dev), retrieve[1].to(dev), retrieve[2].to(dev),
            tokens.to(dev))


@stand_in("verify_tree_greedy")
def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, target_predict, topk=-1):
    """Same arguments and in-place outputs as SGLang's `verify_tree_greedy_func` (returns them too)."""
    target = target_predict.reshape(-1).tolist()
    cand = candidates.tolist()
    index, nxt, sib = retrieve_index.tolist(), retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    for b in range(len(cand)):
        node = 0
        last = index[b][0]
        accept_index[b, 0] = last
        accepted = 0
        while accepted + 1 < accept_index.shape[1]:
            child = nxt[b][node]
            while child != -1 and cand[b][child] != target[last]:
                child = sib[b][child]
            if child == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            node, last = child, index[b][child]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]
    return predicts, accept_index, accept_token_num
