"""The DeepSpeed ZeRO-1/2 backend selected by `backend: {name: deepspeed, config: ...}`.

Status: the recipe section, its validation (ZeRO stage, USP/TP/SP conflicts,
JSON fields that must agree with the recipe) and the ZeRO configs under
`recipes/deepspeed/` exist; the engine seam (a backend object with
backward/step/scale_gradients/state in place of SpecForge's FSDP/DDP backend,
specforge/training/backend.py) is not written yet, so training refuses to start
rather than silently running FSDP/DDP under a recipe that asked for DeepSpeed.
"""

from __future__ import annotations

from typing import Any


def install_deepspeed_backend(backend: Any, config: Any) -> None:
    from pr_specforge.config import ConfigError

    raise ConfigError(
        f"backend.name=deepspeed ({backend.config}): the DeepSpeed engine is not wired into SpecForge's trainer in this "
        "version; train with backend.name=fsdp (training.fsdp_sharding=NO_SHARD is DDP)"
    )
