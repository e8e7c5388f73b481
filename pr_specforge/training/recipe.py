"""Recipe loading: SpecForge's strict config plus the strict `pr:` and `backend:` sections.

    extends: _base/paper.yaml        # optional: deep-merge this recipe over another (relative path), or a list
    model: {...}  data: {...}  training: {...}     # SpecForge's `Config` (strict)
    pr: {...}                        # `pr_specforge.config.PRConfig` (strict)
    backend: {name: deepspeed, config: ...}        # `training.backends.config.BackendConfig`

Owns: reading a recipe and its `extends:` chain, dotted overrides for every section
(`section.field=value`, `pr.field=value`, `backend.field=value`), `model.torch_dtype: auto`,
SpecForge's validation errors in one line each with the fix, and `resolved_payload` (the
resolved recipe a run stores beside its checkpoints and inside each one).

Also owns the online keys of `data:` (`data.online`, `data.online_dtype`: stripped before
SpecForge's strict config, `OnlineSettings`), so every section of a recipe is read here.

Does not own: the meaning of the `pr:` fields (`pr_specforge.config`), of `backend:`
(`training.backends.config`), or the online runtime (`training.online`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from pr_specforge.config import PR_ATTENTION_BACKEND, ConfigError, PRConfig, check_attention_backend
from pr_specforge.training.backends.config import BACKEND_SECTION, BackendConfig

PR_SECTION = "pr"
#: `extends: other.yaml` (relative to the recipe's directory) deep-merges this recipe over that one;
#: `extends: [a.yaml, b.yaml]` merges b over a, then this recipe over both.
EXTENDS_KEY = "extends"


@dataclass
class Recipe:
    """A resolved recipe: SpecForge's `Config`, PR settings and the raw mapping they came from."""

    config: Any  # specforge.config.Config
    pr: PRConfig
    raw: Dict[str, Any]
    path: str
    backend: BackendConfig = BackendConfig()
    online: Any = None  # OnlineSettings when data.online is true


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


# ------------------------------------------------------------------ data.online (ours, beside SpecForge's data:)
ONLINE_KEY, DTYPE_KEY = "online", "online_dtype"
DTYPES = ("bfloat16", "float32", "float16")
#: the strategies an online run supports (`training.online` has a step for each)
ONLINE_STRATEGIES = ("eagle3", "pr")


@dataclass(frozen=True)
class OnlineSettings:
    """What each rank needs to turn a conversation into EAGLE-3 features."""

    conversations: str
    target_path: str
    chat_template: str
    max_length: int
    dtype: str = "bfloat16"
    aux_layers: Optional[Tuple[int, ...]] = None  # resolved at run time (draft config / target depth)

    def to_recipe(self) -> Dict[str, Any]:
        """The `data:` keys a resolved recipe stores for this run (its user-facing form)."""
        return {ONLINE_KEY: True, DTYPE_KEY: self.dtype, "train_data_path": self.conversations, "hidden_states_path": ""}


