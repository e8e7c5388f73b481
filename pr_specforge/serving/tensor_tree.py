"""The draft tree of one round over tensors: the same algorithm as `tree`, at almost no host cost.

Owns:
  * `TensorTreeBuilder` — builds the round of `tree.build_tree` (EAGLE's dynamic tree
    plus reconsideration: pool, bids of Eq. 8, halting, Eq. 9 repricing, the global cut,
    the ancestor mask) with tensor operations only, and one host synchronisation per
    round (`TensorDraftTree`'s single copy of the result to the host).
  * `TensorDraftTree` — the host-side result, with `DraftTree`'s verification interface.

Fixed layout. For a given (B, k, B_w, gamma, m) every tensor has the same shape in every
round, so a round can be captured whole (e.g. in a CUDA graph):
  node slots   0 the root; 1..k its children (step 0); step s >= 1 owns a block of
               (B_w + m) k slots: B_w x k children of the frontier rows, then m x k new
               children of the reconsidered rows; one extra "null" slot, never valid,
               absorbs the writes of empty rows.
  rows         0 the root (the last context row); step s >= 1 owns B_w + m rows, always
               forwarded (an empty row is computed and never read); one extra "null" row.
Slots are allocated in the object tree's creation order, so "earlier node first" ties
break the same way, and the valid slots, sorted, are the object tree's node list.

What the layout fixes, the builder never stores per node: the row that proposed a slot
(`slot_row`, which is also the row its branch continues from and its parent's row), whether
it came from a reconsidered feature (`via_slot`), the k children slots a row proposes
(`kids_of_row`). Per node it keeps only the score, the draft id, validity, the ancestor
matrix (`anc`: depth is a row sum, the visible tree rows are `anc @ onehot(slot_row)`) and
the node's one-pass row; the pool lives on the one-pass rows (a node is forwarded once,
so its row names it), with `row_node` mapping rows back to nodes. "Repriced" is read at the
cut as `anc @ mark` (a node is repriced when an edge on its path was shifted by Eq. 9 or
proposed by a reconsidered feature).

Each step: top-B_w of the previous block (frontier), top-m of the pool's bids, ONE call of
`M` over those rows against the runtime's preallocated KV buffer (the round's tree rows sit
after the context; the additive tree-attention mask is allocated once per round and each
step writes its own rows), top-k children (written straight into per-row buffers), pool
admission and halting against uniforms drawn once per round, then for the halted rows
Eq. 9 as batched index operations: edge deltas of the existing children, propagated to
every descendant through the ancestor matrix (`shift_terms`: each reconsidered row's one
delta per node, added in reconsidered-row order), and the top-k of pi_mix not yet children
as new children.

Random draws: the round draws `1 + (gamma - 1)(B_w + m)` uniforms at its start, one per
row in row order (the root's admission, then per step the frontier rows' and the
reconsidered rows'), exactly as the object tree does, so the same generator gives the same
tree at T > 0; the uniform of row r is `u[r]`.

Shared with `batched_tree` (the same round for a batch of requests): `TreeShape` (the sizes,
the layout's index tensors, the initial ancestor matrix, pool admission), `root_readout` and
`forward_step_rows` (one request's calls of the runtime in a step) and `unpack_round` (the
host vector's reading).

Does not own: the algorithm's definition and its reference (`tree`, the test oracle), the
row forwards (`drafter_runtime`), verification (`verify`), batching requests (`batched_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from pr_specforge.serving.drafter_runtime import DrafterRuntime
from pr_specforge.serving.tree import TreeConfig, round_uniforms, uniform_count

# columns of `state()["info"]`, the per-node view the tests compare with the object tree
PARENT, DEPTH, DRAFT, TOKEN, SRC, VIA, REPRICED, VALID = range(8)
NEG = float("-inf")


@dataclass
class TensorDraftTree:
    """A drafted round, on the host. Kept nodes in verification order (root first)."""

    slots: List[int]  # node slots of the kept nodes
    token_ids: List[int]
    depth_list: List[int]
    parent_list: List[int]  # index into the kept list, -1 for the root
    child_lists: List[List[int]]  # kept children, highest score first (ties: earlier node first)
    scores: List[float]
    via_recon_list: List[bool]
    repriced_list: List[bool]
    onepass: List[Optional[Tuple[float, List[int]]]]  # (max_t pi_one(t|u), one-pass top-k tokens) if forwarded
    mask: torch.Tensor  # [n, n] ancestor-or-self, on the drafter's device
    root_position: int
    recon_rows: int = 0
    recon_kept: int = 0
    repriced_kept: int = 0
    steps: int = 0
    halt_depths: Dict[int, int] = field(default_factory=dict)
    state: Optional[Dict[str, torch.Tensor]] = None  # the round's node tensors (`keep_state=True`)

    @property
    def kept(self) -> List[int]:
        return self.slots

    def tokens(self) -> List[int]:
        return self.token_ids

    def depths(self) -> List[int]:
        return self.depth_list

    def parents(self) -> List[int]:
        return self.parent_list

    def children(self) -> List[List[int]]:
        return self.child_lists

    def tree_mask(self) -> torch.Tensor:
        return self.mask

    def one_pass(self, j: int) -> Optional[Tuple[float, List[int]]]:
        return self.onepass[j]

    def via_recon(self, j: int) -> bool:
        return self.via_recon_list[j]


class _Step:
    """One step's fixed slices: index tensors, and views of the builder's buffers (made once per shape,
    so a step writes its rows and slots without slicing anything)."""

    def __init__(self, tb: "TreeShape", s: int) -> None:
        k, p, bw, dev = tb.k, tb.per_step, tb.bw, tb.rt.device
        n = tb.n_nodes + 1
        self.block, self.r0 = 1 + k + (s - 1) * p * k, 1 + (s - 1) * p
        self.prev, self.prev_n = (1, k) if s == 1 else (self.block - p * k, p * k)
        self.rows = torch.arange(self.r0, self.r0 + p, device=dev)
        self.pad = torch.full((max(0, bw - self.prev_n),), tb.null, device=dev)  # null picks when the previous block is short
        self.eye = torch.zeros(p * k, n, device=dev, dtype=torch.bool)  # each new slot's own bit in the ancestor matrix
        self.eye[:, self.block : self.block + p * k] = torch.eye(p * k, device=dev, dtype=torch.bool)
        self.eye = self.eye.view(p, k, n)
        self.own = torch.zeros(p, tb.n_rows, device=dev)  # each row's own column in the tree part of the mask
        self.own[:, self.r0 : self.r0 + p] = torch.eye(p, device=dev)

    def bind(self, tb: "TensorTreeBuilder") -> None:
        k, p, bw = tb.k, tb.per_step, tb.bw
        prev, blk, rows, fr = slice(self.prev, self.prev + self.prev_n), slice(self.block, self.block + p * k), \
            slice(self.r0, self.r0 + p), slice(self.r0, self.r0 + bw)
        self.valid_prev, self.score_prev = tb.valid[prev], tb.score[prev]
        self.score_blk, self.draft_blk = tb.score[blk].view(p, k), tb.draft[blk].view(p, k)
        self.valid_blk, self.anc_blk = tb.valid[blk].view(p, k), tb.anc[blk].view(p, k, -1)
        self.draft_fr, self.draft_rec = self.draft_blk[:bw], self.draft_blk[bw:]  # top-k ids land here directly
        self.valid_fr, self.valid_rec = self.valid_blk[:bw], self.valid_blk[bw:]
        self.row_node, self.row_ok, self.row_feat = tb.row_node[rows], tb.row_ok[rows], tb.row_feat[rows]
        self.topv, self.top1, self.logp = tb.row_topv[fr], tb.row_topv[fr, 0], tb.row_logp[rows]
        self.ok_fr, self.pooled, self.bid_base, self.survive = tb.row_ok[fr], tb.pooled[fr], tb.bid_base[fr], tb.survive[fr]
        self.u_fr, self.u_rec = tb.u[fr], tb.u[self.r0 + bw : self.r0 + p]
        self.rows_fr, self.rows_rec = self.rows[:bw], self.rows[bw:]


def shift_terms(below: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Eq. 9's shift of every node by each reconsidered row, `[..., N, m]` from `below [..., N, m k]` (whether child
    j of a row is an ancestor-or-self of the node) and the children's deltas `delta [..., m, k]`: per row the one
    delta of the child the node lies under, else 0. Exact in any kernel: a node lies under at most one child of a
    row, so each sum over the k children has at most one nonzero term (and a masked, not multiplied, zero: an
    infinite delta elsewhere gives no NaN)."""
    m, k = delta.shape[-2:]
    mask = below.view(*below.shape[:-1], m, k)
    return torch.where(mask, delta.unsqueeze(-3), 0.0).sum(-1)


