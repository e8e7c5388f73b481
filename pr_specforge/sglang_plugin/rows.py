"""A PR draft step's rows through SGLang's draft model runner: ONE call per step for every running request.

Owns:
  * `env_mode` - how every `PR_EAGLE3_*` mode switch is read; `rows_mode` - the switch `PR_EAGLE3_ROWS`: `sglang` (this module; the default where it can serve, see
    `checks.check_rows`) or `ours` (each request's context is copied into our eager `DrafterRuntime`, which
    runs the rows request by request).
  * `PoolContext` - a request's committed drafter context as it lies in SGLang's draft KV pool (its
    `req_to_token` row and length): what `serving.batched_tree.BatchedTreeBuilder` takes in place of a runtime.
  * `SGLangRows` - the builder's row forwards (`begin` / `root` / `step`, the seam `batched_tree.RuntimeRows`
    defines) through SGLang: each step's `B_w + m` rows of every request are one DECODE `ForwardBatch` of
    SGLang's draft model runner (`draft_model.PRDraftModel`), each row with its position, its token, its
    hidden slot, and its explicit KV-slot list (`row_attention.row_kv_lists`) in `spec_info.kv_indptr /
    kv_indices`, run under the row attention `PR_EAGLE3_ROW_ATTENTION` picks (`row_attention`: our
    `RowListAttnBackend` on a CPU, SGLang's own `TritonAttnBackend` on CUDA or when asked). Readouts (heads and gate), by
    `PR_EAGLE3_READOUTS`: `batched` (the default) reads every request's rows of a step in one call per head
    (`tensor_tree.batch_step_readouts`; the per-request values bit for bit where
    `drafter_runtime.readouts_row_invariant` holds, which the worker checks at start-up and logs); `request` reads
    them request by request (`tensor_tree.step_readouts`), as the per-request builder does.

Captured rounds (`round_graph`, `PR_EAGLE3_ROUND_GRAPH`). A round whose step rows fit `graph_rows` runs on fixed
buffers, one set (and one graph) per B_w, m, batch size and context bucket (`context_bucket`: the next power of two
of the longest context, so a list's context part has that width, its tail past `kv_indptr[-1]` unread): the
requests' `req_to_token` rows to that width, their context lengths and tree-row slots, the
reconsideration rows' places and a `ForwardBatch` built once; each step plans the attention with the backend's
captured-decode metadata (`init_forward_metadata_out_graph(in_capture=True)`: the lists as they are, fixed work
buffers), and `run` hands the body to `RoundGraphs` (replayed from a CUDA graph, or guarded on a CPU).

KV slots. Tree row `r` of a round (row 0: the root, the last context row) lives at `req_to_token[req,
seq_len - 1 + r]`, the layout our runtime's buffer has: rows `1 ..` take the draft slots SGLang reserved
after the context (`(gamma - 1)(B_w + m)` of them; a decode reserves `2 max(steps k, B + 1)` there,
`mem_cache/common.py`, less up to gamma + 1 under the overlap schedule; logged as `kv_room` in the round log);
draft-extend overwrites them after verification. A shape whose rows outgrow that reservation is refused at start-up,
in one line (`checks.rows_room`, `check_rows`); the round itself reads no length on the host to check it again.
Padding requests (`PoolContext.pad`) write SGLang's padding KV slot 0.

Does not own: the tree (`serving.batched_tree`), the worker (`sglang_plugin.worker`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from pr_specforge.serving.batched_tree import READOUTS, RuntimeRows, check_readouts
from pr_specforge.serving.drafter_runtime import DrafterRuntime
from pr_specforge.serving.host_reads import host_reads_allowed, to_device
from pr_specforge.op_parts import part
from pr_specforge.serving.tensor_tree import TreeShape, batch_step_readouts, step_readouts
from pr_specforge.sglang_plugin.round_graph import GRAPH_ENV, GRAPH_MODES, RoundGraphs
from pr_specforge.sglang_plugin.row_attention import ATTENTION_ENV, ROW_ATTENTIONS, row_backend, row_kv_lists

ROWS_ENV = "PR_EAGLE3_ROWS"
ROWS_MODES = ("ours", "sglang")
READOUTS_ENV = "PR_EAGLE3_READOUTS"
M0_DRAFT_ENV = "PR_EAGLE3_M0_DRAFT"
M0_DRAFT_MODES = ("sglang", "pr")


def env_mode(name: str, modes: Sequence[str], default: Optional[str]) -> Optional[str]:
    """The switch `name` of the environment, stripped and lower-cased, `default` when unset or blank; ValueError,
    one line, for a value that is not one of `modes`. Every `PR_EAGLE3_*` mode switch reads through it."""
    mode = (os.environ.get(name) or "").strip().lower() or default
    if mode is not None and mode not in modes:
        raise ValueError(f"PR_EAGLE3: {name}={mode!r} is not one of {', '.join(modes)}")
    return mode


def rows_mode() -> Optional[str]:
    """`PR_EAGLE3_ROWS` as set (None when unset: `checks.check_rows` picks); ValueError, one line, for anything else."""
    return env_mode(ROWS_ENV, ROWS_MODES, None)


def m0_draft_mode() -> str:
    """`PR_EAGLE3_M0_DRAFT`: who drafts a batch whose every request is at m = 0 with B_w = k: `sglang` (the default:
    SGLang's own EAGLE-3 draft, EAGLE3's ops) or `pr` (PR's round with no reconsideration row, the same tree)."""
    return env_mode(M0_DRAFT_ENV, M0_DRAFT_MODES, "sglang")


def readouts_mode() -> str:
    """`PR_EAGLE3_READOUTS`: `batched` (the default: every request's rows of a step in one call per head) or
    `request` (request by request); ValueError, one line, for anything else. Read by the `sglang` row path."""
    return env_mode(READOUTS_ENV, READOUTS, "batched")


def round_graph_mode() -> str:
    """`PR_EAGLE3_ROUND_GRAPH`: `auto` (unset), `on` or `off` (`round_graph.resolve_round_graph` says what each means
    on a device); ValueError, one line, for anything else."""
    return env_mode(GRAPH_ENV, GRAPH_MODES, "auto")


def row_attention_mode() -> str:
    """`PR_EAGLE3_ROW_ATTENTION`: `auto` (unset), `torch_native` or `triton` (`row_attention.resolve_row_attention`
    says what each means on a device); ValueError, one line, for anything else."""
    return env_mode(ATTENTION_ENV, ROW_ATTENTIONS, "auto")


CONTEXT_BUCKET_MIN = 128


def context_bucket(longest: int, cap: int) -> int:
    """The context width of a captured round whose longest context before the root is `longest`: the next power of
    two (at least `CONTEXT_BUCKET_MIN`), at most `cap` (the `req_to_token` table's width). A step's lists take
    `rows x (width + tree rows)` entries, so a width of the whole table would cost a long-context model gigabytes."""
    width = CONTEXT_BUCKET_MIN
    while width < longest:
        width *= 2
    return min(width, cap)


@dataclass
class PoolContext:
    """A request's drafter context in SGLang's draft KV pool: its `req_to_token` row, and its rows (the root is the
    last) twice: `on_device`, the exact count as a 0-d tensor on the device (what the round reads: `batch.seq_lens`,
    which SGLang's overlap schedule resolves on the device), and `length`, an upper bound the host knows without
    reading the device (the request's allocated slots, `req.kv_allocated_len`), which sizes the context lists."""

    drafter: torch.nn.Module
    length: int
    req_pool_index: int
    on_device: torch.Tensor
    pad: bool = False  # a padding request of a captured round (its rows write SGLang's padding KV slot 0)


class SGLangRows(RuntimeRows):
    """The row forwards of `BatchedTreeBuilder` through SGLang's draft model runner (see the module doc)."""

    def __init__(self, draft_runner, rt: DrafterRuntime, readouts: str = "batched",
                 attention: str = "torch_native", graphs: Optional[RoundGraphs] = None, graph_rows: int = 0) -> None:
        self.runner, self.rt, self.readouts = draft_runner, rt, check_readouts(readouts)
        self.attention = attention  # resolved (`row_attention.resolve_row_attention`): torch_native or triton
        self.backend = row_backend(draft_runner, attention)
        self.batch = self.draft_input = None
        # `round_graph`: rounds whose B_w + m rows of every request fit `graph_rows` rows per step run on fixed
        # buffers (`self.fixed`, one set per B_w, m, batch size and context bucket), captured or guarded by `graphs`
        self.graphs, self.graph_rows, self.fixed, self.in_graph = graphs, graph_rows, {}, False
        if graphs is not None and attention == "triton":  # the decode's fixed work buffers; SGLang's own slot table
            # buffer is not used (the lists are the rows'), so it gets one entry
            self.backend.init_cuda_graph_state(graph_rows, graph_rows,
                                               kv_indices_buf=torch.zeros(1, dtype=torch.int64, device=rt.device))

    def prepare(self, batch, draft_input) -> None:
        """The round's SGLang batch (a DECODE batch) and its draft input; call before `BatchedTreeBuilder.build`."""
        self.batch, self.draft_input = batch, draft_input

    def begin(self, tb: TreeShape, ctxs: Sequence[PoolContext]) -> None:
        self.tb, self.rts = tb, [self.rt] * len(ctxs)  # `RuntimeRows.root` reads through the shared runtime
        dev = self.rt.device  # the draft slots the rows take: `checks.rows_room`, checked at start-up
        pool = self.runner.req_to_token_pool.req_to_token
        table = pool[to_device([c.req_pool_index for c in ctxs], pool.device)].to(dev)
        if any(c.pad for c in ctxs):  # padding requests: every slot is SGLang's padding slot 0
            table.masked_fill_(to_device([c.pad for c in ctxs], dev, torch.bool)[:, None], 0)
        ctx_len = torch.stack([c.on_device.reshape(()) for c in ctxs]).to(dev, torch.long) - 1  # no host read
        b, p = len(ctxs), tb.per_step
        self.in_graph = self.graphs is not None and b * p <= self.graph_rows
        cols = ctx_len[:, None] + torch.arange(tb.n_rows, device=dev)
        longest = max(c.length for c in ctxs) - 1  # an upper bound: the lists read `ctx_len` entries of each row
        if self.in_graph:  # the fixed buffers of this B_w, m, batch size and context bucket
            width = context_bucket(longest, table.shape[1])
            self.graph_key = f"B_w {tb.bw}, m {tb.m}, batch {b}, context <= {width}"
            f = self.fixed.get(self.graph_key) or self.fixed.setdefault(self.graph_key, self._fixed(tb, b, width))
            f.ctx_slots.copy_(table[:, :width])
            f.ctx_len.copy_(ctx_len)
            f.row_slots.copy_(table.gather(1, cols))
            self.ctx_slots, self.ctx_len, self.row_slots = f.ctx_slots, f.ctx_len, f.row_slots
            self.recon_index, self.fb, self.spec = f.recon_index, f.fb, f.spec
            return
        self.ctx_len = ctx_len
        self.ctx_slots = table[:, :longest].long()
        self.row_slots = table.gather(1, cols).long()
        self.recon_index = self._recon_index(tb, b)
        self.fb, self.spec = self._forward_batch(b * p)

    def root_positions(self) -> torch.Tensor:
        return self.ctx_len[:, None]

    def _recon_index(self, tb: TreeShape, b: int) -> torch.Tensor:
        """The reconsideration rows' places among a step's `b (B_w + m)` rows (request-major)."""
        dev, p = self.rt.device, tb.per_step
        return (torch.arange(b, device=dev)[:, None] * p + torch.arange(tb.bw, p, device=dev)).reshape(-1)

    def _fixed(self, tb: TreeShape, b: int, width: int) -> SimpleNamespace:
        """A captured round's fixed buffers: its requests' context slots (`width` columns), context lengths and
        tree-row slots, the reconsideration rows' places, and its `ForwardBatch` (built once, from the first such
        round)."""
        dev = self.rt.device
        fb, spec = self._forward_batch(b * tb.per_step)
        return SimpleNamespace(ctx_slots=torch.zeros(b, width, dtype=torch.long, device=dev),
                               ctx_len=torch.zeros(b, dtype=torch.long, device=dev),
                               row_slots=torch.zeros(b, tb.n_rows, dtype=torch.long, device=dev),
                               recon_index=self._recon_index(tb, b), fb=fb, spec=spec)

    def run(self, tb: TreeShape, size: int, body):
        """The round's device part: through `graphs` (replayed or guarded) where `begin` put it on fixed buffers."""
        return self.graphs.run(self.graph_key, body) if self.in_graph else body()

    def _forward_batch(self, n: int):
        """A DECODE `ForwardBatch` of `n` rows over the round's requests (SGLang's own constructor); the steps fill it."""
        from pr_specforge.sglang_plugin.seam import draft_forward_batch

        batch, spec = self.batch, copy.copy(self.draft_input)
        spec.num_tokens_per_req = spec.num_tokens_for_logprob_per_req = self.tb.per_step
        spec.positions = None
        saved = batch.spec_info, batch.out_cache_loc
        batch.spec_info, batch.out_cache_loc = spec, torch.zeros(n, dtype=torch.int64, device=self.rt.device)
        try:  # SGLang's constructor reads the batch's host mirrors: once per graph key, and in every eager round
            with host_reads_allowed():
                fb = draft_forward_batch(batch, self.runner)
        finally:
            batch.spec_info, batch.out_cache_loc = saved
        return fb, spec

    def forward_rows(self, fb) -> torch.Tensor:
        """ONE call of SGLang's draft model for every request's rows of a step (its metadata planned): their
        pre-norm features. The model's forward itself, as SGLang's eager decode calls it, not `ModelRunner.forward`,
        whose decode-graph dispatch is for SGLang's own batches."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        with forward_context(ForwardContext(attn_backend=self.backend)):
            return self.runner.model.forward(fb.input_ids, fb.positions, fb).hidden_states

    def step(self, st, ids, hidden, rec_feat, pos, visible, feat_out, logp_out) -> Optional[torch.Tensor]:
        tb, rt, fb, spec = self.tb, self.rt, self.fb, self.spec
        b, p = ids.shape[0], tb.per_step
        tokens = rt.to_target_ids(ids)
        if rec_feat is not None:  # Eq. 3: the hidden slot holds f^{r-1} as fed back; the model adds Q(.) itself
            tokens = torch.cat([tokens, tokens.new_zeros(b, tb.m)], 1)
            hidden = torch.cat([hidden, rt.feedback(rec_feat).to(hidden.dtype)], 1)
        fb.input_ids, fb.positions = tokens.reshape(b * p), pos.reshape(b * p).long()
        fb.out_cache_loc = self.row_slots[:, st.r0 : st.r0 + p].reshape(b * p)
        spec.hidden_states = hidden.reshape(b * p, -1).to(rt.dtype)
        spec.kv_indptr, spec.kv_indices = row_kv_lists(self.ctx_slots, self.ctx_len, self.row_slots, visible)
        spec.pr_recon_index = self.recon_index if tb.m else self.recon_index[:0]
        if self.in_graph:  # the lists as they are, on the backend's fixed work buffers (a decode graph's metadata)
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        else:  # an eager plan sizes its work from the lists on the host (ours reads the longest; SGLang's eager
            with host_reads_allowed():  # decode metadata likewise)
                self.backend.init_forward_metadata(fb)
        fb.mark_forward_metadata_ready()
        feats = self.forward_rows(fb)
        feats = feats.reshape(b, p, -1).to(feat_out.dtype)
        feat_out.copy_(feats)
        with part("readouts"):
            if self.readouts == "batched":  # one call per head for every request's rows
                return batch_step_readouts(tb, rt, feat_out, logp_out)
            lams = [step_readouts(tb, rt, feats[i], logp_out[i])[1] for i in range(b)]
            return torch.stack(lams) if tb.m else None
