"""`pr-specforge train`: a SpecForge recipe plus a `pr:` section, run by SpecForge's trainer.

    pr-specforge train -c recipes/smollm2-135m-cpu.yaml training.max_steps=20 pr.max_depth=2
    torchrun --nproc_per_node 4 -m pr_specforge.cli train -c recipes/llama3.1-8b-pr.yaml

Owns: recipe loading (SpecForge's strict config + the strict `pr:` section, dotted
overrides for both), building the registry with `pr` added, and the process
launch (in-process for one rank or under torchrun; self-launch through torchrun
for several ranks, re-entering THIS cli so every rank has the patched registry).

Does not own: the trainer loop, checkpoints and tracker (SpecForge's).
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from pr_specforge.config import ConfigError, PRConfig

log = logging.getLogger(__name__)

PR_SECTION = "pr"


@dataclass
class Recipe:
    """A resolved recipe: SpecForge's `Config`, PR settings and the raw mapping they came from."""

    config: Any  # specforge.config.Config
    pr: PRConfig
    raw: Dict[str, Any]
    path: str


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, Any]]:
    """Split dotted overrides into SpecForge's and `pr.*` ones (parsed as YAML scalars)."""
    spec, pr = [], {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, value = item.split("=", 1)
        if key.startswith(PR_SECTION + "."):
            field = key[len(PR_SECTION) + 1 :]
            if "." in field:
                raise ConfigError(f"override {item!r}: pr settings are flat (pr.FIELD=value)")
            pr[field] = _parse_value(value)
        else:
            spec.append(item)
    return spec, pr


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe YAML/JSON; validate SpecForge's part strictly and the `pr:` part strictly."""
    if not os.path.isfile(path):
        raise ConfigError(f"recipe {path!r} does not exist")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path}: expected a mapping at the top level")
    spec_over, pr_over = split_overrides(overrides)
    pr_raw = dict(raw.get(PR_SECTION) or {})
    pr_raw.update(pr_over)
    pr = PRConfig.from_mapping(pr_raw, where=f"{path}: pr")
    spec_raw = {k: v for k, v in raw.items() if k != PR_SECTION}
    config = _specforge_config(spec_raw, spec_over, path)
    if PR_SECTION in raw or config.training.strategy == "pr":
        if config.training.strategy not in ("pr",):
            raise ConfigError(
                f"recipe {path}: has a `pr:` section but training.strategy={config.training.strategy!r}; "
                "set training.strategy=pr (or drop the pr: section for a plain EAGLE-3 run)"
            )
    resolved = copy.deepcopy(raw)
    resolved[PR_SECTION] = pr.to_dict()
    return Recipe(config=config, pr=pr, raw=resolved, path=path)


def _specforge_config(spec_raw: Dict[str, Any], overrides: Sequence[str], path: str):
    from pydantic import ValidationError
    from specforge.config import Config
    from specforge.config.schema import apply_overrides, migrate_legacy_config

    try:
        config = Config.model_validate(migrate_legacy_config(copy.deepcopy(spec_raw)))
        if overrides:
            config = apply_overrides(config, list(overrides))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            lines.append(f"  {loc or '<root>'}: {err.get('msg')}")
        raise ConfigError(f"recipe {path}: invalid SpecForge config:\n" + "\n".join(lines)) from None
    return config


def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_train(recipe_path: str, overrides: Sequence[str], dry_run: bool = False) -> int:
    recipe = load_recipe(recipe_path, overrides)
    cfg = recipe.config
    world = cfg.deployment.trainer.nnodes * cfg.deployment.trainer.nproc_per_node
    if not _in_torchrun() and world > 1:
        if cfg.deployment.trainer.nnodes > 1:
            raise ConfigError(
                "multi-node runs: launch every node with `torchrun --nnodes N --nproc_per_node P "
                "--node_rank R --master_addr ... -m pr_specforge.cli train -c RECIPE` (see recipes/launch/torchrun.sh)"
            )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={cfg.deployment.trainer.nproc_per_node}",
               "-m", "pr_specforge.cli", "train", "-c", recipe_path, *overrides]
        log.info("self-launching %d ranks: %s", world, " ".join(cmd))
        return subprocess.call(cmd)
    if dry_run:
        return 0
    return _run_worker(recipe)


def _run_worker(recipe: Recipe) -> int:
    from pr_specforge import _specforge  # noqa: F401  (CPU-safe loss)
    from pr_specforge.integration import ALGORITHM_NAME, build_registry
    from specforge.application import bind_run, resolve_run
    from specforge.cli import _train

    cfg = recipe.config
    if cfg.training.strategy != ALGORITHM_NAME:
        # eagle3 baselines run through the same entry point, with the same registry.
        log.info("training.strategy=%s (not pr): running SpecForge's own algorithm", cfg.training.strategy)
    registry = build_registry(recipe.pr)
    resolved = resolve_run(cfg, registry)
    os.makedirs(cfg.output_dir, exist_ok=True)
    _write_resolved_recipe(recipe)
    return _train(bind_run(resolved.config, resolved.algorithm)) or 0


def _write_resolved_recipe(recipe: Recipe) -> None:
    """Store the resolved recipe (SpecForge config dump + pr section) in the output dir, atomically."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    payload = recipe.config.model_dump(mode="json")
    payload[PR_SECTION] = recipe.pr.to_dict()
    out = os.path.join(recipe.config.output_dir, "resolved_recipe.yaml")
    fd, tmp = tempfile.mkstemp(dir=recipe.config.output_dir, prefix=".resolved_recipe.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(payload, f, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