class TreeShape:
    """A tree shape's sizes and constant index tensors (the fixed layout of the module doc), shared by
    `TensorTreeBuilder` (one request) and `batched_tree.BatchedTreeBuilder` (a batch of requests)."""

    def __init__(self, rt: DrafterRuntime, cfg: TreeConfig, coforward: bool = True) -> None:
        cfg.check_vocab(rt.draft_vocab_size)
        self.rt, self.cfg, self.coforward = rt, cfg, coforward
        self.max_depth = rt.max_depth  # R
        self.pool_on = rt.is_pr and self.max_depth > 0 and cfg.m > 0
        self.k, self.bw, self.m = cfg.k, cfg.bw, (cfg.m if self.pool_on else 0)
        self.per_step = self.bw + self.m
        self.n_nodes = 1 + self.k + (cfg.gamma - 1) * self.per_step * self.k
        self.null = self.n_nodes
        self.n_rows = 1 + (cfg.gamma - 1) * self.per_step
        self.null_row = self.n_rows
        self._layout()

    def _layout(self) -> None:
        """The shape's constant index tensors: which row proposed each slot, and each step's slices."""
        dev, k, n, r, p = self.rt.device, self.k, self.n_nodes + 1, self.n_rows + 1, self.per_step
        i64 = dict(device=dev, dtype=torch.long)
        slot_row = torch.full((n,), self.null_row, **i64)  # root and null: no proposing row
        slot_row[1 : 1 + k] = 0
        kids = torch.full((r, k), self.null, **i64)
        kids[0] = torch.arange(1, 1 + k, **i64)
        self.via_slot = torch.zeros(n, device=dev, dtype=torch.bool)
        self.steps = [_Step(self, s) for s in range(1, self.cfg.gamma)]
        for st in self.steps:
            slot_row[st.block : st.block + p * k] = st.rows.repeat_interleave(k)
            kids[st.r0 : st.r0 + p] = torch.arange(st.block, st.block + p * k, **i64).view(p, k)
            self.via_slot[st.block + self.bw * k : st.block + p * k] = True
        self.slot_row, self.kids_of_row = slot_row, kids
        onehot = torch.zeros(n, r, device=dev)
        onehot[torch.arange(n, device=dev), slot_row] = 1.0
        self.src_onehot = onehot[:, : r - 1].contiguous()  # [N, rows]: the tree row each slot's branch continues from
        self.recon_row_mask = torch.arange(p, device=dev) >= self.bw  # the PR drafter's adapter acts on these rows
        self.split_readout = self.pool_on and hasattr(self.rt.drafter, "pr_recon_head")

    def initial_ancestors(self) -> torch.Tensor:
        """The ancestor matrix before a round's first step: the root, its k children, the null slot."""
        dev, n, k = self.rt.device, self.n_nodes + 1, self.k
        anc = torch.zeros(n, n, device=dev, dtype=torch.bool)
        anc[0, 0] = anc[self.null, self.null] = True  # the null slot at depth 0 keeps empty rows' positions sane
        anc[1 : 1 + k, 0] = True
        anc[1 : 1 + k, 1 : 1 + k] = torch.eye(k, device=dev, dtype=torch.bool)
        return anc

    @staticmethod
    def _admit(top1_logp, lam, u, ok, pooled, bid_base, survive) -> None:
        """Appendix C.1: forwarded nodes enter the pool with probability `1 - lambda_0` (views of their rows)."""
        # (top1_logp is fp32: .double() copies, so exp_ and neg_ work on the copy) -inf when max_t pi_one = 1
        torch.log1p(top1_logp.double().exp_().neg_(), out=bid_base)
        torch.neg(lam, out=survive).add_(1.0)
        torch.ge(u, lam, out=pooled)
        pooled.logical_and_(ok)


