"""`pr-specforge export`: a SpecForge training checkpoint -> an SGLang or HF drafter directory.

    pr-specforge export work/smollm2/runs/pr/specforge-run-step1536 work/smollm2/draft-sglang --to sglang
    pr-specforge export CKPT OUT --to hf --target work/smollm2/target   # reloads via load_drafter

Owns: reading a `pr` or `eagle3` checkpoint (and the recipe stored in it, to find
the draft config, vocab mapping and target), checking EVERY expected tensor name,
shape and the vocab mapping before anything is written (`core.export_format`, which
the serving side checks an export by too), and writing the output directory atomically
(a temp dir renamed into place).

* `--to sglang`: `config.json` with `architectures: [LlamaForCausalLMEagle3]`,
  `draft_vocab_size`, `target_hidden_size`, `eagle_config` (captured layer ids)
  and the PR settings under `pr_config`; `model.safetensors` with the EAGLE-3
  tensors under SpecForge's names (which are SGLang's: `midlayer.*`, `fc`,
  `norm`, `lm_head`, `d2t`, `t2d`) plus the PR tensors under `pr_self_query.*` /
  `pr_halt_gate.*`, names SGLang's `load_weights` skips (no `model.` parameter
  of that name; none of its rename substrings). Stock SGLang thus serves the
  export as plain EAGLE-3.
* `--to hf`: the full PR drafter (`architectures: [LlamaForCausalLMEagle3PR]`)
  that `pr_specforge.modeling.load_drafter` reloads; with `--target` the frozen
  embedding is copied from the target so the directory is self-contained.
* `--to vllm`: `pr_specforge.export_vllm` (the speculators format stock vLLM serves as a chain), which owns
  the `pr-specforge export` entry point and hands `--to sglang|hf` to `main` here.

Both record what they hold: the dtype of the tensors written (`torch_dtype` / `dtype`), the target by name and
fingerprint (`target_record`, under `pr_specforge_target`: never a machine's path, so an export's fingerprint,
`export_fingerprints`, does not depend on where it was made), and the settings of the run it came from that
`diagnose` / `headroom` rebuild its objective with (`run_record`, under `pr_specforge_run`: TTT length, sequence
length, batch size, attention backend, compute dtype, the `pr` section, and the checkpoint it was made from by
name and content hash), so both give the run's numbers on its export with default flags, and a stage that exports a
run knows whether an export is of its newest checkpoint (`export_is_of`).

Does not own: the serving-time PR tree (SGLang needs new code for that; see
docs/export.md) or SpecForge's own `specforge export` (which refuses `pr`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from pr_specforge.config import PR_SERVING_DEFAULT_M, PR_SERVING_KEY
from pr_specforge.data.hidden_states import TARGET_RECORD_KEY
# what an export holds, checked the same way on the serving side (no SpecForge there): re-exported here
from pr_specforge.core.export_format import (  # noqa: F401
    CONTEXT_KEYS,
    SAFETENSORS_NAME,
    ExportError,
    check_weights,
    declared_context,
    is_embedding as _is_embedding,
    target_context,
)
from pr_specforge.data.io import DataFormatError, honour_umask_tree, read_json_file
from pr_specforge.training.backends.checkpoint import RECIPE_STATE_KEY  # the resolved recipe inside a checkpoint
from pr_specforge.training.backends.checkpoint import TARGET_STATE_KEY  # the target it trained on, by content
from pr_specforge.modeling.drafter import (
    EAGLE3_ARCHITECTURE,
    PR_ARCHITECTURE,
    PR_CONFIG_KEY,
    PR_PARAM_PREFIXES,
)
from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE
from pr_specforge.export_records import (  # noqa: F401 (re-exported: where an export came from, its fingerprints)
    PROVENANCE_KEYS,
    RUN_RECORD_KEY,
    checkpoint_record,
    export_fingerprints,
    export_is_of,
    matches_export,
    run_record,
)

log = logging.getLogger(__name__)

SUPPORTED_STRATEGIES = ("pr", "eagle3")
#: the architecture of an `--to vllm` export (pr_specforge.export_vllm: the speculators format)
SPECULATOR_ARCHITECTURE = "Eagle3Speculator"

#: substrings SGLang's `LlamaForCausalLMEagle3.load_weights` acts on (swallowed or renamed);
#: a PR tensor whose name contains one would be misrouted instead of skipped.
SGLANG_NAME_TRAPS = ("d2t", "t2d", "midlayer", "aux_norm_low", "aux_norm_mid", "aux_norm_high",
                     ".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")
#: top-level module names of SGLang's EAGLE-3 model (a PR tensor under them would collide).
SGLANG_MODULES = ("model.", "lm_head.", "fc.", "fc_norm.", "norm.", "layers.", "embed_tokens.")


# ----------------------------------------------------------------------------- inputs
def read_checkpoint(path: str) -> Dict[str, Any]:
    """The shared training state of a checkpoint dir, its `training_state.pt`, or a run dir (latest)."""
    from pr_specforge._specforge import resolve_training_state

    try:
        return resolve_training_state(path)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"{path}: {e}") from None
    except Exception as e:  # truncated or not a torch file: torch's error does not name it
        from pr_specforge.data.io import brief

        raise ExportError(f"{path}: the training state does not load ({brief(e)}); it is damaged, use an "
                          "earlier checkpoint (the run directory holds one per training.save_interval)") from None


def stored_recipe(state: Dict[str, Any], checkpoint: str) -> Optional[Dict[str, Any]]:
    """The resolved recipe saved with the checkpoint, else the run's `resolved_recipe.yaml`."""
    recipe = state.get(RECIPE_STATE_KEY)
    if isinstance(recipe, dict):
        return recipe
    import yaml

    ckpt_dir = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    run_dir = os.path.dirname(os.path.abspath(ckpt_dir))
    for cand in (os.path.join(ckpt_dir, "resolved_recipe.yaml"), os.path.join(run_dir, "resolved_recipe.yaml")):
        if os.path.isfile(cand):
            with open(cand) as f:
                return yaml.safe_load(f)
    return None


