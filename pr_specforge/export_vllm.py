"""`pr-specforge export SOURCE OUT --to vllm`: a drafter that stock vLLM serves as EAGLE-3 (a chain).

    pr-specforge export work/smollm2/runs/pr OUT --to vllm --target work/smollm2/target
    pr-specforge export work/smollm2/export/pr-sglang OUT --to vllm --target work/smollm2/target  # no run needed

SOURCE is a training run / checkpoint (`pr` or `eagle3`; exported `--to sglang` first, into a temporary directory, by
`export.export_checkpoint` with all its checks) or an existing `--to sglang` export directory. The output is the
speculators format that vLLM reads (`vllm.transformers_utils.configs.speculators`), so the verifier travels with the
drafter and `python -m vllm.entrypoints.openai.api_server --model OUT` serves both:

* `config.json`: `speculators_model_type: eagle3`, `speculators_config` (one greedy proposal method of
  `--num-speculative-tokens`, the verifier's name or path and architecture), `transformer_layer_config` (the drafter's
  one-layer Llama config), `draft_vocab_size`, `target_hidden_size`, `fc_norm`, `norm_output`, and
  `norm_before_residual: false` written out (speculators' default is true; SpecForge's drafter adds the residual
  before `hidden_norm`, as SGLang does).
* **The capture-layer ids in vLLM's convention.** SpecForge and SGLang write `eagle_aux_hidden_state_layer_ids` as
  "the output of layer X"; vLLM reads the same field as "the input of layer X" (its target collects the residual
  stream at index `idx + 1` after layer `idx`, index 0 being the embedding). The export writes each id + 1, from the
  run's own layers: `[1, 14, 26]` -> `[2, 15, 27]` for SmolLM2's 30 layers. Unshifted ids serve outputs equal to
  greedy with a lower acceptance, silently (tests/vllm_live).
* `model.safetensors`: the EAGLE-3 tensors under speculators' names (`midlayer.*` -> `layers.0.*`; `fc`, the trained
  `fc_norm.{0,1,2}`, `norm`, `lm_head`, `d2t`, `t2d`), no embedding (vLLM shares the target's, as training froze it).
  **No `pr_*` tensor is written**: vLLM's loader refuses tensors it does not know, and vLLM 0.32 drafts a chain
  (no tree attention), so a PR drafter is served as its one-pass chain. Reconsideration needs trees (docs/export.md,
  "vLLM").

Refused in one line, before anything is written: two decoder layers (vLLM's `Eagle3LlamaForCausalLM` has one), a
reconsideration adapter (`pr.recon_adapter_rank > 0`: no serving path runs it, PR_EAGLE3 refuses it too), capture
ids the target cannot give (vLLM collects indices 0..L: SpecForge ids 0..L-1), a target whose layer count or hidden
size disagrees with the export's record, and no verifier (`--target` or `--verifier`).

`main` is the `pr-specforge export` entry point: `--to vllm` here, `--to sglang|hf` handed to `export.main`.
Does not own: the checkpoint checks and the SGLang config (export.py), serving (scripts/vllm_cpu_serve.sh).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import torch

from pr_specforge.data.hidden_states import TARGET_RECORD_KEY
from pr_specforge.data.io import DataFormatError, check_not_input, read_json_file
from pr_specforge.export import (
    PR_CONFIG_KEY,
    PROVENANCE_KEYS,
    SAFETENSORS_NAME,
    SPECULATOR_ARCHITECTURE,
    ExportError,
    _parser,
    _replace_dir,
    _write_json,
    check_out_dir,
    check_target,
    export_checkpoint,
    read_checkpoint,
    stored_recipe,
)
from pr_specforge.modeling.drafter import EAGLE3_ARCHITECTURE, PR_PARAM_PREFIXES
from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE

log = logging.getLogger(__name__)

#: the key of the export's own record (what it was made from; read by nothing in vLLM)
VLLM_RECORD_KEY = "pr_specforge_vllm_export"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format (config keys, tensor names) this follows
DEFAULT_SPECULATIVE_TOKENS = 3
#: the drafter config keys that describe the one decoder layer (the rest are EAGLE-3 or ours)
EAGLE3_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config", "fc_norm", "norm_output", "architectures",
               PR_CONFIG_KEY, "pr_serving", "torch_dtype", "dtype") + PROVENANCE_KEYS


def vllm_layer_ids(specforge_ids: List[int], target_layers: Optional[int]) -> List[int]:
    """SpecForge / SGLang capture ids ("output of layer X") -> vLLM's ("input of layer X", index 0 the embedding)."""
    ids = [int(i) for i in specforge_ids]
    if target_layers is not None and any(not 0 <= i < target_layers for i in ids):
        raise ExportError(f"capture layers {ids} (layer outputs) do not fit a target of {target_layers} layers: vLLM "
                          f"collects layer outputs 0..{target_layers - 1} only")
    return [i + 1 for i in ids]


