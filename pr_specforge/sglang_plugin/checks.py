"""What `PR_EAGLE3` refuses at start-up, the tree shape it serves, and loading the PR drafter from an export.

Owns:
  * `PRServeShape` - the round's shape from SGLang's flags and the export: gamma =
    `--speculative-num-steps`, k = `--speculative-eagle-topk`, B = `--speculative-num-draft-tokens` - 1;
    B_w and m from the export's `pr_serving` entry of `config.json` (default B_w = k, m = 3), each
    overridable at launch with `PR_EAGLE3_BW` / `PR_EAGLE3_M` (environment: SGLang's argument
    parser has no field for them, and the environment reaches every SGLang process).
  * `check_server_args` - the one-line refusals (`PRServeError`): tp > 1, k < 2, page size > 1,
    the overlap schedule, a shape whose tree cannot fill B nodes, a drafter without PR tensors,
    a PR tensor renamed or missing, `norm_output`.
  * `PRServeShape.guaranteed_nodes`, `rows_room`, `tree_rows` - what a request's own B_w / m is checked against
    (`admission.request_shape`, where a request is refused).
  * `load_pr_drafter` - our serving drafter (`core.eagle3.PRServingDrafter`, plain torch: no SpecForge) with
    every tensor of the `--to sglang` export (EAGLE-3 and `pr_*`), for the draft worker's tree rows.

Does not own: the registration (`sglang_plugin.algorithm`), the round (`sglang_plugin.worker`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from pr_specforge.config import PR_SERVING_DEFAULT_M as DEFAULT_M
from pr_specforge.config import PR_SERVING_KEY as SERVING_KEY  # an export's config.json: {"bw": int, "m": int}
from pr_specforge.data.io import read_json_object
from pr_specforge.serving.tree import TreeConfig

ALGORITHM = "PR_EAGLE3"
ENV_BW, ENV_M = "PR_EAGLE3_BW", "PR_EAGLE3_M"
REQUEST_KEY = "pr_eagle3"  # a request's own B_w / m: sampling_params.custom_params["pr_eagle3"] = {"bw": .., "m": ..}
log = logging.getLogger(__name__)


class PRServeError(ValueError):
    """A `PR_EAGLE3` launch that cannot serve (one line, naming the flag, file or tensor)."""


@dataclass(frozen=True)
class PRServeShape:
    k: int
    bw: int
    m: int
    gamma: int
    budget: int

    def tree_config(self) -> TreeConfig:
        return TreeConfig(budget=self.budget, k=self.k, bw=self.bw, gamma=self.gamma, m=self.m)

    def guaranteed_nodes(self) -> int:
        """Non-root nodes every round holds at least: each forwarded frontier row adds k one-pass children."""
        total, frontier_pool = self.k, self.k
        for _ in range(1, self.gamma):
            rows = min(self.bw, frontier_pool)
            total += rows * self.k
            frontier_pool = rows * self.k
        return total

    def groups(self) -> int:
        """Node groups of the encoding for SGLang's `build_tree`: the root and every kept node that has kept
        children (at most B of them, and at most the one-pass rows)."""
        return min(self.budget, 1 + (self.gamma - 1) * self.bw)

    def kernel_steps(self) -> int:
        """`spec_steps` of `build_tree_kernel_efficient` for groups 2k wide: its parent list holds them all, and at
        least gamma, the tree's depth: SGLang's Triton build (0.5.16+, the CPU and XPU path) walks a node's ancestors
        `spec_steps` times at most, so a smaller value drops the deepest ancestors from the mask (measured on
        0.5.23: `tests/sglang_plugin/test_sglang_lines.py`); the padded parent list entries are never read."""
        return max(1 + math.ceil((self.groups() - 1) / (2 * self.k)), self.gamma)

    def parent_width(self) -> int:
        """The width of `build_tree_kernel_efficient`'s parent list at `kernel_steps` (groups 2k wide)."""
        return 2 * self.k * (self.kernel_steps() - 1) + 1