def _provenance_draft_config(state: Dict[str, Any]) -> Optional[str]:
    prov = dict(state.get("specforge_model_provenance") or ())
    entry = prov.get("draft_config")
    if isinstance(entry, tuple) and len(entry) >= 2 and isinstance(entry[1], str):
        return entry[1]
    return None


def _pick(what: str, given: Optional[str], candidates: Sequence[Tuple[str, Optional[str]]], flag: str) -> str:
    if given:
        if not os.path.exists(given):
            raise ExportError(f"{flag} {given!r} does not exist")
        return given
    tried = []
    for source, path in candidates:
        if path:
            if os.path.exists(path):
                log.info("%s: %s (from %s)", what, path, source)
                return path
            tried.append(f"{source}: {path} (missing)")
    raise ExportError(f"cannot find the {what}: {'; '.join(tried) or 'the checkpoint records none'}; pass {flag}")


def _load_vocab_mapping(path: str) -> Dict[str, torch.Tensor]:
    from pr_specforge.data.vocab import read_vocab_mapping

    try:
        mapping = read_vocab_mapping(path)
    except ValueError as e:
        raise ExportError(f"{e}; a vocab mapping is a dict with 't2d' and 'd2t' tensors") from None
    return {"t2d": mapping["t2d"], "d2t": mapping["d2t"]}


