"""The registration of `PR_EAGLE3` in SGLang's speculative registry (0.5.14, 0.5.15.post1, 0.5.16-0.5.23).

`PRSpecAlgo` is a `CustomSpecAlgo` (SGLang's plugin base) that answers as EAGLE-3, so SGLang sets up
what EAGLE-3 needs (3-layer hidden capture, the draft KV pool, EAGLE radix-cache keys, the V2
worker's verify and draft-extend). It adds the three methods `CustomSpecAlgo` lacks (0.5.14 to 0.5.23) and the
scheduler calls on every speculative algorithm (`need_topk`, `create_future_map`,
`carries_draft_hidden_states`; a plain registration dies with AttributeError in
`Scheduler.init_overlap`), and the disaggregation hook of the EAGLE family. `handle_server_args`
refuses an SGLang outside the supported range (`seam.check_version`), runs SGLang's own EAGLE-family argument
handling (`_handle_eagle_family`), then the refusals of `checks` (one line each). The calls whose form differs
between SGLang lines go through `seam`.
"""

from __future__ import annotations

import logging

from pr_specforge.sglang_plugin import seam
from pr_specforge.sglang_plugin.checks import ALGORITHM, check_export_and_shape, check_parallel_and_paging

log = logging.getLogger(__name__)


def _spec_class():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class PRSpecAlgo(CustomSpecAlgo):
        """`PR_EAGLE3`: EAGLE-3 to SGLang's set-up, with our draft round."""

        def is_eagle(self) -> bool:
            return True

        def is_eagle3(self) -> bool:
            return True

        def need_topk(self) -> bool:
            return True

        def carries_draft_hidden_states(self) -> bool:
            return True

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                              needs_confidence_relay: bool = False):
            return seam.future_map(self, device, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def build_disagg_draft_input(self, batch, *args):  # (batch, [server_args,] last_tokens_tensor, future_map)
            server_args = args[0] if len(args) == 3 else None
            return seam.disagg_draft_input(batch, *args[-2:], server_args=server_args)

        def handle_server_args(self, server_args) -> None:
            seam.check_version()
            check_parallel_and_paging(server_args)  # before SGLang's own checks, so a refusal names PR_EAGLE3
            seam.eagle_family_arguments(server_args)
            shape = check_export_and_shape(server_args)
            log.info("%s: k=%d, B_w=%d, m=%d, gamma=%d, B=%d", ALGORITHM, shape.k, shape.bw, shape.m, shape.gamma,
                     shape.budget)

    return PRSpecAlgo


def _worker_class(server_args):
    from pr_specforge.sglang_plugin.worker import PREagleWorkerV2

    return PREagleWorkerV2


def register_algorithm() -> None:
    """Add `PR_EAGLE3` to SGLang's registry, once per process."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return
    try:
        seam.check_version()
    except seam.UnsupportedSGLang as e:  # registered all the same: a launch that asks for it is refused in this line
        log.error("%s", e)
    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_spec_class())(_worker_class)