def _env_int(name: str) -> Optional[int]:
    """An integer override from the environment: None when unset; set, it is what serves (an empty or non-integer
    value is refused in one line, never replaced by the export's; its range is `serve_shape`'s to check)."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise PRServeError(f"{ALGORITHM}: {name}={raw!r} is not an integer (unset it to serve the export's value)") from None


def read_export_config(draft_dir: Optional[str]) -> Dict:
    if not draft_dir:
        raise PRServeError(f"{ALGORITHM} needs --speculative-draft-model-path (a `pr-specforge export --to sglang` dir)")
    path = os.path.join(draft_dir, "config.json")
    if not os.path.isfile(path):
        raise PRServeError(f"{ALGORITHM}: {path} does not exist (expected a `pr-specforge export --to sglang` dir)")
    return read_json_object(path, f"{ALGORITHM}:", error=PRServeError)


def serve_shape(server_args, export_config: Dict) -> PRServeShape:
    serving = export_config.get(SERVING_KEY) or {}
    k = int(server_args.speculative_eagle_topk)
    bw, m = _env_int(ENV_BW), _env_int(ENV_M)
    bw = int(serving.get("bw", k)) if bw is None else bw
    m = int(serving.get("m", DEFAULT_M)) if m is None else m
    gamma = int(server_args.speculative_num_steps)
    budget = int(server_args.speculative_num_draft_tokens) - 1
    for name, value, lo in (("B_w (" + ENV_BW + ")", bw, 1), ("m (" + ENV_M + ")", m, 0), ("--speculative-num-steps", gamma, 1),
                            ("--speculative-num-draft-tokens - 1", budget, 1)):
        if value < lo:
            raise PRServeError(f"{ALGORITHM}: {name} must be >= {lo}, got {value}")
    return PRServeShape(k=k, bw=bw, m=m, gamma=gamma, budget=budget)


def check_parallel_and_paging(server_args) -> None:
    """The flags the per-request PR round does not support."""
    if int(server_args.tp_size) > 1:
        raise PRServeError(f"{ALGORITHM} drafts on one rank: --tp-size {server_args.tp_size} is not supported (use --tp-size 1)")
    if server_args.speculative_eagle_topk is None or int(server_args.speculative_eagle_topk) < 2:
        raise PRServeError(f"{ALGORITHM} needs --speculative-eagle-topk >= 2 (SGLang verifies a tree only for topk > 1), "
                           f"got {server_args.speculative_eagle_topk}")
    if int(server_args.page_size or 1) > 1:
        raise PRServeError(f"{ALGORITHM} needs --page-size 1, got {server_args.page_size}")
    if getattr(server_args, "speculative_adaptive", False):
        raise PRServeError(f"{ALGORITHM} has a fixed tree shape: --speculative-adaptive is not supported")
    if draft_attention_backend(server_args) == "fa3":
        raise PRServeError(f"{ALGORITHM} drafts each tree row over its own list of KV slots, which FA3's draft decode "
                           "cannot express (it reads prefix + own lane): use --speculative-draft-attention-backend "
                           "triton or flashinfer")


def draft_attention_backend(server_args) -> Optional[str]:
    """The backend SGLang's draft decode takes: `--speculative-draft-attention-backend`, else the decode one, else
    `--attention-backend` (`speculative/draft_utils.py`, `DraftBackendFactory`)."""
    for name in ("speculative_draft_attention_backend", "decode_attention_backend", "attention_backend"):
        value = getattr(server_args, name, None)
        if value:
            return str(value)
    return None


def rows_room(shape: "PRServeShape", overlap: bool = False) -> int:
    """Draft KV slots after the context a decode reserves per request, at least, at draft time
    (`req.kv_allocated_len - seq_len`, the round log's `kv_room`): `2 max(gamma k, B + 1)` (`mem_cache/common.py`),
    less `gamma + 1` under the overlap schedule, where the reservation is made from a committed length that lags
    the last verify by up to gamma + 1 tokens (`speculative/eagle_info_v2.py`; measured: 2A - gamma at the least)."""
    room = 2 * max(shape.gamma * shape.k, shape.budget + 1)
    return room - (shape.gamma + 1) if overlap else room


def overlap_on(server_args) -> bool:
    """Whether SGLang runs the overlap schedule (its default)."""
    return not getattr(server_args, "disable_overlap_schedule", False)


def tree_rows(shape: "PRServeShape") -> int:
    """A round's tree rows after the root, `(gamma - 1)(B_w + m)`: the draft KV slots `PR_EAGLE3_ROWS=sglang` writes."""
    return (shape.gamma - 1) * (shape.bw + shape.m)


def check_rows(shape: "PRServeShape", export_config: Dict, overlap: bool = False) -> str:
    """The row path (`PR_EAGLE3_ROWS`): as set, else `sglang` where SGLang's draft model runner can run the rows
    and `ours` where it cannot (a drafter with a reconsideration adapter; rows that outgrow `rows_room`). Set to
    `sglang` where it cannot: refused in one line."""
    from pr_specforge.config import PR_CONFIG_KEY
    from pr_specforge.sglang_plugin.rows import ROWS_ENV, rows_mode

    try:
        mode = rows_mode()
    except ValueError as e:
        raise PRServeError(str(e)) from None
    problem = None
    if int((export_config.get(PR_CONFIG_KEY) or {}).get("recon_adapter_rank") or 0) > 0:
        problem = "does not run a drafter with a reconsideration adapter (pr.recon_adapter_rank > 0)"
    elif tree_rows(shape) > rows_room(shape, overlap):
        problem = (f"a round's {tree_rows(shape)} tree rows ((gamma - 1)(B_w + m)) exceed the {rows_room(shape, overlap)} "
                   "draft KV slots SGLang reserves per decode" + (" under the overlap schedule" if overlap else "") +
                   "; lower B_w or m")
    if problem and mode == "sglang":
        raise PRServeError(f"{ALGORITHM}: {ROWS_ENV}=sglang: {problem}, or use {ROWS_ENV}=ours")
    return mode or ("ours" if problem else "sglang")


def rows_for(server_args) -> str:
    """`check_rows` of a launch (the worker asks before SGLang loads the draft model)."""
    export_config = read_export_config(server_args.speculative_draft_model_path)
    return check_rows(serve_shape(server_args, export_config), export_config, overlap_on(server_args))


def check_shape(shape: PRServeShape) -> None:
    have = shape.guaranteed_nodes()
    if have < shape.budget:
        raise PRServeError(
            f"{ALGORITHM}: the tree k={shape.k}, B_w={shape.bw}, gamma={shape.gamma} holds only {have} nodes for sure, "
            f"fewer than B={shape.budget} (--speculative-num-draft-tokens {shape.budget + 1}); lower it to <= {have + 1}")


def _skeleton(export_config: Dict, device):
    """The serving drafter of the export's config (`core.eagle3`: plain torch, no SpecForge)."""
    from pr_specforge.core.eagle3 import PRServingDrafter, ServingDrafterError

    try:
        with torch.device(device):
            return PRServingDrafter.from_export_config(export_config).float()
    except (ServingDrafterError, ValueError) as e:
        raise PRServeError(f"{ALGORITHM}: {e}") from None


def check_drafter(draft_dir: str, export_config: Dict) -> None:
    """Refuse an export that is not a PR drafter, or whose tensors do not fill ours (names and shapes, read
    from the safetensors header only)."""
    from safetensors import safe_open

    from pr_specforge.config import PR_CONFIG_KEY
    from pr_specforge.core.parts import PR_PARAM_PREFIXES

    path = os.path.join(draft_dir, "model.safetensors")
    if PR_CONFIG_KEY not in export_config:
        raise PRServeError(f"{ALGORITHM}: {draft_dir}/config.json has no {PR_CONFIG_KEY!r}: not a PR drafter export "
                           "(serve it with --speculative-algorithm EAGLE3)")
    if export_config.get("norm_output"):
        raise PRServeError(f"{ALGORITHM}: {draft_dir}/config.json sets norm_output; the PR round reads pre-norm features")
    if not os.path.isfile(path):
        raise PRServeError(f"{ALGORITHM}: {path} does not exist")
    with safe_open(path, framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    if not any(n.startswith(PR_PARAM_PREFIXES) for n in shapes):
        raise PRServeError(f"{ALGORITHM}: {path} holds no PR tensors ({', '.join(p + '*' for p in PR_PARAM_PREFIXES)}): "
                           "not a PR drafter (serve it with --speculative-algorithm EAGLE3)")
    want = {n: tuple(p.shape) for n, p in _skeleton(export_config, "meta").state_dict().items() if "embed" not in n}
    missing = sorted(set(want) - set(shapes))
    unknown = sorted(n for n in set(shapes) - set(want) if "embed" not in n)
    wrong = sorted(n for n in set(want) & set(shapes) if want[n] != shapes[n])
    if missing or unknown or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []) + \
                ([f"wrong shape {wrong}"] if wrong else [])
        raise PRServeError(f"{ALGORITHM}: {path} does not fill the PR drafter of its config: " + "; ".join(parts))


def check_server_args(server_args) -> PRServeShape:
    """Every start-up refusal, in one line each (`PRServeError`); returns the round's shape."""
    check_parallel_and_paging(server_args)
    return check_export_and_shape(server_args)


def check_export_and_shape(server_args) -> PRServeShape:
    export_config = read_export_config(server_args.speculative_draft_model_path)
    shape = serve_shape(server_args, export_config)
    check_shape(shape)
    check_drafter(server_args.speculative_draft_model_path, export_config)
    check_rows(shape, export_config, overlap_on(server_args))
    check_readouts()
    check_m0_draft()
    check_row_attention()
    check_round_graph()
    return shape


def check_row_attention(device=None) -> str:
    """`PR_EAGLE3_ROW_ATTENTION` (`rows.row_attention_mode`), refused in one line when it is not a mode;
    with `device` (the draft model's), the backend it resolves to there (`resolve_row_attention`)."""
    from pr_specforge.sglang_plugin.row_attention import resolve_row_attention
    from pr_specforge.sglang_plugin.rows import row_attention_mode

    try:
        mode = row_attention_mode()
        return mode if device is None else resolve_row_attention(mode, device)
    except ValueError as e:
        raise PRServeError(str(e)) from None


def check_round_graph(device=None, server_args=None) -> str:
    """`PR_EAGLE3_ROUND_GRAPH` (`rows.round_graph_mode`), refused in one line when it is not a mode; with `device`
    (the draft model's), what it resolves to there with `server_args`' decode graphs (`resolve_round_graph`):
    `capture`, `guard` or `off`."""
    from pr_specforge.sglang_plugin.round_graph import decode_graphs, resolve_round_graph
    from pr_specforge.sglang_plugin.rows import round_graph_mode

    try:
        mode = round_graph_mode()
    except ValueError as e:
        raise PRServeError(str(e)) from None
    return mode if device is None else resolve_round_graph(mode, device, decode_graphs(server_args))


def check_readouts() -> str:
    """`PR_EAGLE3_READOUTS` (`rows.readouts_mode`), refused in one line when it is not a mode."""
    from pr_specforge.sglang_plugin.rows import readouts_mode

    try:
        return readouts_mode()
    except ValueError as e:
        raise PRServeError(str(e)) from None


def check_m0_draft() -> str:
    """`PR_EAGLE3_M0_DRAFT` (`rows.m0_draft_mode`), refused in one line when it is not a mode."""
    from pr_specforge.sglang_plugin.rows import m0_draft_mode

    try:
        return m0_draft_mode()
    except ValueError as e:
        raise PRServeError(str(e)) from None


@torch.no_grad()
def load_pr_drafter(draft_dir: str, device, dtype: torch.dtype, embedding: torch.Tensor):
    """The serving drafter (`core.eagle3`) with every tensor of the export, the target's `embedding` shared, eval mode."""
    from safetensors.torch import load_file

    export_config = read_export_config(draft_dir)
    model = _skeleton(export_config, "cpu")
    weights = load_file(os.path.join(draft_dir, "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any("embed" not in n for n in missing):
        raise PRServeError(f"{ALGORITHM}: {draft_dir} does not fill the PR drafter: missing {missing}, unknown {unexpected}")
    rows = model.embed_tokens.weight.shape[0]  # SGLang pads its vocabulary embedding (to a multiple of 64)
    model.embed_tokens.weight.copy_(embedding.detach()[:rows].to("cpu", model.embed_tokens.weight.dtype))
    return model.to(device=device, dtype=dtype).eval()