def pop_online_keys(raw: Dict[str, Any], overrides, where: str) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any], list]:
    """Strip `data.online` / `data.online_dtype` from the recipe mapping and the dotted overrides.

    For an online run, SpecForge (whose strict config refuses colocated online runs) is handed
    its colocated offline form: the conversations file moves from `data.train_data_path` to
    `data.hidden_states_path`. Returns `(online request or None, recipe, SpecForge overrides)`.
    """
    data = dict(raw.get("data") or {})
    keys = {k: data.pop(k) for k in (ONLINE_KEY, DTYPE_KEY) if k in data}
    rest = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("data.") and key[5:] in (ONLINE_KEY, DTYPE_KEY, "train_data_path", "hidden_states_path"):
            data[key[5:]] = _parse_value(value) if key[5:] in (ONLINE_KEY, DTYPE_KEY) else value
        else:
            rest.append(item)
    keys.update({k: data.pop(k) for k in (ONLINE_KEY, DTYPE_KEY) if k in data})
    online, dtype = keys.get(ONLINE_KEY, False), keys.get(DTYPE_KEY, "bfloat16")
    if not isinstance(online, bool):
        raise ConfigError(f"{where}: data.online: expected true or false, got {online!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: data.online_dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    if not online and DTYPE_KEY in keys:
        raise ConfigError(f"{where}: data.online_dtype is set but data.online is not; set data.online=true or drop it")
    request = None
    if online:
        if not data.get("train_data_path") or data.get("hidden_states_path"):
            raise ConfigError(f"{where}: data.online=true reads conversations from data.train_data_path; set it "
                              "(a conversation JSONL) and leave data.hidden_states_path unset")
        request = {"conversations": os.path.abspath(data.pop("train_data_path")), "dtype": dtype}
        data["hidden_states_path"] = request["conversations"]
    return request, dict(raw, data=data), rest


def online_settings(config, request: Optional[Dict[str, Any]], where: str) -> Optional[OnlineSettings]:
    """The run's `OnlineSettings` (None for an offline run)."""
    if request is None:
        return None
    if config.training.strategy not in ONLINE_STRATEGIES:
        raise ConfigError(f"{where}: data.online=true supports training.strategy in {list(ONLINE_STRATEGIES)}, "
                          f"got {config.training.strategy!r}")
    data = config.data
    return OnlineSettings(conversations=request["conversations"], target_path=config.model.target_model_path,
                          chat_template=data.chat_template, max_length=data.max_length, dtype=request["dtype"])


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


#: (section, key) of file paths a recipe may give relative to its own directory (one rule for all of them)
RECIPE_RELATIVE_PATHS = (("model", "draft_model_config"), (BACKEND_SECTION, "config"))


def _resolve_recipe_paths(raw: Dict[str, Any], recipe_dir: str) -> None:
    """A relative path a recipe file gives (`RECIPE_RELATIVE_PATHS`) is read from the recipe's own
    directory when it exists there, else as given (SpecForge's rule: the working directory), so the
    packaged recipes work from any working directory and users' cwd-relative recipes keep working."""
    for section, key in RECIPE_RELATIVE_PATHS:
        mapping = raw.get(section)
        value = mapping.get(key) if isinstance(mapping, dict) else None
        if not isinstance(value, str) or not value or os.path.isabs(value):
            continue
        candidate = os.path.normpath(os.path.join(recipe_dir or ".", value))
        if os.path.exists(candidate):
            mapping[key] = os.path.abspath(candidate)


def yaml_problem(error: Exception) -> str:
    """A YAML parse error in one line: `line L, column C: problem`."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(error, "problem", None) or error).strip().split("\n")[0]


def read_recipe_mapping(path: str, _chain: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The recipe's raw mapping with its `extends:` chain resolved (later files win, mappings merge)."""
    if not os.path.isfile(path):
        where = f" (extended by {_chain[-1]})" if _chain else ""
        what = "is a directory; name a recipe YAML file" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"recipe {path!r} {what}{where}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path}: not valid YAML ({yaml_problem(e)})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"recipe {path}: not a text file (not valid YAML)") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path}: expected a mapping at the top level")
    _resolve_recipe_paths(raw, os.path.dirname(path))
    bases = raw.pop(EXTENDS_KEY, None)
    if bases is None:
        return raw
    if isinstance(bases, str):
        bases = [bases]
    if not bases or not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"recipe {path}: {EXTENDS_KEY} must be a recipe path or a list of them (relative to "
                          f"{os.path.dirname(path) or '.'}), got {bases!r}")
    chain, merged = _chain + (os.path.abspath(path),), {}
    for base in bases:  # in order: a later base wins over an earlier one, the extending file over all
        base_path = os.path.normpath(base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base))
        if os.path.abspath(base_path) in chain:
            raise ConfigError(f"recipe {path}: {EXTENDS_KEY} cycle through {base_path}; a recipe cannot extend itself")
        merged = _deep_merge(merged, read_recipe_mapping(base_path, chain))
    return _deep_merge(merged, raw)


def recipe_pr_config(raw: Dict[str, Any], pr_over: Dict[str, Any], path: str) -> PRConfig:
    """The recipe's `pr:` section with its dotted `pr.` overrides, checked: a `pr:` that is no mapping (a list, a
    number) is one line naming the recipe."""
    section = raw.get(PR_SECTION)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"recipe {path}: pr: expected a mapping of PR settings (FIELD: VALUE), "
                          f"got {type(section).__name__} {section!r}")
    return PRConfig.from_mapping({**(section or {}), **pr_over}, where=f"{path}: pr")


#: the data sources SpecForge's schema wants exactly one of
DATA_SOURCES = ("hidden_states_path", "train_data_path", "prompts_path")


