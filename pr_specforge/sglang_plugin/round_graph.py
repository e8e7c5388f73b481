"""The PR round as ONE captured CUDA graph per (tree shape, batch size, context bucket): `PR_EAGLE3_ROUND_GRAPH`.

What is captured. `serving.batched_tree.BatchedTreeBuilder._body`: the root's readouts, every draft step (its rows
through SGLang's draft model, `rows.SGLangRows.step`: the rows' KV-slot lists, the attention, the readouts and the
gate) with the tree's bookkeeping between steps (frontier, pool, Eq. 9, admission and halting), the cut and the
packed result. Outside it, per round: the host inputs copied into fixed buffers (root tokens, features, positions,
the requests' uniforms, their `req_to_token` rows) before the replay, and the one host read of the packed result
after it. The body has no host read and no value-shaped result: `serving.host_reads.NoHostReads` checks it.

The switch, read once at start-up (`mode`):
  * `auto` (unset) - capture on CUDA where SGLang's own decode graphs are on (its `cuda_graph_config.decode`
    backend is not `disabled`), otherwise no graph;
  * `on` - capture on CUDA; on any other device (this CPU) no capture is possible, and the round runs the captured
    path's fixed buffers and metadata eagerly under `NoHostReads` (`guard`): what the capture would record, checked;
  * `off` - the round as it was, eager, its buffers sized to the round.
Which rounds: each (B_w, m, batch size, context bucket: `rows.context_bucket`) whose batch is at most SGLang's largest decode graph
(`cuda_graph_config.decode.bs`; in `guard`, the largest it would capture) and whose rows fit the attention's fixed
buffers (sized for the server's B_w + m). The batch is padded to the smallest of those sizes that holds it
(`round_sizes`, `padded_size`; the worker adds padding requests on SGLang's padding request slot and KV slot 0, and
drops their trees), so the graphs are at most SGLang's own sizes per (B_w, m, bucket). Each is captured at its first round (a warm-up run under `NoHostReads` on a side
stream first: Triton compiles there, and a host read is refused in one line). Any other round, or a key whose
capture fails (logged in one line), runs eagerly, as with `off`. All graphs
share one memory pool: each replay's results are read before the next.

Does not own: the body (`serving.batched_tree`), the rows' fixed buffers (`rows.SGLangRows`).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Hashable, Optional

import torch

from pr_specforge.serving.host_reads import NoHostReads, host_reads_allowed

GRAPH_ENV = "PR_EAGLE3_ROUND_GRAPH"
GRAPH_MODES = ("auto", "off", "on")
log = logging.getLogger(__name__)
_MISSING = object()


def decode_graphs(server_args) -> Optional[list]:
    """SGLang's decode graph batch sizes where its decode graphs are on, else None."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    decode = _decode_config(server_args)
    if decode is None or decode.backend == Backend.DISABLED or not decode.bs:
        return None
    return sorted(decode.bs)


def _decode_config(server_args):
    """SGLang's decode graph config (`cuda_graph_config.decode`), None where the arguments have none."""
    return getattr(getattr(server_args, "cuda_graph_config", None), "decode", None)


def round_sizes(server_args, kind: str) -> Optional[list]:
    """The batch sizes a captured round is padded to: SGLang's decode graph sizes where it captures them
    (`capture`), and in `guard` the sizes it would capture (`cuda_graph_config.decode.bs`, set even with its graphs
    off: `--cuda-graph-bs-decode`); None where there are none (then no padding)."""
    if kind == "capture":
        return decode_graphs(server_args)
    decode = _decode_config(server_args)
    return sorted(decode.bs) if decode is not None and decode.bs else None


def padded_size(n: int, sizes: Optional[list]) -> int:
    """The smallest of `sizes` that holds `n` requests; `n` itself where none does (or there are no sizes)."""
    return next((s for s in sorted(sizes or ()) if s >= n), n)


def resolve_round_graph(mode: str, device, graph_sizes: Optional[list]) -> str:
    """What `mode` means here: `capture` (CUDA graphs), `guard` (the captured path eagerly, checked) or `off`."""
    on_cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        return "capture" if on_cuda and graph_sizes else "off"
    if mode == "on":
        return "capture" if on_cuda else "guard"
    return "off"


class RoundGraphs:
    """One round's device part per key, replayed from a CUDA graph (`capture`) or run under `NoHostReads` (`guard`).
    The caller says which rounds fit its fixed buffers (`rows.SGLangRows`); `last`: how the latest round ran
    (`replay` or `guard`), for the round log."""

    def __init__(self, kind: str) -> None:
        if kind not in ("capture", "guard"):
            raise ValueError(f"RoundGraphs: kind {kind!r} is not capture or guard")
        self.kind = kind
        self.graphs: Dict[Hashable, object] = {}
        self.pool = None
        self.last = None

    def run(self, key: Hashable, body: Callable[[], tuple]) -> tuple:
        if self.kind == "guard":
            self.last = "guard"
            with NoHostReads("PR_EAGLE3's round body"):
                return body()
        entry = self.graphs.get(key, _MISSING)
        if entry is _MISSING:  # a key's first round: the capture waits for the device (its warm-up body is guarded)
            with host_reads_allowed():
                entry = self.graphs[key] = self._capture(key, body)
        if entry is None:
            self.last = "eager"
            return body()
        graph, out = entry
        graph.replay()
        self.last = "replay"
        return out

    def _capture(self, key: Hashable, body: Callable[[], tuple]):
        """(graph, its outputs) for `body`, or None (logged) where it cannot be captured."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), NoHostReads(f"PR_EAGLE3's round body ({key})"):
                body()  # warm-up: Triton compiles and cuBLAS sets up here, not inside the capture
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = body()
            log.info("PR_EAGLE3: captured the round of %s as a CUDA graph", key)
            return graph, out
        except Exception as e:  # noqa: BLE001 - a key that cannot be captured runs eagerly; the server keeps serving
            log.warning("PR_EAGLE3: the round of %s runs eagerly, its capture failed: %s",
                        key, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
