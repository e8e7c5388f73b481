"""The draft backends of `PR_EAGLE3_ROWS=sglang` (`sglang_plugin.row_attention`). The CPU one, on SGLang's real KV
pool, attention layer and forward batch: each row attends to exactly its `kv_indptr / kv_indices` list (equal to
a dense attention over the whole pool with that list as a boolean mask), after writing its own K/V to its
slot. SGLang's Triton decode kernel (the GPU path, here in Triton's interpreter) reads the same lists to the
same result. A step's lists say context before the root, then the tree rows the row sees, in row order, and
are built with no host read (they build on the meta device, where any data-dependent shape fails)."""

from __future__ import annotations

import math
import subprocess
import sys

import torch
from torch.nn.functional import scaled_dot_product_attention

from pr_specforge.sglang_cpu.bridge import install

install()  # SGLang's KV pool warms up a Triton kernel on construction; the bridge skips it on a CPU

SLOTS, H, HKV, D = 40, 4, 2, 8


def _backend():
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from pr_specforge.sglang_plugin.row_attention import RowListAttnBackend

    pool = MHATokenToKVPool(SLOTS, 1, torch.float32, HKV, D, 1, "cpu", False)
    g = torch.Generator().manual_seed(0)
    pool.get_key_buffer(0).copy_(torch.randn(pool.get_key_buffer(0).shape, generator=g))
    pool.get_value_buffer(0).copy_(torch.randn(pool.get_value_buffer(0).shape, generator=g))
    runner = SimpleNamespace(device="cpu", req_to_token_pool=ReqToTokenPool(4, 16, "cpu", False), token_to_kv_pool=pool)
    return RowListAttnBackend(runner), pool


def _forward_batch(lists, out_loc):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    n = len(lists)
    indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(torch.int32)
    spec = EagleDraftInput(kv_indptr=indptr, kv_indices=torch.tensor([s for x in lists for s in x], dtype=torch.int64))
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=torch.zeros(n, dtype=torch.long),
                        req_pool_indices=torch.zeros(n, dtype=torch.long), seq_lens=torch.ones(n, dtype=torch.long),
                        out_cache_loc=out_loc, seq_lens_sum=n, spec_info=spec)


def test_each_row_attends_to_its_slot_list_exactly_as_a_masked_dense_attention():
    from sglang.srt.layers.radix_attention import RadixAttention

    backend, pool = _backend()
    layer = RadixAttention(H, D, 1.0 / math.sqrt(D), HKV, layer_id=0)
    out_loc = torch.tensor([30, 31, 32, 33, 34])
    lists = [[1, 2, 3, 30], [1, 2, 3, 5, 31], [4, 32], [1, 2, 3, 5, 7, 9, 33, 30], [2, 34]]  # ragged, shared, own slot
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(len(lists), h * D, generator=g) for h in (H, HKV, HKV))
    fb = _forward_batch(lists, out_loc)
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(attn_backend=backend)):  # as the draft model's layer calls it
        got = layer(q, k, v, fb).view(len(lists), H, D)
    keys, values = pool.get_key_buffer(0), pool.get_value_buffer(0)
    assert torch.equal(keys[out_loc], k.view(-1, HKV, D)) and torch.equal(values[out_loc], v.view(-1, HKV, D))
    mask = torch.zeros(len(lists), keys.shape[0], dtype=torch.bool)
    for i, slots in enumerate(lists):
        mask[i, slots] = True
    ref = torch.stack([scaled_dot_product_attention(  # per row: one query over the whole pool, the list as its mask
        q.view(-1, H, D)[i][:, None], keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask[i][None],
        scale=1.0 / math.sqrt(D), enable_gqa=True)[:, 0] for i in range(len(lists))])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    other = mask.clone()
    other[0, 4] = True  # one slot more changes the row: the list is what the row reads, nothing else
    changed = scaled_dot_product_attention(q.view(-1, H, D)[0][:, None], keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=other[0][None], scale=1.0 / math.sqrt(D), enable_gqa=True)[:, 0]
    assert not torch.allclose(got[0], changed, atol=1e-4)


def test_a_steps_lists_are_context_then_the_visible_tree_rows():
    from pr_specforge.sglang_plugin.row_attention import row_kv_lists

    ctx_slots = torch.tensor([[10, 11, 12, 0], [20, 21, 22, 23]])
    ctx_len = torch.tensor([3, 4])
    row_slots = torch.tensor([[13, 14, 15, 16], [24, 25, 26, 27]])
    visible = torch.zeros(2, 2, 4, dtype=torch.bool)
    visible[0, 0, [0, 1]] = visible[0, 1, [0, 2]] = visible[1, 0, [0, 3]] = visible[1, 1, [0, 1, 2]] = True
    indptr, indices = row_kv_lists(ctx_slots, ctx_len, row_slots, visible)
    want = [[10, 11, 12, 13, 14], [10, 11, 12, 13, 15], [20, 21, 22, 23, 24, 27], [20, 21, 22, 23, 24, 25, 26]]
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int64  # what Triton's decode reads
    assert [indices[indptr[i]:indptr[i + 1]].tolist() for i in range(4)] == want



def test_a_steps_lists_build_without_a_host_read_so_a_graph_can_capture_them():
    from pr_specforge.sglang_plugin.row_attention import row_kv_lists

    b, p, c, r = 3, 4, 9, 7
    meta = dict(device="meta")
    indptr, indices = row_kv_lists(torch.empty(b, c, dtype=torch.long, **meta), torch.empty(b, dtype=torch.long, **meta),
                                   torch.empty(b, r, dtype=torch.long, **meta), torch.empty(b, p, r, dtype=torch.bool, **meta))
    assert indptr.shape == (b * p + 1,) and indices.shape == (b * p * (c + r),)  # shapes from the inputs' shapes only


KERNEL = """
import torch
from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from pr_specforge.sglang_plugin.row_attention import attend_lists, gather_plan, row_kv_lists
g = torch.Generator().manual_seed(0)
b, p, c, r, h, hkv, d, splits = 2, 3, 6, 5, 4, 2, 16, 2
ctx_slots = torch.randperm(40, generator=g)[: b * c].view(b, c)
row_slots = 40 + torch.arange(b * r).view(b, r)
visible = torch.rand(b, p, r, generator=g) < 0.5
visible[..., 0] = True
indptr, indices = row_kv_lists(ctx_slots, torch.tensor([4, 6]), row_slots, visible)
q = torch.randn(b * p, h, d, generator=g)
kb, vb = (torch.randn(60, hkv, d, generator=g) for _ in range(2))
o = torch.full_like(q, float('nan'))  # a row the kernel leaves unwritten fails the comparison, never reads stale bytes
logits, lse = torch.zeros(b * p, h, splits, d), torch.zeros(b * p, h, splits)
decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, torch.full((b * p,), splits, dtype=torch.int32),
                     splits, d ** -0.5, 1.0, 1.0)
torch.testing.assert_close(o, attend_lists(q, kb, vb, *gather_plan(indptr, indices), d ** -0.5), rtol=1e-5, atol=1e-6)
print("same")
"""


def test_sglangs_triton_decode_kernel_reads_the_lists_as_the_cpu_backend_does():
    """The GPU path's kernel (`decode_attention_fwd`, which `TritonAttnBackend.forward_decode` calls with the lists),
    run by Triton's interpreter in a process of its own (the interpreter is chosen when SGLang defines the kernel)."""
    from pr_specforge.sglang_cpu import child_env

    out = subprocess.run([sys.executable, "-c", KERNEL], env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("same"), out.stderr[-3000:]
