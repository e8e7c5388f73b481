"""`pr-specforge train`: a SpecForge recipe plus a `pr:` section, run by SpecForge's trainer.

    pr-specforge train -c recipes/smollm2-135m-cpu.yaml training.max_steps=20 pr.max_depth=2
    torchrun --nproc_per_node 4 -m pr_specforge.cli train -c recipes/llama3.1-8b-pr.yaml

Owns: recipe loading (SpecForge's strict config + the strict `pr:` and `backend:`
sections, dotted overrides for all, `extends:` to share settings between
recipes), building the registry with `pr` added, and the process
launch (in-process for one rank or under torchrun; self-launch through torchrun
for several ranks, re-entering THIS cli so every rank has the patched registry).

Does not own: the trainer loop, checkpoints and tracker (SpecForge's; the
recipe-carrying checkpoint manager and the JSONL metrics sink are hooked in from
`pr_specforge.backends.checkpoint` and `pr_specforge.telemetry`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from pr_specforge.backends.config import BACKEND_SECTION, BackendConfig
from pr_specforge.config import PR_ATTENTION_BACKEND, ConfigError, PRConfig, check_attention_backend

log = logging.getLogger(__name__)

PR_SECTION = "pr"
#: `extends: other.yaml` (relative to the recipe's directory) deep-merges this recipe over that one.
EXTENDS_KEY = "extends"


@dataclass
class Recipe:
    """A resolved recipe: SpecForge's `Config`, PR settings and the raw mapping they came from."""

    config: Any  # specforge.config.Config
    pr: PRConfig
    raw: Dict[str, Any]
    path: str
    backend: BackendConfig = BackendConfig()
    online: Any = None  # pr_specforge.online.OnlineSettings when data.online is true


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, Any]]:
    """Split dotted overrides into SpecForge's and `pr.*` ones (parsed as YAML scalars)."""
    spec, pr = [], {}
    for item in overrides:
        if item.startswith(BACKEND_SECTION + "."):
            continue  # read by `_backend_overrides`
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


def _backend_overrides(overrides: Sequence[str]) -> Dict[str, Any]:
    out = {}
    for item in overrides:
        if item.startswith(BACKEND_SECTION + ".") and "=" in item:
            key, value = item.split("=", 1)
            out[key[len(BACKEND_SECTION) + 1 :]] = _parse_value(value)
    return out


def _deep_merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_recipe_mapping(path: str, _chain: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The recipe's raw mapping with its `extends:` chain resolved (later files win, mappings merge)."""
    if not os.path.isfile(path):
        where = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(f"recipe {path!r} does not exist{where}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path}: expected a mapping at the top level")
    base = raw.pop(EXTENDS_KEY, None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"recipe {path}: {EXTENDS_KEY} must be one recipe path (relative to {os.path.dirname(path) or '.'}), got {base!r}")
    base_path = os.path.normpath(base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base))
    chain = _chain + (os.path.abspath(path),)
    if os.path.abspath(base_path) in chain:
        raise ConfigError(f"recipe {path}: {EXTENDS_KEY} cycle through {base_path}; a recipe cannot extend itself")
    return _deep_merge(read_recipe_mapping(base_path, chain), raw)


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe YAML/JSON; validate SpecForge's part, the `pr:` and `backend:` parts strictly."""
    from pr_specforge.online import online_settings, pop_online_keys

    raw = read_recipe_mapping(path)
    spec_over, pr_over = split_overrides(overrides)
    online_request, raw, spec_over = pop_online_keys(raw, spec_over, path)
    pr_raw = dict(raw.get(PR_SECTION) or {})
    pr_raw.update(pr_over)
    pr = PRConfig.from_mapping(pr_raw, where=f"{path}: pr")
    backend_raw = raw.get(BACKEND_SECTION)
    backend_over = _backend_overrides(overrides)
    if backend_over:
        backend_raw = {**(backend_raw or {}), **backend_over}
    backend = BackendConfig.from_mapping(backend_raw, where=f"{path}: {BACKEND_SECTION}", recipe_dir=os.path.dirname(path) or ".")
    spec_raw = {k: v for k, v in raw.items() if k not in (PR_SECTION, BACKEND_SECTION)}
    spec_raw, spec_over = _resolve_auto_dtype(spec_raw, spec_over)
    config = _specforge_config(spec_raw, spec_over, path)
    backend_given = "attention_backend" in (spec_raw.get("training") or {}) or any(
        o.split("=", 1)[0] == "training.attention_backend" for o in spec_over)
    if config.training.strategy == "pr" and not backend_given:
        # SpecForge's default (flex_attention) cannot run PR's composed rows; sdpa is PR's layout.
        config = _specforge_config(spec_raw, [*spec_over, f"training.attention_backend={PR_ATTENTION_BACKEND}"], path)
    backend.validate_against(config, where=f"{path}: {BACKEND_SECTION}")
    if PR_SECTION in raw or config.training.strategy == "pr":
        if config.training.strategy not in ("pr",):
            raise ConfigError(
                f"recipe {path}: has a `pr:` section but training.strategy={config.training.strategy!r}; "
                "set training.strategy=pr (or drop the pr: section for a plain EAGLE-3 run)"
            )
    if config.training.strategy == "pr":
        check_attention_backend(config.training.attention_backend, where=f"recipe {path}: training.attention_backend")
    online = online_settings(config, online_request, path)
    resolved = copy.deepcopy(raw)
    resolved[PR_SECTION] = pr.to_dict()
    resolved[BACKEND_SECTION] = backend.to_dict()
    if online is not None:
        resolved.setdefault("data", {}).update(online.to_recipe())
    return Recipe(config=config, pr=pr, raw=resolved, path=path, backend=backend, online=online)


