"""The drafter at serving time: its committed-context KV cache and batched row forwards.

Owns:
  * `DrafterRuntime` — wraps an EAGLE-3 or PR drafter for decoding one sequence:
    checks it against the target (vocabulary, hidden size, captured layers), shares
    the target's input embedding, keeps the KV of the committed context across
    verification rounds (`extend`), and runs any set of tree rows in ONE call of
    the decoder layer `M` (`forward_rows`), each row with its own explicit
    position and its own set of visible tree rows (exact tree attention). The
    two-layer EAGLE-3 control (`modeling.two_layer`) runs its second layer on the
    same rows right after `M`, against KV of its own: the runtime's KV holds
    `layers x H` heads (`M`'s first), so tree builders never see the difference.
  * `aux_layer_ids` — which target layers the drafter reads (SpecForge's capture rule,
    through `pr_specforge._specforge.eagle_capture_layers`).

Context rows follow SpecForge's EAGLE-3 shift (`OnlineEagle3Model`): the drafter
row at position `p` reads `fc(target layers at p)` in the hidden slot and the
embedding of token `p + 1` in the token slot; its feature predicts token `p + 2`.
So after the target has produced token `x_n`, the last context row (position
`n - 1`, token slot `x_n`) is the draft tree's root: its feature offers the
candidates for `x_{n+1}`.

Does not own: which rows run (`pr_specforge.serving.tree`), the target
(`pr_specforge.serving.verify`), or the decode loop (`pr_specforge.serving.decode`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from pr_specforge.core.parts import PRRows


def aux_layer_ids(drafter: nn.Module, num_target_layers: int) -> List[int]:
    """Target decoder layers whose OUTPUTS feed the drafter (`output_hidden_states[i + 1]`)."""
    from pr_specforge._specforge import eagle_capture_layers, target_layer_count

    ids = [int(i) for i in eagle_capture_layers(drafter.config, target_layer_count(num_target_layers))]
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids must be 3 layer indices in [0, {num_target_layers}) "
            f"for a {num_target_layers}-layer target, got {ids}"
        )
    return ids


def check_compatible(drafter: nn.Module, target_config) -> None:
    """Raise ValueError (naming the field) when the drafter cannot serve this target."""
    dcfg = drafter.config
    if int(dcfg.vocab_size) != int(target_config.vocab_size):
        raise ValueError(
            f"drafter vocab_size={dcfg.vocab_size} does not match the target's vocab_size={target_config.vocab_size}"
        )
    t_hidden = int(target_config.hidden_size)
    fc_in = drafter.fc.in_features
    if fc_in != 3 * t_hidden:
        raise ValueError(
            f"drafter target_hidden_size (fc input {fc_in} = 3 x {fc_in // 3}) does not match "
            f"the target's hidden_size={t_hidden}"
        )
    if int(dcfg.hidden_size) != t_hidden:
        raise ValueError(
            f"drafter hidden_size={dcfg.hidden_size} does not match the target's hidden_size={t_hidden} "
            "(the drafter shares the target's input embedding)"
        )


class DrafterRuntime:
    """One sequence's drafter state: the committed-context KV cache `[H, C, Dh]`.

    `drafter` must be in eval mode; everything here runs under `torch.no_grad()`.
    """

    def __init__(self, drafter: nn.Module, target: Optional[nn.Module] = None) -> None:
        self.drafter = drafter
        self.is_pr = isinstance(drafter, PRRows)
        attn = drafter.midlayer.self_attn
        self.second = getattr(drafter, "second_layer", None)
        self.layers = 1 if self.second is None else 2
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.draft_vocab_size = int(drafter.lm_head.out_features)
        if target is not None:
            check_compatible(drafter, target.config)
            emb = target.get_input_embeddings().weight
            with torch.no_grad():
                drafter.embed_tokens.weight.copy_(emb.to(drafter.embed_tokens.weight.dtype))
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.d2t = drafter.d2t.to(self.device)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self._length = 0
        if not hasattr(self, "k_buf"):
            self._allocate(256)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the KV buffer `[layers * H, capacity, Dh]`, keeping the committed rows.

        Zero-filled, so a masked column never holds a NaN (0 * NaN would leak through)."""
        shape = (self.layers * self.num_heads, capacity, self.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if hasattr(self, "k_buf") and self._length:
            k[:, : self._length] = self.k_buf[:, : self._length]
            v[:, : self._length] = self.v_buf[:, : self._length]
        self.k_buf, self.v_buf = k, v

    def reserve(self, rows: int) -> None:
        """Make room for `rows` columns in total (context and a round's tree rows); grows by doubling."""
        if rows > self.k_buf.shape[1]:
            self._allocate(max(rows, 2 * self.k_buf.shape[1]))

    def _heads(self, layer: int) -> slice:
        """Layer `layer`'s heads in the KV buffer and in the `[N, layers * H, Dh]` row keys."""
        return slice(layer * self.num_heads, (layer + 1) * self.num_heads)

    @property
    def k_cache(self) -> torch.Tensor:
        """Committed keys `[layers * H, length, Dh]` (a view of the buffer)."""
        return self.k_buf[:, : self._length]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.v_buf[:, : self._length]

    @property
    def length(self) -> int:
        """Committed context rows (positions `0 .. length-1`)."""
        return self._length

    @property
    def max_depth(self) -> int:
        return self.drafter.max_depth if self.is_pr else 0

    def load_context(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the committed context with rows of an outside KV cache (SGLang's draft pool):
        `keys, values [L, H_kv, Dh]`, keys RoPE'd at positions `0 .. L-1`; KV heads repeated to H."""
        if self.layers != 1:
            raise ValueError("load_context serves one-layer drafters only")
        n, rep = keys.shape[0], self.num_heads // keys.shape[1]
        self._length = 0
        self.reserve(n)
        self.k_buf[:, :n] = keys.transpose(0, 1).repeat_interleave(rep, dim=0).to(self.dtype)
        self.v_buf[:, :n] = values.transpose(0, 1).repeat_interleave(rep, dim=0).to(self.dtype)
        self._length = n

    # ---------------------------------------------------------------- helpers
    def embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.embed_tokens(target_ids.to(self.device))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # --------------------------------------------------------------- readouts
    # Every readout (heads, gate) runs on its rows padded with zero rows to a multiple of `READOUT_ROWS`, and the
    # gate's sigmoid on a vector padded to a multiple of `GATE_SIGMOID_PAD`, so that a row's readout is the same
    # bits whether it is read alone, with its request's other rows, or with every running request's rows in one
    # call (`batch_step_readouts`). Why: a BLAS picks its kernel by the call's row count, and the kernel for a
    # short tail of rows sums in another order (MKL's sgemm on a 2-core AMD EPYC: rows past the last full group of
    # 4 differ by ~1e-6 when the call has under 12 rows); ATen's vectorised elementwise loops take the vector
    # path two vectors at a time and a scalar path for the tail. Padding costs little where a readout is bound by
    # reading the head's weight, as at serving sizes. `readouts_row_invariant` checks the property on the machine
    # it runs on; nothing relies on it but bit-for-bit comparisons.
    READOUT_ROWS = 4
    GATE_SIGMOID_PAD = 64

    @staticmethod
    def _pad(t: torch.Tensor, multiple: int) -> torch.Tensor:
        """`t` with zero rows appended up to a multiple of `multiple` rows."""
        extra = -t.shape[0] % multiple
        return torch.cat([t, t.new_zeros((extra,) + tuple(t.shape[1:]))]) if extra else t

    def _pad_rows(self, feature: torch.Tensor):
        """`(feature padded to a multiple of READOUT_ROWS rows, its own row count)`."""
        return self._pad(feature, self.READOUT_ROWS), feature.shape[0]

    @torch.no_grad()
    def depth_logits(self, feature: torch.Tensor, depth: Union[int, torch.Tensor] = 0) -> torch.Tensor:
        """The readout of features reached at reconsideration depth `depth` (an int, or one per row).

        Both tree builders read every row's proposals through this one method; it is the drafter's
        `depth_logits` (the second head for depths >= 1 with `pr.recon_head: separate`, else the
        one-pass `norm` + `lm_head`), and `compute_logits` for an EAGLE-3 drafter. Rows padded (see above)."""
        x, n = self._pad_rows(feature)
        if torch.is_tensor(depth) and depth.dim():
            depth = self._pad(depth.reshape(-1), self.READOUT_ROWS)
        if self.is_pr:
            return self.drafter.depth_logits(x, depth)[:n]
        return self.drafter.compute_logits(x)[:n]

    @torch.no_grad()
    def log_probs(self, feature: torch.Tensor, depth: Union[int, torch.Tensor] = 0,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`log pi_depth(. | v)` over the draft vocabulary, fp32, `[N, Vd]` (written into `out` when given)."""
        return torch.log_softmax(self.depth_logits(feature, depth).float(), dim=-1, out=out)

    def _gate(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """lambda of the first `n` of the padded gate inputs `x` (the drafter's `HaltGate`, its sigmoid padded)."""
        logit = self.drafter.pr_halt_gate.linear(x).squeeze(-1).float()
        return torch.sigmoid(self._pad(logit, self.GATE_SIGMOID_PAD))[:n]

    @torch.no_grad()
    def halt_probability(self, feature: torch.Tensor) -> torch.Tensor:
        """The drafter's lambda per row (`halt_probability`: the gate reads `norm(f)` or `f`), rows padded."""
        x, n = self._pad_rows(feature)
        return self._gate(self.drafter.norm(x) if self.drafter.pr_settings.gate_reads_normed else x, n)

    @torch.no_grad()
    def readout_and_halt(self, feature: torch.Tensor, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """`(log_probs(feature, 0, out), halt_probability(feature))` of a PR drafter, the same values, with the
        final norm computed once when the head and the gate both read `norm(f)` (the default)."""
        d = self.drafter
        if not (d.norm_output and d.pr_settings.gate_reads_normed):
            return self.log_probs(feature, 0, out), self.halt_probability(feature)
        x, n = self._pad_rows(feature)
        normed = d.norm(x)
        return torch.log_softmax(d.lm_head(normed).float()[:n], dim=-1, out=out), self._gate(normed, n)

    @torch.no_grad()
    def feedback(self, feature: torch.Tensor) -> torch.Tensor:
        """What a child draft step reads of its parent's feature in the hidden slot, as training
        feeds the next TTT step: `norm(f)` with a PR drafter's `post_norm_feedback`, else `f`."""
        return self.drafter.feedback(feature) if self.is_pr else feature

    @torch.no_grad()
    def reconsideration_inputs(self, feature: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The input slots of a reconsideration pass (Eq. 3), as training builds them."""
        return self.drafter.reconsideration_inputs(feature)

    def _qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, max_position: Optional[int] = None,
             recon_rows: Optional[torch.Tensor] = None):
        # Unbound call: the row API only touches `midlayer`, so it serves EAGLE-3 drafters too.
        return PRRows.layer_qkv(self.drafter, emb, hidden, pos, max_position, recon_rows)

    # --------------------------------------------------------------- forwards
    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Append committed rows: `aux_hidden [T, 3*Ht]` (target layers at positions
        `length .. length+T-1`) and `next_tokens [T]` (the token after each).

        Returns their features `[T, d]`; the last one is the next tree's root feature.
        """
        t = aux_hidden.shape[0]
        start = self.length
        hidden = self.drafter.project_hidden_states(aux_hidden.to(self.device, self.dtype))[None]
        emb = self.embed(next_tokens)[None].to(self.dtype)
        pos = torch.arange(start, start + t, device=self.device)[None]
        self.reserve(start + t)
        causal = torch.ones(t, start + t, dtype=torch.bool, device=self.device).tril(start)
        q, k, v = self._qkv(emb, hidden, pos, start + t - 1)  # [1, H, T, Dh]
        feature = PRRows.layer_finish(self.drafter, self._extend_attend(0, q, k, v, start, causal), hidden)
        if self.second is not None:
            q, k, v = self.second.qkv(feature, pos, start + t - 1)
            feature = self.second.finish(self._extend_attend(1, q, k, v, start, causal), feature)
        self._length = start + t
        return feature[0]

    def _extend_attend(self, layer: int, q, k, v, start: int, causal: torch.Tensor) -> torch.Tensor:
        """One layer's causal attention of new committed rows (written to the buffer first) -> `[1, H, T, Dh]`."""
        heads, t = self._heads(layer), q.shape[2]
        self.k_buf[heads, start : start + t] = k[0]
        self.v_buf[heads, start : start + t] = v[0]
        keys, values = self.k_buf[heads, : start + t], self.v_buf[heads, : start + t]
        scores = torch.einsum("htd,hld->htl", q[0], keys) * self.scale
        scores = scores.masked_fill(~causal[None], float("-inf"))
        w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        return torch.einsum("htl,hld->htd", w, values)[None]

    @torch.no_grad()
    def forward_rows(
        self,
        input_emb: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx_len: int,
        tree_k: torch.Tensor,
        tree_v: torch.Tensor,
        visible: Sequence[Sequence[int]],
        recon_rows: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """N independent rows in one call of `M`.

        input_emb, hidden `[N, d]`; positions `[N]`; row `i` attends to context rows
        `< ctx_len`, the tree rows `visible[i]` (indices into `tree_k/tree_v [M, H, Dh]`)
        and its own new key (for the two-layer control, in both layers). `recon_rows [N]` (bool) marks reconsideration rows (the PR
        drafter's adapter acts on those only). Returns `(feature [N, d], k [N, layers * H, Dh], v [N, layers * H, Dh])`.
        """
        n, m = input_emb.shape[0], tree_k.shape[0]
        allow = torch.zeros(n, m, dtype=torch.bool, device=self.device)
        for i, rows in enumerate(visible):
            if len(rows):
                allow[i, list(rows)] = True
        hidden = hidden[:, None].to(self.dtype)
        q, k, v = self._qkv(input_emb[:, None].to(self.dtype), hidden, positions[:, None], recon_rows=recon_rows)
        out = self._rows_attend(0, q[:, :, 0], k[:, :, 0], v[:, :, 0], ctx_len, tree_k, tree_v, allow)
        feature = PRRows.layer_finish(self.drafter, out[:, :, None], hidden, recon_rows)
        ks, vs = [k[:, :, 0]], [v[:, :, 0]]
        if self.second is not None:
            q, k, v = self.second.qkv(feature, positions[:, None])
            out = self._rows_attend(1, q[:, :, 0], k[:, :, 0], v[:, :, 0], ctx_len, tree_k, tree_v, allow)
            feature = self.second.finish(out[:, :, None], feature)
            ks.append(k[:, :, 0])
            vs.append(v[:, :, 0])
        return feature[:, 0], torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def _rows_attend(self, layer: int, q, k, v, ctx_len: int, tree_k, tree_v, allow: torch.Tensor) -> torch.Tensor:
        """One layer's attention of rows `q, k, v [N, H, Dh]` over the context, their visible tree rows and themselves."""
        heads = self._heads(layer)
        tree_k, tree_v = tree_k[:, heads], tree_v[:, heads]
        m = tree_k.shape[0]
        ctx_scores = torch.einsum("nhd,hld->nhl", q, self.k_cache[heads, :ctx_len]) * self.scale
        tree_scores = torch.einsum("nhd,mhd->nhm", q, tree_k) * self.scale if m else q.new_zeros(q.shape[0], self.num_heads, 0)
        own_scores = (q * k).sum(-1, keepdim=True) * self.scale
        tree_scores = tree_scores.masked_fill(~allow[:, None, :], float("-inf"))
        scores = torch.cat([ctx_scores, tree_scores, own_scores], dim=-1)
        w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        out = torch.einsum("nhl,hld->nhd", w[..., :ctx_len], self.v_cache[heads, :ctx_len])
        if m:
            out = out + torch.einsum("nhm,mhd->nhd", w[..., ctx_len : ctx_len + m], tree_v)
        return out + w[..., -1:] * v

    @torch.no_grad()
    def forward_tree_rows(
        self,
        input_emb: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        first_col: int,
        mask: torch.Tensor,
        max_position: int,
        recon_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """N tree rows in one call of `M`, against the preallocated KV buffer (no concatenation).

        The rows' keys/values are written to buffer columns `first_col .. first_col+N-1`
        before attention, so a row sees its own key through its column. `mask [N, L]` is
        additive (0 or -inf) over columns `0 .. L-1`: the committed context and the round's
        tree rows (`reserve` them first). `recon_rows [N]` (bool) marks reconsideration
        rows, as in `forward_rows`. Returns the features `[N, d]`.
        """
        n = input_emb.shape[0]
        hidden = hidden[:, None].to(self.dtype)
        q, k, v = self._qkv(input_emb[:, None].to(self.dtype), hidden, positions[:, None], max_position, recon_rows)
        out = self._tree_attend(0, q, k, v, first_col, mask)
        feature = PRRows.layer_finish(self.drafter, out[:, :, None], hidden, recon_rows)
        if self.second is not None:
            q, k, v = self.second.qkv(feature, positions[:, None], max_position)
            feature = self.second.finish(self._tree_attend(1, q, k, v, first_col, mask)[:, :, None], feature)
        return feature[:, 0]

    def _tree_attend(self, layer: int, q, k, v, first_col: int, mask: torch.Tensor) -> torch.Tensor:
        """One layer's attention of tree rows `q, k, v [N, H, 1, Dh]` (written to columns `first_col..` first) -> `[N, H, Dh]`."""
        heads, n, span = self._heads(layer), q.shape[0], mask.shape[1]
        self.k_buf[heads, first_col : first_col + n] = k[:, :, 0].transpose(0, 1)
        self.v_buf[heads, first_col : first_col + n] = v[:, :, 0].transpose(0, 1)
        scores = torch.matmul(q[:, :, 0].transpose(0, 1), self.k_buf[heads, :span].transpose(1, 2))  # [H, N, L]
        scores = scores * self.scale + mask[None].to(scores.dtype)
        w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        return torch.matmul(w, self.v_buf[heads, :span]).transpose(0, 1)  # [N, H, Dh]


def readouts_row_invariant(rt: DrafterRuntime, rows: int = 48, seed: int = 0) -> bool:
    """Whether, on this machine, a row's readouts (every head, the gate) are the same bits whatever call it is read
    in: random rows read at once against every count 1-12, 16, 24, 32 and 48 of them at offsets 0, 1 and 3.

    A BLAS picks its kernel by shape (not by value), so the answer holds for the drafter's shapes, dtype, device
    and thread count. Where it is True, reading every running request's rows in one call
    (`tensor_tree.batch_step_readouts`) gives each request the trees of reading its rows alone, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + 3, rt.drafter.config.hidden_size, generator=g).to(rt.device, rt.dtype)
    reads = [lambda f: (rt.log_probs(f, 0),)]  # each read: a tuple of per-row results
    if rt.is_pr:
        reads.append(lambda f: (rt.halt_probability(f),))
        if rt.max_depth and hasattr(rt.drafter, "pr_recon_head"):
            reads.append(lambda f: (rt.log_probs(f, 1),))
        if rt.drafter.norm_output and rt.drafter.pr_settings.gate_reads_normed:
            reads.append(rt.readout_and_halt)
    counts = [c for c in list(range(1, 13)) + [16, 24, 32, 48] if c <= rows]
    for read in reads:
        whole = read(x)
        for c in counts:
            for at in (0, 1, 3):
                if not all(torch.equal(got, w[at : at + c]) for got, w in zip(read(x[at : at + c]), whole)):
                    return False
    return True
