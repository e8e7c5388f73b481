"""The speculative decode loop for one sequence, and the autoregressive baseline.

Owns:
  * `SpeculativeDecoder.generate` — prefill, then rounds of: draft a tree
    (`tensor_tree.TensorTreeBuilder` by default, `tree.build_tree` with
    `tree_builder="object"`: the same trees), verify it (`verify`), keep the accepted path's KV in the
    target cache, and feed the accepted tokens' captured target layers to the
    drafter's context (`DrafterRuntime.extend`). Records per-round timings and,
    for each verified node on the accepted path, the diagnostics the evaluator
    buckets (drafter / target confidence, one-pass hit, recovered by reconsideration).
  * `SpeculativeDecoder.generate_many` — several sequences at once: each round drafts the trees
    of all running sequences in one `batched_tree.BatchedTreeBuilder.build` (one host read for
    the batch), then verifies each sequence against its own target cache; a finished sequence
    leaves the batch. Each sequence's result equals `generate`'s for it (`_Sequence` is the
    per-sequence round both use).
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
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest
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
        self.batch_builder: Optional[BatchedTreeBuilder] = None  # `generate_many`'s, built on first use
        self.runtimes: List[DrafterRuntime] = [self.rt]  # `generate_many`'s drafter contexts, one per sequence

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
        seq = _Sequence(self, self.rt, input_ids, max_new_tokens, temperature, seed, eos_token_id)
        while not seq.done:
            t0 = time.perf_counter()
            tree = self.draft(seq.root_token, seq.root_feature, seq.draft_gen)
            t1 = time.perf_counter()
            counterfactual = self._counterfactual(tree, seq.root_token, seq.root_feature) if self.decompose else None
            seq.res.draft_s += t1 - t0
            seq.verify(tree, t1, counterfactual)
        return seq.res

    @torch.no_grad()
    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Union[int, Sequence[int]],
        temperature: float = 0.0,
        seeds: Optional[Sequence[int]] = None,
        eos_token_id=None,
    ) -> List[DecodeResult]:
        """Several sequences, each round's trees drafted for all running ones at once (`BatchedTreeBuilder`);
        a sequence leaves the batch when it finishes (`max_new_tokens`: one limit, or one per prompt). Each result
        equals `generate(prompts[i], max_new_tokens[i], temperature, seeds[i])`'s
        (tested) but for its timings: `draft_s` is each round's batched drafting time shared equally by the sequences in it,
        `total_s` the whole call's wall time shared equally (their sum is the batch's time, so tokens / sum is throughput)."""
        if self.tensor_builder is None:
            raise ValueError("generate_many drafts with the batched tensor builder: use tree_builder='tensor' without decompose")
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        for name, values in (("seeds", seeds), ("max_new_tokens", limits)):
            if len(values) != len(prompts):
                raise ValueError(f"generate_many got {len(prompts)} prompts but {len(values)} {name}")
        if self.batch_builder is None:
            self.batch_builder = BatchedTreeBuilder(self.rt, self.cfg)
        while len(self.runtimes) < len(prompts):  # one drafter context per sequence, kept for later calls
            self.runtimes.append(DrafterRuntime(self.drafter))
        t_begin = time.perf_counter()
        seqs = [_Sequence(self, rt, ids, limit, temperature, seed, eos_token_id)
                for rt, ids, limit, seed in zip(self.runtimes, prompts, limits, seeds)]
        active = [q for q in seqs if not q.done]
        while active:
            t0 = time.perf_counter()
            trees = self.batch_builder.build([BatchRequest(q.rt, q.root_token, q.root_feature, q.draft_gen) for q in active])
            t1 = time.perf_counter()
            for q, tree in zip(active, trees):
                q.res.draft_s += (t1 - t0) / len(active)
                q.verify(tree, time.perf_counter(), None)
            active = [q for q in active if not q.done]
        wall = time.perf_counter() - t_begin
        for q in seqs:  # the batch's wall time, shared: the results' total_s sum to it (throughput, not latency)
            q.res.total_s = wall / len(seqs)
        return [q.res for q in seqs]

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


class _Sequence:
    """One sequence's decode: the target's cache, the drafter's context (`rt`), the generators, the next round's
    root and the result. Built by prefilling; `verify` runs one round on a drafted tree."""

    def __init__(self, dec: "SpeculativeDecoder", rt: DrafterRuntime, input_ids: Sequence[int], max_new_tokens: int,
                 temperature: float, seed: int, eos_token_id) -> None:
        if len(input_ids) < 1:
            raise ValueError("input_ids must hold at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.dec, self.rt, self.max_new_tokens, self.temperature = dec, rt, max_new_tokens, temperature
        self.eos = _eos_set(eos_token_id)
        self.verify_gen = torch.Generator().manual_seed(seed)
        self.draft_gen = torch.Generator().manual_seed(seed + 1)
        self.res = DecodeResult(tokens=[])
        if dec.decompose:
            self.res.decomposition = {c: 0 for c in COUNTERS}
        self.t_start = time.perf_counter()
        # prefill: the target's first token and the drafter's context rows
        self.cache = _new_cache(dec.target)
        ids = torch.tensor([list(input_ids)], device=dec.device)
        out = dec.target(input_ids=ids, past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        first = sample_token(out.logits[0, -1].float(), temperature, self.verify_gen)
        # Per-node logits on use, if the output embedding alone reproduces the target's logits.
        self.head = output_head(dec.target, out.hidden_states[-1][0, -1:], out.logits[0, -1:]) if dec.lazy_logits else None
        aux = torch.cat([out.hidden_states[i + 1][0] for i in dec.layer_ids], dim=-1)
        rt.reset()
        next_tokens = torch.tensor(list(input_ids[1:]) + [first])
        self.root_feature = rt.extend(aux, next_tokens)[-1]
        self.root_token = first
        self.done = False
        self._emit([first])

    def _emit(self, new: Sequence[int]) -> None:
        self.done = _emit(self.res.tokens, new, self.max_new_tokens, self.eos)
        if self.done:
            self.res.total_s = time.perf_counter() - self.t_start

    def verify(self, tree, t1: float, counterfactual: Optional[DraftTree]) -> None:
        """Verify the round's tree (drafted up to time `t1`), keep the accepted path, extend the drafter, record."""
        dec, res = self.dec, self.res
        tokens, depths = tree.tokens(), tree.depths()
        children = tree.children()
        logits, aux = target_forward_tree(
            dec.target, self.cache, tokens, depths, tree.tree_mask(), tree.root_position, dec.layer_ids, self.head
        )
        if self.temperature <= 0:
            path, bonus = accept_greedy(tokens, children, logits)
        else:
            path, bonus = accept_sampling(tokens, children, logits, self.temperature, self.verify_gen)
        commit_cache(self.cache, tree.root_position, path)
        accepted = [tokens[i] for i in path[1:]]
        self.root_feature = self.rt.extend(aux[path], torch.tensor(accepted + [bonus]))[-1]
        self.root_token = bonus
        res.verify_s += time.perf_counter() - t1
        if counterfactual is not None:
            counts = decompose_round(tree, counterfactual, path, bonus, greedy=self.temperature <= 0).to_dict()
            for key, value in counts.items():
                res.decomposition[key] += value
        res.accept_lengths.append(len(path))
        res.recon_rows += tree.recon_rows
        res.recon_kept += tree.recon_kept
        res.repriced_kept += tree.repriced_kept
        res.tree_sizes.append(len(tokens) - 1)
        dec._diagnose(tree, path, bonus, logits, res)
        self._emit(accepted + [bonus])


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
