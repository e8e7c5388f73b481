"""One drafting round for every running request at once: the tensor tree with a leading batch dimension.

Owns:
  * `BatchRequest` — what a request brings to a round: its `DrafterRuntime` (the committed
    context's KV), the root token and feature, and its own seeded generator.
  * `BatchedTreeBuilder` — builds, for each request of the batch, the round of
    `tensor_tree.TensorTreeBuilder`: the frontier, the pool's picks (the bids of Eq. 8),
    admission and halting, Eq. 9 repricing, the global cut and the result's packing are tensor
    operations over `[batch, ...]` buffers, one set of kernels per step for the whole batch;
    the batch's results come to the host in ONE copy per round (`host_reads` counts them).
  * `RuntimeRows` — the row forwards (calls of `M`, self-query inputs), request by request
    through each request's own runtime with the per-request builder's calls
    (`tensor_tree.step_row_features`), and the readouts and gate: `batched` (the default), one
    call per head and step for every request's rows (`tensor_tree.batch_step_readouts`, the same
    bits as request by request where `drafter_runtime.readouts_row_invariant` holds: every
    readout pads its rows, see `DrafterRuntime.READOUT_ROWS`), or `request`, the per-request
    builder's (`tensor_tree.root_readout`, `tensor_tree.forward_step_rows`). An engine's batched
    forward (one call of `M` over every request's rows) replaces it through the same three
    methods: `begin` (the round's requests), `root`, `step`, and `run` (how the round's device part runs:
    `BatchedTreeBuilder._body`, free of host reads, so that it can be captured as one graph).

The batch is rebuilt every round from the requests passed to `build`: a request joins by being
passed and leaves by not being passed. Nothing of a round outlives it (the per-request builder's
buffers carry nothing across rounds either), so a request's tree depends only on its own state:
its runtime, its root and its generator, which the round draws `uniform_count(cfg)` uniforms
from exactly as the per-request builder does. Buffers are allocated once per batch size and
reused (fixed shapes for each batch size, as an engine captures graphs per batch size).

Equal to the per-request builder bit for bit (tested in fp32; with batched readouts, where the machine's
readouts are row-invariant, as on this project's CPU): the layout is the same
(`tensor_tree.TreeShape`), selections are stable sorts and top-k along the last dimension,
elementwise operations do not depend on their neighbours, integer and 0/1 products are exact, and
the sums whose order matters only in a comparison with 0 (`repriced`) are of non-negative
terms. Eq. 9's propagation has a fixed order in both builders (`tensor_tree.shift_terms`: one
exact term per reconsidered row and node, added in reconsidered-row order), so it is one set of
operations for the whole batch, with no loop over the requests.

Does not own: the tree's layout and the one-request builder (`tensor_tree`), the reference
algorithm (`tree`), the runtime (`drafter_runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Union

import torch

from pr_specforge.serving.drafter_runtime import DrafterRuntime
from pr_specforge.serving.host_reads import to_device
from pr_specforge.op_parts import part, step as row_step
from pr_specforge.serving.tensor_tree import (
    NEG,
    TensorDraftTree,
    TensorTreeBuilder,
    TreeShape,
    _Step,
    batch_root_readout,
    batch_step_readouts,
    forward_step_rows,
    root_readout,
    shift_terms,
    step_row_features,
    unpack_round,
)
from pr_specforge.serving.tree import TreeConfig, round_uniforms, uniform_count


@dataclass
class BatchRequest:
    """One request's part of a round. `generator` drives its admissions and halts (keep one per request)."""

    rt: DrafterRuntime
    root_token: Union[int, torch.Tensor]  # a 0-d tensor (on the device: no host read) or a number
    root_feature: torch.Tensor
    generator: Optional[torch.Generator] = None


READOUTS = ("batched", "request")


def check_readouts(readouts: str) -> str:
    if readouts not in READOUTS:
        raise ValueError(f"readouts={readouts!r} is not one of {', '.join(READOUTS)}")
    return readouts


