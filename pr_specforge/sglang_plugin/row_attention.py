"""Draft attention over explicit KV-slot lists: the layout of a PR draft step's rows, and its two backends.

Owns:
  * `row_kv_lists` - a step's rows as SGLang's draft decode metadata: `kv_indptr [N + 1]` (int32) and
    `kv_indices` (int64 slots of the draft KV pool), row `i` attending to
    `kv_indices[kv_indptr[i] : kv_indptr[i + 1]]`: its request's context before the root, then the tree
    rows it sees (its node's ancestors' rows and its own new slot), in row order. This is the layout
    SGLang's Triton decode kernel reads from `spec_info.kv_indptr / kv_indices` (one query row per
    list; `layers/attention/triton_backend.py`, `init_forward_metadata` of a decode with spec info).
    Built with no host read and no data-dependent shape (a scatter into a buffer of `N (C + R)` slots whose
    tail past `kv_indptr[-1]` no row reads), so a captured graph can rebuild it in place.
  * The row attention, `PR_EAGLE3_ROW_ATTENTION` (read by `rows.row_attention_mode`; `resolve_row_attention`):
      - `torch_native` - `RowListAttnBackend`, the CPU bridge's draft decode over those lists: SGLang's
        `TorchNativeAttnBackend` whose `forward_decode` writes the rows' K/V to their slots
        (`out_cache_loc`) and lets each row attend to its own list (one gather and one masked softmax
        for all rows). It replaces, for the PR rows only, the bridge's `CpuMultiStepDraftBackend`
        (which attends to "prefix + own lane", SGLang's approximate tree) and torch_native's decode (which
        attends to `req_to_token[req, :seq_len]`).
      - `triton` - SGLang's own `TritonAttnBackend` over the draft model runner (`row_backend`): its
        `init_forward_metadata` takes a decode's lists from `spec_info.kv_indptr / kv_indices` as they are,
        and its `decode_attention_fwd` kernel attends each row to its list; nothing of it is replaced. The
        GPU path (over the same MHA KV pool whichever backend SGLang's own draft-extend uses); on a CPU it
        runs under Triton's interpreter (`TRITON_INTERPRET=1`, which the bridge's `child_env` sets), slowly.
      - `auto` (the default) - `triton` where the draft model runs on a CUDA device, `torch_native` elsewhere.

Does not own: which rows run and what they see (`serving.batched_tree`), running them (`sglang_plugin.rows`).
"""

from __future__ import annotations

import os
from typing import Tuple

import torch

try:  # the backend needs SGLang; the list layout does not
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
except ImportError:  # pragma: no cover - SGLang is a dependency of the plugin
    TorchNativeAttnBackend = object


ATTENTION_ENV = "PR_EAGLE3_ROW_ATTENTION"
ROW_ATTENTIONS = ("auto", "torch_native", "triton")


def row_kv_lists(ctx_slots: torch.Tensor, ctx_len: torch.Tensor, row_slots: torch.Tensor,
                 visible: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`ctx_slots [b, C]` (request b's context slots, the first `ctx_len[b]` valid), `row_slots [b, R]` (the slot
    of each tree row of b), `visible [b, p, R]` bool (the tree rows each of b's p rows sees, itself included)
    -> `(kv_indptr [b p + 1] int32, kv_indices [b p (C + R)] int64)`, rows in request-major order; entries past
    `kv_indptr[-1]` are zero and belong to no row. No host read: every shape follows from the inputs' shapes."""
    b, p, _ = visible.shape
    dev = ctx_slots.device
    cols = torch.arange(ctx_slots.shape[1], device=dev)
    ctx_ok = (cols[None, :] < ctx_len[:, None])[:, None, :].expand(b, p, -1)
    ok = torch.cat([ctx_ok, visible], dim=-1).reshape(b * p, -1)
    slots = torch.cat([ctx_slots[:, None, :].expand(b, p, -1), row_slots[:, None, :].expand(b, p, -1)], dim=-1)
    n, width = ok.shape
    indptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    torch.cumsum(ok.sum(-1), 0, out=indptr[1:])
    place = indptr[:-1, None].long() + ok.long().cumsum(-1) - 1  # a kept slot's place: its row's start + its rank
    place = torch.where(ok, place, n * width)  # the rest land in one spare entry past the end
    indices = torch.zeros(n * width + 1, dtype=torch.int64, device=dev)
    indices.scatter_(0, place.reshape(-1), slots.reshape(-1).to(torch.int64))
    return indptr, indices[:-1]


def resolve_row_attention(mode: str, device) -> str:
    """The backend `mode` means on `device`: `auto` is `triton` on CUDA and `torch_native` elsewhere; `triton` off
    CUDA needs Triton's interpreter (`TRITON_INTERPRET=1`), else ValueError (one line)."""
    on_cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        return "triton" if on_cuda else "torch_native"
    if mode == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"PR_EAGLE3: {ATTENTION_ENV}=triton on {torch.device(device).type} runs SGLang's Triton "
                         "kernel in Triton's interpreter: set TRITON_INTERPRET=1 (the CPU bridge's environment does)")
    return mode


def row_backend(draft_runner, attention: str):
    """The PR rows' attention backend for a resolved `attention` (`resolve_row_attention`): for `triton`, SGLang's
    `TritonAttnBackend` over the draft model runner (decode only: `skip_prefill`), whose `init_forward_metadata`
    attends each row of a DECODE batch to its list in `spec_info.kv_indptr / kv_indices`."""
    if attention != "triton":
        return RowListAttnBackend(draft_runner)
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(draft_runner, skip_prefill=True)


def gather_plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                fixed: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lists as a padded gather: `index [N, L]` (slots; padding repeats slot 0 of the list) and `valid [N, L]`.
    L: the longest list (a host read), or with `fixed` the lists' buffer width `len(kv_indices) // N` (`row_kv_lists`
    gives each row that many entries: no host read, for a captured round)."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
    if fixed:
        width = kv_indices.numel() // max(lens.numel(), 1)
    else:
        width = int(lens.max()) if lens.numel() else 0
    col = torch.arange(width, device=kv_indices.device)
    valid = col[None, :] < lens[:, None]
    at = torch.where(valid, kv_indptr[:-1, None].long() + col[None, :], kv_indptr[:-1, None].long())
    return kv_indices[at.clamp(max=max(kv_indices.numel() - 1, 0))], valid


def attend_lists(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """`q [N, H, D]` over the slots `index [N, L]` (where `valid`) of `k_buf, v_buf [slots, Hkv, D]` -> `[N, H, Dv]`."""
    keys, values = k_buf[index].to(q.dtype), v_buf[index].to(q.dtype)  # [N, L, Hkv, D]
    rep = q.shape[1] // keys.shape[2]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
    scores = torch.einsum("nhd,nlhd->nhl", q, keys) * scaling
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("nhl,nlhd->nhd", w, values)


class RowListAttnBackend(TorchNativeAttnBackend):
    """torch_native with a decode over `spec_info.kv_indptr / kv_indices` (see the module doc)."""

    def init_forward_metadata(self, forward_batch, fixed: bool = False) -> None:
        super().init_forward_metadata(forward_batch)
        spec = forward_batch.spec_info
        self.plan = gather_plan(spec.kv_indptr, spec.kv_indices, fixed)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = True) -> None:
        """The metadata of a captured round (`TritonAttnBackend`'s name): the plan at the lists' fixed width."""
        self.init_forward_metadata(forward_batch, fixed=True)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = attend_lists(q_, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                           self.token_to_kv_pool.get_value_buffer(layer.layer_id), *self.plan, layer.scaling)
        return out.reshape(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)