def _is_sglang_export(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(
        os.path.join(path, SAFETENSORS_NAME))


def _read_config(path: str) -> Dict[str, Any]:
    try:
        cfg = read_json_file(os.path.join(path, "config.json"))
    except DataFormatError as e:
        raise ExportError(str(e)) from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{path}/config.json: not a JSON object")
    return cfg


def _target_config(target: Optional[str]) -> Optional[Dict[str, Any]]:
    if target is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target).get_text_config().to_dict()
    except (OSError, ValueError) as e:
        raise ExportError(f"--target {target}: its config.json does not load ({type(e).__name__})") from None


def check_servable(source: str, cfg: Dict[str, Any], names: List[str], target_cfg: Optional[Dict[str, Any]]) -> int:
    """Refuse what vLLM's EAGLE-3 cannot serve as trained; returns the target's layer count (or None)."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch == TWO_LAYER_ARCHITECTURE or int(cfg.get("num_hidden_layers", 1)) != 1 or any(
            n.startswith(("second_layer.", "midlayer2.", "layers.1.")) for n in names):
        raise ExportError(f"{source}: a drafter with two decoder layers; vLLM's Eagle3LlamaForCausalLM runs one and "
                          "would drop the second silently")
    if arch != EAGLE3_ARCHITECTURE:
        raise ExportError(f"{source}: config.json's architectures {cfg.get('architectures')} is not an SGLang export "
                          f"({EAGLE3_ARCHITECTURE}); export the run --to vllm, or --to sglang first")
    if any(n.startswith("pr_recon_adapter.") for n in names) or (cfg.get(PR_CONFIG_KEY) or {}).get("recon_adapter_rank"):
        raise ExportError(f"{source}: a drafter with a reconsideration adapter (pr.recon_adapter_rank > 0); no serving "
                          "path runs it (PR_EAGLE3 refuses it too)")
    record = cfg.get(TARGET_RECORD_KEY) or {}
    layers = record.get("num_hidden_layers")
    if target_cfg is not None:
        for key in ("num_hidden_layers", "hidden_size"):
            if record.get(key) is not None and int(record[key]) != int(target_cfg[key]):
                raise ExportError(f"--target has {key} {target_cfg[key]}, but the drafter was trained on a target with "
                                  f"{record[key]}: name the target it was trained on")
        layers = int(target_cfg["num_hidden_layers"])
        if int(cfg.get("target_hidden_size") or cfg["hidden_size"]) != int(target_cfg["hidden_size"]):
            raise ExportError(f"--target has hidden_size {target_cfg['hidden_size']}, the drafter's target_hidden_size "
                              f"is {cfg.get('target_hidden_size')}: name the target it was trained on")
    return None if layers is None else int(layers)


def check_recorded_target(source: str, cfg: Dict[str, Any], target: Optional[str]) -> None:
    """`--target` is the target the SGLang export records (`TARGET_RECORD_KEY`'s content `fingerprint`, what `export`
    wrote from the target it read): a target of the same shape and other weights is refused in one line."""
    from pr_specforge.data.io import dir_fingerprint

    recorded = (cfg.get(TARGET_RECORD_KEY) or {}).get("fingerprint")
    if target is None or not recorded or not os.path.isdir(target):
        return
    found = dir_fingerprint(target)
    if found != recorded:
        raise ExportError(f"--target {target}: not the target {source} was exported with (its fingerprint is {found}, "
                          f"the export records {recorded}): name the target it was trained on")


#: the one decoder layer's tensors (SpecForge's / SGLang's names)
MIDLAYER_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                    "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")


def expected_tensors(cfg: Dict[str, Any], layer_count: int) -> List[str]:
    """The EAGLE-3 tensors an SGLang export of config `cfg` holds (its `pr_*` tensors aside)."""
    names = [f"midlayer.{n}.weight" for n in MIDLAYER_TENSORS] + ["fc.weight", "norm.weight", "lm_head.weight",
                                                                  "d2t", "t2d"]
    if cfg.get("fc_norm"):
        names += [f"fc_norm.{i}.weight" for i in range(layer_count)]
    return names


def check_tensors(source: str, cfg: Dict[str, Any], names: List[str], layer_count: int) -> None:
    """Every tensor vLLM loads is there under its name, and nothing else but `pr_*`: vLLM refuses an unknown name
    at start-up, and a missing one stays at its initial value, silently (d2t: zeros, every draft maps to a wrong id)."""
    expected = set(expected_tensors(cfg, layer_count))
    missing = sorted(expected - set(names))
    unknown = sorted(n for n in set(names) - expected if not n.startswith(PR_PARAM_PREFIXES))
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ExportError(f"{source}/{SAFETENSORS_NAME}: not the tensors of an EAGLE-3 drafter ({'; '.join(parts)}); "
                          "re-export it from the run")


def check_shapes_and_values(source: str, cfg: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
    """Before converting: every EAGLE-3 tensor has the shape `cfg` gives it (the serving drafter's, `eagle3_tensors`:
    a truncated `fc.weight`, a `d2t` of another length, a config whose vocab disagrees with the tensors), the vocab
    map is consistent, and every floating tensor (`pr_*` too) is finite. One line naming the file and the tensor."""
    from pr_specforge.core.eagle3 import ServingDrafterError, eagle3_tensors
    from pr_specforge.core.export_format import check_tensors as check_against

    where = f"{source}/{SAFETENSORS_NAME}"
    try:
        expected = eagle3_tensors(cfg)
        check_against(expected, {k: v for k, v in tensors.items() if k in expected}, cfg, EAGLE3_ARCHITECTURE)
    except (ExportError, ServingDrafterError, TypeError, ValueError, KeyError) as e:
        said = " ".join(str(e).split()).replace("checkpoint does not match the draft config: ", "")
        raise ExportError(f"{where}: does not match its config.json: {said}; re-export it from the run") from None
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ExportError(f"{where}: {name} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; a "
                              "drafter with them drafts garbage: re-export it from a finite checkpoint")


def speculators_config(cfg: Dict[str, Any], layer_ids: List[int], verifier: str, verifier_arch: List[str],
                       tokens: int, dtype: str, source_kind: str, specforge_ids: List[int]) -> Dict[str, Any]:
    """The speculators-format config.json of an SGLang export's config `cfg`."""
    layer_cfg = {k: v for k, v in cfg.items() if k not in EAGLE3_KEYS}
    layer_cfg.update(model_type="llama", num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype=dtype)
    out = {
        "architectures": [SPECULATOR_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch)},
        },
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        "target_hidden_size": int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "torch_dtype": dtype,
        VLLM_RECORD_KEY: {"drafter": source_kind, "served_as": "one-pass chain" if source_kind == "pr" else "chain",
                          "specforge_capture_layers": list(specforge_ids), "capture_layers_convention": "vllm (+1)"},
    }
    for key in PROVENANCE_KEYS:  # the target by name and fingerprint, the run's settings: as the SGLang export has them
        if cfg.get(key):
            out[key] = cfg[key]
    return out