def _resolve_auto_dtype(spec_raw: Dict[str, Any], overrides: List[str]):
    """`model.torch_dtype: auto` (recipe or override) -> the offline drafter's dtype (`dtypes.offline_dtype`)."""
    from pr_specforge.dtypes import offline_dtype

    device = "cpu"
    if (spec_raw.get("model") or {}).get("torch_dtype") == "auto" or "model.torch_dtype=auto" in overrides:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = offline_dtype("auto", device)
    model = dict(spec_raw.get("model") or {})
    if model.get("torch_dtype") == "auto":
        model["torch_dtype"] = dtype
        spec_raw = {**spec_raw, "model": model}
    overrides = [f"model.torch_dtype={dtype}" if o == "model.torch_dtype=auto" else o for o in overrides]
    return spec_raw, overrides


def _specforge_config(spec_raw: Dict[str, Any], overrides: Sequence[str], path: str):
    from pydantic import ValidationError
    from pr_specforge._specforge import Config
    from pr_specforge._specforge import apply_overrides, migrate_legacy_config

    try:
        config = Config.model_validate(migrate_legacy_config(copy.deepcopy(spec_raw)))
        if overrides:
            _check_override_paths(config, overrides)
            config = apply_overrides(config, list(overrides))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            lines.append(f"  {loc or '<root>'}: {err.get('msg')}{_fix_hint(err)}")
        raise ConfigError(f"recipe {path}: invalid SpecForge config:\n" + "\n".join(lines)) from None
    return config


def _check_override_paths(config, overrides: Sequence[str]) -> None:
    """An override of a field SpecForge's config does not have: one line naming it and the near names."""
    import difflib

    raw = config.model_dump()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        path = item.split("=", 1)[0]
        node, walked = raw, []
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                names = sorted(node) if isinstance(node, dict) else []
                near = difflib.get_close_matches(key, names, n=3)
                where = ".".join(walked) or "the recipe's top level"
                hint = f"; did you mean {', '.join('.'.join([*walked, n]) for n in near)}?" if near else \
                    f"; {where} has: {', '.join(names)}" if names else ""
                raise ConfigError(f"override {item!r}: {where} has no field {key!r}{hint}")
            node = node[key]
            walked.append(key)