def _stand_ins(raw: Dict[str, Any]) -> Dict[str, Any]:
    """`raw` with what SpecForge's schema requires of a runnable recipe (a target, a data source) stood in for where
    it is unset, so a recipe part (an `extends:` base, a control recipe) is checked as strictly as a whole one."""
    model, data = raw.get("model"), raw.get("data")
    stand_in: Dict[str, Any] = {}
    if model is None or (isinstance(model, dict) and "target_model_path" not in model):
        stand_in["model"] = {"target_model_path": "unset"}
    if data is None or (isinstance(data, dict) and not any(data.get(k) for k in DATA_SOURCES)):
        stand_in["data"] = {"hidden_states_path": "unset"}
    return _deep_merge(stand_in, raw)


def _check_sections(raw: Dict[str, Any], path: str) -> None:
    """Each section of SpecForge's config a recipe gives (`model:`, `training:`, ...) is a mapping: one line naming
    it (SpecForge's own validators fail with a TypeError on `training: 5`)."""
    from pydantic import BaseModel

    from pr_specforge._specforge import Config

    for key, field in Config.model_fields.items():
        value = raw.get(key)
        section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        if section and value is not None and not isinstance(value, dict):
            raise ConfigError(f"recipe {path}: {key}: expected a mapping of fields (FIELD: VALUE), "
                              f"got {type(value).__name__} {value!r}")


def load_recipe(path: str, overrides: Sequence[str] = (), part: bool = False) -> Recipe:
    """Read a recipe YAML/JSON; validate SpecForge's part, the `pr:` and `backend:` parts strictly. `part`: a recipe
    that need not be runnable alone (`recipes/_base/*.yaml`, what `control` reads): every key it has is checked as
    strictly, and the target and data source SpecForge requires may be unset (`_stand_ins`)."""
    raw = read_recipe_mapping(path)
    _check_sections(raw, path)
    if part:
        raw = _stand_ins(raw)
    spec_over, pr_over = split_overrides(overrides)
    online_request, raw, spec_over = pop_online_keys(raw, spec_over, path)
    pr = recipe_pr_config(raw, pr_over, path)
    backend_raw = raw.get(BACKEND_SECTION)
    backend_over = _backend_overrides(overrides)
    if backend_over:
        backend_raw = {**(backend_raw or {}), **backend_over}
    backend = BackendConfig.from_mapping(backend_raw, where=f"{path}: {BACKEND_SECTION}")
    spec_raw = {k: v for k, v in raw.items() if k not in (PR_SECTION, BACKEND_SECTION)}
    spec_raw, spec_over = _resolve_auto_dtype(spec_raw, spec_over)
    config = _specforge_config(spec_raw, spec_over, path)
    _check_finite(config.model_dump(), f"recipe {path}")
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
    """`model.torch_dtype: auto` (recipe or override) -> the drafter's dtype (`dtypes.resolve_dtype`: bf16 on CUDA or on a
    CPU with native bf16, else float32; the offline head follows it, `training.target_head`)."""
    from pr_specforge.dtypes import resolve_dtype

    device = "cpu"
    if (spec_raw.get("model") or {}).get("torch_dtype") == "auto" or "model.torch_dtype=auto" in overrides:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype("auto", device)
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


def _check_finite(node: Any, where: str, dotted: str = "") -> None:
    """Every number of SpecForge's config is finite (pydantic accepts `.nan` and `.inf` for a float)."""
    import math

    if isinstance(node, dict):
        for key, value in node.items():
            _check_finite(value, where, f"{dotted}.{key}" if dotted else str(key))
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{where}: {dotted}: expected a finite number, got {node!r}")


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


def resolved_payload(recipe: Recipe) -> Dict[str, Any]:
    """The resolved recipe: SpecForge's config dump plus the `pr:` and `backend:` sections."""
    payload = recipe.config.model_dump(mode="json")
    if recipe.config.training.strategy == "pr":  # a `pr:` section on another strategy is refused on reload
        payload[PR_SECTION] = recipe.pr.to_dict()
    payload[BACKEND_SECTION] = recipe.backend.to_dict()
    if recipe.online is not None:  # the user's form: conversations + data.online, not the JSONL as "features"
        payload["data"].update(recipe.online.to_recipe())
    return payload