def convert_sglang_export(src: str, out_dir: str, *, target: Optional[str], verifier: Optional[str],
                          tokens: int, dtype: Optional[str], overwrite: bool, checked_out: bool = False) -> Dict[str, Any]:
    """An SGLang export directory `src` -> a vLLM (speculators) directory `out_dir`, atomically; returns a summary."""
    from safetensors.torch import load_file, save_file

    if not checked_out:
        check_out_dir(out_dir, overwrite)
    cfg = _read_config(src)
    try:
        tensors = load_file(os.path.join(src, SAFETENSORS_NAME))
    except Exception as e:  # noqa: BLE001 (a damaged file: safetensors' own error names no file)
        raise ExportError(f"{src}/{SAFETENSORS_NAME}: does not load ({type(e).__name__}); re-export it") from None
    target_cfg = _target_config(target)
    layers = check_servable(src, cfg, list(tensors), target_cfg)
    check_recorded_target(src, cfg, target)
    if verifier is None and target is None:
        raise ExportError("no verifier: pass --target TARGET_DIR (its path is written as the verifier) or --verifier "
                          "NAME_OR_PATH (a hub id, to share the export)")
    specforge_ids = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if specforge_ids is None:
        if layers is None:
            raise ExportError(f"{src}: config.json records no capture layers and no target layer count; pass --target")
        from pr_specforge._specforge import eagle_capture_layers, target_layer_count

        specforge_ids = eagle_capture_layers(cfg, target_layer_count(layers))
    layer_ids = vllm_layer_ids(specforge_ids, layers)
    check_tensors(src, cfg, list(tensors), len(layer_ids))
    check_shapes_and_values(src, cfg, tensors)
    pr_names = sorted(n for n in tensors if n.startswith(PR_PARAM_PREFIXES))
    kept = {("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
            for n, t in tensors.items() if not n.startswith(PR_PARAM_PREFIXES)}
    floats = {t.dtype for t in kept.values() if t.is_floating_point()}
    out_dtype = getattr(torch, dtype) if dtype else (floats.pop() if len(floats) == 1 else torch.float32)
    kept = {n: (t.to(out_dtype) if t.is_floating_point() else t).contiguous() for n, t in kept.items()}
    dtype_name = str(out_dtype).replace("torch.", "")
    kind = "pr" if (pr_names or cfg.get(PR_CONFIG_KEY)) else "eagle3"
    arch = (target_cfg or {}).get("architectures") or ["LlamaForCausalLM"]
    name = verifier if verifier is not None else os.path.abspath(target)
    config = speculators_config(cfg, layer_ids, name, arch, tokens, dtype_name, kind, list(specforge_ids))
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
    try:
        save_file(kept, os.path.join(tmp, SAFETENSORS_NAME), metadata={"format": "pt"})
        _write_json(os.path.join(tmp, "config.json"), config)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out_dir, "drafter": kind, "layer_ids": layer_ids, "specforge_ids": list(specforge_ids),
            "dropped": pr_names, "verifier": name, "tokens": int(tokens), "dtype": dtype_name}