class RuntimeRows:
    """The batch's row forwards through each request's own runtime, with the per-request builder's calls.

    `readouts`: `batched` (the default) reads every request's rows in one call per head and step
    (`tensor_tree.batch_step_readouts`: the same bits as `request` where `readouts_row_invariant` holds);
    `request` reads them request by request, as the per-request builder does."""

    def __init__(self, readouts: str = "batched") -> None:
        self.readouts = check_readouts(readouts)

    def begin(self, tb: TreeShape, rts: Sequence[DrafterRuntime]) -> None:
        """The round's requests: room for their tree rows, and each one's additive tree-attention mask."""
        self.tb, self.rts, self.ctx, self.masks = tb, list(rts), [], []
        for rt in rts:
            ctx = rt.length - 1  # tree row r sits at column ctx + r (row 0: the root's own)
            rt.reserve(ctx + tb.n_rows)
            self.ctx.append(ctx)
            self.masks.append(torch.zeros((tb.n_rows, ctx + tb.n_rows), device=rt.device, dtype=rt.dtype))

    def root_positions(self) -> torch.Tensor:
        """The round's root positions `[b, 1]` (a request's last context row), from `begin`'s requests."""
        return to_device([[ctx] for ctx in self.ctx], self.rts[0].device)

    def run(self, tb: TreeShape, size: int, body):
        """The round's device part for `size` requests, `body()` -> (packed result, kept nodes): run here as it
        is (`sglang_plugin.rows.SGLangRows` may replay it as a captured graph)."""
        return body()

    def root(self, feats: torch.Tensor, logp_out: torch.Tensor) -> Optional[torch.Tensor]:
        """Root readouts `[b, 1, Vd]` written into `logp_out`; lambda_0 `[b, 1]` with a pool."""
        if self.readouts == "batched":
            return batch_root_readout(self.rts[0], feats, self.tb.pool_on, logp_out)
        lams = [root_readout(rt, feats[b], self.tb.pool_on, logp_out[b])[1] for b, rt in enumerate(self.rts)]
        return torch.stack(lams) if self.tb.pool_on else None

    def step(self, st: _Step, ids, hidden, rec_feat, pos, visible, feat_out, logp_out) -> Optional[torch.Tensor]:
        """One step's rows of every request (`[b, rows, ...]`); `visible [b, rows, n_rows]`: the tree rows each
        row sees. Writes features and readouts into `feat_out`, `logp_out`; returns lambda `[b, rows]` with a pool."""
        tb, lams = self.tb, []
        for b, rt in enumerate(self.rts):
            mask = self.masks[b][st.r0 : st.r0 + tb.per_step]
            mask[:, self.ctx[b] :] = torch.where(visible[b], 0.0, NEG)
            args = (tb, rt, ids[b], hidden[b], None if rec_feat is None else rec_feat[b], pos[b], self.ctx[b] + st.r0,
                    mask, rt.length - 1 + tb.cfg.gamma, feat_out[b])
            if self.readouts == "batched":
                step_row_features(*args)
            else:
                lams.append(forward_step_rows(*args, logp_out[b])[1])
        if self.readouts == "batched":
            with part("readouts"):
                return batch_step_readouts(tb, self.rts[0], feat_out, logp_out)
        return torch.stack(lams) if tb.m else None


class _Batch:
    """One batch size's round buffers: the per-request builder's, with a leading batch dimension."""

    def __init__(self, tb: TreeShape, size: int) -> None:
        rt, dev, n, r, k = tb.rt, tb.rt.device, tb.n_nodes + 1, tb.n_rows + 1, tb.k
        f64, i64 = dict(device=dev, dtype=torch.float64), dict(device=dev, dtype=torch.long)
        flag = dict(device=dev, dtype=torch.bool)
        self.size = size
        self.bi = torch.arange(size, device=dev)[:, None]  # the batch index, for advanced indexing
        self.score, self.shifted = torch.zeros(size, n, **f64), torch.zeros(size, n, **f64)
        self.draft = torch.zeros(size, n, **i64)
        self.valid = torch.zeros(size, n, **flag)
        self.valid[:, 1 : 1 + k] = True
        self.anc = tb.initial_ancestors().repeat(size, 1, 1)
        self.row_of = torch.full((size, n), -1, **i64)
        self.row_node = torch.full((size, r), tb.null, **i64)
        self.row_node[:, 0] = 0
        self.row_feat = torch.zeros(size, r, rt.drafter.config.hidden_size, device=dev, dtype=rt.dtype)
        self.row_logp = torch.zeros(size, r, rt.draft_vocab_size, device=dev, dtype=torch.float32)
        self.row_topv = torch.zeros(size, r, k, device=dev, dtype=torch.float32)
        self.row_ok = torch.zeros(size, r, **flag)
        self.row_ok[:, 0] = True
        self.pooled = torch.zeros(size, r, **flag)
        self.u, self.bid_base, self.survive = (torch.zeros(size, r, **f64) for _ in range(3))
        self.depth_r, self.cur_row = torch.zeros(size, r, **i64), torch.zeros(size, r, **i64)
        self.root_tok = torch.zeros(size, **i64)
        self.root_pos = torch.zeros(size, 1, **i64)  # the root row's position

    def reset(self) -> None:
        for t in (self.shifted, self.pooled, self.depth_r):
            t.zero_()
        self.row_of.fill_(-1)
        self.row_of[:, 0] = 0
        self.cur_row.copy_(torch.arange(self.cur_row.shape[1], device=self.cur_row.device).expand_as(self.cur_row))