def root_readout(rt: DrafterRuntime, feat: torch.Tensor, pool_on: bool, out: torch.Tensor):
    """The root row's readout `[1, Vd]` (written into `out`) and, with a pool, its lambda_0 (else None)."""
    if pool_on:
        return rt.readout_and_halt(feat, out=out)
    return rt.log_probs(feat, 0, out=out), None


def forward_step_rows(tb: TreeShape, rt: DrafterRuntime, ids, hidden, rec_feat, pos, col: int, mask, max_pos: int,
                      feat_out: torch.Tensor, logp_out: torch.Tensor):
    """ONE call of `M` over a step's rows of one request: the frontier rows (draft ids `ids`, their parents'
    features `hidden`) and, with a pool, the carried rows (their current depth's features `rec_feat`, else None).
    Writes the features into `feat_out` and the readouts into `logp_out`; returns `(logp_out, lambda or None)`."""
    feats = step_row_features(tb, rt, ids, hidden, rec_feat, pos, col, mask, max_pos, feat_out)
    return step_readouts(tb, rt, feats, logp_out)


def step_row_features(tb: TreeShape, rt: DrafterRuntime, ids, hidden, rec_feat, pos, col: int, mask, max_pos: int,
                      feat_out: torch.Tensor) -> torch.Tensor:
    """`forward_step_rows` without the readouts: the step's row features, written into `feat_out` (returned)."""
    bw = tb.bw
    emb = rt.embed(rt.to_target_ids(ids))
    if rec_feat is not None:  # Eq. 3's input slots for the carried rows, from their current depth's feature
        r_emb, r_hidden = rt.reconsideration_inputs(rec_feat)
        emb, hidden = torch.cat([emb.to(r_emb.dtype), r_emb]), torch.cat([hidden, r_hidden])
    recon = tb.recon_row_mask if tb.m else None
    if tb.coforward or not tb.m:
        feats = rt.forward_tree_rows(emb, hidden, pos, col, mask, max_pos, recon)
    else:  # the serial baseline of Appendix A.1: the reconsideration rows in their own call of M
        feats = torch.cat([
            rt.forward_tree_rows(emb[:bw], hidden[:bw], pos[:bw], col, mask[:bw], max_pos, recon[:bw]),
            rt.forward_tree_rows(emb[bw:], hidden[bw:], pos[bw:], col + bw, mask[bw:], max_pos, recon[bw:])])
    feat_out.copy_(feats)
    return feat_out


