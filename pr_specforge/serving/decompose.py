"""Where a PR round's acceptance comes from: the round against its m = 0 counterfactual tree.

Diagnostic mode of the evaluator (`pr-specforge eval --decompose`). Each round the decoder
also builds the m = 0 tree (EAGLE's tree from the PR drafter's one-pass head) from the SAME
drafter state and root; it is never verified. Comparing the two splits the mechanism's effect:

  frontier_slots      nodes forwarded this round (each took one of the B_w frontier slots of a step)
  frontier_recon      ... of them on a reconsidered branch (the node or an ancestor was proposed by
                      a reconsidered feature)
  frontier_repriced   ... of them whose score reconsideration changed (repriced or proposed)
  displaced           kept nodes of the m = 0 cut that the PR cut does not keep (token paths;
                      one-pass nodes pushed out from under the cut)
  accepted            draft tokens accepted this round (bonus excluded)
  gained_proposal     accepted tokens beyond the longest accepted prefix the m = 0 cut also holds,
                      where the first such node is on a reconsidered branch (only a reconsidered
                      proposal put it under the cut)
  gained_repricing    the same where the first such node is a one-pass proposal (repricing, or a
                      frontier reconsideration changed, put it under the cut)
  lost_lb             1 when the m = 0 cut holds the whole accepted path AND the bonus token as a
                      child (the m = 0 tree would have accepted at least one token more), else 0:
                      a lower bound on what displacement cost this round
`gained_*` and `lost_lb` are defined at temperature 0 only (acceptance is then the target's greedy
path, known along the accepted tokens and the bonus); at T > 0 they stay 0 and `exact` is False.

Does not own: the trees (`tree`), the decode loop (`decode`), aggregation (`pr_specforge.eval`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

from pr_specforge.serving.tree import DraftTree

COUNTERS = ("frontier_slots", "frontier_recon", "frontier_repriced", "displaced", "accepted",
            "gained_proposal", "gained_repricing", "lost_lb")


@dataclass
class RoundDecomposition:
    frontier_slots: int = 0
    frontier_recon: int = 0
    frontier_repriced: int = 0
    displaced: int = 0
    accepted: int = 0
    gained_proposal: int = 0
    gained_repricing: int = 0
    lost_lb: int = 0

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def _token_path(tree: DraftTree, nid: int) -> Tuple[int, ...]:
    out: List[int] = []
    while nid > 0:
        out.append(tree.nodes[nid].token)
        nid = tree.nodes[nid].parent
    return tuple(reversed(out))


def _on_recon_branch(tree: DraftTree, nid: int) -> bool:
    while nid > 0:
        if tree.nodes[nid].via_recon:
            return True
        nid = tree.nodes[nid].parent
    return False


def decompose_round(tree: DraftTree, counterfactual: DraftTree, path: List[int], bonus: int, greedy: bool) -> RoundDecomposition:
    """Counters of one round (see module doc). `path`: indices into `tree.kept` from the root."""
    d = RoundDecomposition()
    forwarded = [i for i, n in enumerate(tree.nodes) if i > 0 and n.row >= 0]
    d.frontier_slots = len(forwarded)
    d.frontier_recon = sum(_on_recon_branch(tree, i) for i in forwarded)
    d.frontier_repriced = sum(tree.nodes[i].repriced for i in forwarded)
    kept = {_token_path(tree, i) for i in tree.kept[1:]}
    cf_kept = {_token_path(counterfactual, i) for i in counterfactual.kept[1:]}
    d.displaced = len(cf_kept - kept)
    accepted_ids = [tree.kept[j] for j in path[1:]]
    d.accepted = len(accepted_ids)
    if not greedy:
        return d
    tokens = tuple(tree.nodes[i].token for i in accepted_ids)
    p = 0
    while p < len(tokens) and tokens[: p + 1] in cf_kept:
        p += 1
    if p < len(tokens):
        gained = len(tokens) - p
        if _on_recon_branch(tree, accepted_ids[p]):
            d.gained_proposal = gained
        else:
            d.gained_repricing = gained
    elif tokens + (int(bonus),) in cf_kept:
        d.lost_lb = 1
    return d
