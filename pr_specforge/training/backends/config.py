"""The recipe's `backend:` section: which data-parallel engine wraps the drafter.

    backend:
      name: deepspeed                       # or fsdp (SpecForge's FSDP1/DDP, the default)
      config: recipes/deepspeed/zero2.json  # a DeepSpeed JSON (ZeRO stage 1 or 2)

SpecForge's strict `Config` has no such key, so `pr_specforge.training.recipe.load_recipe`
strips this section and validates it here, against the SpecForge config it
must run beside (impossible combinations fail at load time).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

BACKEND_SECTION = "backend"
BACKEND_NAMES = ("fsdp", "deepspeed")
ZERO_STAGES = (1, 2)


def _error(message: str):
    from pr_specforge.config import ConfigError

    return ConfigError(message)


@dataclass(frozen=True)
class BackendConfig:
    """name: `fsdp` (SpecForge's own; `training.fsdp_sharding` picks FSDP or DDP) or `deepspeed`.
    config: DeepSpeed JSON path (relative paths resolve against the working directory,
        then the recipe's directory); required for `deepspeed`, forbidden for `fsdp`.
    """

    name: str = "fsdp"
    config: Optional[str] = None

    @classmethod
    def from_mapping(cls, raw: Optional[Mapping[str, Any]], where: str = BACKEND_SECTION) -> "BackendConfig":
        """The `backend:` section; a relative `config` is taken as given (a recipe file's own value was
        already resolved against the recipe's directory by `training.recipe`, overrides are cwd-relative)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise _error(f"{where}: expected a mapping like {{name: deepspeed, config: recipes/deepspeed/zero2.json}}")
        unknown = sorted(set(raw) - {"name", "config"})
        if unknown:
            raise _error(f"{where}: unknown key(s) {unknown}; allowed keys: ['config', 'name']")
        name = raw.get("name", "fsdp")
        if name not in BACKEND_NAMES:
            raise _error(f"{where}.name: {name!r} is not a backend; use one of {list(BACKEND_NAMES)}")
        config = raw.get("config")
        if name == "fsdp" and config is not None:
            raise _error(f"{where}.config: only the deepspeed backend reads a config file; drop it or set {where}.name=deepspeed")
        if name == "deepspeed":
            if not config:
                raise _error(f"{where}.config: the deepspeed backend needs a DeepSpeed JSON; set {where}.config=recipes/deepspeed/zero2.json")
            if not os.path.isfile(config):
                raise _error(f"{where}.config: {config!r} does not exist; point it at a DeepSpeed JSON (see recipes/deepspeed/)")
        return cls(name=name, config=config)

    def deepspeed_json(self) -> Dict[str, Any]:
        with open(self.config) as f:
            return json.load(f)

    def validate_against(self, config: Any, where: str = BACKEND_SECTION) -> None:
        """Combinations SpecForge's runtime cannot honour under this backend."""
        if self.name != "deepspeed":
            return
        t = config.training
        if t.attention_backend == "usp":
            raise _error(f"{where}.name=deepspeed with training.attention_backend=usp: DeepSpeed runs plain data parallel, "
                         "USP needs SpecForge's sequence-parallel mesh; use attention_backend=sdpa (or fa), or backend.name=fsdp")
        if t.tp_size != 1 or t.sp_ulysses_size != 1 or t.sp_ring_size != 1:
            raise _error(f"{where}.name=deepspeed needs training.tp_size=sp_ulysses_size=sp_ring_size=1 (data parallel only); "
                         "drop the model-parallel sizes or use backend.name=fsdp")
        if t.optimizer_cpu_offload:
            raise _error(f"{where}.name=deepspeed: set offload in the DeepSpeed JSON (zero_optimization.offload_optimizer), "
                         "not training.optimizer_cpu_offload=true")
        ds = self.deepspeed_json()
        stage = (ds.get("zero_optimization") or {}).get("stage", 0)
        if stage not in ZERO_STAGES:
            raise _error(f"{self.config}: zero_optimization.stage={stage}; the deepspeed backend supports ZeRO stages {list(ZERO_STAGES)}")
        for key, want in (("train_micro_batch_size_per_gpu", t.batch_size), ("gradient_accumulation_steps", t.accumulation_steps),
                          ("gradient_clipping", t.max_grad_norm)):
            if key in ds and ds[key] != "auto" and ds[key] != want:
                raise _error(f"{self.config}: {key}={ds[key]} disagrees with the recipe ({want}); set it to \"auto\" "
                             "(the recipe's training section is authoritative)")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