def _fix_hint(err: Dict[str, Any]) -> str:
    """The fix for a SpecForge validation error, in words."""
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "; remove it (SpecForge's config is strict: PR settings go under pr:, the engine under backend:)"
    for bound, words in (("gt", "greater than"), ("ge", "at least"), ("lt", "less than"), ("le", "at most")):
        if bound in ctx:
            return f"; set it to a value {words} {ctx[bound]}"
    if kind == "literal_error" and "expected" in ctx:
        return f"; use one of {ctx['expected']}"
    if kind == "missing":
        return "; add it to the recipe"
    return ""


def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_train(recipe_path: str, overrides: Sequence[str], dry_run: bool = False, start_over: bool = False) -> int:
    recipe = load_recipe(recipe_path, overrides)
    preflight(recipe)
    if dry_run:
        return 0
    recipe, overrides = _resume_by_default(recipe, recipe_path, list(overrides), start_over)
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
        return _self_launch(cmd, cfg.output_dir)
    return _run_worker(recipe)


#: set in the ranks `pr-specforge train` launches itself: an interrupted rank exits quietly, the launcher reports.
SELF_LAUNCHED_ENV = "PR_SPECFORGE_SELF_LAUNCHED"


class TrainingInterrupted(Exception):
    """Ctrl-C: the message says what was kept and how to resume."""


def interrupted_message(output_dir: str) -> str:
    from pr_specforge.preflight import run_checkpoints

    latest = run_checkpoints(output_dir)
    if latest is None:
        return (f"interrupted before the first checkpoint; {output_dir} holds none (training.save_interval sets how "
                "often one is written); rerun the same command to train from step 0")
    return (f"interrupted; checkpoints kept in {output_dir} (newest: {os.path.basename(latest)}); "
            "rerun the same command to resume from it")


def _self_launch(cmd: List[str], output_dir: str) -> int:
    """torchrun in its own session: Ctrl-C reaches this process only, which interrupts the ranks
    (they stop quietly) and reports in one line, instead of torchrun's and every rank's tracebacks."""
    import signal

    proc = subprocess.Popen(cmd, env={**os.environ, SELF_LAUNCHED_ENV: "1"}, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        for pid in _children(proc.pid):
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        while True:
            try:
                proc.wait()
                break
            except KeyboardInterrupt:
                continue
        raise TrainingInterrupted(interrupted_message(output_dir)) from None


def _children(pid: int) -> List[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _resume_by_default(recipe: Recipe, recipe_path: str, overrides: List[str], start_over: bool):
    """A run directory holding checkpoints is resumed unless the user said `--start-over` (which discards them)."""
    from pr_specforge.preflight import resume_or_start_over

    cfg = recipe.config
    if start_over and int(os.environ.get("RANK", "0")) != 0:
        return recipe, overrides  # rank 0 discards the old checkpoints; no rank resumes
    resume = resume_or_start_over(cfg.output_dir, cfg.training.resume_from, start_over)
    if start_over:
        log.info("--start-over: discarded the checkpoints and metrics in %s; training from step 0", cfg.output_dir)
    if resume is None or resume == cfg.training.resume_from:
        return recipe, overrides
    log.info("%s holds checkpoints: resuming from the newest (pass --start-over to discard them and train from step 0)",
             cfg.output_dir)
    overrides = [*overrides, f"training.resume_from={resume}"]
    return load_recipe(recipe_path, overrides), overrides


def _first_feature_file(root: str) -> Optional[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".ckpt", ".ckpt.gz")):
                return os.path.join(dirpath, name)
    return None


def preflight(recipe: Recipe) -> None:
    """Cheap checks that turn deep trainer failures into errors naming the file and field."""
    import json

    from pr_specforge.modeling.drafter import EAGLE3_ARCHITECTURE, PR_ARCHITECTURE

    cfg = recipe.config
    draft_path = cfg.model.draft_model_config
    draft = None
    if draft_path:
        if not os.path.isfile(draft_path):
            raise ConfigError(f"model.draft_model_config: {draft_path!r} does not exist")
        with open(draft_path) as f:
            try:
                draft = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"model.draft_model_config: {draft_path} is not valid JSON ({e})") from None
        arch = (draft.get("architectures") or [None])[0]
        if cfg.training.strategy in ("pr", "eagle3") and arch not in (EAGLE3_ARCHITECTURE, PR_ARCHITECTURE):
            raise ConfigError(
                f"model.draft_model_config: {draft_path} has architectures[0]={arch!r}, which is not an EAGLE-3 "
                f"drafter; the {cfg.training.strategy} strategy needs {EAGLE3_ARCHITECTURE!r}"
            )
    from pr_specforge.preflight import check_target, check_vocab_map

    check_target(cfg.model.target_model_path)
    if recipe.online is not None:
        from pr_specforge.online import check_inputs

        check_inputs(recipe.online)  # the online run builds its own vocab map
    else:
        check_vocab_map(cfg.model.vocab_mapping_path, draft, cfg.data.hidden_states_path)
    for field in ("hidden_states_path", "eval_hidden_states_path"):
        if field == "hidden_states_path" and recipe.online is not None:
            continue
        sample = check_feature_dir(f"data.{field}", getattr(cfg.data, field), draft, draft_path)
        if (field == "eval_hidden_states_path" and sample is not None and cfg.training.strategy == "eagle3"
                and str(cfg.model.torch_dtype) == "float32" and str(sample["hidden_state"].dtype) != "torch.float32"):
            # SpecForge 0.2.0's eval loop feeds stored features to the drafter uncast; the failure would
            # come as a dtype error deep in torch at the first eval step, hours into training.
            raise ConfigError(
                f"data.eval_hidden_states_path: features are {sample['hidden_state'].dtype} but model.torch_dtype is "
                "float32, and SpecForge's eagle3 eval loop does not cast them; set model.torch_dtype=bfloat16 "
                "or train without held-out eval"
            )


