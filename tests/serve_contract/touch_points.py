"""Run inside an SGLang environment (`python -m tests.serve_contract.touch_points TREES.json OUT.json`, under the
CPU bridge's environment, `pr_specforge.sglang_cpu.child_env`): each touch point of `PR_EAGLE3` on the installed
SGLang, called for real where no server is needed, written as JSON for `tests/sglang_plugin/test_sglang_lines.py`.

TREES.json: PR trees encoded for SGLang's `build_tree` (inputs and the 0.5.14-validated reference outputs of the
bridge's builder); each is built again here through `seam.build_tree` (SGLang's own kernel of this line: on 0.5.16+
its Triton kernel, which the bridge's stand-in `sgl_kernel` routes the CPU op to)."""

from __future__ import annotations

import inspect
import json
import sys
from types import SimpleNamespace


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the probe reports what a call raises
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok"


def registration(out: dict) -> None:
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from pr_specforge.sglang_plugin import register, seam

    register()
    algo = SpeculativeAlgorithm.from_string("PR_EAGLE3")
    out["custom_spec_algo_lacks"] = [n for n in ("need_topk", "create_future_map", "carries_draft_hidden_states")
                                     if not hasattr(CustomSpecAlgo, n)]
    from sglang.srt.managers.scheduler import Scheduler

    out["scheduler_passes_confidence_relay"] = "needs_confidence_relay=" in inspect.getsource(Scheduler)
    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    fm = algo.create_future_map("cpu", pool, needs_cpu_seq_lens=True, needs_confidence_relay=False)
    out["create_future_map"] = type(fm).__name__ if isinstance(fm, FutureMap) else repr(fm)
    out["disagg_draft_input_takes_server_args"] = "server_args" in seam._params(
        __import__("sglang.srt.speculative.eagle_disaggregation", fromlist=["x"]).build_eagle_disagg_draft_input)
    out["version_refusals"] = [_raises(lambda v=v: seam.check_version(v)) for v in ("0.5.13", "0.5.24", "0.6.0")]


def server_args(out: dict, target: str, draft: str) -> None:
    """SGLang's own argument resolution with PR_EAGLE3 (and what our handler is handed)."""
    from sglang.srt.server_args import ServerArgs

    from pr_specforge.sglang_plugin import seam

    seen = []
    original = seam.eagle_family_arguments
    seam.eagle_family_arguments = lambda a: (seen.append(type(a).__name__), original(a))[1]
    try:
        def build(algorithm):  # 0.5.14 resolves in __post_init__; 0.5.23 in resolve_once (what launch_server calls)
            args = ServerArgs(model_path=target, device="cpu", dtype="float32", attention_backend="torch_native",
                              disable_cuda_graph=True, disable_overlap_schedule=True, speculative_algorithm=algorithm,
                              speculative_draft_model_path=draft, speculative_num_steps=3, speculative_eagle_topk=2,
                              speculative_num_draft_tokens=7, context_length=256)
            getattr(args, "resolve_once", lambda: None)()
            return args
        pr, eagle = build("PR_EAGLE3"), build("EAGLE3")
    finally:
        seam.eagle_family_arguments = original
    out["handle_server_args_gets"] = seen
    fields = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "page_size",
              "disable_overlap_schedule", "speculative_draft_model_path")
    out["resolved_like_eagle3"] = {f: getattr(pr, f) == getattr(eagle, f) for f in fields}
    out["refusal_topk_1"] = _raises(lambda: (lambda a: getattr(a, "resolve_once", lambda: None)())(ServerArgs(
        model_path=target, device="cpu", dtype="float32", attention_backend="torch_native", disable_cuda_graph=True,
        disable_overlap_schedule=True, speculative_algorithm="PR_EAGLE3", speculative_draft_model_path=draft,
        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, context_length=256)))


