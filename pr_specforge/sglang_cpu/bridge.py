"""Run-time patches that let SGLang 0.5.14's EAGLE-3 speculative path run on a CPU.

Each patch is applied right after its SGLang module is first imported (an import
hook, `install`), in whatever process imports it: the server, the engine, and the
scheduler subprocesses SGLang spawns (they inherit the hook through
`pr_specforge/sglang_cpu/site/sitecustomize.py`). Nothing is patched when a CUDA
device is visible, and no installed file is edited.

What each patch replaces (the CUDA-only spots of docs/export.md, "SGLang on a CPU"):

====================================================  =========================================================
SGLang 0.5.14 (sglang.srt....)                        CPU replacement
====================================================  =========================================================
mem_cache.memory_pool.MHATokenToKVPool                a no-op: no Triton KV-copy warm-up; KV moves take
  ._init_kv_copy_and_warmup                             SGLang's own native path (SGLANG_NATIVE_MOVE_KV_CACHE=1)
models.llama.LlamaForCausalLM.set_embed               the original, with `torch.cuda.synchronize/empty_cache`
                                                        made no-ops for the call
models.llama_eagle3.LlamaForCausalLMEagle3            the original, plus a key check: it raises when a tensor of
  .load_weights                                         the checkpoint is skipped (other than `pr_*`) or a
                                                        parameter (other than the shared embedding) stays unloaded
layers.attention.torch_native_backend                 + TARGET_VERIFY with the tree mask and DRAFT_EXTEND_V2
  .TorchNativeAttnBackend.forward_extend                (`attention.verify_or_draft_extend`)
speculative.draft_utils.DraftBackendFactory           `attention.CpuMultiStepDraftBackend` for `torch_native`
  .create_decode_backend / create_draft_extend_backend  (draft extend: the torch_native backend itself)
speculative.triton_ops.cache_locs                     torch gathers/scatters: `assign_extend_cache_locs_func`,
                                                        `assign_req_to_token_pool_func`,
                                                        `assign_draft_cache_locs_contiguous[grid](...)`
speculative.eagle_utils.build_tree_kernel_efficient   `tree.build_tree`
speculative.eagle_utils.verify_tree_greedy_func       `tree.verify_tree_greedy`
managers.overlap_utils.FutureMap                      the original, with `Tensor.record_stream` a no-op for the
  ._resolve_spec_extras                                 call (the overlap schedule's one CUDA-stream call; a CPU
                                                        tensor has no stream to be kept alive on)
plugins (0.5.14 and 0.5.16+)                          unchanged; our per-request admission registered with its
                                                        hook registry (`sglang_plugin.admission.install`): plain
                                                        and EAGLE3 servers refuse an empty prompt in one line
====================================================  =========================================================

Greedy verification only (temperature 0): SGLang's sampling verify needs sgl-kernel.
Other Triton kernels of the path run under `TRITON_INTERPRET=1` (set by `child_env`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Callable, Dict

log = logging.getLogger(__name__)

#: tensors of our exports that SGLang's EAGLE-3 loader skips on purpose (the PR parts)
SKIPPED_PREFIX = "pr_"
#: parameters of SGLang's draft model that serving fills from the target
SHARED_PARAMS = ("model.embed_tokens.weight",)


class DraftLoadError(ValueError):
    """The draft checkpoint would serve silently broken (a tensor skipped or a parameter left unloaded)."""


# ----------------------------------------------------------------- the patches
def _patch_memory_pool(mod) -> None:
    def no_kv_copy_warmup(self):  # replaces the Triton warm-up; move_kv_cache then takes the native path
        self._kv_copy_config = None

    mod.MHATokenToKVPool._init_kv_copy_and_warmup = no_kv_copy_warmup


@contextlib.contextmanager
def _no_ops(owner, *names):
    """`owner`'s attributes `names` made no-ops for the block, restored after (also on failure)."""
    saved = [getattr(owner, name) for name in names]
    for name in names:
        setattr(owner, name, lambda *a, **k: None)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(owner, name, value)


def _call_with_no_ops(cls, method: str, owner, *names) -> None:
    """`cls.method` replaced by the original run under `_no_ops(owner, *names)`."""
    original = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        with _no_ops(owner, *names):
            return original(self, *args, **kwargs)

    setattr(cls, method, wrapped)


def _patch_llama(mod) -> None:  # `set_embed` syncs and empties the CUDA cache
    import torch

    _call_with_no_ops(mod.LlamaForCausalLM, "set_embed", torch.cuda, "synchronize", "empty_cache")