def step_readouts(tb: TreeShape, rt: DrafterRuntime, feats: torch.Tensor, logp_out: torch.Tensor):
    """A step's readouts of one request's row features `feats [B_w + m, d]` into `logp_out`; returns
    `(logp_out, lambda or None)`. Shared by every row forward (ours and SGLang's draft model runner)."""
    bw = tb.bw
    if not tb.m:
        return rt.log_probs(feats, 0, out=logp_out), None
    if tb.split_readout:  # a second head: read each part with its own head only (depths >= 1 share it)
        rt.log_probs(feats[:bw], 0, out=logp_out[:bw])
        rt.log_probs(feats[bw:], 1, out=logp_out[bw:])
        lam = rt.halt_probability(feats)
    else:
        lam = rt.readout_and_halt(feats, out=logp_out)[1]
    return logp_out, lam.double()


def batch_root_readout(rt: DrafterRuntime, feats: torch.Tensor, pool_on: bool, out: torch.Tensor):
    """`root_readout` of every request's root row `feats [b, 1, d]` in ONE call; lambda_0 `[b, 1]` with a pool."""
    b = feats.shape[0]
    logp, lam = root_readout(rt, feats.reshape(b, -1), pool_on, None)
    out.copy_(logp.view(b, 1, -1))
    return None if lam is None else lam.view(b, 1)


def batch_step_readouts(tb: TreeShape, rt: DrafterRuntime, feats: torch.Tensor, logp_out: torch.Tensor):
    """`step_readouts` of every request's step rows `feats [b, B_w + m, d]` in ONE call per head (not one per
    request): written into `logp_out [b, B_w + m, Vd]`; lambda `[b, B_w + m]` (float64) with a pool, else None.
    Each request's values equal `step_readouts` of its rows alone where `readouts_row_invariant` holds."""
    b, p, d = feats.shape
    flat = feats.reshape(b * p, d)
    if not tb.m:
        logp_out.copy_(rt.log_probs(flat, 0).view(b, p, -1))
        return None
    if tb.split_readout:
        bw = tb.bw
        logp_out[:, :bw].copy_(rt.log_probs(feats[:, :bw].reshape(-1, d), 0).view(b, bw, -1))
        logp_out[:, bw:].copy_(rt.log_probs(feats[:, bw:].reshape(-1, d), 1).view(b, p - bw, -1))
        lam = rt.halt_probability(flat)
    else:
        logp, lam = rt.readout_and_halt(flat)
        logp_out.copy_(logp.view(b, p, -1))
    return lam.view(b, p).double()


