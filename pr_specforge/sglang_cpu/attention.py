"""CPU attention for SGLang 0.5.14's EAGLE-3 path, written for the CPU bridge (`pr_specforge.sglang_cpu`).

SGLang's `torch_native` backend serves plain prefill/decode on CPU but has no
speculative modes. This module supplies them with `scaled_dot_product_attention`
and explicit boolean masks:

* `verify_or_draft_extend` - replaces `TorchNativeAttnBackend.forward_extend` for
  the two speculative extend modes: TARGET_VERIFY (the target scores the draft
  tree; each tree token sees the committed prefix plus the tree tokens that
  SGLang's `custom_mask` marks: its ancestors and itself, so topk > 1 trees
  verify correctly) and DRAFT_EXTEND_V2 (the drafter re-reads the accepted
  tokens; `extend_prefix_lens` is None there, the prefix is `seq_lens - width`).
  Other modes go to the original method.
* `CpuMultiStepDraftBackend` - stands in for the CUDA multi-step draft backends
  (`TritonMultiStepDraftBackend` etc.) that `DraftBackendFactory` would build:
  draft step i of lane (req b, branch t) attends to b's committed prefix and to
  its own lane's slots of steps 0..i, the same KV that SGLang's
  `generate_draft_decode_kv_indices` kernel selects (lanes attend to their own
  earlier slots, not to the node's true ancestors: SGLang's tree, not ours).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scaling, gqa: bool) -> torch.Tensor:
    """q [n, H, D], k/v [m, Hk, D], mask [n, m] bool (True: attend) -> [n, H, Dv]."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _store_kv(backend, layer, forward_batch, k, v) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)


def _buffers(pool, layer):
    return pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)


def verify_or_draft_extend(original):
    """A `forward_extend` for `TorchNativeAttnBackend` that adds the two speculative modes to `original`."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        mode = forward_batch.forward_mode
        if not (mode.is_target_verify() or mode.is_draft_extend_v2()):
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if save_kv_cache:
            _store_kv(self, layer, forward_batch, k, v)
        k_buf, v_buf = _buffers(self.token_to_kv_pool, layer)
        bs = forward_batch.batch_size
        width = q.shape[0] // bs
        q_ = q.view(bs, width, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty((bs, width, layer.tp_q_head_num, layer.v_head_dim))
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        seq_lens = forward_batch.seq_lens.tolist()
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
        offset = 0
        for b in range(bs):
            if mode.is_target_verify():  # seq_lens: the committed prefix; the tree follows it
                prefix = seq_lens[b]
                custom = forward_batch.spec_info.custom_mask
                if custom.numel() == bs * width * width:  # QLEN_ONLY (SGLang 0.5.16+ on a CPU): the tree part alone
                    tree = custom[b * width * width: (b + 1) * width * width].view(width, width).bool()
                    mask = torch.cat([tree.new_ones(width, prefix), tree], 1)
                else:  # FULL_MASK: each row's prefix, then its tree part
                    span = custom[offset: offset + width * (prefix + width)]
                    offset += width * (prefix + width)
                    mask = span.view(width, prefix + width).bool()
            else:  # DRAFT_EXTEND_V2: seq_lens already include the `width` slots written now
                prefix = seq_lens[b] - width
                mask = torch.ones(width, prefix + width, dtype=torch.bool).tril(prefix)
            slots = rows[b, : prefix + width]
            out[b] = _attend(q_[b], k_buf[slots], v_buf[slots], mask, layer.scaling, gqa)
        return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    forward_extend.__wrapped__ = original
    return forward_extend


class _DraftStep:
    """Attention of one draft step (`attn_backends[i]` of the multi-step backend)."""

    def __init__(self, parent: "CpuMultiStepDraftBackend", step: int):
        self.parent, self.step = parent, step
        self.needs_cpu_seq_lens = False

    def init_forward_metadata(self, forward_batch) -> None:
        pass

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        p = self.parent
        if save_kv_cache:
            _store_kv(p, layer, forward_batch, k, v)
        k_buf, v_buf = _buffers(p.token_to_kv_pool, layer)
        bs, topk, steps = p.meta["bs"], p.topk, p.num_steps
        q_ = q.reshape(bs * topk, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty((bs * topk, layer.tp_q_head_num, layer.v_head_dim))
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        rows, seq_lens = p.meta["rows"], p.meta["seq_lens"]
        for b in range(bs):
            prefix = rows[b, : seq_lens[b]]
            for t in range(topk):
                start = seq_lens[b] + t * steps  # this lane's draft slots, one per step
                slots = torch.cat([prefix, rows[b, start: start + self.step + 1]])
                r = b * topk + t
                out[r] = _attend(q_[r: r + 1], k_buf[slots], v_buf[slots], None, layer.scaling, gqa)[0]
        return out.view(bs * topk, layer.tp_q_head_num * layer.v_head_dim)


class CpuMultiStepDraftBackend:
    """The multi-step draft-decode backend on CPU (replaces the CUDA `*MultiStepDraftBackend` classes)."""

    needs_cpu_seq_lens = False

    def __init__(self, model_runner, topk: int, num_steps: int):
        self.topk, self.num_steps = topk, num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.attn_backends = [_DraftStep(self, i) for i in range(num_steps - 1)]
        self.meta = {}

    def init_forward_metadata(self, forward_batch) -> None:
        self.meta = {
            "bs": forward_batch.batch_size,
            "rows": self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices],
            "seq_lens": forward_batch.seq_lens.tolist(),
        }