def _patch_eagle3(mod) -> None:
    original = mod.LlamaForCausalLMEagle3.load_weights

    def load_weights(self, weights):
        check = _LoadCheck(self, mod)
        for name, tensor in weights:
            check.load(original, name, tensor)
        check.raise_if_broken()

    mod.LlamaForCausalLMEagle3.load_weights = load_weights


class _LoadCheck:
    """Feeds SGLang's loader one tensor at a time and records which parameter shards each one filled."""

    def __init__(self, model, mod):
        self.model, self.mod = model, mod
        self.params = dict(model.named_parameters())
        self.filled: Dict[str, set] = {}
        self.skipped = []

    def load(self, original, name, tensor) -> None:
        calls = []
        saved = {}
        for pname, p in self.params.items():
            inner = getattr(p, "weight_loader", None)
            saved[pname] = inner
            p.weight_loader = self._recorder(pname, inner or self.mod.default_weight_loader, calls)
        try:
            original(self.model, [(name, tensor)])
        finally:
            for pname, p in self.params.items():
                if saved[pname] is None:
                    del p.weight_loader
                else:
                    p.weight_loader = saved[pname]
        if not calls and "d2t" not in name and "t2d" not in name:
            self.skipped.append(name)
        for pname, shard in calls:
            self.filled.setdefault(pname, set()).add(shard)

    @staticmethod
    def _recorder(pname, inner, calls):
        def record(param, loaded, *shard):
            calls.append((pname, shard[0] if shard else None))
            return inner(param, loaded, *shard)
        return record

    def raise_if_broken(self) -> None:
        shards = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}
        unloaded = []
        for pname in self.params:
            if pname in SHARED_PARAMS or pname.startswith(SKIPPED_PREFIX):  # `pr_*`: the PR draft model loads them
                continue
            need = next((s for key, s in shards.items() if key in pname), {None})
            if not need <= self.filled.get(pname, set()):
                unloaded.append(pname)
        unknown = [n for n in self.skipped if not n.startswith(SKIPPED_PREFIX)]
        problems = ([f"tensors SGLang's loader skipped: {unknown}"] if unknown else []) + \
                   ([f"parameters left unloaded (random): {unloaded}"] if unloaded else [])
        if problems:
            raise DraftLoadError("draft checkpoint does not fill SGLang's LlamaForCausalLMEagle3: " + "; ".join(problems))


def _patch_torch_native(mod) -> None:
    from pr_specforge.sglang_cpu.attention import verify_or_draft_extend

    cls = mod.TorchNativeAttnBackend
    cls.forward_extend = verify_or_draft_extend(cls.forward_extend)


def _patch_draft_factory(mod) -> None:
    from pr_specforge.sglang_cpu.attention import CpuMultiStepDraftBackend

    cls = mod.DraftBackendFactory
    decode, extend = cls.create_decode_backend, cls.create_draft_extend_backend

    def native(self) -> bool:
        return (self.draft_attn_backend or self.server_args.attention_backend) == "torch_native"

    def create_decode_backend(self):
        if not native(self):
            return decode(self)
        if self.speculative_num_steps <= 1:
            return None
        return CpuMultiStepDraftBackend(self.draft_model_runner, self.topk, self.speculative_num_steps)

    def create_draft_extend_backend(self):
        return None if native(self) else extend(self)  # None: the draft runner keeps its torch_native backend

    cls.create_decode_backend, cls.create_draft_extend_backend = create_decode_backend, create_draft_extend_backend


