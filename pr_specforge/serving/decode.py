"""The speculative decode loop for one sequence, and the autoregressive baseline.

Owns:
  * `SpeculativeDecoder.generate` — prefill, then rounds of: draft a tree
    (`tensor_tree.TensorTreeBuilder` by default, `tree.build_tree` with
    `tree_builder="object"`: the same trees), verify it (`verify`), keep the accepted path's KV in the
    target cache, and feed the accepted tokens' captured target layers to the
    drafter's context (`DrafterRuntime.extend`). Records per-round timings and,
    for each verified node on the accepted path, the diagnostics the evaluator
    buckets (drafter / target confidence, one-pass hit, recovered by reconsideration).
  * `autoregressive_decode` — the target alone, token by token, with its KV cache:
    the reference output at T = 0 and the speed baseline.

Diagnostics, per verified node `u` on the accepted path whose children were drafted
(the emitted token at that position is `t*`: the accepted child's token, or the bonus):
  `c_d` = max_t pi_one(t|u); `c_t` = max_t pi_tgt(t|u) (softmax of the target's logits);
  `top1_hit` = the one-pass top-1 token equals `t*` (Figure 1a's acceptance);
  `onepass_hit` = `t*` is among u's one-pass top-k proposals;
  `recovered` = not `onepass_hit` and `t*` was accepted through a child that
  reconsideration proposed (Table 7's "turned from wrong to right").

Does not own: the tree algorithm (`tree`), prompts and aggregation (`pr_specforge.eval`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from pr_specforge.serving.decompose import COUNTERS, decompose_round
from pr_specforge.serving.drafter_runtime import DrafterRuntime, aux_layer_ids
from pr_specforge.serving.tensor_tree import TensorTreeBuilder
from pr_specforge.serving.tree import DraftTree, TreeConfig, build_tree
from pr_specforge.serving.verify import (
    accept_greedy,
    accept_sampling,
    commit_cache,
    output_head,
    sample_token,
    target_forward_tree,
)


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


@dataclass
class DecodeResult:
    """One sequence. `tokens` excludes the prompt and is cut at `max_new_tokens` / EOS."""

    tokens: List[int]
    accept_lengths: List[int] = field(default_factory=list)  # tokens emitted per round (bonus included)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    recon_rows: int = 0
    recon_kept: int = 0  # kept (verified) nodes proposed by reconsideration, summed over rounds
    repriced_kept: int = 0  # kept nodes proposed or repriced by reconsideration, summed over rounds
    tree_sizes: List[int] = field(default_factory=list)
    # per verified node: (c_d, c_t, top1_hit, onepass_hit, recovered)
    diagnostics: List[Tuple[float, float, bool, bool, bool]] = field(default_factory=list)
    # with `decompose`: the counters of `serving.decompose`, summed over rounds (None otherwise)
    decomposition: Optional[Dict[str, int]] = None

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.rounds)


def _emit(out: List[int], new: Sequence[int], max_new_tokens: int, eos_token_id) -> bool:
    """Append; return True when decoding is finished."""
    for t in new:
        out.append(int(t))
        if len(out) >= max_new_tokens or (eos_token_id is not None and int(t) in eos_token_id):
            return True
    return False


def _eos_set(eos_token_id) -> Optional[set]:
    if eos_token_id is None:
        return None
    return set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


TREE_BUILDERS = ("tensor", "object")


class SpeculativeDecoder:
    """Target + drafter + tree shape. A tree with `m = 0` serves a PR drafter as plain EAGLE.

    `tree_builder`: "tensor" (`tensor_tree`, one host sync per round) or "object" (`tree`,
    the reference); they draft the same trees.
    `decompose=True` (diagnostic): each round also builds the m = 0 tree from the same drafter
    state and records `serving.decompose`'s counters. It drafts with the object builder (whose
    trees it reads); the decode itself is unchanged (the counterfactual consumes no random
    numbers); the counterfactual's time is not in `draft_s` but is in `total_s`: take no speed
    from a decomposing run."""

    def __init__(self, target, drafter, tree_config: TreeConfig, lazy_logits: bool = True,
                 tree_builder: str = "tensor", decompose: bool = False) -> None:
        if tree_builder not in TREE_BUILDERS:
            raise ValueError(f"tree_builder must be one of {TREE_BUILDERS}, got {tree_builder!r}")
        self.target = target.eval()
        self.drafter = drafter.eval()
        self.rt = DrafterRuntime(drafter, target)
        tree_config.check_vocab(self.rt.draft_vocab_size)
        self.cfg = tree_config
        self.lazy_logits = lazy_logits  # the target's vocabulary projection only for the nodes acceptance reads
        self.layer_ids = aux_layer_ids(drafter, int(target.config.num_hidden_layers))
        self.decompose = decompose
        self.device = target.get_input_embeddings().weight.device
        use_tensor = tree_builder == "tensor" and not decompose
        self.tensor_builder = TensorTreeBuilder(self.rt, tree_config) if use_tensor else None

    def draft(self, root_token: int, root_feature: torch.Tensor, generator: torch.Generator):
        if self.tensor_builder is not None:
            return self.tensor_builder.build(root_token, root_feature, generator)
        return build_tree(self.rt, root_token, root_feature, self.cfg, generator)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id=None,
    ) -> DecodeResult:
        if len(input_ids) < 1:
            raise ValueError("input_ids must hold at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos = _eos_set(eos_token_id)
        verify_gen = torch.Generator().manual_seed(seed)
        draft_gen = torch.Generator().manual_seed(seed + 1)
        res = DecodeResult(tokens=[])
        if self.decompose:
            res.decomposition = {c: 0 for c in COUNTERS}
        t_start = time.perf_counter()

        # prefill: the target's first token and the drafter's context rows
        cache = _new_cache(self.target)
        ids = torch.tensor([list(input_ids)], device=self.device)
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        first = sample_token(out.logits[0, -1].float(), temperature, verify_gen)
        # Per-node logits on use, if the output embedding alone reproduces the target's logits.
        head = output_head(self.target, out.hidden_states[-1][0, -1:], out.logits[0, -1:]) if self.lazy_logits else None
        aux = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        self.rt.reset()
        next_tokens = torch.tensor(list(input_ids[1:]) + [first])
        root_feature = self.rt.extend(aux, next_tokens)[-1]
        root_token = first
        done = _emit(res.tokens, [first], max_new_tokens, eos)

        while not done:
            t0 = time.perf_counter()
            tree = self.draft(root_token, root_feature, draft_gen)
            t1 = time.perf_counter()
            counterfactual = self._counterfactual(tree, root_token, root_feature) if self.decompose else None
            tokens, depths = tree.tokens(), tree.depths()
            children = tree.children()
            logits, aux = target_forward_tree(
                self.target, cache, tokens, depths, tree.tree_mask(), tree.root_position, self.layer_ids, head
            )
            if temperature <= 0:
                path, bonus = accept_greedy(tokens, children, logits)
            else:
                path, bonus = accept_sampling(tokens, children, logits, temperature, verify_gen)
            commit_cache(cache, tree.root_position, path)
            accepted = [tokens[i] for i in path[1:]]
            root_feature = self.rt.extend(aux[path], torch.tensor(accepted + [bonus]))[-1]
            root_token = bonus
            t2 = time.perf_counter()
            res.draft_s += t1 - t0
            res.verify_s += t2 - t1
            if counterfactual is not None:
                counts = decompose_round(tree, counterfactual, path, bonus, greedy=temperature <= 0).to_dict()
                for key, value in counts.items():
                    res.decomposition[key] += value
            res.accept_lengths.append(len(path))
            res.recon_rows += tree.recon_rows
            res.recon_kept += tree.recon_kept
            res.repriced_kept += tree.repriced_kept
            res.tree_sizes.append(len(tokens) - 1)
            self._diagnose(tree, path, bonus, logits, res)
            done = _emit(res.tokens, accepted + [bonus], max_new_tokens, eos)
        res.total_s = time.perf_counter() - t_start
        return res

    def _counterfactual(self, tree: DraftTree, root_token: int, root_feature: torch.Tensor) -> DraftTree:
        """The m = 0 tree of this round from the same drafter state (no reconsideration, no coins).

        Without reconsideration (an EAGLE-3 drafter, R = 0 or m = 0) the round's
        own tree is that tree (`test_pr_tree_with_m0_is_the_eagle_tree`), so it is not rebuilt."""
        if not (self.rt.is_pr and self.rt.max_depth > 0 and self.cfg.m > 0):
            return tree
        return build_tree(self.rt, root_token, root_feature, replace(self.cfg, m=0))

    def _diagnose(self, tree, path: List[int], bonus: int, logits, res: DecodeResult) -> None:
        tokens = tree.tokens()
        for step, j in enumerate(path):
            proposal = tree.one_pass(j)
            if proposal is None:  # a leaf never forwarded: its children were not drafted
                continue
            c_d, one_pass = proposal  # one_pass: the one-pass top-k tokens, best first
            if step + 1 < len(path):
                emitted, via_recon = tokens[path[step + 1]], tree.via_recon(path[step + 1])
            else:
                emitted, via_recon = bonus, False
            onepass_hit = emitted in one_pass
            res.diagnostics.append(
                (c_d, float(torch.softmax(logits[j], dim=-1).max()), one_pass[0] == emitted, onepass_hit,
                 (not onepass_hit) and via_recon)
            )


@torch.no_grad()
def autoregressive_decode(
    target,
    input_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id=None,
) -> Tuple[List[int], float]:
    """The target alone (KV-cached, one token per forward). Returns `(tokens, seconds)`."""
    eos = _eos_set(eos_token_id)
    gen = torch.Generator().manual_seed(seed)
    device = target.get_input_embeddings().weight.device
    t0 = time.perf_counter()
    cache = _new_cache(target)
    ids = torch.tensor([list(input_ids)], device=device)
    out_tokens: List[int] = []
    while True:
        out = target(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = sample_token(out.logits[0, -1].float(), temperature, gen)
        if _emit(out_tokens, [tok], max_new_tokens, eos):
            break
        ids = torch.tensor([[tok]], device=device)
    return out_tokens, time.perf_counter() - t0