def export_vllm(source: str, out_dir: str, *, target: Optional[str] = None, verifier: Optional[str] = None,
                tokens: int = DEFAULT_SPECULATIVE_TOKENS, dtype: Optional[str] = None, overwrite: bool = False,
                draft_config: Optional[str] = None, vocab_mapping: Optional[str] = None) -> Dict[str, Any]:
    """`source`: a run / checkpoint, or an `--to sglang` export directory. Returns the summary of what was written."""
    if int(tokens) < 1:
        raise ExportError(f"--num-speculative-tokens must be >= 1, got {tokens}")
    check_out_dir(out_dir, overwrite)
    try:
        check_not_input("OUT_DIR", out_dir, [source, target])
    except DataFormatError as e:
        raise ExportError(str(e)) from None
    check_target(target)
    if _is_sglang_export(source) and (draft_config is None and vocab_mapping is None):
        return convert_sglang_export(source, out_dir, target=target, verifier=verifier, tokens=tokens, dtype=dtype,
                                     overwrite=overwrite, checked_out=True)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.sglang-")
    try:
        sglang_dir = os.path.join(staging, "sglang")
        export_checkpoint(source, sglang_dir, "sglang", draft_config=draft_config, vocab_mapping=vocab_mapping,
                          target=target, dtype=dtype)
        if target is None and verifier is None:
            target = _run_target(source)
        return convert_sglang_export(sglang_dir, out_dir, target=target, verifier=verifier, tokens=tokens,
                                     dtype=dtype, overwrite=overwrite, checked_out=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run_target(source: str) -> Optional[str]:
    """The target directory a run trained with (its stored recipe), when it exists here."""
    recipe = stored_recipe(read_checkpoint(source), source) or {}
    path = (recipe.get("model") or {}).get("target_model_path")
    return path if path and os.path.isdir(path) else None


def summary_line(s: Dict[str, Any]) -> str:
    """The export's output line: what vLLM will serve."""
    what = (f"a PR drafter served as its one-pass chain ({len(s['dropped'])} pr_* tensors not written: vLLM has no "
            "tree drafting, so no reconsideration)" if s["drafter"] == "pr" else "an EAGLE-3 drafter, served as a chain")
    return (f"{s['out']}: {what}; capture ids {s['layer_ids']} (vLLM's input-of-layer convention, from the run's "
            f"{s['specforge_ids']}), {s['tokens']} speculative tokens, {s['dtype']}, verifier {s['verifier']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`pr-specforge export`: `--to vllm` here, `--to sglang|hf` by `export.main` (one parser for all three)."""
    from pr_specforge import export
    from pr_specforge.lock import OutputBusy, output_lock

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.to != "vllm":
        return export.main(argv)
    try:
        if args.bw is not None or args.m is not None:
            raise ExportError("--bw / --m are PR_EAGLE3's serving defaults: they go with --to sglang")
        tokens = DEFAULT_SPECULATIVE_TOKENS if args.num_speculative_tokens is None else args.num_speculative_tokens
        with output_lock(args.out_dir, "OUT_DIR"):  # one writer per export directory (`pr_specforge.lock`)
            summary = export_vllm(args.checkpoint, args.out_dir, target=args.target, verifier=args.verifier,
                                  tokens=tokens, dtype=args.dtype, overwrite=args.overwrite,
                                  draft_config=args.draft_config, vocab_mapping=args.vocab_mapping)
    except (ExportError, OutputBusy) as e:
        print(f"pr-specforge export: {e}", file=sys.stderr)
        return 2
    print(summary_line(summary))
    return 0