class TensorTreeBuilder(TreeShape):
    """One sequence's tree builder; its buffers and index tensors are allocated once and reused every round."""

    def __init__(self, rt: DrafterRuntime, cfg: TreeConfig, coforward: bool = True) -> None:
        super().__init__(rt, cfg, coforward)
        self._allocate()
        for st in self.steps:
            st.bind(self)

    def _allocate(self) -> None:
        rt, dev, n, r, k = self.rt, self.rt.device, self.n_nodes + 1, self.n_rows + 1, self.k
        f64, i64 = dict(device=dev, dtype=torch.float64), dict(device=dev, dtype=torch.long)
        self.score = torch.zeros(n, **f64)
        self.draft = torch.zeros(n, **i64)
        self.valid = torch.zeros(n, device=dev, dtype=torch.bool)
        self.valid[1 : 1 + k] = True  # the root's children (the root itself is kept apart from the cut)
        self.shifted = torch.zeros(n, **f64)  # > 0: an edge into the node was repriced (Eq. 9)
        self.anc = self.initial_ancestors()  # anc[x, a]: a is x or one of its ancestors
        self.row_of = torch.full((n,), -1, **i64)  # the node's one-pass row, -1 if never forwarded
        self.row_of_init = self.row_of.clone()
        self.row_of_init[0] = 0
        # per row (index n_rows: the null row)
        self.row_node = torch.full((r,), self.null, **i64)  # the node the row forwarded
        self.row_node[0] = 0
        self.row_feat = torch.zeros(r, rt.drafter.config.hidden_size, device=dev, dtype=rt.dtype)
        # every row's readout (pi_one of one-pass rows, pi_d of reconsideration rows), written there by the head
        self.row_logp = torch.zeros(r, rt.draft_vocab_size, device=dev, dtype=torch.float32)
        self.row_topv = torch.zeros(r, k, device=dev, dtype=torch.float32)  # one-pass top-k log-probs (ids: the children's drafts)
        self.row_ok = torch.zeros(r, device=dev, dtype=torch.bool)  # the row held a node
        self.row_ok[0] = True
        self.u = torch.zeros(r, **f64)  # the round's uniforms: u[r] is row r's
        # the pool, on one-pass rows
        self.pooled = torch.zeros(r, device=dev, dtype=torch.bool)
        self.bid_base = torch.zeros(r, **f64)  # log(1 - max_t pi_one(t|v)): Eq. 8 minus s(v)
        self.survive = torch.zeros(r, **f64)  # prod_{s<d}(1 - lambda_s) over the depths walked so far
        self.depth_r = torch.zeros(r, **i64)  # reconsideration depth reached
        self.cur_row = torch.zeros(r, **i64)  # the row of the node's current-depth feature
        self.cur_row_init = torch.arange(r, **i64)
        self.root_tok = torch.zeros(1, **i64)

    def _reset(self) -> None:
        for t in (self.shifted, self.pooled, self.depth_r):
            t.zero_()
        self.row_of.copy_(self.row_of_init)
        self.cur_row.copy_(self.cur_row_init)

    # ---------------------------------------------------------------- round
    def _root(self, root_token: int, root_feature: torch.Tensor) -> None:
        rt, k = self.rt, self.k
        self.root_tok.fill_(int(root_token))
        feat = root_feature.reshape(1, -1).to(rt.dtype)
        self.row_feat[0] = feat[0]
        logp, lam = root_readout(rt, feat, self.pool_on, self.row_logp[:1])
        torch.topk(logp, k, dim=-1, out=(self.row_topv[:1], self.draft[1 : 1 + k].view(1, k)))
        self.score[1 : 1 + k] = self.row_topv[0]
        if self.pool_on:
            self._admit(self.row_topv[:1, 0], lam.double(), self.u[:1], self.row_ok[:1],
                        self.pooled[:1], self.bid_base[:1], self.survive[:1])

    def _frontier(self, st: _Step) -> Tuple[torch.Tensor, torch.Tensor]:
        """The B_w highest-scoring valid slots of the previous block (ties: earlier slot first); null when short."""
        order = torch.sort(torch.where(st.valid_prev, st.score_prev, NEG), descending=True, stable=True).indices[: self.bw]
        ok = st.valid_prev[order]
        adv = torch.where(ok, order + st.prev, self.null)
        if st.pad.shape[0]:
            adv, ok = torch.cat([adv, st.pad]), torch.cat([ok, st.pad < 0])
        return adv, ok

    def _pool_pick(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The m highest bids of the pool (Eq. 8: `s(v) + log(1 - max_t pi_one(t|v))`), as one-pass rows;
        ties: earlier node first. Empty picks are the null row."""
        # rows in node order, the pooled ones first: a bid of -inf (max pi_one = 1) still outranks an empty pick
        by_node = torch.sort(torch.where(self.pooled, self.row_node, self.row_node + self.n_nodes + 1)).indices
        bid = torch.where(self.pooled, self.score[self.row_node] + self.bid_base, NEG)[by_node]
        rec = by_node[torch.sort(bid, descending=True, stable=True).indices[: self.m]]
        ok = self.pooled[rec]
        return torch.where(ok, rec, self.null_row), ok

    def _step(self, st: _Step) -> None:
        bw, m, k = self.bw, self.m, self.k
        adv, adv_ok = self._frontier(st)
        rec, nodes, ok = None, adv, adv_ok
        if m:
            rec, rec_ok = self._pool_pick()
            nodes, ok = torch.cat([adv, self.row_node[rec]]), torch.cat([adv_ok, rec_ok])
        anc = self.anc.index_select(0, nodes)  # [p, N]: the rows' nodes' ancestors-or-self
        logp, lam = self._forward(st, adv, rec, anc)  # logp: this step's rows of `row_logp`
        torch.topk(logp[:bw] if m else logp, k, dim=-1, out=(st.topv, st.draft_fr))  # the one-pass children
        self.row_of.index_copy_(0, adv, st.rows_fr)
        st.row_node.copy_(nodes)
        st.row_ok.copy_(ok)
        st.valid_fr.copy_(adv_ok[:, None])
        vals = st.topv
        if m:
            self._admit(st.top1, lam[:bw], st.u_fr, st.ok_fr, st.pooled, st.bid_base, st.survive)
            vals = torch.cat([vals.double(), self._reconsider(st, rec, rec_ok, logp[bw:], lam[bw:])])
        # created after Eq. 9's shifts, from their parents' repriced scores: as if shifted with them
        torch.add(self.score[nodes][:, None], vals, out=st.score_blk)  # fp32 edge log-probs promote to fp64
        torch.logical_or(anc[:, None], st.eye, out=st.anc_blk)

    def _forward(self, st: _Step, adv: torch.Tensor, rec: Optional[torch.Tensor], anc: torch.Tensor):
        """ONE call of `M` over the step's frontier and reconsidered rows; their readouts (and lambda for PR)."""
        n, r0 = self.per_step, st.r0
        hidden = self.rt.feedback(self.row_feat[self.slot_row[adv]])  # post-norm feedback when the drafter has it
        rec_feat = self.row_feat[self.cur_row[rec]] if self.m else None
        pos = anc.sum(1) + (self.root_pos - 1)  # position = root's + depth; depth = ancestors-or-self - 1
        visible = torch.addmm(st.own, anc.float(), self.src_onehot)  # tree rows each row may see, and its own
        mask = self.mask[r0 : r0 + n]
        mask[:, self.ctx :] = torch.where(visible > 0, 0.0, NEG)
        return forward_step_rows(self, self.rt, self.draft[adv], hidden, rec_feat, pos, self.ctx + r0, mask,
                                 self.max_pos, st.row_feat, st.logp)

    def _reconsider(self, st: _Step, rec, rec_ok, logp_d, lam):
        """One depth deeper for the carried bids (one-pass rows `rec`); the halted ones are repriced (Eq. 9).

        Writes the new children's draft ids and validity (the top-k of pi_mix that are not children yet)
        and returns their `log pi_mix [m, k]`."""
        d = self.depth_r[rec] + 1
        self.depth_r.index_copy_(0, rec, d)
        self.cur_row.index_copy_(0, rec, st.rows_rec)
        halt_here = torch.where(d >= self.max_depth, 1.0, lam)  # the gate's lambda, 1 at the cap R
        survive = self.survive[rec]
        q = (survive * halt_here)[:, None]  # Eq. 4's q(d) = lambda_d prod_{s<d}(1 - lambda_s), prod alone at R
        self.survive.index_copy_(0, rec, survive * (1.0 - halt_here))
        stay = (st.u_rec >= halt_here) & rec_ok  # u < 1 always halts at the cap
        self.pooled.index_copy_(0, rec, stay)
        halt = rec_ok ^ stay
        logp_one = self.row_logp[rec]
        kids = self.kids_of_row[rec]  # v's one-pass children
        kid_draft = self.draft[kids]
        # pi_mix's top-k in fp32 over the vocabulary, log pi_mix in float64 where it is read
        new_ids = torch.topk(torch.lerp(logp_one.exp(), logp_d.exp(), q.float()), self.k, dim=-1).indices
        ids = torch.cat([kid_draft, new_ids], dim=1)
        one, deep = logp_one.gather(1, ids).double().exp(), logp_d.gather(1, ids).double().exp()
        # Eq. 9, [m, 2k]; floored at -1e300 (pi_mix underflowing to 0 in fp64 would give -inf, and one
        # -inf delta would turn every score into NaN through `anc @ delta`; the object tree keeps -inf there)
        log_mix = torch.log(one + q * (deep - one)).clamp(min=-1e300, max=0.0)
        self._shift_existing(self.row_node[rec], halt, kids.view(-1), log_mix[:, : self.k])
        exists = (new_ids[:, :, None] == kid_draft[:, None, :]).any(-1)
        st.draft_rec.copy_(new_ids)
        torch.logical_and(halt[:, None], exists.logical_not_(), out=st.valid_rec)
        return log_mix[:, self.k :]

    def _shift_existing(self, v, halt, kids, log_mix) -> None:
        """Eq. 9 on the existing children: `s(c) = s(v) + log pi_mix(c|v)`, the same delta to every descendant.

        `shift_terms`: a node lies under at most one child of each reconsidered row, so each row gives it one
        term, exactly; the m terms are added to its score one by one in reconsidered-row order, as the object
        tree shifts subtree after subtree. The batched builder adds them in the same order: the same bits."""
        new = self.score[v][:, None] + log_mix
        delta = torch.where(halt[:, None], new - self.score[kids].view(-1, self.k), 0.0)
        terms = shift_terms(self.anc.index_select(1, kids), delta)  # [N, m]
        for i in range(terms.shape[-1]):  # m adds, in reconsidered-row order
            self.score += terms[..., i]
        self.shifted.index_add_(0, kids, delta.view(-1).abs())  # > 0 where the edge moved

    # ------------------------------------------------------------------ cut
    def _cut(self):
        """Keep the root and the `B` highest-scoring nodes, in verification order; ancestor mask."""
        n, b = self.n_nodes + 1, self.cfg.budget
        order = torch.sort(torch.where(self.valid, self.score, NEG), descending=True, stable=True).indices[:b]
        ok = self.valid[order]
        if order.shape[0] < b:
            pad = order.new_full((b - order.shape[0],), self.null)
            order, ok = torch.cat([order, pad]), torch.cat([ok, pad < 0])
        ranked = torch.where(ok, order, self.null)
        depth = self.anc[ranked].sum(1)
        order = torch.sort(torch.where(ok, depth * n + ranked, n * n)).indices
        kept = torch.cat([ranked.new_zeros(1), ranked[order]])
        ok = torch.cat([ok.new_ones(1), ok[order]])
        where = torch.full((n,), -1, dtype=torch.long, device=kept.device)
        where[kept] = torch.arange(kept.shape[0], device=kept.device)
        where[self.null] = -1
        return kept, ok, where

    def _pack(self, kept, ok, where) -> torch.Tensor:
        """Everything the host needs from the round, as one int64 vector (doubles as their bits)."""
        rt, anc = self.rt, self.anc[kept]
        token = torch.where(kept == 0, self.root_tok, rt.to_target_ids(self.draft[kept]))
        parent = torch.where(kept == 0, -1, where[self.row_node[self.slot_row[kept]]])
        score = torch.where(ok, self.score[kept], NEG)
        by_score = torch.sort(score, descending=True, stable=True).indices
        repriced = torch.mv(anc.double(), self.via_slot.double() + self.shifted) > 0
        row = self.row_of[kept]
        top1 = self.row_topv[row, 0].double().exp()
        parts = [
            ok.long(), kept, token, anc.sum(1) - 1, parent, self.via_slot[kept].long(), repriced.long(), by_score,
            (row >= 0).long(), top1.view(torch.long), score.view(torch.long),
            rt.to_target_ids(self.draft[self.kids_of_row[row]]).reshape(-1), self._counts(),
        ]
        return torch.cat(parts)

    def _counts(self) -> torch.Tensor:
        """Reconsideration rows, steps that forwarded a row, halts per depth 0..R."""
        rows = self.row_ok[1 : self.n_rows].view(self.cfg.gamma - 1, self.per_step)
        depth = self.depth_r[: self.n_rows]  # the null row's depth counts empty picks
        halted = ~self.pooled[: self.n_rows] & (depth > 0)
        halts = torch.zeros(self.max_depth + 1, dtype=torch.long, device=rows.device)
        halts.index_add_(0, depth, halted.long())
        return torch.cat([rows[:, self.bw :].sum().view(1), rows.any(1).sum().view(1), halts])

    @torch.no_grad()
    def build(self, root_token: int, root_feature: torch.Tensor, generator: Optional[torch.Generator] = None,
              keep_state: bool = False) -> TensorDraftTree:
        rt, cfg = self.rt, self.cfg
        if rt.length < 1:
            raise ValueError("the drafter context is empty: call DrafterRuntime.extend before drafting")
        self._reset()
        self.ctx = rt.length - 1  # context columns; tree row r sits at column ctx + r (row 0: the root's own)
        self.root_pos = rt.length - 1
        self.max_pos = self.root_pos + cfg.gamma
        rt.reserve(self.ctx + self.n_rows)
        # the additive tree-attention mask of the round: every context column open; each step writes its rows' tree part
        self.mask = torch.zeros((self.n_rows, self.ctx + self.n_rows), device=rt.device, dtype=rt.dtype)
        if self.pool_on:
            self.u[: self.n_rows].copy_(round_uniforms(uniform_count(cfg), generator), non_blocking=True)
        self._root(root_token, root_feature)
        for st in self.steps:
            self._step(st)
        kept, ok, where = self._cut()
        mask = self.anc[kept][:, kept]
        host = self._pack(kept, ok, where).cpu()  # the round's one synchronisation
        tree = self._unpack(host, mask, rt.length)
        if keep_state:
            tree.state = self.state()
        return tree

    def _unpack(self, host: torch.Tensor, mask: torch.Tensor, root_position: int) -> TensorDraftTree:
        return unpack_round(host, mask, root_position, self.cfg.budget, self.k)

    def state(self) -> Dict[str, torch.Tensor]:
        """The round's node tensors (copies) in the per-node layout of `info` (see its columns), for tests and diagnostics."""
        anc, via = self.anc, self.via_slot
        token = self.rt.to_target_ids(self.draft)
        token[0] = self.root_tok[0]
        info = torch.stack([
            self.row_node[self.slot_row], anc.sum(1) - 1, self.draft, token, self.slot_row, via.long(),
            (torch.mv(anc.double(), via.double() + self.shifted) > 0).long(), self.valid.long(),
        ], dim=1)
        info[0, VALID] = 1
        return {
            "score": self.score.clone(), "info": info, "row_logp": self.row_logp.clone(), "row_of": self.row_of.clone(),
            "cur_row": self.cur_row.clone(), "depth_r": self.depth_r.clone(), "row_node": self.row_node.clone(),
        }


#: the per-node rows of a packed round (`_pack`), each `B + 1` wide, kept nodes first; then one-pass children, counts
PACKED_ROWS = ("ok", "slot", "token", "depth", "parent", "via", "repriced", "by_score", "forwarded", "top1", "score")


def packed_nodes(packed: torch.Tensor, budget: int) -> torch.Tensor:
    """The per-node rows of packed rounds `[b, L]` (on any device) as a view `[b, len(PACKED_ROWS), B + 1]`."""
    b1 = budget + 1
    return packed[:, : len(PACKED_ROWS) * b1].view(packed.shape[0], len(PACKED_ROWS), b1)


def packed_counts(packed: torch.Tensor, budget: int, k: int) -> torch.Tensor:
    """The counts of packed rounds `[b, L]` (`_counts`: reconsideration rows, steps that forwarded a row, halts per
    depth), a view `[b, 2 + R + 1]` after the node rows and the one-pass children."""
    return packed[:, (len(PACKED_ROWS) + k) * (budget + 1):]


def unpack_round(host: torch.Tensor, mask: torch.Tensor, root_position: int, budget: int, k: int) -> TensorDraftTree:
    """A round's host vector (`_pack`'s layout) and its ancestor mask as a `TensorDraftTree`."""
    b1, rows = budget + 1, len(PACKED_ROWS)
    cols = packed_nodes(host[None], budget)[0]
    n = int(cols[0].sum())
    vals = cols[:, :n].tolist()
    ok, slots, tokens, depths, parents, via, repriced, by_score, fwd = vals[:9]
    top1 = cols[9, :n].view(torch.float64).tolist()
    scores = cols[10, :n].view(torch.float64).tolist()
    onepass = host[rows * b1 : (rows + k) * b1].view(b1, k)[:n].tolist()
    counts = packed_counts(host[None], budget, k)[0].tolist()
    children: List[List[int]] = [[] for _ in range(n)]
    for j in by_score[:n]:
        if j < n and parents[j] >= 0:
            children[parents[j]].append(j)
    return TensorDraftTree(
        slots=slots, token_ids=tokens, depth_list=depths, parent_list=parents, child_lists=children,
        scores=scores, via_recon_list=[bool(x) for x in via], repriced_list=[bool(x) for x in repriced],
        onepass=[(top1[j], onepass[j]) if fwd[j] else None for j in range(n)],
        mask=mask[:n, :n], root_position=root_position,
        recon_rows=counts[0], steps=counts[1],
        recon_kept=sum(via), repriced_kept=sum(repriced),
        halt_depths={d: c for d, c in enumerate(counts[2:]) if c},
    )