# --------------------------------------------------------------------------- the model
def build_drafter_skeleton(draft_config: Dict[str, Any], strategy: str, pr_settings: Optional[Dict[str, Any]]):
    """The (randomly initialised) drafter whose parameter set the checkpoint must fill."""
    from transformers import LlamaConfig

    from pr_specforge._specforge import LlamaForCausalLMEagle3
    from pr_specforge.config import PRConfig
    from pr_specforge.modeling.drafter import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
    from pr_specforge.modeling.two_layer import LlamaForCausalLMEagle3TwoLayer

    cfg = LlamaConfig.from_dict({k: v for k, v in draft_config.items() if k != PR_CONFIG_KEY})
    if strategy == "eagle3":
        if (draft_config.get("architectures") or [None])[0] == TWO_LAYER_ARCHITECTURE:
            return LlamaForCausalLMEagle3TwoLayer(cfg).float()
        return LlamaForCausalLMEagle3(cfg).float()
    if pr_settings is not None:
        settings = PRConfig.from_mapping(pr_settings, where="checkpoint pr_settings").draft_settings()
    else:
        settings = PRDraftSettings(**(draft_config.get(PR_CONFIG_KEY) or {}))
    return LlamaForCausalLMEagle3PR(build_pr_config(cfg, settings)).float()


