"""The one adapter between pr_specforge and SpecForge 0.2.0 internals.

Every import of a SpecForge-internal symbol goes through this module, so a
SpecForge upgrade touches one file. It also owns the single runtime patch we
need: SpecForge's soft cross-entropy (`specforge.core.loss.LogSoftmaxLoss`) is a
Triton kernel, which cannot run on CPU; we route CPU tensors to the same math in
plain PyTorch and leave CUDA tensors on the original kernel.

It deliberately does not re-export anything it does not use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import specforge.algorithms.eagle3.model as _eagle3_model_mod
from specforge.algorithms.eagle3.model import (  # noqa: F401
    OnlineEagle3Model,
    _compute_target_p_padded,
)
from specforge.core.loss import LogSoftmaxLoss as _TritonLogSoftmaxLoss
from specforge.modeling.draft.llama3_eagle import (  # noqa: F401
    LlamaForCausalLMEagle3,
    LlamaMutiRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from specforge.modeling.draft.registry import DRAFT_REGISTRY, register_draft  # noqa: F401
from specforge.utils import padding  # noqa: F401

SPECFORGE_VERSION = "0.2.0"


def soft_cross_entropy_rows(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy `-(p * log_softmax(logits)).sum(-1)` in fp32.

    This is the per-position loss `l_p^r` of Eq. 6 (the same one SpecForge's
    EAGLE-3 uses), before masking and averaging.
    """
    return -(target_p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


class CpuSafeLogSoftmaxLoss:
    """Drop-in for `LogSoftmaxLoss.apply`: Triton on CUDA, plain torch elsewhere.

    The torch path computes `(-(p * log_softmax(logits)).sum(-1) * mask).mean()`
    over all B*T rows: exactly the reduction of SpecForge's kernel.
    """

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor):
        if logits.is_cuda:
            return _TritonLogSoftmaxLoss.apply(logits, target_p, position_mask)
        rows = soft_cross_entropy_rows(logits, target_p)
        return (rows * position_mask.squeeze(-1).to(rows.dtype)).mean()


def install_cpu_loss() -> None:
    """Route SpecForge's EAGLE-3 loss through `CpuSafeLogSoftmaxLoss` (idempotent)."""
    _eagle3_model_mod.LogSoftmaxLoss = CpuSafeLogSoftmaxLoss


install_cpu_loss()