def _patch_cache_locs(mod) -> None:
    import torch

    from pr_specforge.op_parts import stand_in

    @stand_in("assign_extend_cache_locs")
    def assign_extend_cache_locs_func(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                                      draft_token_num, device):
        rows = req_to_token[req_pool_indices]
        return torch.cat([rows[b, s:e] for b, (s, e) in enumerate(zip(start_offset.tolist(), end_offset.tolist()))]
                         ).to(torch.int64)

    @stand_in("assign_req_to_token_pool")
    def assign_req_to_token_pool_func(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                      batch_size):
        at = 0
        for req, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
            req_to_token[req, s:e] = out_cache_loc[at: at + e - s].to(req_to_token.dtype)
            at += e - s

    class DraftCacheLocs:  # `assign_draft_cache_locs_contiguous[(bs,)](...)`: each lane's slots after the prefix
        def __getitem__(self, grid):
            return self.run

        @staticmethod
        @stand_in("assign_draft_cache_locs")
        def run(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps):
            width = topk * num_steps
            for b, (req, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
                out_cache_loc[b * width: (b + 1) * width] = req_to_token[req, s: s + width]

    mod.assign_extend_cache_locs_func = assign_extend_cache_locs_func
    mod.assign_req_to_token_pool_func = assign_req_to_token_pool_func
    mod.assign_draft_cache_locs_contiguous = DraftCacheLocs()


def _patch_overlap_utils(mod) -> None:
    """`Tensor.record_stream` a no-op for the call: a CPU tensor has no streams to keep it alive on (the call raises
    `unknown parameter type` on a CPU tensor, and a CPU stream has no kernel for it)."""
    import torch

    _call_with_no_ops(mod.FutureMap, "_resolve_spec_extras", torch.Tensor, "record_stream")


def _patch_plugins(mod) -> None:
    """Per-request admission (`sglang_plugin.admission.install`: an empty or over-long prompt, a malformed
    `/generate` body, sampling on a speculative CPU server refused in one line, HTTP 400) registered with SGLang's
    hook registry as its plugin module loads, before `load_plugins` applies the hooks: a server the bridge runs
    refuses so also where the serving install's entry point is absent (the checkout on PYTHONPATH). Idempotent."""
    from pr_specforge.sglang_plugin.admission import install

    install()


def _patch_eagle_utils(mod) -> None:
    from pr_specforge.sglang_cpu.tree import build_tree, verify_tree_greedy

    mod.build_tree_kernel_efficient = build_tree
    mod.verify_tree_greedy_func = verify_tree_greedy


PATCHES: Dict[str, Callable] = {
    "sglang.srt.mem_cache.memory_pool": _patch_memory_pool,
    "sglang.srt.models.llama": _patch_llama,
    "sglang.srt.models.llama_eagle3": _patch_eagle3,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
    "sglang.srt.speculative.draft_utils": _patch_draft_factory,
    "sglang.srt.speculative.triton_ops.cache_locs": _patch_cache_locs,
    "sglang.srt.speculative.eagle_utils": _patch_eagle_utils,
    "sglang.srt.managers.overlap_utils": _patch_overlap_utils,
    "sglang.srt.plugins": _patch_plugins,
}


# ------------------------------------------------------------------ the hook
def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


#: SGLang 0.5.16+: the one 0.5.14 patch that still applies (the draft runs SGLang's Triton backend in the interpreter;
#: the target's torch_native backend still has no TARGET_VERIFY); the CUDA-only ops: `kernels`' stand-in sgl_kernel
PATCHES_0516: Dict[str, Callable] = {"sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
                                     "sglang.srt.plugins": _patch_plugins}


def _apply(name: str, module, patches: Dict[str, Callable] = PATCHES) -> None:
    if getattr(module, "__pr_specforge_cpu_bridge__", False):
        return
    patches[name](module)
    module.__pr_specforge_cpu_bridge__ = True
    log.debug("sglang cpu bridge: patched %s", name)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the normal path finder and runs the patch after the module body."""

    def __init__(self, patches: Dict[str, Callable] = PATCHES) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run_body = spec.loader.exec_module

        def exec_module(module):
            run_body(module)
            if _on_cpu():
                _apply(fullname, module, self.patches)

        spec.loader.exec_module = exec_module
        return spec


def _sglang_release() -> tuple:
    from importlib.metadata import version

    from pr_specforge.sglang_plugin.seam import version_tuple

    return version_tuple(version("sglang"))


def install() -> bool:
    """Patch SGLang's modules as they are imported (and those already imported); False on a CUDA machine.
    SGLang 0.5.16+: the stand-in `sgl_kernel` of `kernels` and `PATCHES_0516` (the rest of `PATCHES` is 0.5.14's;
    the draft there runs SGLang's Triton backend in the interpreter)."""
    if any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        return True
    if "torch" in sys.modules and not _on_cpu():
        return False
    patches = PATCHES
    if _sglang_release() >= (0, 5, 16):
        from pr_specforge.sglang_cpu.kernels import install_stand_in

        install_stand_in()
        patches = PATCHES_0516
    os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    sys.meta_path.insert(0, _PatchAfterImport(patches))
    for name in patches:
        if name in sys.modules and _on_cpu():
            _apply(name, sys.modules[name], patches)
    return True
