"""Exact tree verification by a `transformers` target (Appendix C.4).

Owns:
  * `target_forward_tree` — one target forward over the kept tree (root first)
    against the target's `DynamicCache`, with a 4D additive mask (the committed
    prefix + each node's ancestors and itself) and explicit position ids
    (`root_position + depth`); returns logits and the three captured layers.
    With an output head (`output_head`), the logits are `TreeLogits`: the head runs
    on a node's final hidden state when acceptance first reads that node, so a round
    computes the vocabulary projection for the path it walks (about tau nodes), not
    for every node of the tree.
  * `accept_greedy` (T = 0: longest path matching the target's argmax tokens) and
    `accept_sampling` (T > 0: target-only multi-candidate rejection sampling: visit
    the children in order, accept `c_i` with probability `r_{i-1}(c_i)`, else zero
    it and renormalise; if every child is rejected, the bonus token is drawn from
    the residual). Both return the accepted path and the bonus token.
  * `commit_cache` — keep the committed prefix plus the accepted path's KV, drop
    the rejected nodes' KV.

The verifier sees tokens and topology only, never a draft probability, so any
tree shape (EAGLE's or a reconsidered one) is verified losslessly.

Does not own: drafting (`tree`), the round loop (`decode`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

Head = Callable[[torch.Tensor], torch.Tensor]


class TreeLogits:
    """The target's logits over the tree's nodes, each computed on first use (fp32 `[V]`)."""

    def __init__(self, hidden: torch.Tensor, head: Head) -> None:
        self.hidden, self.head = hidden, head
        self._rows: Dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, u: int) -> torch.Tensor:
        u = int(u)
        if u not in self._rows:
            self._rows[u] = self.head(self.hidden[u : u + 1])[0].float()
        return self._rows[u]


def output_head(target, hidden: torch.Tensor, logits: torch.Tensor, rtol: float = 1e-4) -> Optional[Head]:
    """The target's hidden-to-logits map, if its output embedding alone reproduces `logits`.

    `hidden`/`logits`: a forward's final hidden states and logits for the same rows. A model
    whose forward transforms its logits further (a soft cap, a logit scale) fails the check,
    and then None: the caller keeps the forward's own logits for every node."""
    head = target.get_output_embeddings()
    if head is None:
        return None
    with torch.no_grad():
        ours = head(hidden).float()
    ref = logits.float()
    scale = ref.abs().max().clamp_min(1.0)
    return head if bool(((ours - ref).abs().max() <= rtol * scale)) else None


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64 on the CPU, whatever the logits' device.

    Every draw at T > 0 uses these, so the sequence's CPU generator serves a CUDA target
    too and a seed draws the same tokens on either device.
    """
    return torch.softmax(logits.detach().double().cpu() / temperature, dim=-1)


def sample_token(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> int:
    """The target's own next token: argmax at T = 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, temperature), 1, generator=generator))


@torch.no_grad()
def target_forward_tree(
    target,
    cache,
    tokens: Sequence[int],
    depths: Sequence[int],
    mask: torch.Tensor,
    root_position: int,
    layer_ids: Sequence[int],
    head: Optional[Head] = None,
) -> Tuple[Union[torch.Tensor, TreeLogits], torch.Tensor]:
    """Forward the kept tree. `mask [n, n]` ancestor-or-self. Returns the logits (`[n, V]` fp32,
    or `TreeLogits` computed per node on use when `head` is given) and the captured layers
    `[n, 3*Ht]` (layer outputs, `hidden_states[i + 1]`)."""
    device = target.get_input_embeddings().weight.device
    dtype = target.get_input_embeddings().weight.dtype
    n = len(tokens)
    past = cache.get_seq_length()
    if past != root_position:
        raise RuntimeError(f"target cache holds {past} positions, expected {root_position}")
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=mask.device), mask], dim=1).to(device)
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    additive = additive.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    ids = torch.tensor([list(tokens)], device=device)
    pos = torch.tensor([[root_position + d for d in depths]], device=device)
    out = target(
        input_ids=ids,
        attention_mask=additive,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        **({"logits_to_keep": torch.zeros(0, dtype=torch.long, device=device)} if head is not None else {}),
    )
    aux = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    if head is not None:
        return TreeLogits(out.hidden_states[-1][0], head), aux
    return out.logits[0].float(), aux


def accept_greedy(tokens: Sequence[int], children: Sequence[Sequence[int]], logits: torch.Tensor) -> Tuple[List[int], int]:
    """T = 0: follow the child whose token is the target's argmax; the first miss gives the bonus."""
    path, u = [0], 0
    while True:
        best = int(torch.argmax(logits[u]))
        nxt = next((c for c in children[u] if tokens[c] == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        u = nxt


def accept_sampling(
    tokens: Sequence[int],
    children: Sequence[Sequence[int]],
    logits: torch.Tensor,
    temperature: float,
    generator: Optional[torch.Generator],
) -> Tuple[List[int], int]:
    """T > 0: target-only multi-candidate rejection sampling (each child a deterministic proposal)."""
    path, u = [0], 0
    while True:
        r = sampling_probs(logits[u], temperature)
        nxt = None
        for c in children[u]:
            t = tokens[c]
            p_t = float(r[t])
            if p_t > 0.0 and (p_t >= 1.0 or float(torch.rand((), generator=generator, dtype=torch.float64)) < p_t):
                nxt = c
                break
            r[t] = 0.0
            r = r / r.sum()
        if nxt is None:
            return path, int(torch.multinomial(r, 1, generator=generator))
        path.append(nxt)
        u = nxt


def commit_cache(cache, root_position: int, path: Sequence[int]) -> None:
    """Keep prefix `[0, root_position)` plus the path's entries (tree order index `i` sits
    at cache slot `root_position + i`); everything else in the tree is dropped."""
    keep = torch.tensor(list(range(root_position)) + [root_position + i for i in path])
    for layer in cache.layers:
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
