"""Verification: greedy longest match, and rejection sampling that reproduces the target's distribution."""

import torch

from pr_specforge.serving import accept_greedy, accept_sampling

# A fixed toy tree (verification order, parents before children):
#   0 (root) -> 1, 2, 3 ;  1 -> 4, 5 ;  2 -> 6
PARENTS = [-1, 0, 0, 0, 1, 1, 2]
CHILDREN = [[1, 2, 3], [4, 5], [6], [], [], [], []]
V = 12


def toy_logits(seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(PARENTS), V, generator=g) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_accepts_the_longest_matching_path():
    logits = torch.full((len(PARENTS), V), -5.0)
    tokens = [0, 3, 4, 5, 7, 8, 9]
    logits[0, 3] = 5.0  # root -> node 1 (token 3)
    logits[1, 8] = 5.0  # node 1 -> node 5 (token 8)
    logits[5, 11] = 5.0  # node 5 is a leaf: bonus 11
    path, bonus = accept_greedy(tokens, CHILDREN, logits)
    assert path == [0, 1, 5] and bonus == 11
    logits[0] = -5.0
    logits[0, 6] = 5.0  # no child matches: bonus only
    assert accept_greedy(tokens, CHILDREN, logits) == ([0], 6)


def test_rejection_sampling_emits_the_target_distribution():
    """First token ~ pi(.|root); second token given that the first was node 1's token ~ pi(.|node 1).
    Deterministic seed: 6000 trials, chi-square far below the 0.1% critical value (df=11: 31.3)."""
    for temperature, seed in ((1.0, 0), (0.7, 1)):
        logits = toy_logits(seed)
        p0 = torch.softmax(logits[0].double() / temperature, -1)
        p1 = torch.softmax(logits[1].double() / temperature, -1)
        order = torch.argsort(p0, descending=True).tolist()
        order1 = torch.argsort(p1, descending=True).tolist()
        # children: the likeliest token, a mid one, and a duplicate of the likeliest (never accepted twice)
        tokens = [0, order[0], order[3], order[0], order1[1], order1[0], 5]
        g = torch.Generator().manual_seed(1234 + seed)
        first = torch.zeros(V, dtype=torch.float64)
        second = torch.zeros(V, dtype=torch.float64)
        trials = 6000
        for _ in range(trials):
            path, bonus = accept_sampling(tokens, CHILDREN, logits, temperature, g)
            emitted = [tokens[i] for i in path[1:]] + [bonus]
            first[emitted[0]] += 1
            if len(path) > 1 and path[1] == 1:
                second[emitted[1]] += 1
        assert chi_square(first, p0) < 31.3
        assert 0.5 * (first / trials - p0).abs().sum() < 0.03
        assert second.sum() > 1000
        assert chi_square(second, p1) < 31.3
