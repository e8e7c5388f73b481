"""The draft tree of one verification round: EAGLE's dynamic tree plus reconsideration.

Owns:
  * `TreeConfig` — `budget` (B), `k`, `bw` (B_w), `gamma`, `m`, validated.
  * `Node`, `DraftTree` — the tree, its global cut, the verification order and
    the ancestor mask (`tree_mask`).
  * `build_tree` — the drafting round of Sec. 5 / Appendix C.

The round, step by step (one step = one batched call of `M`):
  step 0   the root is the last committed context row (forwarded by
           `DrafterRuntime.extend`); it offers its top-k children.
  step 1.. gamma-1: the `bw` highest-scoring nodes created in the previous step
           (the frontier, as in EAGLE's level-wise expansion) are forwarded; each
           offers its top-k children with `s(c) = s(u) + log pi_one(c|u)`.
           In the SAME batch, the `m` highest bids of the pool (Eq. 8) are carried
           one depth deeper: row `f^r = M(f^{r-1}, Q(f^{r-1}))` at v's position,
           attending to the context, v's ancestors and its own new key.
  cut      the `budget` highest-scoring non-root nodes are kept (ties: earlier
           node first, so the cut is ancestor-closed because `s(child) <= s(parent)`).
So the deepest drafted token sits at depth `gamma` (SGLang's `num_steps`).

Pool and halting (Appendix C.1). A forwarded node enters the pool with probability
`1 - lambda_0`. A node carried to depth `r` reads `lambda_r` off `f^r` and halts with
probability `lambda_r` (always at `r = R`). Nodes still pooled when the round ends are
not repriced. The round draws its uniforms at its start from its generator, one per
row in row order (`round_uniforms`: the root's, then `B_w + m` per step,
the frontier rows' then the carried rows'), so the tensor builder, which draws them
the same way, builds the same tree from the same seed.

Repricing (Eq. 9, Appendix C.2). When v halts at `d_v` we use
  `q(d_v) = lambda_{d_v} prod_{s<d_v} (1 - lambda_s)`   (`prod_{s<R}(1 - lambda_s)` at the cap),
i.e. `halting_distribution` of the lambdas v actually walked, read at `d_v`: the
probability that the gate halts exactly where it did. Then
  `pi_mix = pi_one + q(d_v) (pi_{d_v} - pi_one)`;
every existing child `c` gets `s(c) = s(v) + log pi_mix(c|v)` and the same change
`delta_c` is added to every descendant; the top-k tokens of `pi_mix` that are not
children yet join as children with `s(v) + log pi_mix(t|v)`. They continue from
`f_v^{d_v}` and see v's slot as the halt-depth row (`Node.recon_row`), on that
branch only; the one-pass children keep seeing v's one-pass row.

With an empty pool (`m = 0`, an EAGLE-3 drafter, `R = 0`, or a gate that always
halts at depth 0) no reconsideration row is ever built and the code path is EAGLE's.

This builder is the reference (and the tests' oracle) of `tensor_tree`, which builds
the same round over tensors with one host synchronisation; decoding uses that one.

Does not own: the row forwards (`drafter_runtime`), verification (`verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from pr_specforge.core.parts import halting_distribution
from pr_specforge.serving.drafter_runtime import DrafterRuntime


@dataclass(frozen=True)
class TreeConfig:
    """Draft-tree shape (paper defaults: B in {24, 48}, k = 6, B_w = 6, gamma = 8, m = 3)."""

    budget: int = 24
    k: int = 6
    bw: int = 6
    gamma: int = 8
    m: int = 3

    def __post_init__(self) -> None:
        for name, lo in (("budget", 1), ("k", 1), ("bw", 1), ("gamma", 1), ("m", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"tree {name} must be an integer >= {lo}, got {value!r}")

    def check_vocab(self, draft_vocab_size: int) -> None:
        if self.k > draft_vocab_size:
            raise ValueError(f"tree k={self.k} exceeds the drafter's draft_vocab_size={draft_vocab_size}")


@dataclass
class Node:
    """One draft token. `score` = summed edge log-probabilities from the root."""

    token: int  # target vocabulary id
    draft_id: int  # draft vocabulary id (-1 for the root)
    parent: int
    depth: int
    score: float
    step: int  # the step that created it
    anc_rows: Tuple[int, ...]  # tree rows of its ancestors as its branch sees them
    via_recon: bool = False  # proposed by the parent's reconsidered feature
    repriced: bool = False  # its score differs from the one-pass tree's: an edge on its path was repriced
    #                         by Eq. 9, or the node / an ancestor was proposed by a reconsidered feature
    children: List[int] = field(default_factory=list)
    # set once forwarded (one pass)
    row: int = -1
    feature: Optional[torch.Tensor] = None
    logp_one: Optional[torch.Tensor] = None  # [Vd] fp32
    # reconsideration state
    pooled: bool = False
    depth_r: int = 0  # deepest depth reached so far
    lambdas: List[float] = field(default_factory=list)
    cur_feature: Optional[torch.Tensor] = None
    cur_row: int = -1
    halt_depth: int = -1  # d_v once halted
    q_halt: float = 0.0
    recon_feature: Optional[torch.Tensor] = None
    recon_row: int = -1
    recon_logp: Optional[torch.Tensor] = None  # log pi_{d_v}

    top1_prob: float = float("nan")  # max_t pi_one(t|v), set once forwarded


@dataclass
class DraftTree:
    """A drafted round: all nodes (node 0 is the root) and the kept set after the cut."""

    nodes: List[Node]
    kept: List[int]  # node ids in verification order: root first, parents before children
    root_position: int  # target position of the root token
    recon_rows: int = 0  # reconsideration rows carried this round
    recon_kept: int = 0  # kept nodes (after the cut) proposed by a reconsidered feature
    repriced_kept: int = 0  # kept nodes whose score reconsideration changed (repriced, or proposed by it)
    steps: int = 0  # batched forwards after the root's
    halt_depths: Dict[int, int] = field(default_factory=dict)  # d_v -> count

    def tokens(self) -> List[int]:
        return [self.nodes[i].token for i in self.kept]

    def depths(self) -> List[int]:
        return [self.nodes[i].depth for i in self.kept]

    def parents(self) -> List[int]:
        """Parent of each kept node as an index into `kept` (-1 for the root)."""
        where = {nid: j for j, nid in enumerate(self.kept)}
        return [where[self.nodes[i].parent] if i else -1 for i in self.kept]

    def children(self) -> List[List[int]]:
        """Kept children of each kept node (indices into `kept`), highest score first."""
        where = {nid: j for j, nid in enumerate(self.kept)}
        out: List[List[int]] = [[] for _ in self.kept]
        for j, nid in enumerate(self.kept):
            kids = [c for c in self.nodes[nid].children if c in where]
            kids.sort(key=lambda c: (-self.nodes[c].score, c))
            out[j] = [where[c] for c in kids]
        return out

    def tree_mask(self) -> torch.Tensor:
        """`[n, n]` bool, `mask[i, j]` = kept node j is node i or one of its ancestors."""
        return tree_mask(self.parents())

    def one_pass(self, j: int) -> Optional[Tuple[float, List[int]]]:
        """Kept node j's `(max_t pi_one(t|u), one-pass top-k tokens)`, None if never forwarded."""
        node = self.nodes[self.kept[j]]
        if node.logp_one is None:
            return None
        return node.top1_prob, [self.nodes[c].token for c in node.children if not self.nodes[c].via_recon]

    def via_recon(self, j: int) -> bool:
        return self.nodes[self.kept[j]].via_recon


