"""The control's task: pointer chasing on a random cycle, shaped like an EAGLE-3 offline batch.

Each sample draws a random cycle `f` over `N` symbols and lists its pairs in a shuffled order,
one pair `x v(f(x))` per symbol (`x` a key token, `v(y)` the value token of symbol `y`). Then
come `K` queries `Qk x' v(y)` about distinct symbols (a repeated query could copy the earlier
answer): `x'` is the query copy of symbol `a`, `k` the query kind (`Q1` or
`Q2`) and `y` the answer, `f(a)` for `Q1` and `f(f(a))` for `Q2`. The three tokens of a symbol
share its embedding; only a key token's target features carry it.

The answers are hidden (`hide_answers`): the sequence holds PAD where an answer stands, and only
the teacher names it. Were an earlier 2-hop answer in the context, its row `(a', v(f(f(a))))`
would be a 2-hop fact, and since `f∘f` is a permutation a single pass could eliminate every
answer such facts already name: with the answers visible at N = 5, K = 4, depth 0 answered
60-85% of the 2-hop queries, far more than one read allows.

Through SpecForge's EAGLE-3 shift a drafter row at position `p` reads the target's features of
token `p` in its hidden slot and the embedding of token `p + 1` in its token slot, and predicts
token `p + 2`. So a pair's row holds the pair `(x, v(f(x)))`, and the row that predicts the
answer holds `(Qk, a')`. A 1-hop answer needs one attention read (the row whose key is `a`);
a 2-hop answer needs two (the row whose key is what the first read returned), which one pass
of the single-layer drafter cannot do and a reconsideration pass can.

The target's 3-layer features are a fixed map of the token identity (what the target "knows"
at a position is its token); the teacher is the one-hot of the next token, and the loss mask is
set on answer positions only.

Owns: `ControlTask` (vocabulary layout, `batch`). Does not own the drafter or the training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

PAD, Q1, Q2 = 0, 1, 2
#: the logit of the teacher's token (0 elsewhere): a one-hot teacher after the softmax
TEACHER_LOGIT = 30.0


@dataclass(frozen=True)
class ControlTask:
    """Vocabulary: PAD, Q1, Q2, then three copies of the `symbols` symbols: keys `x` (a pair's first
    element), values `v(x)` (a pair's second element, and the answers: the draft vocabulary) and
    query copies `x'`. The three copies of a symbol share its embedding row (they name it)."""

    symbols: int = 8
    queries: int = 4
    #: the symbols a sample's cycle is drawn from (None: `symbols`, every sample uses them all)
    pool: Optional[int] = None
    feature_seed: int = 1234
    #: put PAD where each answer stands, so that no answer is in the context (the teacher still is the answer)
    hide_answers: bool = True

    def __post_init__(self) -> None:
        if self.one_pass_bound >= 1.0:
            raise ValueError(f"the control needs at least 5 symbols, got N = {self.symbols}: one pass rules out a, f(a) "
                             "and the symbol before a, so it answers 1/(N-3) of the 2-hop queries by elimination "
                             f"(all of them at N = {self.symbols}) and no second pass could show; N = 5 bounds one pass "
                             "at 50%, the default N = 6 at 33%")
        if not 1 <= self.queries <= self.symbols:
            raise ValueError(f"the control asks 1 to N = {self.symbols} queries per sample (one per symbol), got {self.queries}")
        if self.pool is not None and self.pool < self.symbols:
            raise ValueError(f"the control's symbol pool must hold at least N = {self.symbols} symbols, got {self.pool}")

    @property
    def one_pass_bound(self) -> float:
        """The share of 2-hop queries one pass can answer at best: it rules out `a`, `f(a)` and the symbol before `a`
        among the sample's N symbols and guesses among the N - 3 left (all of them where at most one is left)."""
        return 1.0 / max(self.symbols - 3, 1)

    @property
    def size(self) -> int:
        """M: the symbols in the vocabulary (each sample's N are drawn from them)."""
        return self.symbols if self.pool is None else self.pool
    @property
    def first_key(self) -> int:
        return 3

    @property
    def first_symbol(self) -> int:
        """The first value token: draft token `i` is the value of symbol `i`."""
        return 3 + self.size

    @property
    def first_query(self) -> int:
        return 3 + 2 * self.size

    @property
    def vocab_size(self) -> int:
        return 3 + 3 * self.size

    @property
    def seq_len(self) -> int:
        return 2 * self.symbols + 3 * self.queries

    def vocab_map(self):
        """`(t2d, d2t)`: the draft vocabulary is the value tokens (the answers)."""
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.first_symbol:self.first_symbol + self.size] = True
        d2t = torch.full((self.size,), self.first_symbol, dtype=torch.long)
        return t2d, d2t

    def embedding_table(self, hidden: int) -> torch.Tensor:
        """The target's input embedding `[V, hidden]` (the drafter shares it): fixed random rows, the
        three copies of a symbol on one row."""
        g = torch.Generator().manual_seed(self.feature_seed)
        emb = torch.randn(self.vocab_size, hidden, generator=g)
        n = self.size
        for first in (self.first_symbol, self.first_query):
            emb[first:first + n] = emb[self.first_key:self.first_key + n]
        return emb

    def feature_table(self, target_hidden: int) -> torch.Tensor:
        """The fixed map token -> the target's 3 captured layers `[V, 3 * target_hidden]`: for a key
        token the first layer is its embedding (a low layer carries the token), for every other
        token a random code; the upper two layers are random codes per token."""
        g = torch.Generator().manual_seed(self.feature_seed + 1)
        table = torch.randn(self.vocab_size, 3 * target_hidden, generator=g)
        keys = slice(self.first_key, self.first_key + self.size)
        table[keys, :target_hidden] = self.embedding_table(target_hidden)[keys]
        return table

    def tokens(self, batch: int, generator: torch.Generator):
        """`(tokens [B, L], answer mask [B, L], kind [B, L])`: kind 1 or 2 at answer positions, 0 elsewhere."""
        n, k = self.symbols, self.queries
        toks = torch.empty(batch, self.seq_len, dtype=torch.long)
        kind = torch.zeros(batch, self.seq_len, dtype=torch.long)
        for b in range(batch):
            sym = torch.randperm(self.size, generator=generator)[:n]  # the sample's N symbols
            order = torch.randperm(n, generator=generator)
            f = torch.empty(n, dtype=torch.long)
            f[order] = order.roll(-1)  # f(order[i]) = order[i + 1]: one cycle through every symbol
            pairs = torch.randperm(n, generator=generator)
            ctx = torch.stack([sym[pairs] + self.first_key, sym[f[pairs]] + self.first_symbol], dim=1).reshape(-1)
            a = torch.randperm(n, generator=generator)[:k]  # distinct: a repeated query would copy the earlier answer
            hops = torch.randint(1, 3, (k,), generator=generator)
            ans = torch.where(hops == 1, f[a], f[f[a]])
            qs = torch.stack([torch.where(hops == 1, Q1, Q2), sym[a] + self.first_query, sym[ans] + self.first_symbol], dim=1)
            toks[b] = torch.cat([ctx, qs.reshape(-1)])
            kind[b, 2 * n + 2::3] = hops
        return toks, kind > 0, kind

    def batch(self, batch: int, generator: torch.Generator, target_hidden: int, table: torch.Tensor) -> Dict[str, torch.Tensor]:
        """An EAGLE-3 training batch after SpecForge's shift (what `OnlineEagle3Model.forward` reads),
        plus `kind [B, L]`: at row `p`, the kind of the query whose answer is token `p + 2` (0: none)."""
        toks, answer, kind = self.tokens(batch, generator)
        b, length = toks.shape
        seen = toks.masked_fill(answer, PAD) if self.hide_answers else toks  # what the drafter reads
        nxt = torch.cat([seen[:, 1:], torch.full((b, 1), PAD)], dim=1)  # token p + 1 (the token slot)
        after = torch.cat([toks[:, 2:], torch.full((b, 2), PAD)], dim=1)  # token p + 2 (the teacher's)
        target = torch.zeros(b, length, self.vocab_size)
        target.scatter_(2, after[..., None], TEACHER_LOGIT)
        row_kind = torch.cat([kind[:, 2:], torch.zeros(b, 2, dtype=torch.long)], dim=1)
        return {
            "input_ids": nxt,
            "attention_mask": torch.ones(b, length, dtype=torch.long),
            "target": target,
            "loss_mask": (row_kind > 0).long()[..., None],
            "hidden_states": table[seen],
            "kind": row_kind,
            "answer": after,
        }
