"""The offline teacher head in the stored features' dtype: float32 offline training on any CPU.

SpecForge 0.2.0's `TargetHead.from_pretrained` casts the frozen head to bf16 whatever the recipe's
`model.torch_dtype`, so float32 features failed at the first step (`expected m1 and m2 to have the same
dtype`) and offline training was bf16 on every CPU, also where torch emulates bf16 (an AVX2-only CPU: a
SmolLM2 drafter's step 56 s instead of about 1 s, docs/pipeline.md).

`FeatureDtypeTargetHead` wraps the head SpecForge built (the same module, the same bf16 weight) and
scores a stored final hidden state in that state's own dtype: bf16 features exactly as SpecForge does (its
forward, bit for bit), features of another dtype with the target's lm_head read from the target's files
straight into that dtype (nothing passes through bf16; SpecForge's public `TargetHead.load_weights`). That read
draws nothing from the training's RNG stream (`weight_in`), so a resume is exact in either dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.nn.functional as F

from pr_specforge._specforge import TargetHead


class FeatureDtypeTargetHead(TargetHead):
    """SpecForge's frozen offline `TargetHead` that scores features of any dtype in that dtype."""

    @classmethod
    def around(cls, head: TargetHead, config) -> "FeatureDtypeTargetHead":
        wrapped = cls.__new__(cls)  # not TargetHead.__init__: it would allocate a second vocab x hidden weight
        torch.nn.Module.__init__(wrapped)
        wrapped.config, wrapped.hidden_size, wrapped.vocab_size = head.config, head.hidden_size, head.vocab_size
        wrapped.fc = head.fc  # SpecForge's frozen weight, shared, not copied
        wrapped.model_path = head.model_path  # set by SpecForge's load_weights
        wrapped._model = config.model  # where the weight is read from for other dtypes
        wrapped._weights: Dict[torch.dtype, torch.Tensor] = {}
        return wrapped.eval()

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The target's lm_head weight in `dtype`, read once from the target's files."""
        if dtype not in self._weights:
            m = self._model
            # The scratch head's `nn.Linear` is initialised at random before the target's weight replaces it: a draw
            # from the global RNG at the first step with these features, i.e. after a resume restored the
            # checkpoint's RNG state (which the uninterrupted run drew at its step 1, not here). Drawn from a fork,
            # the training's RNG stream never sees it, so a killed and resumed run is bitwise the uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                scratch = TargetHead(m.target_model_path, trust_remote_code=m.trust_remote_code, cache_dir=m.cache_dir)
            scratch = scratch.to(dtype=dtype)
            scratch.load_weights(model_path=m.target_model_path, lm_head_key=m.lm_head_key, cache_dir=m.cache_dir)
            self._weights[dtype] = scratch.fc.weight.detach().to(self.fc.weight.device)
        return self._weights[dtype]

    def forward(self, hidden_states):
        if hidden_states.dtype == self.fc.weight.dtype:
            return super().forward(hidden_states)
        with torch.no_grad():
            return F.linear(hidden_states, self.weight_in(hidden_states.dtype))


def with_feature_dtype_head(parts, config):
    """`parts` (SpecForge's `AlgorithmModelParts`) with its offline head scoring features in their own dtype."""
    if parts.target_head is None or isinstance(parts.target_head, FeatureDtypeTargetHead):
        return parts
    return dataclasses.replace(parts, target_head=FeatureDtypeTargetHead.around(parts.target_head, config))
