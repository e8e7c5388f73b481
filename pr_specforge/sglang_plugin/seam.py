"""Every SGLang call of `PR_EAGLE3` whose form differs between the supported SGLang lines, in one place.

Supported: SGLang 0.5.14 (SpecForge 0.2.0's pin), 0.5.15.post1 (the same touch points as 0.5.14) and 0.5.16 through
0.5.23; any other version is refused at start-up in one line (`check_version`, called by the registration). Each
function below is one touch point; it asks SGLang which form it has (a signature, an attribute), never a version
number, so a line between two tested ones takes whichever form it carries. The table of the touch points, what
each is on each line, and which were run where: docs/export.md, "SGLang versions".

Does not own: what the worker does with them (`worker`, `rows`, `algorithm`).
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache
from typing import Optional, Tuple

OLDEST, NEWEST = (0, 5, 14), (0, 5, 23)
SUPPORTED = "SGLang 0.5.14, 0.5.15.post1 and 0.5.16-0.5.23"


class UnsupportedSGLang(RuntimeError):
    """An SGLang version outside `SUPPORTED` (one line)."""


def version_tuple(version: str) -> Tuple[int, ...]:
    """`0.5.15.post1` -> (0, 5, 15): the release, without pre/post/dev/local parts."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise UnsupportedSGLang(f"PR_EAGLE3 supports {SUPPORTED}; cannot read SGLang's version {version!r}")
    return tuple(int(x) for x in m.groups())


def installed_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def check_version(version: Optional[str] = None) -> str:
    """The installed SGLang's version (or `version`), refused in one line outside `SUPPORTED`."""
    version = installed_version() if version is None else version
    if not OLDEST <= version_tuple(version) <= NEWEST:
        raise UnsupportedSGLang(f"PR_EAGLE3 supports {SUPPORTED}; this is SGLang {version}")
    return version


@lru_cache(maxsize=None)
def _params(fn) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


# ----------------------------------------------------------------------------- the registration
def future_map(algo, device, req_to_token_pool, needs_cpu_seq_lens: bool = True, needs_confidence_relay: bool = False):
    """SGLang's `FutureMap` for the overlap schedule. 0.5.16+ passes (and FutureMap takes) `needs_confidence_relay`."""
    from sglang.srt.managers.overlap_utils import FutureMap

    if "needs_confidence_relay" in _params(FutureMap.__init__):
        return FutureMap(device, algo, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)
    return FutureMap(device, algo, req_to_token_pool, needs_cpu_seq_lens)


def disagg_draft_input(batch, last_tokens_tensor, future_map, server_args=None):
    """EAGLE's disaggregation draft input; 0.5.18 dropped its `server_args` argument."""
    from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input as build

    if "server_args" in _params(build):
        return build(batch, server_args, last_tokens_tensor, future_map)
    return build(batch, last_tokens_tensor, future_map)


def eagle_family_arguments(server_args) -> None:
    """SGLang's own EAGLE-family argument handling (`speculative_hook._handle_eagle_family`, on every line)."""
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

    _handle_eagle_family(server_args)


# ----------------------------------------------------------------------------- the draft
def idle_verify_input(topk: int, spec_steps: int, num_verify_tokens: int, device):
    """An idle batch's verify input; 0.5.16+ needs the `device`."""
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    if "device" in _params(EagleVerifyInput.create_idle_input):
        return EagleVerifyInput.create_idle_input(topk, spec_steps, num_verify_tokens, device)
    return EagleVerifyInput.create_idle_input(topk, spec_steps, num_verify_tokens)


def build_tree(backend, tree_mask_mode, bonus_tokens, parent_list, top_scores_index, draft_tokens, seq_lens,
               seq_lens_sum, topk: int, spec_steps: int, num_verify_tokens: int, bs: int, longest: int):
    """SGLang's `build_tree_kernel_efficient` into the target backend's verify buffers -> its six outputs.

    0.5.14-0.5.16: the buffers come from `backend.get_verify_buffers_to_fill_after_draft()` (mask, positions) and
    go in as the 11th and 12th arguments. 0.5.17+: `backend.verify_mask` (None, or a buffer with its own mask mode,
    `fits(bs)` and `is_read`) and the 12th argument is `fill_prefix_mask` (passed by keyword here: a positional
    None there skips the prefix mask silently). `seq_lens_sum` None (no host sum): an upper bound `bs * longest`,
    or 0 where the mask needs no size from it."""
    from sglang.srt.speculative import eagle_utils

    kernel = eagle_utils.build_tree_kernel_efficient
    mode, fill = tree_mask_mode, {}
    if "fill_prefix_mask" in _params(kernel):
        vm = getattr(backend, "verify_mask", None)
        mask_buf = None if vm is None or not vm.fits(bs) else vm.buffer
        if vm is not None:
            mode = vm.mode
        fill = {"fill_prefix_mask": True if vm is None else vm.is_read}
        bufs = (mask_buf,)
        sized_off_bs = mask_buf is not None or mode == type(mode).QLEN_ONLY
    else:
        bufs = tuple(backend.get_verify_buffers_to_fill_after_draft())
        sized_off_bs = bufs[0] is not None
    if seq_lens_sum is None:
        seq_lens_sum = 0 if sized_off_bs else bs * longest
    return kernel(bonus_tokens, parent_list, top_scores_index, draft_tokens, seq_lens, seq_lens_sum, topk, spec_steps,
                  num_verify_tokens, mode, *bufs, **fill)


def draft_forward_batch(batch, runner):
    """A DECODE `ForwardBatch` that captures the last hidden states. 0.5.14-0.5.15: `ForwardBatch.init_new(batch,
    runner)` reads `batch.capture_hidden_mode`; 0.5.16+: the field is gone and `init_new` takes
    `capture_hidden_mode` and the required keyword `return_hidden_states_before_norm` (0.5.22 adds optional
    `kv_loc_plan` / `write_cols`, left to their defaults)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    if "return_hidden_states_before_norm" in _params(ForwardBatch.init_new):
        return ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.LAST,
                                     return_hidden_states_before_norm=False)
    batch.capture_hidden_mode = CaptureHiddenMode.LAST
    return ForwardBatch.init_new(batch, runner)


# ----------------------------------------------------------------------------- a request's KV
def kv_allocated_len(req) -> Optional[int]:
    """The request's allocated KV slots: `req.kv_allocated_len` (0.5.14-0.5.15), `req.kv.kv_allocated_len` (0.5.16+)."""
    kv = getattr(req, "kv", None)
    return getattr(kv if kv is not None and hasattr(kv, "kv_allocated_len") else req, "kv_allocated_len", None)


def req_pool_idx(req) -> int:
    """The request's row of the request-to-token table: `req.req_pool_idx` (to 0.5.19), `req.kv.req_pool_idx` (0.5.20+)."""
    kv = getattr(req, "kv", None)
    return (kv if kv is not None and hasattr(kv, "req_pool_idx") else req).req_pool_idx
