"""The PR draft worker: SGLang 0.5.14's V2 EAGLE worker with our round in place of its `draft`.

`PREagleWorkerV2` is `EAGLEWorkerV2` whose draft worker is a `PRDraftWorker` (SGLang hard-codes
`EagleDraftWorker` in `EAGLEWorkerV2.__init__`, so the built instance takes our subclass). Everything
but `draft` is SGLang's: the draft model, its KV pool and draft-extend (prefill and decode), target
verify, acceptance, the radix cache, chunked prefill, retraction.

A batch whose every request is at m = 0 with B_w = k (the server's shape or the requests' own) is drafted by SGLang's
own EAGLE-3 draft (`EagleDraftWorker.draft`, `_eagle3_draft`; `PR_EAGLE3_M0_DRAFT=sglang`, the default): PR's round
then forwards EAGLE-3's rows and keeps EAGLE-3's tree, so SGLang's draft is the same tree with EAGLE3's ops, op for
op (its counters are 0; with a round log its trees are read back from the verify input, `encoding.trees_of_verify`).
`PR_EAGLE3_M0_DRAFT=pr`, a batch with one reconsidering request, B_w != k, or sampled drafts
(`--speculative-use-rejection-sampling`) draft PR's round for all.

`PRDraftWorker.draft` has two row paths, chosen by `PR_EAGLE3_ROWS` (`checks.check_rows`: `sglang` by default
where SGLang's runner can run the rows):
  * `ours`: request by request, steps 1-3 below (chosen by itself for adapter drafters and rows that outgrow the
    draft slots SGLang reserves);
  * `sglang` (the default): one `serving.batched_tree.BatchedTreeBuilder` round for every running request of a (B_w, m),
    whose rows (all requests' `B_w + m` per step) run in ONE call of SGLang's draft model runner per step, and
    whose readouts run in one call per head and step (`PR_EAGLE3_READOUTS=batched`, the default; `request`: one
    per request)
    (`rows.SGLangRows`, the draft model `draft_model.PRDraftModel`, the attention over explicit KV-slot lists
    that `PR_EAGLE3_ROW_ATTENTION` picks: `row_attention.RowListAttnBackend` on a CPU, SGLang's
    `TritonAttnBackend` on CUDA); the context stays in SGLang's pool.
    The round's device part runs as one CUDA graph per (B_w, m, batch size, context bucket) where `PR_EAGLE3_ROUND_GRAPH` says
    (`round_graph`: on CUDA with SGLang's decode graphs on by default; `on` on a CPU runs it under a host-read guard),
    its batch padded to SGLang's decode graph sizes (`_pad_request`).
    Its kept trees are encoded on the device for every request at once (`encoding.encode_packed`). The draft's own
    code reads nothing on the host (`PR_EAGLE3_CHECK_HOST_READS=on` checks it, `_host_read_check`; the live tests run
    with it), so SGLang's overlap schedule can run it (`supports_overlap=True`): the lengths, bonus
    tokens and features are read on the device, the host gives what it holds (request slots, allocated KV slots as
    the lengths' bound, uniforms), and each round's six numbers per request (the encoding's check, the counters)
    are read when SGLang has the round's verify result on the host (`on_verify_complete_cpu` -> `pr_verified`, which
    also records them into each request's `meta_info["pr_eagle3"]`, `admission`; with a round log, right after the
    round's verify, `_settle`).
    The tree logic, the encoding's result (3) and the verify input are the same for both.
Path `ours`, request by request:
  1. the request's committed drafter context is its rows of SGLang's draft KV pool (slots
     `req_to_token[req, :seq_len]`, written by SGLang's draft-extend); they are read into our
     `DrafterRuntime` (`load_context`), and the root is SGLang's bonus token and the draft-extend
     feature of the last context row;
  2. `pr_specforge.serving.tensor_tree.TensorTreeBuilder` builds the paper's round (our PR drafter,
     loaded from the same export with its `pr_*` tensors; the request's own seeded generator);
  3. the kept tree is encoded for SGLang's `build_tree_kernel_efficient` (`encoding`) and returned as
     SGLang's `EagleVerifyInput` (spec_steps = gamma, topk = k, B + 1 verify tokens).
A request may set its own B_w and m (`sampling_params.custom_params = {"pr_eagle3": {"bw": .., "m": ..}}`;
k, gamma and B are the server's: SGLang's verify has one shape). The worker sums the counters (rounds,
reconsideration rows, kept and repriced reconsidered nodes) over all requests (`pr_totals`); when `PR_EAGLE3_ROUND_LOG`
names a file, each request's round is appended there as one JSON line (under the overlap schedule, a finished
request's last, dropped draft too).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest
from pr_specforge.serving.drafter_runtime import DrafterRuntime, readouts_row_invariant
from pr_specforge.serving.host_reads import NoHostReads, to_device
from pr_specforge.op_parts import part
from pr_specforge.serving.tensor_tree import TensorTreeBuilder
from pr_specforge.sglang_plugin.checks import (
    check_m0_draft, check_readouts, check_round_graph, check_row_attention, check_server_args, load_pr_drafter,
    overlap_on, rows_for, rows_room)
from pr_specforge.sglang_plugin.admission import UNREPORTED_LINE, record_round, worker_shape
from pr_specforge.sglang_plugin.draft_model import use_for_draft
from pr_specforge.sglang_plugin.encoding import check_encoded, encode_packed, encode_tree, round_counts, trees_of_verify
from pr_specforge.sglang_plugin.round_graph import RoundGraphs, padded_size, round_sizes
from pr_specforge.sglang_plugin import seam
from pr_specforge.sglang_plugin.rows import PoolContext, SGLangRows, env_mode

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A round's host part, left for `PRDraftWorker._settle`: its summary on its way to the host (`done`: the copy's
    event on CUDA, else None), per request its id, allocated slots, how its round ran and its padded batch, and with
    a round log the lengths on the device and the packed trees per group (builder, packed, kept, members, size);
    the batch's requests, and once settled each one's counters (`COUNTERS`)."""

    summary: torch.Tensor
    done: Optional[object]
    rids: List[str]
    allocated: List[int]
    graph: List[str]
    graph_batch: List[int]
    seq_lens: Optional[torch.Tensor]
    built: list
    reqs: list = field(default_factory=list)
    counts: Optional[list] = None
    eagle3: bool = False  # SGLang's own draft made the round (`PR_EAGLE3_M0_DRAFT`)
    verify: Optional[object] = None  # with a round log, that round's verify input (its trees: `trees_of_verify`)


