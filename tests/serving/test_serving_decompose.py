"""The decomposition counters of a PR round against its m = 0 counterfactual tree (`serving.decompose`)."""

import json

import torch

from pr_specforge.serving import SpeculativeDecoder, TreeConfig, build_tree
from pr_specforge.serving.decompose import decompose_round
from tests.serving.test_serving_tree import draft, eager_gate, models, primed_runtime  # noqa: F401  (fixture)


def _kept_path(tree, nid):
    """Indices into `tree.kept` from the root to node `nid`."""
    where = {n: j for j, n in enumerate(tree.kept)}
    out = []
    while nid >= 0:
        out.append(where[nid])
        nid = tree.nodes[nid].parent
    return list(reversed(out))


def _trees(pr, target, budget=24, seed=0):
    rt, root, feat = primed_runtime(pr, target)
    tree = build_tree(rt, root, feat, TreeConfig(budget=budget, m=3), torch.Generator().manual_seed(seed))
    cf = build_tree(rt, root, feat, TreeConfig(budget=budget, m=0))
    return tree, cf


def test_counters_against_itself_are_zero_and_frontier_counts_forwarded_nodes(models):
    target, _, pr = models
    eager_gate(pr, -2.0)
    tree, cf = _trees(pr, target)
    d = decompose_round(cf, cf, [0, 1], bonus=5, greedy=True)
    assert d.frontier_recon == d.frontier_repriced == d.displaced == d.gained_proposal == d.gained_repricing == 0
    assert d.frontier_slots == sum(1 for i, n in enumerate(cf.nodes) if i and n.row >= 0) > 0
    d = decompose_round(tree, cf, [0], bonus=5, greedy=True)
    assert 0 < d.frontier_recon <= d.frontier_repriced <= d.frontier_slots
    kept = {tuple(_tokens(tree, i)) for i in tree.kept[1:]}
    cf_kept = {tuple(_tokens(cf, i)) for i in cf.kept[1:]}
    assert d.displaced == len(cf_kept - kept) == len(kept - cf_kept) > 0  # same budget: one in for one out


def _tokens(tree, nid):
    out = []
    while nid > 0:
        out.append(tree.nodes[nid].token)
        nid = tree.nodes[nid].parent
    return list(reversed(out))


def test_accepted_tokens_are_attributed_to_proposal_repricing_or_counted_as_lost(models):
    target, _, pr = models
    eager_gate(pr, -2.0)
    tree, cf = _trees(pr, target, budget=48, seed=1)
    cf_paths = {tuple(_tokens(cf, i)) for i in cf.kept[1:]}
    recon = next(i for i in tree.kept[1:] if tree.nodes[i].via_recon)
    path = _kept_path(tree, recon)
    d = decompose_round(tree, cf, path, bonus=0, greedy=True)
    prefix = 0
    while prefix < len(path) - 1 and tuple(_tokens(tree, tree.kept[path[prefix + 1]])) in cf_paths:
        prefix += 1
    assert d.accepted == len(path) - 1 and d.gained_proposal == len(path) - 1 - prefix > 0 and d.gained_repricing == 0
    assert decompose_round(tree, cf, path, bonus=0, greedy=False).gained_proposal == 0  # T > 0: not defined
    # a path both cuts hold, whose bonus the m = 0 cut holds as a child: nothing gained, at least one token lost
    shared = next(i for i in tree.kept[1:] if not tree.nodes[i].repriced and tuple(_tokens(tree, i)) in cf_paths
                  and any(c in cf.kept for c in _cf_node(cf, _tokens(tree, i)).children))
    cf_node = _cf_node(cf, _tokens(tree, shared))
    bonus = next(cf.nodes[c].token for c in cf_node.children if c in cf.kept)
    d = decompose_round(tree, cf, _kept_path(tree, shared), bonus=bonus, greedy=True)
    assert d.gained_proposal == d.gained_repricing == 0 and d.lost_lb == 1


def _cf_node(cf, tokens):
    nid = 0
    for t in tokens:
        nid = next(c for c in cf.nodes[nid].children if cf.nodes[c].token == t)
    return cf.nodes[nid]


def test_decomposing_decoder_decodes_the_same_and_counts_every_accepted_token(models):
    target, eagle, pr = models
    eager_gate(pr, -2.0)
    prompt = list(range(3, 12))
    cfg = TreeConfig(budget=12, gamma=3)
    plain = SpeculativeDecoder(target, pr, cfg).generate(prompt, 8)
    dec = SpeculativeDecoder(target, pr, cfg, decompose=True).generate(prompt, 8)
    assert dec.tokens == plain.tokens and dec.accept_lengths == plain.accept_lengths  # the counterfactual changes nothing
    c = dec.decomposition
    assert c["accepted"] == sum(dec.accept_lengths) - dec.rounds
    assert c["gained_proposal"] + c["gained_repricing"] <= c["accepted"]
    assert c["frontier_recon"] <= c["frontier_repriced"] <= c["frontier_slots"]
    assert c["displaced"] > 0, c
    json.dumps(c)
    c = SpeculativeDecoder(target, eagle, cfg, decompose=True).generate(prompt, 4).decomposition
    assert c["frontier_slots"] > 0
    assert c["frontier_recon"] == c["displaced"] == c["gained_proposal"] == c["gained_repricing"] == c["lost_lb"] == 0