def draft_side(out: dict) -> None:
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    from pr_specforge.sglang_plugin import seam

    out["idle_verify_input_takes_device"] = "device" in seam._params(
        __import__("sglang.srt.speculative.eagle_info", fromlist=["x"]).EagleVerifyInput.create_idle_input)
    out["idle_verify_input"] = _raises(lambda: seam.idle_verify_input(2, 3, 7, "cpu"))
    out["init_new_keywords"] = [p for p in seam._params(ForwardBatch.init_new) if p not in ("batch", "model_runner")]
    out["schedule_batch_has_capture_hidden_mode"] = "capture_hidden_mode" in {
        f for f in getattr(ScheduleBatch, "__dataclass_fields__", {})}
    req = Req("r0", "", [1, 2, 3], SamplingParams(max_new_tokens=4))
    out["req_kv_allocated_len_at"] = "req.kv" if hasattr(getattr(req, "kv", None), "kv_allocated_len") else "req"
    out["req_pool_idx_at"] = "req.kv" if hasattr(getattr(req, "kv", None), "req_pool_idx") else "req"
    out["seam_reads_req"] = [seam.kv_allocated_len(req), seam.req_pool_idx(req)]
    kernel = eagle_utils.build_tree_kernel_efficient
    out["build_tree_12th"] = list(seam._params(kernel))[11]
    out["draft_takes_with_topology"] = "with_topology" in seam._params(EagleDraftWorker.draft)
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    out["verify_buffers"] = "verify_mask" if hasattr(AttentionBackend, "verify_mask") else \
        "get_verify_buffers_to_fill_after_draft"
    _ = torch


def cpu_bridge_side(out: dict) -> None:
    import importlib.util

    from sglang.srt.speculative import draft_utils

    try:
        out["triton_ops_cache_locs_module"] = importlib.util.find_spec("sglang.srt.speculative.triton_ops.cache_locs") is not None
    except ModuleNotFoundError:
        out["triton_ops_cache_locs_module"] = False
    out["draft_backend_factory_has_server_args"] = "server_args" in inspect.signature(
        draft_utils.DraftBackendFactory.__init__).parameters
    from sglang.srt.speculative import eagle_utils

    default_tree_mask_mode = getattr(eagle_utils, "default_tree_mask_mode", None)
    out["default_tree_mask_mode"] = None if default_tree_mask_mode is None else default_tree_mask_mode().name


def trees(out: dict, path: str) -> None:
    """Each encoded tree through `seam.build_tree` (FULL_MASK, no preallocated buffer), and the 12th argument's
    trap on 0.5.17+: the kernel called positionally with None there (the 0.5.14 call's `position_buf`), into a mask
    buffer of ours filled with a sentinel, so what the call leaves unfilled is read as the sentinel."""
    import torch
    from sglang.srt.speculative import eagle_utils

    from pr_specforge.sglang_plugin import seam

    mode = eagle_utils.TreeMaskMode.FULL_MASK
    results = []
    for t in json.load(open(path)):
        args = [torch.tensor(t[k]) for k in ("bonus", "parent_list", "top_scores_index", "draft_tokens", "seq_lens")]
        backend = SimpleNamespace(verify_mask=None, get_verify_buffers_to_fill_after_draft=lambda: (None, None))
        got = seam.build_tree(backend, mode, *args, int(t["seq_lens"][0]), t["topk"], t["steps"], t["tokens"], 1, 0)
        row = {"outputs": [x.tolist() for x in got]}
        if "fill_prefix_mask" in seam._params(eagle_utils.build_tree_kernel_efficient):
            # the mask buffer is ours, filled with a sentinel (False) the prefix fill would overwrite: never the
            # kernel's own `torch.empty`, whose bytes are whatever the allocator had (a test must not read them)
            seq_len, n = int(t["seq_lens"][0]), int(t["tokens"])
            sentinel = torch.zeros(seq_len * n + n * n, dtype=torch.bool)
            trap = eagle_utils.build_tree_kernel_efficient(*args, seq_len, t["topk"], t["steps"], n, mode, sentinel,
                                                           None)
            row["positional_none_mask"] = trap[0].tolist()
        results.append(row)
    out["trees"] = results


def main(trees_path: str, out_path: str, target: str, draft: str) -> int:
    from importlib.metadata import version

    out = {"sglang": version("sglang")}
    for part in (registration, draft_side, cpu_bridge_side):
        try:
            part(out)
        except Exception as e:  # noqa: BLE001 - reported, the test names it
            out[part.__name__ + "_error"] = f"{type(e).__name__}: {e}"
    for part, args in ((server_args, (target, draft)), (trees, (trees_path,))):
        try:
            part(out, *args)
        except Exception as e:  # noqa: BLE001
            out[part.__name__ + "_error"] = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
