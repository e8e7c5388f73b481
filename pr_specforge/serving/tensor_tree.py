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
               forwarded (an empty row is computed and never read).
Slots are allocated in the object tree's creation order, so "earlier node first" ties
break the same way, and the valid slots, sorted, are the object tree's node list.

Each step: top-B_w of the previous block (frontier), top-m of the pool's bids, ONE call of
`M` over those rows against the runtime's preallocated KV buffer (the round's tree rows sit
after the context, the additive tree-attention mask is allocated once per round and each
step writes its own rows), top-k children, pool admission and halting against uniforms
drawn once per round, then for the halted rows Eq. 9 as batched index operations: edge
deltas of the existing children, propagated to every descendant through the ancestor
matrix (`anc @ delta`), and the top-k of pi_mix not yet children as new children.

Random draws: the round draws `1 + (gamma - 1)(B_w + m)` uniforms at its start (root's
admission, then per step one per frontier row and one per reconsidered row, in row order),
exactly as the object tree does, so the same generator gives the same tree at T > 0.

Does not own: the algorithm's definition and its reference (`tree`, the test oracle), the
row forwards (`drafter_runtime`), verification (`verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from pr_specforge.serving.drafter_runtime import DrafterRuntime
from pr_specforge.serving.tree import TreeConfig, round_uniforms, uniform_count

# columns of the packed per-node integer state
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


class TensorTreeBuilder:
    """One sequence's tree builder; its buffers are allocated once and reused every round."""

    def __init__(self, rt: DrafterRuntime, cfg: TreeConfig, coforward: bool = True) -> None:
        cfg.check_vocab(rt.draft_vocab_size)
        self.rt, self.cfg, self.coforward = rt, cfg, coforward
        self.pool_on = rt.is_pr and rt.max_depth > 0 and cfg.m > 0
        self.k, self.bw, self.m = cfg.k, cfg.bw, (cfg.m if self.pool_on else 0)
        self.per_step = self.bw + self.m
        self.n_nodes = 1 + self.k + (cfg.gamma - 1) * self.per_step * self.k
        self.null = self.n_nodes
        self.n_rows = 1 + (cfg.gamma - 1) * self.per_step
        self._allocate()

    # ------------------------------------------------------------- buffers
    def _allocate(self) -> None:
        dev, n, r, rt = self.rt.device, self.n_nodes + 1, self.n_rows, self.rt
        d = rt.drafter.config.hidden_size
        f64, i64 = dict(device=dev, dtype=torch.float64), dict(device=dev, dtype=torch.long)
        self.score = torch.zeros(n, **f64)
        self.info = torch.zeros(n, 8, **i64)
        self.vis = torch.zeros(n, r, device=dev, dtype=torch.bool)  # rows a node's forward may see
        self.anc = torch.zeros(n, n, device=dev, dtype=torch.bool)  # anc[x, a]: a is x or one of its ancestors
        self.row_of = torch.zeros(n, **i64)  # the node's one-pass row
        self.first_child = torch.zeros(n, **i64)  # first slot of its k one-pass children
        self.top1 = torch.zeros(n, **f64)  # max_t pi_one(t|u)
        self.forwarded = torch.zeros(n, device=dev, dtype=torch.bool)
        self.row_feat = torch.zeros(r, d, device=dev, dtype=rt.dtype)
        self.row_logp = torch.zeros(r, rt.draft_vocab_size, device=dev, dtype=torch.float32)
        self.pooled = torch.zeros(n, device=dev, dtype=torch.bool)
        self.bid_base = torch.zeros(n, **f64)  # log(1 - max_t pi_one(t|v)), Eq. 8 minus s(v)
        self.depth_r = torch.zeros(n, **i64)
        self.cur_row = torch.zeros(n, **i64)
        self.survive = torch.zeros(n, **f64)  # prod_{s<r}(1 - lambda_s) over the depths walked so far
        self.row_ok = torch.zeros(r, device=dev, dtype=torch.bool)  # the row held a node
        self.arange_k = torch.arange(self.k, **i64)
        self.step_rows = torch.arange(self.per_step, **i64)
        self.own = torch.eye(r, device=dev, dtype=torch.bool)
        self.zero_depth = torch.zeros(self.bw, **i64)
        self.via = torch.zeros(self.per_step, self.k, **i64)  # children of reconsidered rows: via_recon
        self.via[self.bw :] = 1
        self.true1 = torch.ones(1, device=dev, dtype=torch.bool)
        # the step's rows: bw frontier rows, then m reconsideration rows (the PR drafter's adapter acts on these)
        self.recon_row_mask = torch.arange(self.per_step, device=dev) >= self.bw

    def _reset(self) -> None:
        for t in (self.score, self.info, self.vis, self.anc, self.forwarded, self.pooled, self.depth_r,
                  self.row_ok):
            t.zero_()
        self.row_of.fill_(-1)

    # ------------------------------------------------------------- helpers
    def _new_nodes(self, start: int, parents: torch.Tensor, logps: torch.Tensor, draft: torch.Tensor,
                   src_rows: torch.Tensor, valid: torch.Tensor, via: torch.Tensor) -> None:
        """Write the `[P, k]` children of `parents [P]` into slots `start ..` (score, ids, masks).

        `via [P, k]` (0/1): proposed by a reconsidered feature; `src_rows [P]`: the row the
        children continue from (the parent's one-pass row, or its halt-depth row)."""
        p, k = parents.shape[0], self.k
        sl = slice(start, start + p * k)
        self.score[sl] = (self.score[parents][:, None] + logps).reshape(-1)
        pinfo = self.info[parents]
        cols = [
            parents[:, None].expand(p, k), (pinfo[:, DEPTH] + 1)[:, None].expand(p, k), draft,
            self.rt.to_target_ids(draft), src_rows[:, None].expand(p, k), via,
            pinfo[:, REPRICED][:, None] | via, valid.long(),
        ]
        self.info[sl] = torch.stack(cols, dim=-1).reshape(p * k, 8)
        vis = self.vis[parents] | self.own[src_rows]
        self.vis[sl] = vis[:, None].expand(p, k, self.n_rows).reshape(p * k, self.n_rows)
        self.anc[sl] = self.anc[parents][:, None].expand(p, k, self.n_nodes + 1).reshape(p * k, -1)
        self.anc[sl, sl].diagonal().fill_(True)

    def _forwarded(self, nodes: torch.Tensor, rows: torch.Tensor, first_child: int, top1_logp: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
        """Record forwarded nodes (their row, children block, top-1); returns `max_t pi_one(t|u)`."""
        top1 = top1_logp.double().exp()
        self.row_of[nodes] = rows
        self.first_child[nodes] = first_child + self.k * self.step_rows[: nodes.shape[0]]
        self.top1[nodes] = top1
        self.forwarded[nodes] = valid
        return top1

    def _admit(self, nodes, rows, top1, lam, u, valid) -> None:
        """Appendix C.1: a forwarded node enters the pool with probability `1 - lambda_0`."""
        self.bid_base[nodes] = torch.log1p(-top1)  # -inf when max_t pi_one = 1
        self.survive[nodes] = 1.0 - lam
        self.cur_row[nodes] = rows
        self.pooled[nodes] = valid & (u >= lam)

    def _top(self, key: torch.Tensor, ok: torch.Tensor, n: int, offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Slots of the `n` highest `key` (ties: earlier slot first) and whether each is a real
        pick (`ok`); an empty pick is the null slot."""
        order = torch.sort(key, descending=True, stable=True).indices[:n]
        good = ok[order]
        if order.shape[0] < n:
            order = torch.cat([order, order.new_zeros(n - order.shape[0])])
            good = torch.cat([good, good.new_zeros(n - good.shape[0])])
        return torch.where(good, order + offset if offset else order, self.null), good

    # ---------------------------------------------------------------- round
    def _root(self, root_token: int, root_feature: torch.Tensor, u: Optional[torch.Tensor]) -> None:
        rt = self.rt
        self.info[0, TOKEN] = int(root_token)
        self.info[0, VALID] = 1
        self.anc[0, 0] = True
        feat = root_feature.reshape(1, -1).to(rt.dtype)
        self.row_feat[0] = feat[0]
        logp = rt.log_probs(feat, 0)
        self.row_logp[0] = logp[0]
        root = self.step_rows[:1]  # node 0, row 0
        ok = self.true1
        top = torch.topk(logp, self.k, dim=-1)
        top1 = self._forwarded(root, root, 1, top.values[:, 0], ok)
        self._new_nodes(1, root, top.values.double(), top.indices, root, ok[:, None].expand(1, self.k), self.via[:1])
        if self.pool_on:
            self._admit(root, root, top1, rt.halt_probability(feat).double(), u[:1], ok)

    def _step(self, s: int, u: Optional[torch.Tensor]) -> None:
        bw, m, k = self.bw, self.m, self.k
        prev = 1 if s == 1 else 1 + k + (s - 2) * self.per_step * k
        prev_n = k if s == 1 else self.per_step * k
        block = 1 + k + (s - 1) * self.per_step * k
        r0 = 1 + (s - 1) * self.per_step
        fvalid = self.info[prev : prev + prev_n, VALID].bool()
        adv, adv_ok = self._top(torch.where(fvalid, self.score[prev : prev + prev_n], NEG), fvalid, bw, prev)
        rows = r0 + self.step_rows
        nodes, ok = adv, adv_ok
        if m:
            rec, rec_ok = self._top(torch.where(self.pooled, self.score + self.bid_base, NEG), self.pooled, m)
            nodes, ok = torch.cat([adv, rec]), torch.cat([adv_ok, rec_ok])
        depth = self.depth_r[rec] + 1 if m else None  # the carried rows' new depth
        logp, lam = self._forward(nodes, r0, depth)
        top = torch.topk(logp[:bw], k, dim=-1)
        top1 = self._forwarded(adv, rows[:bw], block, top.values[:, 0], adv_ok)
        vals, ids, kids_ok = top.values.double(), top.indices, adv_ok[:, None].expand(bw, k)
        if m:
            self._admit(adv, rows[:bw], top1, lam[:bw], u[r0 : r0 + bw], adv_ok)
            r_vals, r_ids, r_ok = self._reconsider(rec, rec_ok, depth, rows[bw:], logp[bw:], lam[bw:], u[r0 + bw : r0 + bw + m])
            vals, ids, kids_ok = torch.cat([vals, r_vals]), torch.cat([ids, r_ids]), torch.cat([kids_ok, r_ok])
        # created after Eq. 9's shifts, from their parents' repriced scores: as if shifted with them
        self._new_nodes(block, nodes, vals, ids, rows, kids_ok, self.via)
        self.row_ok[r0 : r0 + self.per_step] = ok

    def _forward(self, nodes: torch.Tensor, r0: int, depth: Optional[torch.Tensor]):
        """ONE call of `M` over the step's frontier and reconsidered rows; their readouts."""
        rt, bw, m, n = self.rt, self.bw, self.m, self.per_step
        info = self.info[nodes]
        emb, hidden = rt.embed(info[:bw, TOKEN]), self.row_feat[info[:bw, SRC]]
        if m:  # Eq. 3's input slots for the carried rows, from their current depth's feature
            r_emb, r_hidden = rt.reconsideration_inputs(self.row_feat[self.cur_row[nodes[bw:]]])
            emb, hidden = torch.cat([emb.to(r_emb.dtype), r_emb]), torch.cat([hidden, r_hidden])
        pos = self.root_pos + info[:, DEPTH]
        self.mask[r0 : r0 + n, self.ctx :] = torch.where(self.vis[nodes] | self.own[r0 : r0 + n], 0.0, NEG)
        mask = self.mask[r0 : r0 + n]
        col = self.ctx + r0
        recon = self.recon_row_mask if m else None
        if self.coforward or not m:
            feats = rt.forward_tree_rows(emb, hidden, pos, col, mask, self.max_pos, recon)
        else:  # the serial baseline of Appendix A.1: the reconsideration rows in their own call of M
            feats = torch.cat([
                rt.forward_tree_rows(emb[:bw], hidden[:bw], pos[:bw], col, mask[:bw], self.max_pos, recon[:bw]),
                rt.forward_tree_rows(emb[bw:], hidden[bw:], pos[bw:], col + bw, mask[bw:], self.max_pos, recon[bw:])])
        self.row_feat[r0 : r0 + n] = feats
        if not m:
            return rt.log_probs(feats, 0), None
        lam = rt.halt_probability(feats).double()
        logp = rt.log_probs(feats, torch.cat([self.zero_depth, depth]))
        self.row_logp[r0 : r0 + bw] = logp[:bw]  # pi_one of the frontier rows, read if they are repriced
        return logp, lam

    def _reconsider(self, rec, rec_ok, d, rows, logp_d, lam, u):
        """One depth deeper (`d`) for the carried bids; the halted ones are repriced (Eq. 9).

        Returns the new children `(log pi_mix [m, k], draft ids, valid)`: the top-k of pi_mix
        that are not children yet."""
        self.depth_r[rec] = d
        self.cur_row[rec] = rows
        cap = d >= self.rt.max_depth
        halt_here = torch.where(cap, 1.0, lam)
        survive = self.survive[rec]
        q = (survive * halt_here)[:, None]  # Eq. 4's q(d) = lambda_d prod_{s<d}(1 - lambda_s), prod alone at R
        self.survive[rec] = survive * (1.0 - halt_here)
        halt = rec_ok & (cap | (u < lam))
        self.pooled[rec] = rec_ok & ~halt
        logp_one = self.row_logp[self.row_of[rec].clamp(min=0)]
        kids = self.first_child[rec][:, None] + self.arange_k  # v's one-pass children
        kid_draft = self.info[kids, DRAFT]
        # pi_mix's top-k in fp32 over the vocabulary, log pi_mix in float64 where it is read
        new_ids = torch.topk(torch.lerp(logp_one.exp(), logp_d.exp(), q.float()), self.k, dim=-1).indices
        ids = torch.cat([kid_draft, new_ids], dim=1)
        one, deep = logp_one.gather(1, ids).double().exp(), logp_d.gather(1, ids).double().exp()
        log_mix = torch.log(one + q * (deep - one)).clamp(max=0.0)  # Eq. 9, [m, 2k]
        self._shift_existing(rec, halt, kids.reshape(-1), log_mix[:, : self.k])
        exists = (new_ids[:, :, None] == kid_draft[:, None, :]).any(-1)
        return log_mix[:, self.k :], new_ids, halt[:, None] & ~exists

    def _shift_existing(self, rec, halt, kids, log_mix) -> None:
        """Eq. 9 on the existing children: `s(c) = s(v) + log pi_mix(c|v)`, the same delta to every descendant."""
        new = self.score[rec][:, None] + log_mix
        delta = torch.where(halt[:, None], new - self.score[kids].view(-1, self.k), 0.0).reshape(-1)
        moved = self.anc.index_select(1, kids).double() @ torch.stack([delta, (delta != 0).double()], dim=1)
        self.score += moved[:, 0]
        self.info[:, REPRICED] |= (moved[:, 1] > 0).long()

    # ------------------------------------------------------------------ cut
    def _cut(self):
        """Keep the root and the `B` highest-scoring nodes, in verification order; ancestor mask."""
        n = self.n_nodes + 1
        valid = self.info[:, VALID].bool()
        valid_nr = valid.clone()
        valid_nr[0] = False
        ranked, ok = self._top(torch.where(valid_nr, self.score, NEG), valid_nr, self.cfg.budget)
        depth = self.info[ranked, DEPTH]
        order = torch.sort(torch.where(ok, depth * n + ranked, n * n)).indices
        kept = torch.cat([ranked.new_zeros(1), ranked[order]])
        ok = torch.cat([ok.new_ones(1), ok[order]])
        where = torch.full((n,), -1, dtype=torch.long, device=kept.device)
        where[kept] = torch.arange(kept.shape[0], device=kept.device)
        where[self.null] = -1
        return kept, ok, where

    def _pack(self, kept, ok, where) -> torch.Tensor:
        """Everything the host needs from the round, as one int64 vector (doubles as their bits)."""
        info = self.info[kept]
        parent = torch.where(kept == 0, -1, where[info[:, PARENT]])
        score = torch.where(ok, self.score[kept], NEG)
        by_score = torch.sort(score, descending=True, stable=True).indices
        onepass = self.info[(self.first_child[kept][:, None] + self.arange_k).clamp(max=self.null), TOKEN]
        parts = [
            ok.long(), kept, info[:, TOKEN], info[:, DEPTH], parent, info[:, VIA], info[:, REPRICED], by_score,
            self.forwarded[kept].long(), self.top1[kept].view(torch.long), score.view(torch.long),
            onepass.reshape(-1), self._counts(),
        ]
        return torch.cat(parts)

    def _counts(self) -> torch.Tensor:
        """Reconsideration rows, steps that forwarded a row, halts per depth 0..R."""
        rows = self.row_ok[1:].view(self.cfg.gamma - 1, self.per_step)
        halted = (~self.pooled[: self.null]) & (self.depth_r[: self.null] > 0)
        halts = torch.zeros(self.rt.max_depth + 1, dtype=torch.long, device=rows.device)
        halts.index_add_(0, self.depth_r[: self.null], halted.long())
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
        self.mask = torch.full((self.n_rows, self.ctx + self.n_rows), NEG, device=rt.device, dtype=rt.dtype)
        self.mask[:, : self.ctx] = 0.0
        u = None
        if self.pool_on:
            u = round_uniforms(uniform_count(cfg), generator).to(rt.device, non_blocking=True)
        self._root(root_token, root_feature, u)
        for s in range(1, cfg.gamma):
            self._step(s, u)
        kept, ok, where = self._cut()
        mask = self.anc[kept][:, kept]
        host = self._pack(kept, ok, where).cpu()  # the round's one synchronisation
        tree = self._unpack(host, mask, rt.length)
        if keep_state:
            tree.state = self.state()
        return tree

    def _unpack(self, host: torch.Tensor, mask: torch.Tensor, root_position: int) -> TensorDraftTree:
        b1, k = self.cfg.budget + 1, self.k
        cols = host[: 11 * b1].view(11, b1)
        n = int(cols[0].sum())
        vals = cols[:, :n].tolist()
        ok, slots, tokens, depths, parents, via, repriced, by_score, fwd = vals[:9]
        top1 = cols[9, :n].view(torch.float64).tolist()
        scores = cols[10, :n].view(torch.float64).tolist()
        onepass = host[11 * b1 : 11 * b1 + b1 * k].view(b1, k)[:n].tolist()
        counts = host[11 * b1 + b1 * k :].tolist()
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

    def state(self) -> Dict[str, torch.Tensor]:
        """The round's node tensors (copies), for tests and diagnostics."""
        return {
            "score": self.score.clone(), "info": self.info.clone(), "row_logp": self.row_logp.clone(),
            "row_of": self.row_of.clone(), "cur_row": self.cur_row.clone(), "depth_r": self.depth_r.clone(),
        }

