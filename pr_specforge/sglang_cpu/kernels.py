"""SGLang 0.5.16+ on a CPU without sgl-kernel's CPU ops: a stand-in `sgl_kernel` module (bridge, tests only; with
it, plain serving and EAGLE3 / PR_EAGLE3 with a Triton draft backend run on 0.5.23 here: docs/export.md).

With `SGLANG_USE_CPU_ENGINE=1`, SGLang 0.5.16+ imports, at module load, sgl-kernel ops built for CPUs
(`from sgl_kernel import *_cpu`, e.g. `mem_cache/allocation.py`, `mem_cache/memory_pool.py` through
`kernels/ops/kvcache/cache_move.py`). The package index serves sglang-kernel 0.4.10 as a CUDA build only:
`import sgl_kernel` loads `sm100/common_ops.abi3.so`, which needs `libcuda.so.1`
("[sgl_kernel] CRITICAL: Could not load any common_ops library!"). When that import fails on this
machine, `install_stand_in` puts this module's functions in its place, each replacing the named op:

=====================================  =====================================================================
sgl-kernel op (SGLang caller)           stand-in
=====================================  =====================================================================
assign_req_to_token_pool_cpu            `assign_req_to_token_pool`: each request's new KV slots into its
  (mem_cache/allocation.py)               `req_to_token` row, from `start` to `end`
copy_all_layer_kv_cache_cpu             `copy_kv_rows`: for every KV buffer (a raw address and a row stride
  (kernels/ops/kvcache/cache_move.py)     in bytes), row `src[i]` copied onto row `tgt[i]` (`ctypes.memmove`)
build_tree_kernel_efficient_cpu         SGLang's own Triton kernel of the op (`spec_tree.sgl_build_tree_kernel_
  (kernels/ops/speculative/spec_tree.py)  triton`, XPU's path; run by the Triton interpreter, TRITON_INTERPRET=1)
verify_tree_greedy_cpu                  SGLang's own Triton kernel (`spec_tree.verify_tree_greedy_triton`), the same
  (kernels/ops/speculative/spec_tree.py)  way
assign_draft_cache_locs_contiguous_cpu  SGLang's own Triton kernels of the two ops (`assign_draft_cache_locs_
assign_extend_cache_locs_cpu              contiguous`, `assign_extend_cache_locs`), the interpreter again
  (kernels/ops/speculative/cache_locs.py)
fill_bonus_tokens_cpu                   `fill_bonus_tokens`: each request's last accepted token
fill_accept_out_cache_loc_cpu           `fill_accept_out_cache_loc`: the accepted slots, packed in order
  (kernels/ops/speculative/eagle.py)
rotate_input_ids_cpu (multi-layer EAGLE) `unbridged`: raises NotImplementedError naming the op
=====================================  =====================================================================

Any other name is absent (`from sgl_kernel import x` raises ImportError, as without sgl-kernel).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

from pr_specforge.op_parts import stand_in

UNBRIDGED = ("rotate_input_ids_cpu",)


@stand_in("assign_req_to_token_pool")
def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Replaces sgl-kernel's `assign_req_to_token_pool_cpu`: request b's slots `out_cache_loc[at:at + n_b]` into
    `req_to_token[req_pool_indices[b], start[b]:end[b]]`, `at` the sum of the earlier requests' `n`."""
    at = 0
    for req, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[req, s:e] = out_cache_loc[at: at + e - s].to(req_to_token.dtype)
        at += e - s


def copy_kv_rows(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Replaces sgl-kernel's `copy_all_layer_kv_cache_cpu`: in each buffer `data_ptrs[j]` (rows `strides[j]` bytes
    apart), row `src_loc[i]` onto row `tgt_loc[i]`."""
    import ctypes

    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist()) if t != s]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in pairs:
            ctypes.memmove(int(base) + t * stride, int(base) + s * stride, stride)


@stand_in("build_tree")
def build_tree_triton(*args):
    """Replaces sgl-kernel's `build_tree_kernel_efficient_cpu` (same arguments) by SGLang's Triton kernel of it."""
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    return sgl_build_tree_kernel_triton(*args)


@stand_in("verify_tree_greedy")
def verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                              retrive_next_sibling, target_predict):
    """Replaces sgl-kernel's `verify_tree_greedy_cpu` (its keywords) by SGLang's Triton kernel of it."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton as kernel

    return kernel(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                  retrive_next_sibling, target_predict)


@stand_in("assign_draft_cache_locs")
def draft_cache_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols) -> None:
    """Replaces sgl-kernel's `assign_draft_cache_locs_contiguous_cpu` by SGLang's Triton kernel of it."""
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous as kernel

    bs = seq_lens.shape[0]
    kernel[(bs,)](req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols, positions=None,
                  mrope=None, BS=bs, WRITE_POSITIONS=False, WRITE_MROPE=False)


@stand_in("assign_extend_cache_locs")
def extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len) -> None:
    """Replaces sgl-kernel's `assign_extend_cache_locs_cpu` by SGLang's Triton kernel of it."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs as kernel

    bs = req_pool_indices.shape[0]
    kernel[(bs,)](req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len,
                  1 << max(bs - 1, 0).bit_length())


@stand_in("fill_bonus_tokens")
def fill_bonus_tokens(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Replaces sgl-kernel's `fill_bonus_tokens_cpu`: request b's bonus token is its last accepted one,
    `accept_tokens[b * stride + accept_lens[b] - 1]`."""
    import torch

    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    bonus_tokens.copy_(accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1].to(bonus_tokens.dtype))


@stand_in("fill_accept_out_cache_loc")
def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Replaces sgl-kernel's `fill_accept_out_cache_loc_cpu`: the slots of the accepted entries (`!= -1`) of
    `accept_index`, in order, at the front of `accept_out_cache_loc`."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def unbridged(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl-kernel's {name} has no CPU stand-in in pr_specforge.sglang_cpu.kernels")
    op.__name__ = name
    return op


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == "sgl_kernel" else None

    def create_module(self, spec):
        module = types.ModuleType("sgl_kernel", __doc__)
        module.assign_req_to_token_pool_cpu = assign_req_to_token_pool
        module.copy_all_layer_kv_cache_cpu = copy_kv_rows
        module.build_tree_kernel_efficient_cpu = build_tree_triton
        module.verify_tree_greedy_cpu = verify_tree_greedy_triton
        module.assign_draft_cache_locs_contiguous_cpu = draft_cache_locs
        module.assign_extend_cache_locs_cpu = extend_cache_locs
        module.fill_bonus_tokens_cpu = fill_bonus_tokens
        module.fill_accept_out_cache_loc_cpu = fill_accept_out_cache_loc
        for name in UNBRIDGED:
            setattr(module, name, unbridged(name))
        module.__pr_specforge_stand_in__ = True
        return module

    def exec_module(self, module) -> None:
        return None


def install_stand_in() -> bool:
    """Use the stand-in when the installed `sgl_kernel` cannot load here; True when it is in use."""
    try:
        import sgl_kernel  # noqa: F401
        return bool(getattr(sgl_kernel, "__pr_specforge_stand_in__", False))
    except ImportError:
        sys.modules.pop("sgl_kernel", None)
    sys.meta_path.insert(0, _StandIn())
    return True