def resolve_capture_layers(draft_config: Dict[str, Any], recipe: Optional[Dict[str, Any]], target_dir: Optional[str]) -> Optional[List[int]]:
    """Captured target layers (SpecForge's order: run override, draft config, target default)."""
    from pr_specforge._specforge import eagle_capture_layers

    override = ((recipe or {}).get("model") or {}).get("aux_hidden_state_layer_ids")
    given = override is not None or (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None
    target_config = None
    if not given:
        if not (target_dir and os.path.isfile(os.path.join(target_dir, "config.json"))):
            return None
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(target_dir)
    return [int(x) for x in eagle_capture_layers(draft_config, target_config, override)]


def fit_context(cfg: Dict[str, Any], context: Optional[int]) -> None:
    """SGLang serves a drafter only if its config's context is at least the target's (else a ValueError at
    start-up); positions past the drafter's trained length change nothing in its default rope, and SGLang's
    own override (`SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`) writes the same field, so the export does."""
    own = declared_context(cfg)
    if context is None:
        log.warning("no target found: the SGLang config keeps the draft config's context length %s; SGLang refuses "
                    "a target with a longer one (pass --target)", own)
    elif own is None or own < context:
        cfg["max_position_embeddings"] = context
        for key in CONTEXT_KEYS[:-1]:
            cfg.pop(key, None)
        if declared_context(cfg) < context:  # a rope factor below 1
            raise ExportError(f"the draft config's rope scaling {cfg.get('rope_scaling')} leaves its context below the target's {context}")
        log.info("SGLang config: max_position_embeddings %s -> %s (the target's context length)", own, context)


def serving_entry(bw: Optional[int], m: Optional[int]) -> Dict[str, int]:
    """The export's `pr_serving` entry: m (default the paper's 3) and B_w when given (else the launch's k)."""
    entry = {"m": PR_SERVING_DEFAULT_M if m is None else int(m)}
    if bw is not None:
        entry["bw"] = int(bw)
    if entry.get("bw", 1) < 1 or entry["m"] < 0:
        raise ExportError(f"--bw must be >= 1 and --m >= 0, got --bw {bw} --m {m}")
    return entry


def sglang_config(draft_config: Dict[str, Any], model, capture_layers: Optional[List[int]], dtype: torch.dtype,
                  context: Optional[int] = None, serving: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    cfg = {k: v for k, v in draft_config.items() if k != PR_CONFIG_KEY}
    fit_context(cfg, context)
    cfg.update(architectures=[EAGLE3_ARCHITECTURE], model_type="llama", num_hidden_layers=1,
               torch_dtype=str(dtype).replace("torch.", ""))
    cfg["draft_vocab_size"] = int(draft_config.get("draft_vocab_size") or draft_config["vocab_size"])
    cfg["target_hidden_size"] = int(draft_config.get("target_hidden_size") or draft_config["hidden_size"])
    if capture_layers is not None:
        cfg["eagle_config"] = {**(draft_config.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": capture_layers}
    settings = getattr(model, "pr_settings", None)
    if settings is not None:
        cfg[PR_CONFIG_KEY] = settings.to_dict()
        cfg[PR_SERVING_KEY] = dict(serving or serving_entry(None, None))
    # SGLang's `norm_output: true`: the next draft step reads the normed feature, i.e. post-norm feedback.
    # SpecForge's key of that name says whether logits are normed (true, its default, is what SGLang
    # always does): written only when true for both, so either reader loads the drafter as trained.
    if settings is not None and settings.post_norm_feedback:
        cfg["norm_output"] = True
    elif cfg.get("norm_output"):
        del cfg["norm_output"]
    return cfg


def check_sglang_names(names: Sequence[str]) -> None:
    """PR tensors must be skipped by SGLang's loader, never misrouted into an EAGLE-3 parameter."""
    bad = [n for n in names if n.startswith(PR_PARAM_PREFIXES) and (any(t in n for t in SGLANG_NAME_TRAPS) or n.startswith(SGLANG_MODULES))]
    if bad:
        raise ExportError(f"PR tensor names SGLang's EAGLE-3 loader would misroute: {bad}; keep PR tensors under {PR_PARAM_PREFIXES} without {SGLANG_NAME_TRAPS}")


# ------------------------------------------------------------------------------ export
def export_checkpoint(checkpoint: str, out_dir: str, to: str, *, draft_config: Optional[str] = None,
                      vocab_mapping: Optional[str] = None, target: Optional[str] = None,
                      dtype: Optional[str] = None, overwrite: bool = False, bw: Optional[int] = None,
                      m: Optional[int] = None) -> str:
    """Check the checkpoint against its draft config, then write `out_dir` atomically; returns it. `bw` / `m`: the
    `pr_serving` entry of a PR drafter's SGLang config (what `PR_EAGLE3` serves by default)."""
    if to not in ("sglang", "hf"):
        raise ExportError(f"--to must be sglang or hf, got {to!r}")
    serving = serving_entry(bw, m)
    if to != "sglang" and (bw is not None or m is not None):
        raise ExportError("--bw / --m are PR_EAGLE3's serving defaults: they go with --to sglang")
    check_out_dir(out_dir, overwrite)
    check_target(target)
    state = read_checkpoint(checkpoint)
    strategy = state.get("strategy")
    if strategy not in SUPPORTED_STRATEGIES:
        raise ExportError(f"{checkpoint}: written by strategy {strategy!r}; this exporter handles {SUPPORTED_STRATEGIES}")
    recipe = stored_recipe(state, checkpoint)
    model_section = (recipe or {}).get("model") or {}
    cfg_path = _pick("draft config", draft_config, [("stored recipe", model_section.get("draft_model_config")),
                                                     ("checkpoint provenance", _provenance_draft_config(state))], "--draft-config")
    try:
        draft_cfg = read_json_file(cfg_path)
    except DataFormatError as e:
        raise ExportError(f"draft config {e}") from None
    if target is None and model_section.get("target_model_path") and os.path.isdir(model_section["target_model_path"]):
        target = model_section["target_model_path"]
    check_trained_target(state, target)
    weights = {k: v for k, v in state["draft_state_dict"].items() if not _is_embedding(k)}
    mapping_path = vocab_mapping or (None if {"t2d", "d2t"} <= set(weights) else model_section.get("vocab_mapping_path"))
    if mapping_path:
        if not os.path.isfile(mapping_path):
            raise ExportError(f"vocab mapping {mapping_path!r} does not exist; pass --vocab-mapping")
        mapping = _load_vocab_mapping(mapping_path)
        for key, value in mapping.items():
            if key in weights and not torch.equal(weights[key].to(value.dtype), value):
                raise ExportError(f"{mapping_path}: {key} disagrees with the checkpoint's {key}; the mapping belongs to another run")
            weights[key] = value
    elif not {"t2d", "d2t"} <= set(weights):
        raise ExportError("the checkpoint has no t2d/d2t and no vocab mapping was found; pass --vocab-mapping")
    if strategy == "pr" and not any(k.startswith(PR_PARAM_PREFIXES) for k in weights):
        raise ExportError("a pr checkpoint without pr_self_query/pr_halt_gate tensors: not a PR drafter")
    if strategy != "pr" and (bw is not None or m is not None):
        raise ExportError(f"--bw / --m are PR_EAGLE3's serving defaults; {checkpoint} is an {strategy} checkpoint")

    model = build_drafter_skeleton(draft_cfg, strategy, state.get("pr_settings"))
    if to == "sglang" and hasattr(model, "second_layer"):
        raise ExportError(f"{checkpoint}: a two-layer EAGLE-3 drafter; SGLang's LlamaForCausalLMEagle3 has one decoder "
                          "layer and would drop the second silently: export it --to hf (served by `pr-specforge eval`)")
    check_weights(model, weights, draft_cfg)
    float_dtypes = {v.dtype for k, v in weights.items() if v.is_floating_point()}
    out_dtype = getattr(torch, dtype) if dtype else (float_dtypes.pop() if len(float_dtypes) == 1 else torch.float32)

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
    capture_layers = resolve_capture_layers(draft_cfg, recipe, target)
    record = _target_record(target, capture_layers)
    run = run_record(recipe, strategy, checkpoint)
    try:
        if to == "sglang":
            _write_sglang(tmp, model, weights, draft_cfg, capture_layers, out_dtype, target_context(target), record,
                          serving, run)
        else:
            _write_hf(tmp, model, weights, target, out_dtype, recipe, record, run)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s checkpoint %s -> %s (%s)", strategy, checkpoint, out_dir, to)
    return out_dir


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse, before reading the checkpoint, an OUT_DIR under a file, and one that `--overwrite` would replace
    although it is not an earlier export (a file, or a directory holding other files: they would be lost), or a
    symbolic link (replacing it would put a directory where the link was and leave its target stale), or one in a
    directory that cannot be written (`data.io`'s rule for every output)."""
    from pr_specforge.data.io import check_output_parent, is_read_only

    try:
        check_output_parent("OUT_DIR", out_dir)
    except DataFormatError as e:
        raise ExportError(str(e)) from None
    if os.path.islink(out_dir):
        raise ExportError(f"OUT_DIR {out_dir} is a symbolic link (to {os.readlink(out_dir)}); an export replaces a "
                          "directory, never a link (its target would be left stale): name the directory itself, or "
                          "another OUT_DIR")
    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise ExportError(f"{out_dir} exists; pass --overwrite to replace it")
    if not os.path.isdir(out_dir):
        raise ExportError(f"OUT_DIR {out_dir} is a file, not an earlier export; --overwrite replaces export directories only")
    if is_read_only(out_dir):
        raise ExportError(f"OUT_DIR {out_dir} is read-only; it is not replaced (make it writable to replace it, or name "
                          "another OUT_DIR)")
    cfg_path = os.path.join(out_dir, "config.json")
    try:
        arch = (read_json_file(cfg_path).get("architectures") or [None])[0] if os.path.isfile(cfg_path) else None
    except (DataFormatError, AttributeError, TypeError):
        arch = None
    if os.listdir(out_dir) and arch not in (PR_ARCHITECTURE, EAGLE3_ARCHITECTURE, TWO_LAYER_ARCHITECTURE,
                                            SPECULATOR_ARCHITECTURE):
        raise ExportError(f"OUT_DIR {out_dir} holds files that are not an earlier export (no drafter config.json); "
                          "--overwrite replaces an export only: name another OUT_DIR")
    others = sorted(name for name in os.listdir(out_dir)
                    if not (os.path.isfile(os.path.join(out_dir, name)) and is_export_file(name)))
    if others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise ExportError(f"OUT_DIR {out_dir} holds files that are not an earlier export's: {others[0]}{more}, which "
                          "--overwrite would delete; move them out, or name another OUT_DIR")


def is_export_file(name: str) -> bool:
    """A file an export writes (SGLang: config.json and the weights; HF: `save_pretrained`'s config, weights, shards
    and their index, generation config): `--overwrite` replaces a directory that holds nothing else."""
    return name in ("config.json", "generation_config.json", SAFETENSORS_NAME, SAFETENSORS_NAME + ".index.json") or (
        re.fullmatch(r"model-\d+-of-\d+\.safetensors", name) is not None)


def check_target(target: Optional[str]) -> None:
    """A `--target` that is not a model directory is one line, before any work (without it, the SGLang export would
    keep the draft config's context and record no target; the HF export would ask the Hub for the name)."""
    if target is None:
        return
    if not os.path.isdir(target):
        raise ExportError(f"--target {target}: {'is a file, not' if os.path.exists(target) else 'does not exist; name'} "
                          "the target model's directory")
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise ExportError(f"--target {target}: no config.json; name the target model's directory")


def check_trained_target(state: Dict[str, Any], target: Optional[str]) -> None:
    """The target an export reads (its embedding, context and record) is the one the run trained on, by content: its
    weights digest equals the checkpoint's `TARGET_STATE_KEY` record (a checkpoint of an older version records none:
    not checked). One line naming both."""
    recorded = state.get(TARGET_STATE_KEY)
    if not (target and isinstance(recorded, dict) and recorded.get("weights")):
        return
    from pr_specforge.data.hidden_states import target_weights_digest

    found = target_weights_digest(target)
    if found != recorded["weights"]:
        raise ExportError(f"--target {target}: not the target this run trained on (its weights' digest is {found}; the "
                          f"run trained on {recorded.get('name')!r}, digest {recorded['weights']}): name the target it "
                          "was trained on")


def _target_record(target: Optional[str], capture_layers: Optional[List[int]]) -> Optional[Dict[str, Any]]:
    """The target by name and fingerprint, recorded in the export's config.json under `TARGET_RECORD_KEY` so
    `headroom` / `diagnose` can refuse features of another target; None when unknown. `name` is the target
    directory's name and `fingerprint` the content of its config and weight files (`dir_fingerprint`, what `eval`
    records as `target_weights`); the shape fields are `data.hidden_states.target_record`'s. Never its path: a path of one
    machine would leak into a shared file and make the export's fingerprint depend on where it was made."""
    if not (target and os.path.isfile(os.path.join(target, "config.json"))):
        return None
    from pr_specforge.data.hidden_states import target_record
    from pr_specforge.data.io import dir_fingerprint

    try:
        record = target_record(target, capture_layers)
    except (OSError, ValueError) as e:
        raise ExportError(f"--target {target}: its config.json does not load ({type(e).__name__})") from None
    record.pop("path", None)
    record.update(name=os.path.basename(os.path.abspath(target)), fingerprint=dir_fingerprint(target))
    return record


def _write_sglang(tmp: str, model, weights: Dict[str, torch.Tensor], draft_cfg: Dict[str, Any],
                  capture_layers: Optional[List[int]], dtype: torch.dtype, context: Optional[int],
                  record: Optional[Dict[str, Any]], serving: Optional[Dict[str, int]] = None,
                  run: Optional[Dict[str, Any]] = None) -> None:
    from safetensors.torch import save_file

    check_sglang_names(list(weights))
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(tensors, os.path.join(tmp, SAFETENSORS_NAME), metadata={"format": "pt"})
    cfg = sglang_config(draft_cfg, model, capture_layers, dtype, context, serving)
    if record:
        cfg[TARGET_RECORD_KEY] = record
    if run:
        cfg[RUN_RECORD_KEY] = run
    _write_json(os.path.join(tmp, "config.json"), cfg)


def _write_hf(tmp: str, model, weights: Dict[str, torch.Tensor], target: Optional[str], dtype: torch.dtype,
              recipe: Optional[Dict[str, Any]], record: Optional[Dict[str, Any]],
              run: Optional[Dict[str, Any]] = None) -> None:
    if record:
        setattr(model.config, TARGET_RECORD_KEY, record)
    if run:
        setattr(model.config, RUN_RECORD_KEY, run)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(_is_embedding(k) for k in missing), (missing, unexpected)
    state = dict(model.state_dict())
    if target:
        embedding_key = ((recipe or {}).get("model") or {}).get("embedding_key") or "model.embed_tokens.weight"
        model.load_embedding(target, embedding_key=embedding_key)
        state = dict(model.state_dict())
    else:
        log.warning("no --target: the HF export carries no embedding (load it from the target before use)")
        state = {k: v for k, v in state.items() if not _is_embedding(k)}
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    model.to(dtype)  # `save_pretrained` records the dtype of the model's parameters, whatever the state dict holds
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures", [None])[0] not in (PR_ARCHITECTURE, EAGLE3_ARCHITECTURE, TWO_LAYER_ARCHITECTURE):
        raise ExportError(f"unexpected architectures {cfg.get('architectures')} in the HF export")
    written = str(dtype).replace("torch.", "")
    if (cfg.get("dtype") or cfg.get("torch_dtype")) != written:
        raise ExportError(f"the HF config records dtype {cfg.get('dtype') or cfg.get('torch_dtype')!r}, its tensors are {written}")


def _write_json(path: str, payload: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Move the finished temp dir into place; an existing `out_dir` is swapped out, then removed. Its
    modes are an ordinary directory's (mkdtemp's 0700 and safetensors' 0600 would lock other users out); an export
    it replaces keeps its directory's mode (`data.io`'s rule: a replaced output keeps its mode)."""
    honour_umask_tree(tmp)
    if os.path.isdir(out_dir):
        os.chmod(tmp, os.stat(out_dir).st_mode & 0o7777)
    for root, _, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)), prefix=f".{os.path.basename(out_dir)}.old-")
        os.rmdir(old)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a SpecForge checkpoint dir ({run_id}-stepN), its training_state.pt, or a run output dir (latest)")
    p.add_argument("out_dir", help="directory to write (atomically)")
    p.add_argument("--to", required=True, choices=("sglang", "hf", "vllm"),
                   help="sglang: EAGLE-3 + pr_* tensors (PR_EAGLE3 or stock EAGLE3); hf: the full PR drafter (our "
                        "evaluator); vllm: speculators format, served by stock vLLM as a chain (CHECKPOINT may also be "
                        "an --to sglang export directory)")
    p.add_argument("--draft-config", default=None, help="draft config JSON (default: the one the run trained with)")
    p.add_argument("--vocab-mapping", default=None, help="vocab_mapping.pt (default: t2d/d2t stored in the checkpoint)")
    p.add_argument("--target", default=None, help="target model dir: embedding for --to hf, default captured layers")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"), help="tensor dtype (default: as trained)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.add_argument("--bw", type=int, default=None,
                   help="--to sglang, a PR drafter: the B_w PR_EAGLE3 serves by default (pr_serving; default: the launch's k)")
    p.add_argument("--m", type=int, default=None,
                   help="--to sglang, a PR drafter: the m PR_EAGLE3 serves by default (pr_serving; default 3)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="--to vllm: the chain's length vLLM drafts by default (speculators' speculative_tokens; default 3)")
    p.add_argument("--verifier", default=None,
                   help="--to vllm: the verifier's hub id or path written into the export (default: --target's path)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`--to sglang|hf` (`pr-specforge export` enters at `export_vllm.main`, which hands these here)."""
    from pr_specforge.lock import OutputBusy, output_lock

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.to == "vllm":
            raise ExportError("--to vllm is pr_specforge.export_vllm.main's (the `pr-specforge export` command)")
        if args.num_speculative_tokens is not None or args.verifier is not None:
            raise ExportError("--num-speculative-tokens / --verifier go with --to vllm")
        with output_lock(args.out_dir, "OUT_DIR"):  # one writer per export directory (`pr_specforge.lock`)
            out = export_checkpoint(args.checkpoint, args.out_dir, args.to, draft_config=args.draft_config,
                                    vocab_mapping=args.vocab_mapping, target=args.target, dtype=args.dtype,
                                    overwrite=args.overwrite, bw=args.bw, m=args.m)
    except (ExportError, OutputBusy) as e:
        print(f"pr-specforge export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