def round_uniforms(n_draws: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The round's pool-admission and halting uniforms (float64, on the CPU), drawn at once."""
    return torch.rand(n_draws, generator=generator, dtype=torch.float64)


def uniform_count(cfg: TreeConfig) -> int:
    """Uniforms per round: the root's admission, then `B_w + m` per step."""
    return 1 + (cfg.gamma - 1) * (cfg.bw + cfg.m)


def tree_mask(parents: List[int]) -> torch.Tensor:
    """Ancestor-or-self relation from a parent list in topological order."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


class _Builder:
    def __init__(self, rt: DrafterRuntime, cfg: TreeConfig, generator: Optional[torch.Generator], coforward: bool = True):
        self.rt, self.cfg = rt, cfg
        self.coforward = coforward
        self.reconsider = rt.is_pr and rt.max_depth > 0 and cfg.m > 0
        self.u: List[float] = []
        if self.reconsider:
            self.u = round_uniforms(uniform_count(cfg), generator).tolist()
        self.nodes: List[Node] = []
        self.row_k: List[torch.Tensor] = []
        self.row_v: List[torch.Tensor] = []
        self.pool: List[int] = []
        self.recon_rows = 0
        self.halt_depths: Dict[int, int] = {}

    # ------------------------------------------------------------- bookkeeping
    def add_row(self, k: torch.Tensor, v: torch.Tensor) -> int:
        self.row_k.append(k)
        self.row_v.append(v)
        return len(self.row_k) - 1

    def add_child(self, parent: int, draft_id: int, token: int, edge: float, step: int, via_recon: bool) -> None:
        p = self.nodes[parent]
        slot = p.recon_row if via_recon else p.row
        node = Node(
            token=token,
            draft_id=draft_id,
            parent=parent,
            depth=p.depth + 1,
            score=p.score + edge,
            step=step,
            anc_rows=p.anc_rows + (slot,),
            via_recon=via_recon,
            repriced=via_recon or p.repriced,  # its score carries reconsideration's pricing
        )
        self.nodes.append(node)
        p.children.append(len(self.nodes) - 1)

    def shift_subtree(self, nid: int, delta: float) -> None:
        stack = list(self.nodes[nid].children)
        while stack:
            c = stack.pop()
            self.nodes[c].score += delta
            self.nodes[c].repriced = True
            stack.extend(self.nodes[c].children)

    def coin(self, step: int, j: int) -> float:
        """The uniform of row j of step `step` (the root's at step 0)."""
        return self.u[0 if step == 0 else 1 + (step - 1) * (self.cfg.bw + self.cfg.m) + j]

    # ----------------------------------------------------------------- steps
    def offer_children(self, nid: int, feature: torch.Tensor, logp: torch.Tensor, step: int) -> None:
        node = self.nodes[nid]
        node.feature, node.logp_one = feature, logp
        top = torch.topk(logp, self.cfg.k)
        node.top1_prob = float(top.values[0].double().exp())
        tokens = self.rt.to_target_ids(top.indices).tolist()
        for lp, did, tok in zip(top.values.tolist(), top.indices.tolist(), tokens):
            self.add_child(nid, did, tok, lp, step, via_recon=False)

    def admit(self, nid: int, lam0: float, u: float) -> None:
        """Appendix C.1: enter the pool with probability `1 - lambda_0`."""
        node = self.nodes[nid]
        node.lambdas = [lam0]
        node.cur_feature, node.cur_row = node.feature, node.row
        if u >= lam0:
            node.pooled = True
            self.pool.append(nid)

    def bid(self, nid: int) -> float:
        """Eq. 8: `s(v) + log(1 - max_t pi_one(t|v))`."""
        node = self.nodes[nid]
        top1 = node.top1_prob
        return node.score + (float(torch.log1p(torch.tensor(-top1, dtype=torch.float64))) if top1 < 1.0 else float("-inf"))

    def reprice(self, nid: int, step: int) -> None:
        """Eq. 9 on every edge out of v; new top-k tokens of pi_mix join as children."""
        v = self.nodes[nid]
        d = v.depth_r
        walked = torch.tensor(v.lambdas[: min(d, self.rt.max_depth - 1) + 1], dtype=torch.float64)
        q_d = float(halting_distribution(walked)[d])
        v.halt_depth, v.q_halt = d, q_d
        v.recon_feature, v.recon_row = v.cur_feature, v.cur_row
        self.halt_depths[d] = self.halt_depths.get(d, 0) + 1
        pi_one = v.logp_one.double().exp()
        pi_d = v.recon_logp.double().exp()
        log_mix = torch.log(pi_one + q_d * (pi_d - pi_one)).clamp(max=0.0)
        existing = set()
        for c in v.children:
            child = self.nodes[c]
            existing.add(child.draft_id)
            new_score = v.score + float(log_mix[child.draft_id])
            delta = new_score - child.score
            child.score = new_score
            if delta != 0.0:
                child.repriced = True
                self.shift_subtree(c, delta)
        top = torch.topk(log_mix, self.cfg.k)
        tokens = self.rt.to_target_ids(top.indices).tolist()
        for lm, did, tok in zip(top.values.tolist(), top.indices.tolist(), tokens):
            if did not in existing:
                self.add_child(nid, did, tok, lm, step, via_recon=True)

    def step(self, step: int) -> bool:
        cfg, rt = self.cfg, self.rt
        frontier = [i for i, n in enumerate(self.nodes) if n.step == step - 1 and n.row < 0 and i > 0]
        frontier.sort(key=lambda i: (-self.nodes[i].score, i))
        advance = frontier[: cfg.bw]
        recon: List[int] = []
        if self.reconsider and cfg.m > 0 and self.pool:
            ranked = sorted(self.pool, key=lambda i: (-self.bid(i), i))
            recon = ranked[: cfg.m]
        if not advance and not recon:
            return False

        emb, hidden, pos, visible = [], [], [], []
        for i in advance:
            node, parent = self.nodes[i], self.nodes[self.nodes[i].parent]
            emb.append(rt.embed(torch.tensor([node.token]))[0])
            hidden.append(rt.feedback(parent.recon_feature if node.via_recon else parent.feature))
            pos.append(self.root_pos + node.depth)
            visible.append(node.anc_rows)
        if recon:
            r_emb, r_hidden = rt.reconsideration_inputs(torch.stack([self.nodes[i].cur_feature for i in recon]))
            emb.extend(r_emb)
            hidden.extend(r_hidden)
            for i in recon:
                pos.append(self.root_pos + self.nodes[i].depth)
                visible.append(self.nodes[i].anc_rows)
        tree_k, tree_v = torch.stack(self.row_k), torch.stack(self.row_v)
        pos_t = torch.tensor(pos, device=rt.device)
        emb_t, hidden_t = torch.stack(emb), torch.stack(hidden)
        # each row's reconsideration depth: 0 for the frontier, the depth a pooled node is carried to
        depths = torch.tensor([0] * len(advance) + [self.nodes[i].depth_r + 1 for i in recon], device=rt.device)
        recon_rows = depths > 0 if recon else None
        if self.coforward or not recon or not advance:
            feats, ks, vs = rt.forward_rows(emb_t, hidden_t, pos_t, self.ctx_len, tree_k, tree_v, visible, recon_rows)
        else:  # the serial baseline of Appendix A.1: reconsideration in its own call of M
            a = len(advance)
            parts = [
                rt.forward_rows(emb_t[sl], hidden_t[sl], pos_t[sl], self.ctx_len, tree_k, tree_v, visible[sl], recon_rows[sl])
                for sl in (slice(0, a), slice(a, None))
            ]
            feats, ks, vs = (torch.cat(x) for x in zip(*parts))
        logps = rt.log_probs(feats, depths)
        rows = [self.add_row(ks[j], vs[j]) for j in range(len(pos))]
        lams = rt.halt_probability(feats).tolist() if self.reconsider else None

        for j, i in enumerate(advance):
            self.nodes[i].row = rows[j]
            self.offer_children(i, feats[j], logps[j], step)
            if self.reconsider:
                self.admit(i, lams[j], self.coin(step, j))
        for jj, i in enumerate(recon):
            j = len(advance) + jj
            self.recon_rows += 1
            v = self.nodes[i]
            v.depth_r += 1
            v.cur_feature, v.cur_row, v.recon_logp = feats[j], rows[j], logps[j]
            halt = v.depth_r >= rt.max_depth
            if not halt:
                v.lambdas.append(lams[j])
                halt = self.coin(step, self.cfg.bw + jj) < lams[j]
            if halt:
                self.pool.remove(i)
                v.pooled = False
                self.reprice(i, step)
        return True

    def build(self, root_token: int, root_feature: torch.Tensor) -> DraftTree:
        rt, cfg = self.rt, self.cfg
        if rt.length < 1:
            raise ValueError("the drafter context is empty: call DrafterRuntime.extend before drafting")
        self.ctx_len = rt.length - 1  # the last context row is the root's own row
        self.root_pos = rt.length - 1  # drafter position of the root row
        root = Node(token=int(root_token), draft_id=-1, parent=-1, depth=0, score=0.0, step=-1, anc_rows=())
        self.nodes.append(root)
        root.row = self.add_row(rt.k_cache[:, -1], rt.v_cache[:, -1])
        feat = root_feature.reshape(1, -1)
        self.offer_children(0, feat[0], rt.log_probs(feat, 0)[0], step=0)
        if self.reconsider:
            self.admit(0, float(rt.halt_probability(feat)[0]), self.coin(0, 0))
        steps = 0
        for s in range(1, cfg.gamma):
            if not self.step(s):
                break
            steps += 1
        kept = global_cut(self.nodes, cfg.budget)
        return DraftTree(
            recon_kept=sum(self.nodes[i].via_recon for i in kept),
            repriced_kept=sum(self.nodes[i].repriced for i in kept),  # via_recon implies repriced
            nodes=self.nodes,
            kept=kept,
            root_position=rt.length,
            recon_rows=self.recon_rows,
            steps=steps,
            halt_depths=dict(self.halt_depths),
        )


def global_cut(nodes: List[Node], budget: int) -> List[int]:
    """Keep the root and the `budget` highest-scoring nodes; return them in verification order."""
    for i, n in enumerate(nodes[1:], 1):
        assert n.score <= nodes[n.parent].score, f"node {i} scores above its parent after repricing"
    ranked = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i].score, i))[:budget]
    kept = set(ranked)
    for i in ranked:
        assert nodes[i].parent == 0 or nodes[i].parent in kept, "the global cut is not ancestor-closed"
    return [0] + sorted(ranked, key=lambda i: (nodes[i].depth, i))


@torch.no_grad()
def build_tree(
    rt: DrafterRuntime,
    root_token: int,
    root_feature: torch.Tensor,
    cfg: TreeConfig,
    generator: Optional[torch.Generator] = None,
    coforward: bool = True,
) -> DraftTree:
    """Draft one round from the root (the last committed context row, see module doc).

    `m = 0` (or an EAGLE-3 drafter, or `R = 0`) gives EAGLE's dynamic tree.
    `generator` drives the sampled pool admissions and halts. `coforward=False` runs the
    reconsideration rows in a separate call of `M` (same tree; the serial cost baseline).
    """
    cfg.check_vocab(rt.draft_vocab_size)
    return _Builder(rt, cfg, generator, coforward).build(root_token, root_feature)