def _check_manifest_status(field: str, feats: str) -> None:
    import json

    path = os.path.join(feats, "manifest.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            status = json.load(f).get("status", "complete")
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{field}: {path} is not valid JSON ({e})") from None
    if status != "complete":
        raise ConfigError(f"{field}: {path} has status {status!r}: the `pr-specforge data hidden-states` run writing "
                          f"{feats} did not finish; rerun the same command to complete it")


def check_feature_dir(field: str, feats: Optional[str], draft: Optional[dict], draft_path: Optional[str]):
    """The first feature file under `feats`, checked against the draft config; None when unset."""
    if not feats:
        return None
    if not os.path.isdir(feats):
        raise ConfigError(f"{field}: {feats!r} is not a directory (prepare features first)")
    first = _first_feature_file(feats)
    if first is None:
        raise ConfigError(f"{field}: no .ckpt feature files under {feats}")
    _check_manifest_status(field, feats)
    import torch

    from pr_specforge.data.io import brief

    try:
        sample = torch.load(first, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, pickled objects
        raise ConfigError(f"feature file {first}: does not load ({brief(e)}); "
                          f"delete it and rerun the `pr-specforge data hidden-states` command that wrote {feats}") from None
    if not isinstance(sample, dict):
        raise ConfigError(f"feature file {first}: holds a {type(sample).__name__}, not a SpecForge EAGLE-3 feature dict")
    missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in sample]
    if missing:
        raise ConfigError(f"feature file {first}: missing key(s) {missing}; not a SpecForge EAGLE-3 feature file")
    if draft is not None:
        target_hidden = int(draft.get("target_hidden_size") or draft.get("hidden_size"))
        width = int(sample["aux_hidden_state"].shape[-1])
        if width != 3 * target_hidden:
            raise ConfigError(
                f"feature file {first}: aux_hidden_state width {width} != 3 x target_hidden_size "
                f"({target_hidden}) of {draft_path}; the features come from a different target"
            )
    return sample


def _run_worker(recipe: Recipe) -> int:
    from pr_specforge.integration import ALGORITHM_NAME, build_registry
    from pr_specforge._specforge import bind_run, resolve_run
    from pr_specforge._specforge import train_resolved_run as _train

    cfg = recipe.config
    if cfg.training.strategy != ALGORITHM_NAME:
        # eagle3 baselines run through the same entry point, with the same registry.
        log.info("training.strategy=%s (not pr): running SpecForge's own algorithm", cfg.training.strategy)
    cfg, registry = run_config(recipe)
    resolved = resolve_run(cfg, registry)
    os.makedirs(cfg.output_dir, exist_ok=True)
    _write_resolved_recipe(recipe)
    install_training_runtime(recipe)
    interrupted: List[bool] = []
    with _watch_sigint(interrupted):
        try:
            _train(bind_run(resolved.config, resolved.algorithm))  # returns the final step count, not a status
        except BaseException:
            # After Ctrl-C a rank may fail with its peer's closed connection rather than KeyboardInterrupt.
            if not interrupted:
                raise
            if os.environ.get(SELF_LAUNCHED_ENV) == "1":
                return 0  # the launcher reports, once
            raise TrainingInterrupted(interrupted_message(cfg.output_dir)) from None
    return 0


def run_config(recipe: Recipe):
    """`(SpecForge config, registry)` a run trains with: `pr` registered, and for `data.online`
    the vocab map, the online step and the conversation reader (`pr_specforge.online`)."""
    from pr_specforge.integration import build_registry

    registry = build_registry(recipe.pr)
    if recipe.online is None:
        return recipe.config, registry
    from pr_specforge.online import prepare_online_run

    return prepare_online_run(recipe.config, recipe.online, registry)


@contextlib.contextmanager
def assembled_run(recipe: Recipe):
    """SpecForge's assembled trainer for `recipe` in this process (one rank), never fitted:
    yields `(strategy, loader)` for tests and benchmarks that drive steps themselves."""
    from pr_specforge import _specforge as sf

    sf.install_cpu_loss()
    cfg, registry = run_config(recipe)
    resolved = sf.resolve_run(cfg, registry)
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding  # as SpecForge's CLI does: the backend reads it
    sf.bootstrap_single_process_env()
    sf.init_distributed(timeout=cfg.training.dist_timeout)
    try:
        trainer = sf.build_training_run(resolved.config, algorithm=resolved.algorithm).trainer
        yield sf.trainer_strategy(trainer), sf.trainer_loader(trainer)
    finally:
        sf.destroy_distributed()


@contextlib.contextmanager
def _watch_sigint(seen: List[bool]):
    """Append to `seen` when SIGINT arrives (which still raises KeyboardInterrupt); restore the handler after."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        seen.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def install_training_runtime(recipe: Recipe) -> None:
    """Every runtime patch training needs, in one place (nothing is patched at import time):
    SpecForge's loss on CPU, recipe-carrying atomic checkpoints, the metrics JSONL sink, and
    the chosen backend."""
    from pr_specforge._specforge import install_cpu_loss, install_feature_file_errors
    from pr_specforge.backends.checkpoint import install_checkpoint_manager
    from pr_specforge.telemetry import install_metrics_sink

    install_cpu_loss()
    install_feature_file_errors()
    install_checkpoint_manager(resolved_payload(recipe))
    install_metrics_sink()
    if recipe.backend.name == "deepspeed":
        from pr_specforge.backends.deepspeed import install_deepspeed_backend

        install_deepspeed_backend(recipe.backend, recipe.config)


def resolved_payload(recipe: Recipe) -> Dict[str, Any]:
    """The resolved recipe: SpecForge's config dump plus the `pr:` and `backend:` sections."""
    payload = recipe.config.model_dump(mode="json")
    if recipe.config.training.strategy == "pr":  # a `pr:` section on another strategy is refused on reload
        payload[PR_SECTION] = recipe.pr.to_dict()
    payload[BACKEND_SECTION] = recipe.backend.to_dict()
    if recipe.online is not None:  # the user's form: conversations + data.online, not the JSONL as "features"
        payload["data"].update(recipe.online.to_recipe())
    return payload


def _write_resolved_recipe(recipe: Recipe) -> None:
    """Store the resolved recipe (SpecForge config dump + pr section) in the output dir, atomically."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    payload = resolved_payload(recipe)
    from pr_specforge.data.io import atomic_write_text

    atomic_write_text(os.path.join(recipe.config.output_dir, "resolved_recipe.yaml"),
                      yaml.safe_dump(payload, sort_keys=False))