@dataclass
class _LoggedTree:
    """A tree as the round log writes it: its tokens and parents in node order."""

    node_tokens: List[int]
    node_parents: List[int]

    def tokens(self) -> List[int]:
        return self.node_tokens

    def parents(self) -> List[int]:
        return self.node_parents


def _to_host(summary: torch.Tensor):
    """`summary` copied to the host without waiting: on CUDA into pinned memory behind an event (-> copy, event),
    elsewhere as it is (-> tensor, None)."""
    if summary.device.type != "cuda":
        return summary, None
    host = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
    host.copy_(summary, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _kv_room(allocated: Optional[int], seq_len: Optional[int]) -> Optional[int]:
    """The draft slots after the context (the round log's `kv_room`): None where either side is unknown."""
    return None if allocated is None or seq_len is None else allocated - seq_len


ROUND_LOG = "PR_EAGLE3_ROUND_LOG"
CHECK_HOST_READS = "PR_EAGLE3_CHECK_HOST_READS"  # on: every `sglang`-path draft under NoHostReads(host_data=True)
COUNTERS = ("recon_rows", "recon_kept", "repriced_kept")  # a request's per-round counters, summed on the worker
MAX_PENDING = 2  # drafted rounds awaiting SGLang's verify result: one, and one more under the overlap schedule
#: the start-up line of the `sglang` row path (benchmarks/serving_cost.py reads it from the server's log)
READY_LINE = ("PR_EAGLE3 rows' attention: %s; readouts: %s; round graph: %s; a row's readouts are the same bits in any "
              "call on this machine: %s")


class PRDraftWorker(EagleDraftWorker):
    """`EagleDraftWorker` whose `draft` runs the PR round (see the module docstring)."""

    def pr_setup(self, mode: str) -> None:
        self.pr_shape = check_server_args(self.server_args)
        self.pr_mode = mode  # "sglang" or "ours" (`checks.check_rows`)
        self.pr_max_rows = rows_room(self.pr_shape, overlap_on(self.server_args)) if mode == "sglang" else None
        self.pr_check_reads = env_mode(CHECK_HOST_READS, ("off", "on"), "off") == "on"
        # a batch all at m = 0, B_w = k is SGLang's own EAGLE-3 draft (`_eagle3_batch`), unless sampled drafts
        self.pr_m0_draft = check_m0_draft() == "sglang" and not getattr(
            self.server_args, "speculative_use_rejection_sampling", False)
        self.pr_counting(os.environ.get(ROUND_LOG) or None)

    def pr_counting(self, log_path: Optional[str]) -> None:
        """The worker's round bookkeeping from nothing: totals over every request's rounds, no pending round, the
        round log (`PR_EAGLE3_ROUND_LOG`) or None."""
        self.pr_totals: Dict[str, int] = dict.fromkeys(("rounds",) + COUNTERS, 0)
        # the drafted rounds whose verify SGLang has not processed yet, oldest first (`pr_verified`)
        self.pr_pending: Deque[_Pending] = collections.deque()
        self.pr_log = log_path

    def alloc_memory_pool(self, *args, **kwargs):
        super().alloc_memory_pool(*args, **kwargs)
        embed, _ = self.target_worker.model_runner.model.get_embed_and_head()
        dtype = self.draft_runner.model_config.dtype
        drafter = load_pr_drafter(self.server_args.speculative_draft_model_path, embed.device, dtype, embed)
        self.pr_rt = DrafterRuntime(drafter)
        self.pr_builders = {}
        self.pr_rows = self.pr_row_invariant = self.pr_sizes = self.pr_pad = None
        if self.pr_mode == "sglang":
            attention = check_row_attention(embed.device)
            graph = check_round_graph(embed.device, self.server_args)
            # a captured round's batch: padded to SGLang's decode graph sizes (in `guard`: those it would capture),
            # up to the largest (without sizes: any batch the request pool holds, unpadded)
            self.pr_sizes = None if graph == "off" else round_sizes(self.server_args, graph)
            sizes = self.pr_sizes or [self.req_to_token_pool.size]
            self.pr_rows = SGLangRows(self.draft_runner, self.pr_rt, check_readouts(), attention,
                                      None if graph == "off" else RoundGraphs(graph),
                                      max(sizes) * (self.pr_shape.bw + self.pr_shape.m))
            self.pr_row_invariant = readouts_row_invariant(self.pr_rt)
            log.info(READY_LINE, attention, self.pr_rows.readouts, graph, self.pr_row_invariant)
        self.pr_layer_id = next(m.layer_id for m in self.draft_runner.model.modules() if isinstance(m, RadixAttention))

    def _builder(self, req):
        """The round's builder: the server's shape, or the request's `custom_params["pr_eagle3"]` B_w / m
        (a `TensorTreeBuilder` over our runtime, or with `PR_EAGLE3_ROWS=sglang` a `BatchedTreeBuilder` whose rows
        run in SGLang's draft model runner)."""
        shape = worker_shape(req, self.pr_shape, self.pr_max_rows)
        key = (shape.bw, shape.m)
        if key not in self.pr_builders:
            cfg = shape.tree_config()
            self.pr_builders[key] = TensorTreeBuilder(self.pr_rt, cfg) if self.pr_rows is None else \
                BatchedTreeBuilder(self.pr_rt, cfg, rows=self.pr_rows)
        return self.pr_builders[key]

    def _generator(self, req) -> torch.Generator:
        gen = getattr(req, "pr_generator", None)
        if gen is None:  # SpeculativeDecoder's convention: drafting draws from seed + 1
            seed = getattr(req.sampling_params, "sampling_seed", None) or 0
            gen = req.pr_generator = torch.Generator().manual_seed(int(seed) + 1)
        return gen

    def _round(self, req, slots: torch.Tensor, root_token: int, root_feature: torch.Tensor):
        """One request's round over our runtime (`PR_EAGLE3_ROWS=ours`): its context copied from the pool."""
        pool = self.draft_runner.token_to_kv_pool
        keys = pool.get_key_buffer(self.pr_layer_id)[slots]
        values = pool.get_value_buffer(self.pr_layer_id)[slots]
        self.pr_rt.load_context(keys, values)
        return self._builder(req).build(root_token, root_feature, self._generator(req))

    def _batched_rounds(self, batch, draft_input, width: int):
        """Every request's round with `PR_EAGLE3_ROWS=sglang`: one batched build per (B_w, m) in use, each step's
        rows of all its requests in one call of SGLang's draft model runner, its verify input encoded on the device
        (`encoding.encode_packed`). No host read: the lengths, bonus tokens and features are read on the device, the
        host gives only what it owns (the request slots, their allocations as the lengths' bound, the uniforms).
        -> the verify input's `(parent_list, top_scores_index, draft_tokens)` in request order on the device, and the
        round's host part, `_Pending`: per request its summary (`encode_packed`'s check, then recon_rows, recon_kept,
        repriced_kept) on its way to the host and how its round ran (`round_graph`); with a round log, the packed
        trees."""
        shape, bs = self.pr_shape, len(batch.reqs)
        dev = batch.seq_lens.device
        parent_list = torch.full((bs, width), -1, dtype=torch.long, device=dev)
        top_scores_index = torch.empty((bs, shape.budget), dtype=torch.long, device=dev)
        draft_tokens = torch.empty((bs, shape.budget), dtype=torch.long, device=dev)
        summary = torch.empty((bs, 6), dtype=torch.long, device=dev)
        groups, graph, graph_batch, built = {}, ["off"] * bs, [0] * bs, []
        for b, req in enumerate(batch.reqs):
            groups.setdefault(id(self._builder(req)), []).append(b)
        for members in groups.values():
            builder = self._builder(batch.reqs[members[0]])
            self.pr_rows.prepare(batch, draft_input)
            with part("load"):
                requests = [BatchRequest(PoolContext(self.pr_rt.drafter, self._length_bound(batch.reqs[b]),
                                                     seam.req_pool_idx(batch.reqs[b]), batch.seq_lens[b]),
                                         draft_input.bonus_tokens[b], draft_input.hidden_states[b],
                                         self._generator(batch.reqs[b]))
                            for b in members]
            size = padded_size(len(members), self.pr_sizes)  # a captured size: padding requests fill it
            requests += [self._pad_request(draft_input)] * (size - len(members))
            packed, kept = builder.build_packed(requests)
            packed, kept = packed[: len(members)], kept[: len(members)]
            with part("encoding"):
                at = to_device(members, dev)
                *parts, check = encode_packed(packed, shape.budget, shape.k, width)
                for out, one in zip((parent_list, top_scores_index, draft_tokens), parts):
                    out.index_copy_(0, at, one.to(dev))
                summary.index_copy_(0, at, torch.cat([check, round_counts(packed, shape.budget, shape.k)], 1).to(dev))
            graphs = self.pr_rows.graphs
            ran = "off" if graphs is None else graphs.last if self.pr_rows.in_graph else "eager"
            for b in members:
                graph[b], graph_batch[b] = ran, size
            if self.pr_log:  # for the round log's trees (valid until this batch size's next round)
                built.append((builder, packed, kept, members, size))
        pending = _Pending(*_to_host(summary), [req.rid for req in batch.reqs],
                           [seam.kv_allocated_len(req) for req in batch.reqs], graph, graph_batch,
                           batch.seq_lens.clone() if self.pr_log else None, built, list(batch.reqs))
        return (parent_list, top_scores_index, draft_tokens), pending

    def _pad_request(self, draft_input) -> BatchRequest:
        """A padding request of a captured round: SGLang's padding request slot 0 (its rows' KV writes go to the
        padding KV slot 0), a context of one row, root token 0, a zero feature; its tree is drafted and dropped."""
        if self.pr_pad is None:
            dev, feature = draft_input.hidden_states.device, draft_input.hidden_states[0]
            ctx = PoolContext(self.pr_rt.drafter, 1, 0, torch.ones((), dtype=torch.long, device=dev), pad=True)
            self.pr_pad = BatchRequest(ctx, torch.zeros((), dtype=torch.long, device=dev), torch.zeros_like(feature),
                                       torch.Generator().manual_seed(0))
        return self.pr_pad

    def _length_bound(self, req) -> int:
        """An upper bound of a request's context length the host holds: its allocated KV slots (SGLang's V2
        decode allocates them from the host's committed length before each round), else the request table's width."""
        allocated = int(seam.kv_allocated_len(req) or 0)
        return allocated if allocated > 0 else self.req_to_token_pool.req_to_token.shape[1]

    def _settle(self) -> None:
        """Every pending round's host part, where not yet settled (`_settle_round`): with a round log, right after
        the verify (`PREagleWorkerV2.forward_batch_generation`)."""
        for p in self.pr_pending:
            if p.counts is None:
                self._settle_round(p)

    def pr_verified(self) -> None:
        """SGLang has the oldest pending round's verify result on the host (`on_verify_complete_cpu`, after the
        result's copy is done, so its summary is too): the round settled where still pending (`_settle_round`) and
        recorded into each request's meta info (`admission.record_round`), for the requests SGLang counts it for:
        neither finished nor retracted (the round an overlap schedule drafts after a request's last is dropped)."""
        if not self.pr_pending:
            return
        p = self.pr_pending.popleft()
        if p.counts is None:
            self._settle_round(p)
        for req, counts in zip(p.reqs, p.counts):
            if not (req.finished() or getattr(req, "is_retracted", False)):
                record_round(req, counts[0], counts[1])

    def _settle_round(self, p: _Pending) -> None:
        """The host's part of a round of the `sglang` path: its encodings checked (`check_encoded`), its
        counters summed and, with a round log, its lines written. `draft` leaves it pending so that nothing in the
        draft waits for the device; it is settled when SGLang processes the round's verify result (`pr_verified`),
        or with a round log right after its verify (`_settle`)."""
        if p.eagle3:
            return self._settle_eagle3(p)
        if p.done is not None:
            p.done.synchronize()
        shape = self.pr_shape
        lengths = p.seq_lens.tolist() if p.seq_lens is not None else [None] * len(p.rids)
        trees = [None] * len(p.rids)
        for builder, packed, kept, members, size in p.built:
            for b, tree in zip(members, builder.unpack(packed.cpu(), kept, [lengths[b] for b in members], size=size)):
                trees[b] = tree
        p.counts = [s[3:] for s in p.summary.tolist()]
        for b, s in enumerate(p.summary.tolist()):
            check_encoded(s[:3], shape.budget, shape.k, shape.parent_width())
            self._count(p.rids[b], lengths[b], s[3:], trees[b], len(p.rids), _kv_room(p.allocated[b], lengths[b]),
                        p.graph[b], p.graph_batch[b])

    def _settle_eagle3(self, p: _Pending) -> None:
        """A round SGLang's own draft made: no reconsideration row, so every counter is 0; with a round log, its
        trees read back from its verify input (`trees_of_verify`)."""
        n = len(p.rids)
        lengths = p.seq_lens.tolist() if p.seq_lens is not None else [None] * n
        trees = [None] * n
        if p.verify is not None:
            v = p.verify
            trees = [_LoggedTree(*t) for t in trees_of_verify(v.draft_token.cpu(), v.retrieve_next_token.cpu(),
                                                               v.retrieve_next_sibling.cpu(), v.draft_token_num)]
        p.counts = [[0] * len(COUNTERS) for _ in range(n)]
        for b in range(n):
            self._count(p.rids[b], lengths[b], p.counts[b], trees[b], n, _kv_room(p.allocated[b], lengths[b]),
                        p.graph[b], p.graph_batch[b], rows="eagle3")

    def _count(self, rid: str, seq_len, counts, tree, batch_size: int, kv_room, graph: str, graph_batch: int = 0,
               rows: Optional[str] = None) -> None:
        """A request's round: its counters (`counts` = recon_rows, recon_kept, repriced_kept) into the worker's totals
        and, with a round log, its line (`tree`: the round's tree)."""
        self.pr_totals["rounds"] += 1
        for name, value in zip(COUNTERS, counts):
            self.pr_totals[name] += int(value)
        if self.pr_log:
            readouts = self.pr_rows.readouts if self.pr_rows is not None else "request"
            attention = self.pr_rows.attention if self.pr_rows is not None else "ours"
            invariant = self.pr_row_invariant
            if rows == "eagle3":  # SGLang's own draft ran: none of PR's rows, readouts or their invariance
                readouts = attention = invariant = None
            line = {"rid": rid, "seq_len": seq_len, "rows": rows or self.pr_mode, "readouts": readouts,
                    "attention": attention,
                    "graph": graph, "graph_batch": graph_batch,
                    "row_invariant": invariant, "batch": batch_size, "kv_room": kv_room,
                    "tokens": tree.tokens(), "parents": tree.parents(),
                    **{name: int(value) for name, value in zip(COUNTERS, counts)}}
            with open(self.pr_log, "a") as f:
                f.write(json.dumps(line) + "\n")

    @torch.no_grad()
    def draft(self, batch, with_topology: bool = False):
        if with_topology:  # SGLang 0.5.22+ asks for it under pipeline parallelism only
            raise RuntimeError("PR_EAGLE3 drafts on one rank: pipeline parallelism (draft with_topology) is not supported")
        shape = self.pr_shape
        if batch.forward_mode.is_idle():
            return seam.idle_verify_input(self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens,
                                          batch.seq_lens.device)
        while len(self.pr_pending) > MAX_PENDING:  # rounds SGLang never reported verified: settled, not recorded
            log.warning(UNREPORTED_LINE)
            p = self.pr_pending.popleft()
            if p.counts is None:
                self._settle_round(p)
        if self._eagle3_batch(batch):
            return self._eagle3_draft(batch)
        draft_input = batch.spec_info
        width = shape.parent_width()
        if self.pr_rows is not None:
            with self._host_read_check():
                verify, pending = self._batched_rounds(batch, draft_input, width)
            self.pr_pending.append(pending)
        else:
            lengths = batch.seq_lens.tolist()
            rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
            bonus = draft_input.bonus_tokens.tolist()
            trees = [self._round(req, rows[b, : lengths[b]].long(), int(bonus[b]), draft_input.hidden_states[b])
                     for b, req in enumerate(batch.reqs)]
            verify = self._encode(trees, width)
            counts = [[getattr(tree, name) for name in COUNTERS] for tree in trees]
            for b, (tree, req) in enumerate(zip(trees, batch.reqs)):
                self._count(req.rid, lengths[b], counts[b], tree, len(trees),
                            _kv_room(seam.kv_allocated_len(req), lengths[b]), "off")
            self.pr_pending.append(_Pending(None, None, [], [], [], [], None, [], list(batch.reqs), counts))
        with part("verify_input"):  # SGLang's own tree build, as its EAGLE3's draft builds its verify input
            return self._verify_input(batch, draft_input, *verify)

    def _eagle3_batch(self, batch) -> bool:
        """Whether SGLang's own EAGLE-3 draft drafts this batch (`PR_EAGLE3_M0_DRAFT=sglang`, the default): every
        request at m = 0 with B_w = k, where PR's round forwards EAGLE-3's rows and keeps EAGLE-3's tree, node for
        node (docs/serving.md), so the draft is SGLang's own, op for op. A batch with one reconsidering request
        (or B_w != k) is PR's round for all."""
        if not self.pr_m0_draft:
            return False
        for req in batch.reqs:
            shape = worker_shape(req, self.pr_shape, self.pr_max_rows)
            if shape.m != 0 or shape.bw != self.topk:
                return False
        return True

    def _eagle3_draft(self, batch):
        """SGLang's own draft (`EagleDraftWorker.draft`: its draft forwards, top-k selection, tree and verify input),
        with the round's host part left pending as PR's rounds are (`pr_verified`: counters 0, meta info)."""
        verify = EagleDraftWorker.draft(self, batch)
        bs = len(batch.reqs)
        self.pr_pending.append(_Pending(None, None, [req.rid for req in batch.reqs],
                                        [seam.kv_allocated_len(req) for req in batch.reqs], ["eagle3"] * bs, [0] * bs,
                                        batch.seq_lens.clone() if self.pr_log else None, [], list(batch.reqs),
                                        eagle3=True, verify=verify if self.pr_log else None))
        return verify

    def _host_read_check(self):
        """With `PR_EAGLE3_CHECK_HOST_READS=on` (a debugging aid: a Python call per torch operation), the round runs
        under `NoHostReads(host_data=True)`: host values may come in, and any read that would wait for the device
        fails the draft in one line, but for the parts that read by design (`host_reads_allowed`: SGLang's
        `ForwardBatch` at a graph key's first round and in eager rounds, an eager round's attention metadata)."""
        if not self.pr_check_reads:
            return contextlib.nullcontext()
        return NoHostReads("PR_EAGLE3's draft (PR_EAGLE3_CHECK_HOST_READS=on)", host_data=True)

    def _encode(self, trees, width: int):
        """The `ours` path's trees, encoded on the host one by one (`encoding.encode_tree`)."""
        n, k = self.pr_shape.budget, self.pr_shape.k
        parent_list = torch.full((len(trees), width), -1, dtype=torch.long)
        top_scores_index = torch.empty((len(trees), n), dtype=torch.long)
        draft_tokens = torch.empty((len(trees), n), dtype=torch.long)
        for b, tree in enumerate(trees):
            if len(tree.tokens()) != n + 1:
                raise RuntimeError(f"PR_EAGLE3: a round kept {len(tree.tokens()) - 1} nodes, not B={n}")
            parents, scores = encode_tree(tree.parents(), tree.via_recon_list, k, width)
            order = sorted(range(n), key=scores.__getitem__)
            parent_list[b] = torch.tensor(parents)
            top_scores_index[b] = torch.tensor([scores[i] for i in order])
            draft_tokens[b] = torch.tensor([tree.tokens()[i + 1] for i in order])
        return parent_list, top_scores_index, draft_tokens

    def _verify_input(self, batch, draft_input, parent_list, top_scores_index, draft_tokens) -> EagleVerifyInput:
        """SGLang's own tree build (`build_tree_kernel_efficient`, groups 2k wide, into the target backend's verify
        buffers: `seam.build_tree`) and verify input. The build sizes an unallocated tree mask by the lengths' sum:
        the batch's host sum, else (as SGLang's own draft does, with no host read) an upper bound, the backend's
        longest context (else the request table's width) per request."""
        shape, dev = self.pr_shape, batch.seq_lens.device
        backend = self.target_worker.model_runner.attn_backend
        longest = getattr(backend, "max_context_len", None) or self.req_to_token_pool.req_to_token.shape[1]
        tree_mask, position, retrieve_index, retrieve_next_token, retrieve_next_sibling, tokens = seam.build_tree(
            backend, self.tree_mask_mode, draft_input.bonus_tokens, parent_list.to(dev), top_scores_index.to(dev),
            draft_tokens.to(dev), batch.seq_lens, batch.seq_lens_sum, 2 * shape.k, shape.kernel_steps(),
            shape.budget + 1, len(batch.reqs), longest)
        return EagleVerifyInput(
            draft_token=tokens, custom_mask=tree_mask, positions=position, retrieve_index=retrieve_index,
            retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
            retrieve_cum_len=None, spec_steps=shape.gamma, topk=shape.k, draft_token_num=shape.budget + 1,
            capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None, draft_probs=None)


class PREagleWorkerV2(EAGLEWorkerV2):
    """SGLang's V2 EAGLE worker with `PRDraftWorker` as its draft worker."""

    def __init__(self, *args, **kwargs):
        mode = rows_for(kwargs["server_args"] if "server_args" in kwargs else args[0])
        with use_for_draft() if mode == "sglang" else contextlib.nullcontext():  # the draft model's class
            super().__init__(*args, **kwargs)
        self._draft_worker.__class__ = PRDraftWorker
        self._draft_worker.pr_setup(mode)
        log.info("PR_EAGLE3 draft worker ready: %s, rows: %s, pr_specforge from %s", self._draft_worker.pr_shape, mode,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the installed package or a checkout

    def forward_batch_generation(self, batch, *args, **kwargs):
        out = super().forward_batch_generation(batch, *args, **kwargs)
        if self._draft_worker.pr_log:  # a round log is written as each round ends (else when SGLang processes it)
            self._draft_worker._settle()
        return out

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        """SGLang's hook after a decode batch's verify result is on the host: that round's host part
        (`PRDraftWorker.pr_verified`: counters, each request's meta info)."""
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        self._draft_worker.pr_verified()