class BatchedTreeBuilder(TreeShape):
    """The round of `TensorTreeBuilder` for a batch of requests that share one drafter (`rt`: any runtime of it)."""

    def __init__(self, rt: DrafterRuntime, cfg: TreeConfig, coforward: bool = True,
                 rows: Optional[RuntimeRows] = None) -> None:
        super().__init__(rt, cfg, coforward)
        self.rows = rows if rows is not None else RuntimeRows()
        self.host_reads = 0  # host synchronisations issued by `build`: one per round, whatever the batch size
        self._batches: Dict[int, _Batch] = {}

    def _check(self, i: int, req: BatchRequest) -> DrafterRuntime:
        if req.rt.drafter is not self.rt.drafter:
            raise ValueError(f"request {i}: its runtime wraps another drafter than the builder's")
        if req.rt.length < 1:
            raise ValueError(f"request {i}: the drafter context is empty: call DrafterRuntime.extend before drafting")
        return req.rt

    @torch.no_grad()
    def build(self, requests: Sequence[BatchRequest], keep_state: bool = False) -> List[TensorDraftTree]:
        """One round for every request passed (in order); the trees `TensorTreeBuilder.build` gives each alone."""
        if not requests:
            return []
        packed, kept = self.build_packed(requests)
        host = packed.cpu()  # the round's one synchronisation, for the whole batch
        self.host_reads += 1
        return self.unpack(host, kept, [req.rt.length for req in requests], keep_state)

    def build_packed(self, requests: Sequence[BatchRequest]):
        """The round on the device, no host read: `(packed [b, L], kept [b, B + 1])`, `packed` in
        `tensor_tree.unpack_round`'s layout (`serving`'s engines encode their verify input from it on the device,
        `sglang_plugin.encoding.encode_packed`). Valid until the next round of this batch size."""
        rts = [self._check(i, req) for i, req in enumerate(requests)]
        x = self._batches.get(len(requests)) or self._batches.setdefault(len(requests), _Batch(self, len(requests)))
        with part("load"):  # the round's inputs: its rows' slots, roots, uniforms
            self.rows.begin(self, rts)
            self._load(x, requests)
        return self.rows.run(self, x.size, lambda: self._body(x))

    def unpack(self, host: torch.Tensor, kept: torch.Tensor, lengths: Sequence[int],
               keep_state: bool = False, size: Optional[int] = None) -> List[TensorDraftTree]:
        """The trees of the latest round of `size` requests (default `len(lengths)`) from its packed result read to
        the host: those of its first `len(lengths)` requests (the rest: padding)."""
        x = self._batches[size or len(lengths)]
        trees = []
        for b, length in enumerate(lengths):
            tree = unpack_round(host[b], x.anc[b][kept[b]][:, kept[b]], length, self.cfg.budget, self.k)
            if keep_state:
                tree.state = self.state(x, b)
            trees.append(tree)
        return trees

    def _load(self, x: _Batch, requests: Sequence[BatchRequest]) -> None:
        """The round's inputs into the batch's fixed buffers: root tokens, features and positions (`rows`), uniforms;
        copies only (no host read where the tokens and positions are on the device)."""
        x.root_tok.copy_(torch.stack([torch.as_tensor(req.root_token).reshape(()) for req in requests]))
        x.row_feat[:, 0] = torch.stack([req.root_feature.reshape(-1) for req in requests]).to(self.rt.dtype)
        x.root_pos.copy_(self.rows.root_positions())
        if self.pool_on:
            u = torch.stack([round_uniforms(uniform_count(self.cfg), req.generator) for req in requests])
            x.u[:, : self.n_rows].copy_(u, non_blocking=True)

    def _body(self, x: _Batch):
        """The round on the device, from the loaded buffers to the packed result `[b, L]` and the kept nodes: no host
        read and no data-dependent shape (what `sglang_plugin.round_graph` captures as one graph per batch size)."""
        with part("tree"):  # the tree's own bookkeeping; its named parts below are labelled where they run
            x.reset()
            self._root(x)
            for st in self.steps:
                with row_step():  # the counter's row-step scope (a no-op unless counting)
                    self._step(x, st)
        with part("cut"):
            kept, ok, where = self._cut(x)
        with part("pack"):
            return self._pack(x, kept, ok, where), kept

    # ---------------------------------------------------------------- round
    def _root(self, x: _Batch) -> None:
        k = self.k
        with part("readouts"):
            lam = self.rows.root(x.row_feat[:, :1], x.row_logp[:, :1])
        top = torch.topk(x.row_logp[:, 0], k, dim=-1)
        x.row_topv[:, 0], x.draft[:, 1 : 1 + k] = top.values, top.indices
        x.score[:, 1 : 1 + k] = x.row_topv[:, 0]
        if self.pool_on:
            with part("pool"):
                self._admit(x.row_topv[:, :1, 0], lam.double(), x.u[:, :1], x.row_ok[:, :1],
                            x.pooled[:, :1], x.bid_base[:, :1], x.survive[:, :1])

    def _frontier(self, x: _Batch, st: _Step):
        """Per request, the B_w highest-scoring valid slots of the previous block (ties: earlier slot first)."""
        prev = slice(st.prev, st.prev + st.prev_n)
        valid_prev = x.valid[:, prev]
        order = torch.sort(torch.where(valid_prev, x.score[:, prev], NEG), dim=-1, descending=True, stable=True)
        order = order.indices[:, : self.bw]
        ok = valid_prev.gather(1, order)
        adv = torch.where(ok, order + st.prev, self.null)
        if st.pad.shape[0]:
            pad = st.pad.expand(x.size, -1)
            adv, ok = torch.cat([adv, pad], 1), torch.cat([ok, pad < 0], 1)
        return adv, ok

    def _pool_pick(self, x: _Batch):
        """Per request, the m highest bids of its pool (Eq. 8) as one-pass rows (ties: earlier node first)."""
        pooled, node = x.pooled, x.row_node
        by_node = torch.sort(torch.where(pooled, node, node + self.n_nodes + 1), dim=-1).indices
        bid = torch.where(pooled, x.score.gather(1, node) + x.bid_base, NEG).gather(1, by_node)
        rec = by_node.gather(1, torch.sort(bid, dim=-1, descending=True, stable=True).indices[:, : self.m])
        ok = pooled.gather(1, rec)
        return torch.where(ok, rec, self.null_row), ok

    def _step(self, x: _Batch, st: _Step) -> None:
        bw, m, k, p, b = self.bw, self.m, self.k, self.per_step, x.size
        fr, blk = slice(st.r0, st.r0 + bw), slice(st.block, st.block + p * k)
        with part("frontier"):
            adv, adv_ok = self._frontier(x, st)
        rec, nodes, ok = None, adv, adv_ok
        if m:
            with part("bids"):
                rec, rec_ok = self._pool_pick(x)
            nodes, ok = torch.cat([adv, x.row_node.gather(1, rec)], 1), torch.cat([adv_ok, rec_ok], 1)
        anc = x.anc[x.bi, nodes]  # [b, p, N]: the rows' nodes' ancestors-or-self
        logp, lam = self._forward(x, st, adv, rec, anc)
        top = torch.topk(logp[:, :bw], k, dim=-1)  # the one-pass children
        x.row_topv[:, fr] = top.values
        x.draft[:, blk].view(b, p, k)[:, :bw] = top.indices
        x.row_of.scatter_(1, adv, st.rows[:bw].expand(b, -1))
        x.row_node[:, st.r0 : st.r0 + p], x.row_ok[:, st.r0 : st.r0 + p] = nodes, ok
        x.valid[:, blk].view(b, p, k)[:, :bw] = adv_ok[:, :, None]
        vals = top.values
        if m:
            with part("pool"):
                self._admit(x.row_topv[:, fr, 0], lam[:, :bw], x.u[:, fr], x.row_ok[:, fr], x.pooled[:, fr],
                            x.bid_base[:, fr], x.survive[:, fr])
            with part("repricing"):
                vals = torch.cat([vals.double(), self._reconsider(x, st, rec, rec_ok, logp[:, bw:], lam[:, bw:])], 1)
        # created after Eq. 9's shifts, from their parents' repriced scores: as if shifted with them
        x.score[:, blk] = (x.score.gather(1, nodes)[:, :, None] + vals).view(b, p * k)
        x.anc[:, blk] = (anc[:, :, None] | st.eye[None]).view(b, p * k, -1)

    def _forward(self, x: _Batch, st: _Step, adv, rec, anc):
        """The step's rows of every request through `rows`; their readouts (and lambda with a pool)."""
        rows = slice(st.r0, st.r0 + self.per_step)
        with part("row_inputs"):
            hidden = self.rt.feedback(x.row_feat[x.bi, self.slot_row[adv]])  # post-norm feedback if the drafter has it
            rec_feat = x.row_feat[x.bi, x.cur_row.gather(1, rec)] if self.m else None
            pos = anc.sum(-1) + (x.root_pos - 1)  # position = root's + depth
            visible = torch.matmul(anc.float(), self.src_onehot) + st.own > 0  # exact: sums of 0/1
        with part("rows"):  # the rows' forward (the model, its readouts: labelled inside)
            lam = self.rows.step(st, x.draft.gather(1, adv), hidden, rec_feat, pos, visible,
                                 x.row_feat[:, rows], x.row_logp[:, rows])
        return x.row_logp[:, rows], lam

    def _reconsider(self, x: _Batch, st: _Step, rec, rec_ok, logp_d, lam):
        """`TensorTreeBuilder._reconsider` per request: one depth deeper, Eq. 9 for the halted; new children's
        log pi_mix `[b, m, k]`."""
        b, m, k = x.size, self.m, self.k
        d = x.depth_r.gather(1, rec) + 1
        x.depth_r.scatter_(1, rec, d)
        x.cur_row.scatter_(1, rec, st.rows[self.bw :].expand(b, -1))
        halt_here = torch.where(d >= self.max_depth, 1.0, lam)  # the gate's lambda, 1 at the cap R
        survive = x.survive.gather(1, rec)
        q = (survive * halt_here)[:, :, None]  # Eq. 4's q(d)
        x.survive.scatter_(1, rec, survive * (1.0 - halt_here))
        stay = (x.u[:, st.r0 + self.bw : st.r0 + self.per_step] >= halt_here) & rec_ok
        x.pooled.scatter_(1, rec, stay)
        halt = rec_ok ^ stay
        logp_one = x.row_logp[x.bi, rec]  # [b, m, Vd]
        kids = self.kids_of_row[rec]  # [b, m, k]: v's one-pass children
        kid_draft = x.draft.gather(1, kids.view(b, -1)).view(b, m, k)
        new_ids = torch.topk(torch.lerp(logp_one.exp(), logp_d.exp(), q.float()), k, dim=-1).indices
        ids = torch.cat([kid_draft, new_ids], dim=-1)
        one, deep = logp_one.gather(-1, ids).double().exp(), logp_d.gather(-1, ids).double().exp()
        log_mix = torch.log(one + q * (deep - one)).clamp(min=-1e300, max=0.0)  # Eq. 9, floored as in tensor_tree
        self._shift_existing(x, x.row_node.gather(1, rec), halt, kids.view(b, -1), log_mix[..., :k])
        exists = (new_ids[..., None] == kid_draft[..., None, :]).any(-1)
        blk = slice(st.block + self.bw * k, st.block + self.per_step * k)
        x.draft[:, blk] = new_ids.view(b, m * k)
        x.valid[:, blk] = (halt[:, :, None] & exists.logical_not_()).view(b, m * k)
        return log_mix[..., k:]

    def _shift_existing(self, x: _Batch, v, halt, kids, log_mix) -> None:
        """Eq. 9 on the existing children, the same delta to every descendant: `TensorTreeBuilder._shift_existing`
        for the whole batch, each node's m terms (`shift_terms`) added in reconsidered-row order (the same bits)."""
        new = x.score.gather(1, v)[:, :, None] + log_mix
        delta = torch.where(halt[:, :, None], new - x.score.gather(1, kids).view_as(new), 0.0)  # [b, m, k]
        below = x.anc.gather(2, kids[:, None, :].expand(-1, x.anc.shape[1], -1))  # [b, N, m k]
        terms = shift_terms(below, delta)  # [b, N, m]
        for i in range(terms.shape[-1]):  # m adds for the whole batch: no loop over the requests
            x.score += terms[..., i]
        x.shifted.scatter_add_(1, kids, delta.view(x.size, -1).abs())

    # ------------------------------------------------------------------ cut
    def _cut(self, x: _Batch):
        """Per request: the root and the `B` highest-scoring nodes, in verification order."""
        n, budget, size = self.n_nodes + 1, self.cfg.budget, x.size
        order = torch.sort(torch.where(x.valid, x.score, NEG), dim=-1, descending=True, stable=True).indices[:, :budget]
        ok = x.valid.gather(1, order)
        if order.shape[1] < budget:
            pad = order.new_full((size, budget - order.shape[1]), self.null)
            order, ok = torch.cat([order, pad], 1), torch.cat([ok, pad < 0], 1)
        ranked = torch.where(ok, order, self.null)
        depth = x.anc[x.bi, ranked].sum(-1)
        order = torch.sort(torch.where(ok, depth * n + ranked, n * n), dim=-1).indices
        kept = torch.cat([ranked.new_zeros(size, 1), ranked.gather(1, order)], 1)
        ok = torch.cat([ok.new_ones(size, 1), ok.gather(1, order)], 1)
        where = torch.full((size, n), -1, dtype=torch.long, device=kept.device)
        where.scatter_(1, kept, torch.arange(kept.shape[1], device=kept.device).expand(size, -1))
        where[:, self.null] = -1
        return kept, ok, where

    def _pack(self, x: _Batch, kept, ok, where) -> torch.Tensor:
        """`TensorTreeBuilder._pack`'s vector for every request, `[b, L]`."""
        rt, bi = self.rt, x.bi
        anc = x.anc[bi, kept]
        token = torch.where(kept == 0, x.root_tok[:, None], rt.to_target_ids(x.draft.gather(1, kept)))
        parent = torch.where(kept == 0, -1, where.gather(1, x.row_node.gather(1, self.slot_row[kept])))
        score = torch.where(ok, x.score.gather(1, kept), NEG)
        by_score = torch.sort(score, dim=-1, descending=True, stable=True).indices
        # a sum of non-negative terms compared with 0: exact in any order
        repriced = torch.matmul(anc.double(), (self.via_slot.double() + x.shifted)[:, :, None])[..., 0] > 0
        row = x.row_of.gather(1, kept)
        top1 = x.row_topv[bi, row, 0].double().exp()  # row -1 (never forwarded): the null row, as in tensor_tree
        parts = [
            ok.long(), kept, token, anc.sum(-1) - 1, parent, self.via_slot[kept].long(), repriced.long(), by_score,
            (row >= 0).long(), top1.view(torch.long), score.view(torch.long),
            rt.to_target_ids(x.draft[bi[:, :, None], self.kids_of_row[row]]).reshape(x.size, -1), self._counts(x),
        ]
        return torch.cat(parts, dim=1)

    def _counts(self, x: _Batch) -> torch.Tensor:
        """Per request: reconsideration rows, steps that forwarded a row, halts per depth 0..R."""
        rows = x.row_ok[:, 1 : self.n_rows].reshape(x.size, self.cfg.gamma - 1, self.per_step)
        depth = x.depth_r[:, : self.n_rows]
        halted = ~x.pooled[:, : self.n_rows] & (depth > 0)
        halts = torch.zeros(x.size, self.max_depth + 1, dtype=torch.long, device=rows.device)
        halts.scatter_add_(1, depth, halted.long())
        return torch.cat([rows[:, :, self.bw :].sum((1, 2))[:, None], rows.any(2).sum(1)[:, None], halts], 1)

    def state(self, x: _Batch, b: int) -> Dict[str, torch.Tensor]:
        """Request b's node tensors, in `TensorTreeBuilder.state`'s layout (read through a view of its slices)."""
        names = ("anc", "draft", "row_node", "shifted", "valid", "score", "row_logp", "row_of", "cur_row", "depth_r")
        view = SimpleNamespace(rt=self.rt, via_slot=self.via_slot, slot_row=self.slot_row,
                               root_tok=x.root_tok[b : b + 1], **{name: getattr(x, name)[b] for name in names})
        return TensorTreeBuilder.state(view)
