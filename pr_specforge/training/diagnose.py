"""`pr-specforge diagnose`: a trained checkpoint's objective telemetry on held-out features.

    pr-specforge diagnose DRAFTER --features HELDOUT_FEATURES [--checkpoint CKPT] [--target DIR] [--json OUT [--overwrite]]

Answers, on features the drafter never trained on: does the gate open (halt past depth 0,
per depth-0 confidence band)? Do reconsidered depths compute anything else than depth 0
(`||f^r - f^0|| / ||f^0||`, and how often depth r's top-1 is depth 0's)? Do they out-predict
depth 0 (top-1 accuracy per depth, and the share of depth-0 misses some depth recovers)? And the one-pass chain's
per-TTT-step accuracy with SpecForge's simulated acceptance length, and the acceptance
simulator's lengths (`training.simulate`: one-pass, width-2 control, PR), for EAGLE-3 runs too,
so two drafters trained on the same data compare on the same held-out positions.

How: the run's resolved recipe is rebuilt by SpecForge's own assembly with the held-out
features as its training data (so batches are prepared exactly as in training), the
checkpoint's draft weights are loaded, and the strategy's `forward_loss` runs over every
batch under `no_grad` in eval mode. PR's telemetry comes out as (numerator, denominator)
sums; they are summed over the whole set before dividing.

The drafter may be a run directory, a checkpoint directory, an HF export or an SGLang export
(`drafter_source`; an export's weights are read by the evaluator's loader, `modeling.load_drafter`, so
an SGLang export is the plain EAGLE-3 drafter SGLang serves; a tied target such as SmolLM2 is read
through its embedding, `target_lm_head_key`). `pr-specforge headroom` rebuilds drafters the same way,
with its own chain observer. Features made from another target than the drafter's are refused
(`check_same_target`: the features' manifest fingerprint, as a features resume checks it). A `--json` file that
exists is refused in one line before any work, unless `--overwrite`; one of the command's inputs (`drafter_inputs`:
the run's recipe, a checkpoint, the features) always is.

Owns: the aggregation and the table, `drafter_source`, `check_features_fit`, `check_same_target`. Does not own the metrics' definitions
(`pr_specforge.training.objective.ttt`) or the data pipeline (SpecForge's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from pr_specforge.config import ConfigError


def _resolve_checkpoint(run_dir: Path, checkpoint: Optional[str]) -> str:
    from pr_specforge.training.preflight import latest_checkpoint

    if checkpoint:
        if not Path(checkpoint).exists():
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no such checkpoint")
        return checkpoint
    return latest_checkpoint(run_dir)


@dataclass
class DrafterSource:
    """What a drafter is rebuilt from: a run's resolved recipe and a checkpoint (or an HF export's weights)."""

    raw: Dict  # the resolved recipe (SpecForge config + pr:)
    label: str  # the run / checkpoint / export path, for the report
    checkpoint: str  # a SpecForge checkpoint dir, or an HF export dir (`hf` is True)
    hf: bool = False
    weights: Optional[Dict] = None  # a checkpoint's draft state dict, read (and so checked) before the run is assembled


def drafter_source(path: str, checkpoint: Optional[str] = None, features: Optional[str] = None,
                   target: Optional[str] = None, ttt_length: Optional[int] = None) -> DrafterSource:
    """A training run directory (its newest checkpoint, or `checkpoint`), a checkpoint directory (the
    recipe stored in it), or an HF export (`pr-specforge export --to hf`; needs the target: `target`,
    else the one the export records, else the one the features' manifest names; an SGLang export likewise)."""
    from pr_specforge.export import read_checkpoint, stored_recipe

    p = Path(path)
    kind = source_kind(path)
    if kind == "run":
        raw = _run_recipe(p / "resolved_recipe.yaml")
        ckpt = _resolve_checkpoint(p, checkpoint)
        return DrafterSource(raw, str(p), ckpt, weights=_draft_weights(read_checkpoint(ckpt), ckpt))
    if checkpoint:
        raise ConfigError(f"--checkpoint needs a run directory; {path} holds no resolved_recipe.yaml")
    if kind == "checkpoint":
        state = read_checkpoint(str(p))
        raw = stored_recipe(state, str(p))
        if raw is None:
            raise ConfigError(f"{path}: the checkpoint carries no recipe and no resolved_recipe.yaml is beside it")
        return DrafterSource(raw, str(p), str(p if p.is_dir() else p.parent), weights=_draft_weights(state, str(p)))
    return DrafterSource(_export_recipe(p, features, target, ttt_length), str(p), str(p), hf=True)


def _run_recipe(path: Path) -> Dict:
    """A run's resolved_recipe.yaml as a mapping, or one line naming it."""
    import yaml

    from pr_specforge.training.recipe import yaml_problem

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(e)}); the run directory is damaged") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a recipe mapping, got a {type(raw).__name__}; the run directory is damaged")
    return raw


def _draft_weights(state: Dict, checkpoint: str) -> Dict:
    weights = state.get("draft_state_dict") if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"{checkpoint}: the training state holds no draft_state_dict; not a SpecForge drafter checkpoint")
    return weights


def drafter_inputs(path: str, checkpoint: Optional[str], features: str, target: Optional[str]) -> List[str]:
    """What `drafter_source` and the measurement read, for `data.io`'s rule that an output is never one of them: a
    run's recipe and metrics and every checkpoint directory in it (the run's other files, e.g. an earlier diagnosis,
    may be written); a checkpoint or an export as a whole; the features; the target."""
    p = Path(path)
    if (p / "resolved_recipe.yaml").exists():
        run = [str(p / "resolved_recipe.yaml"), str(p / "metrics.jsonl"), *(str(d) for d in p.iterdir() if d.is_dir())]
    else:
        run = [path]
    return [*run, checkpoint, features, target]


def source_kind(path: str) -> str:
    """`run`, `checkpoint` or `hf` (see `drafter_source`); anything else is refused in one line."""
    p = Path(path)
    if (p / "resolved_recipe.yaml").exists():
        return "run"
    if (p / "training_state.pt").exists() or (p.name == "training_state.pt" and p.is_file()):
        return "checkpoint"
    if (p / "config.json").exists():
        return "hf"
    raise FileNotFoundError(f"{path}: not a training run (no resolved_recipe.yaml), a checkpoint (no training_state.pt) "
                            "or an HF export (no config.json); is this a `pr-specforge train` output directory?")


def _export_recipe(export: Path, features: Optional[str], target: Optional[str], ttt_length: Optional[int]) -> Dict:
    """The recipe an HF (or SGLang) export is rebuilt with: its config as the draft config, the features' vocab
    map, the target's lm_head key (`target_lm_head_key`), and the settings of the run it came from that the export
    records (`export.run_record`: TTT length, sequence length, batch size, attention backend, compute dtype, the
    `pr` section), so the export measures the run's numbers; `--ttt-length` / `--target` win over them. An export
    made before it recorded them is rebuilt with the dtype its config names and SpecForge's defaults."""
    from pr_specforge.config import PR_CONFIG_KEY
    from pr_specforge.data.hidden_states import TARGET_RECORD_KEY
    from pr_specforge.data.io import read_json_object
    from pr_specforge.export import RUN_RECORD_KEY
    from pr_specforge.modeling.drafter import PR_ARCHITECTURE, drafter_architecture

    try:
        arch = drafter_architecture(str(export))
    except ValueError as e:
        raise ConfigError(f"{e}; DRAFTER must be a `pr-specforge train` run, a checkpoint or an export "
                          "(`pr-specforge export`), not the target model") from None
    cfg = read_json_object(export / "config.json", error=ConfigError)
    recorded = _manifest(features)
    run = cfg.get(RUN_RECORD_KEY) if isinstance(cfg.get(RUN_RECORD_KEY), dict) else {}
    own = (cfg.get(TARGET_RECORD_KEY) or {}).get("path")  # an export made before targets were recorded by name
    target = target or (own if own and Path(own).is_dir() else None) or (recorded.get("target") or {}).get("path")
    if not target or not Path(target).is_dir():
        raise ConfigError(f"{export} is an export: pass --target TARGET_DIR (the target model the features come from)")
    vocab = Path(features or "") / (recorded.get("vocab_mapping") or "vocab_mapping/vocab_mapping.pt")
    pr = arch == PR_ARCHITECTURE
    ttt_length = ttt_length or run.get("ttt_length")
    raw = {
        "model": {"target_model_path": str(target), "draft_model_config": str(export / "config.json"),
                  "vocab_mapping_path": str(vocab) if vocab.is_file() else "",
                  "lm_head_key": run.get("lm_head_key") or target_lm_head_key(Path(target)),
                  # the run's compute dtype (its numbers), else the dtype of the tensors written
                  "torch_dtype": str(run.get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "float32")},
        "data": {"hidden_states_path": str(features),
                 "max_length": int(run.get("max_length") or recorded.get("max_length") or 2048),
                 "dataloader_num_workers": 0},
        "training": {"strategy": "pr" if pr else "eagle3", "batch_size": int(run.get("batch_size") or 1),
                     "attention_backend": run.get("attention_backend") or "sdpa",
                     "fsdp_sharding": "NO_SHARD", **({"ttt_length": ttt_length} if ttt_length else {})},
    }
    if pr:
        raw["pr"] = dict(run["pr"]) if pr and isinstance(run.get("pr"), dict) else dict(cfg.get(PR_CONFIG_KEY) or {})
    return raw


def _manifest(features: Optional[str]) -> Dict:
    """The features' manifest.json (`data hidden-states` writes it), {} when there is none."""
    from pr_specforge.data.hidden_states import MANIFEST
    from pr_specforge.data.io import read_json_object

    path = Path(features or "") / MANIFEST
    return read_json_object(path, "--features", error=ConfigError) if features and path.is_file() else {}


#: SpecForge's default name of a target's output head (`model.lm_head_key`)
LM_HEAD_KEY = "lm_head.weight"


def target_lm_head_key(target: Path) -> str:
    """Where the target's output head is stored: what `data smollm2-target` recorded, else the input embedding
    for a tied target whose weight index has no `lm_head.weight` (SmolLM2), else SpecForge's default."""
    from pr_specforge.data.io import read_json_object

    meta = target / "pr_specforge_target.json"
    if meta.is_file():
        key = read_json_object(meta, error=ConfigError).get("lm_head_key")
        if isinstance(key, str) and key:
            return key
    indexes = sorted(target.glob("*.index.json"))
    if not indexes:
        return LM_HEAD_KEY
    weights = read_json_object(indexes[0], error=ConfigError).get("weight_map") or {}
    config = read_json_object(target / "config.json", error=ConfigError) if (target / "config.json").is_file() else {}
    tied = "model.embed_tokens.weight"
    if LM_HEAD_KEY not in weights and tied in weights and config.get("tie_word_embeddings"):
        return tied
    return LM_HEAD_KEY


def check_same_target(features: str, source: DrafterSource) -> None:
    """Refuse features whose manifest's target fingerprint (`data.hidden_states.target_fingerprint`, what a
    features resume is checked against) differs from the drafter's target: measured on another target's hidden
    states, every acceptance would read as a measurement and be noise. The drafter's target is its training
    features' record (a run or checkpoint), else the fingerprint of its `model.target_model_path`."""
    from pr_specforge.data.hidden_states import TARGET_FIELDS

    theirs = _manifest(features).get("target")
    mine = _drafter_target(source)
    if not isinstance(theirs, dict) or mine is None:
        return  # features or a drafter that record no target: nothing to compare
    where, ours = mine
    for field in TARGET_FIELDS:
        if field in theirs and field in ours and theirs[field] != ours[field]:
            raise ConfigError(f"--features {features}: made from another target: its manifest.json records "
                              f"target.{field} {theirs[field]!r}, the drafter's target ({where}) has {ours[field]!r}; "
                              "measure on held-out features of the drafter's own target")
    check_export_target(source, ours)


def check_export_target(source: DrafterSource, ours: Dict) -> None:
    """An export records its target by name and content fingerprint (`export._target_record`), not by path: the
    target it is measured with (`--target`, else the features' manifest) must have that content."""
    from pr_specforge.data.io import dir_fingerprint

    target = (source.raw.get("model") or {}).get("target_model_path")
    if not (source.hf and ours.get("fingerprint") and target and Path(target).is_dir()):
        return
    if (fp := dir_fingerprint(str(target))) != ours["fingerprint"]:
        raise ConfigError(f"{target} is another target than the drafter's: the export records target "
                          f"{ours.get('name')!r} with fingerprint {ours['fingerprint']}, {target} has {fp}; measure "
                          "on held-out features of the drafter's own target, or pass --target with its directory")


def _drafter_target(source: DrafterSource):
    """`(where, record)` of the drafter's target, or None when nothing says which target it is: an export's
    own record (`export` writes it), a run's training features' manifest, else its `model.target_model_path`."""
    from pr_specforge.data.hidden_states import TARGET_RECORD_KEY, target_record

    raw = source.raw
    model = raw.get("model") or {}
    data = raw.get("data") or {}
    draft_path = model.get("draft_model_config")
    draft = _json_or_empty(draft_path)
    if source.hf and isinstance(draft.get(TARGET_RECORD_KEY), dict):
        return f"recorded in {draft_path}", draft[TARGET_RECORD_KEY]
    if not source.hf and data.get("hidden_states_path") and not data.get("online"):
        record = _manifest(data["hidden_states_path"]).get("target")
        if isinstance(record, dict):
            return f"recorded in {Path(data['hidden_states_path']) / 'manifest.json'}", record
    target = model.get("target_model_path")
    if not target or not (Path(target) / "config.json").is_file():
        return None
    aux = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        return f"model.target_model_path {target}", target_record(target, aux)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.target_model_path {target}: its config.json does not load ({type(e).__name__})") from None


def _json_or_empty(path: Optional[str]) -> Dict:
    from pr_specforge.data.io import read_json_object

    return read_json_object(path, error=ConfigError) if path and os.path.isfile(path) else {}


def diagnose(run_dir: str, features: str, checkpoint: Optional[str] = None, limit: Optional[int] = None,
             seed: int = 0, progress: bool = True, observers: Sequence = (), target: Optional[str] = None,
             ttt_length: Optional[int] = None) -> Dict:
    """Run the checkpoint's training objective over `features` without updating it; return the metrics.

    `run_dir` is any `drafter_source` path (or a resolved `DrafterSource`); each of `observers` (`training.simulate.ChainObserver`)
    sees every forward's chain (the acceptance simulator always does)."""
    import yaml

    from pr_specforge.training.preflight import check_feature_dir

    if isinstance(run_dir, DrafterSource):
        source = run_dir
        sample = check_feature_dir("--features", features, None, None)
    else:
        source_kind(run_dir)
        sample = check_feature_dir("--features", features, None, None)
        source = drafter_source(run_dir, checkpoint, features, target, ttt_length)
    raw = source.raw
    check_features_fit(features, sample, raw)
    check_same_target(features, source)
    if source.hf and (raw.get("training") or {}).get("strategy") != "pr" and "hidden_state" in sample:
        # SpecForge's eagle3 step feeds the features to the drafter uncast: rebuild an EAGLE-3 export in their dtype
        raw["model"]["torch_dtype"] = str(sample["hidden_state"].dtype).replace("torch.", "")
    if (raw.get("training") or {}).get("strategy") != "pr":
        raw.pop("pr", None)  # eagle3 runs trained before c2ad539 wrote a pr: section, which load_recipe refuses
    data = raw.get("data") or {}
    if data.pop("online", None):  # an online run: diagnose reads the held-out feature files instead
        data.pop("online_dtype", None)
        data["train_data_path"] = ""
    with tempfile.TemporaryDirectory(prefix="pr-diagnose-") as scratch:
        recipe_path = Path(scratch) / "resolved_recipe.yaml"
        recipe_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return _diagnose(recipe_path, scratch, source, features, limit, seed, progress, observers)


def check_features_fit(features: str, sample: Dict, raw: Dict) -> None:
    """The features (`sample`: their first file) were captured from the drafter's target: hidden widths
    and vocab, each checked against the recipe's draft config (one line naming the field)."""
    path = (raw.get("model") or {}).get("draft_model_config")
    if not path or not os.path.isfile(path):
        return
    draft = _json_or_empty(path)
    hidden = int(draft.get("target_hidden_size") or draft.get("hidden_size"))
    first = "the first feature file"
    for key, width in (("hidden_state", hidden), ("aux_hidden_state", 3 * hidden)):
        got = int(sample[key].shape[-1]) if key in sample else width
        if got != width:
            raise ConfigError(f"--features {features}: {first} has {key} width {got}, the drafter ({path}) expects "
                              f"{width} (target_hidden_size {hidden}); the features come from another target")
    manifest = Path(features) / "manifest.json"
    vocab = (_manifest(features).get("target") or {}).get("vocab_size")
    if vocab is not None and int(vocab) != int(draft.get("vocab_size", vocab)):
        raise ConfigError(f"--features {features}: {manifest} records target vocab_size {vocab}, the drafter ({path}) "
                          f"has vocab_size {draft['vocab_size']}; the features come from another target")
    ids = sample.get("input_ids")
    if ids is not None and int(ids.max()) >= int(draft.get("vocab_size", 1 << 62)):
        raise ConfigError(f"--features {features}: {first} holds token id {int(ids.max())} >= the drafter's vocab_size "
                          f"{draft['vocab_size']} ({path}); the features come from another target")


def _diagnose(recipe_path: Path, scratch: str, source: DrafterSource, features: str, limit: Optional[int],
              seed: int, progress: bool, observers: Sequence) -> Dict:
    import dataclasses

    import torch

    from pr_specforge import _specforge as sf
    from pr_specforge.training.recipe import load_recipe
    from pr_specforge.training.simulate import Simulator, chain_model
    from pr_specforge.training.train import assembled_run

    recipe = load_recipe(str(recipe_path), [
        f"data.hidden_states_path={os.path.abspath(features)}", "data.eval_hidden_states_path=",
        # the sampler's order (which samples --limit reads, and each one's halt draws) follows --seed, not a run's
        # training.seed: an export carries none (SpecForge's default 42), so a run and its export read the same samples
        f"training.seed={seed}", "training.eval_interval=0",
        "training.num_epochs=1", f"output_dir={scratch}", "tracking.report_to=none",
    ])
    cfg = recipe.config
    if cfg.training.resume_from or cfg.training.max_steps:  # the run's own schedule and resume point do not apply
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"resume_from": None, "max_steps": None})})
        recipe = dataclasses.replace(recipe, config=cfg)
    sim = Simulator()
    with assembled_run(recipe) as (strategy, loader):
        _load_draft_weights(strategy, source)
        torch.manual_seed(seed)
        model = chain_model(strategy)
        with contextlib.ExitStack() as stack:
            for observer in (sim, *observers):
                stack.enter_context(observer.observing(model))
            correct, denom, ratios, batches = _sums(strategy, loader, limit, progress)
    if not batches:
        raise ConfigError(f"--features {features}: no batch was read (fewer samples than training.batch_size?)")
    acc = [c / d if d else 0.0 for c, d in zip(correct, denom)]
    return {
        "run": source.label, "checkpoint": source.checkpoint, "features": str(features), "strategy": cfg.training.strategy,
        "batches": batches, "positions": denom[0] if denom else 0,
        "one_pass_acc": acc, "simulated_acc_len": sf.simulated_acc_len(acc),
        "sim": sim.metrics(), "sim_per_step": sim.per_step(),
        "pr": {k: (n / d if d else None) for k, (n, d) in sorted(ratios.items())},
        "pr_counts": {k: [n, d] for k, (n, d) in sorted(ratios.items())},
    }


def _load_draft_weights(strategy, source: DrafterSource) -> None:
    """The checkpoint's (or HF export's) draft weights into the assembled run's drafter (eval mode)."""
    from pr_specforge.training.registration import _unwrap

    module = strategy.trainable_module()
    ckpt = source.checkpoint
    state = _export_weights(ckpt) if source.hf else source.weights
    draft = _unwrap(module).draft_model
    dtypes = {k: v.dtype for k, v in draft.state_dict().items()}
    state = {k: (v.to(dtypes[k]) if k in dtypes and v.is_floating_point() else v) for k, v in state.items()}
    result = draft.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("embed_tokens.")]
    if result.unexpected_keys or missing:
        raise ConfigError(f"{ckpt}: draft weights do not fit the run's drafter (unexpected "
                          f"{sorted(result.unexpected_keys)[:5]}, missing {missing[:5]})")
    module.eval()


def _export_weights(export: str) -> Dict:
    """An export's draft weights as the evaluator loads them (`modeling.load_drafter`: the class its config
    names, so an SGLang export is the plain EAGLE-3 drafter SGLang serves, its `pr_*` tensors skipped), less
    what the files do not hold (an export without --target has no embedding: the target's is kept)."""
    from safetensors import safe_open

    from pr_specforge.modeling import load_drafter

    files = sorted(Path(export).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{export}: no *.safetensors weights in the export")
    stored = set()
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                stored.update(handle.keys())
        model = load_drafter(export)
    except Exception as e:  # a truncated or foreign weight file: the loader's error does not name it
        from pr_specforge.data.io import brief

        raise ConfigError(f"{export}: the export's weights do not load ({brief(e)}); export it again") from None
    return {k: v for k, v in model.state_dict().items() if k in stored}


def _sums(strategy, loader, limit: Optional[int], progress: bool):
    """`(correct, denom, ratios, batches)`: per-TTT-step correct / denominator sums and the
    strategy's ratio metrics as (numerator, denominator) sums, over the loader's batches."""
    import torch
    from tqdm import tqdm

    correct: List[float] = []
    denom: List[float] = []
    ratios: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])
    batches = 0
    with torch.no_grad():
        for batch in tqdm(loader, desc="diagnose", unit="batch", disable=not progress):
            out = strategy.forward_loss(batch)
            m = out.metrics
            for j, (c, d) in enumerate(zip(m["acc_corrects"], m["acc_denoms"])):
                if j == len(correct):
                    correct.append(0.0)
                    denom.append(0.0)
                correct[j] += float(torch.as_tensor(c).sum())
                denom[j] += float(torch.as_tensor(d).sum())
            for key, (num, den) in (out.ratio_metrics or {}).items():
                ratios[key][0] += float(torch.as_tensor(num).sum())
                ratios[key][1] += float(torch.as_tensor(den).sum())
            batches += 1
            if limit is not None and batches >= limit:
                break
    return correct, denom, ratios, batches


def render(report: Dict) -> str:
    """A short text table of one diagnosis."""
    from pr_specforge.training.objective.metrics import CONFIDENCE_BAND_NAMES, RECOVER_TOPK

    lines = [f"{report['run']} @ {os.path.basename(report['checkpoint'])} on {report['features']} "
             f"({report['batches']} batches, {report['positions']:.0f} positions)",
             "one-pass acc per TTT step: " + " ".join(f"{a:.3f}" for a in report["one_pass_acc"])
             + f"  (simulated acc len {report['simulated_acc_len']:.3f})"]
    if report.get("sim"):
        lines.append("simulated acc len (training.simulate): " + "  ".join(
            f"{k.rsplit('acc_len_', 1)[1]} {v:.3f}" for k, v in report["sim"].items()))
    pr = report["pr"]
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in pr if k.startswith("pr/acc_depth_") and k.rsplit("_", 1)[1].isdigit())
    if depths:
        lines.append("mixed rollout      | " + " | ".join(f"depth {r}" for r in depths))
        lines.append("top-1 acc          | " + " | ".join(f"{pr[f'pr/acc_depth_{r}']:.3f}" for r in depths))
        lines.append("q_bar              | " + " | ".join(f"{pr[f'pr/depth_marginal_{r}']:.3f}" for r in depths))
        lines.append("halt share         | " + " | ".join(f"{pr[f'pr/halt_share_depth_{r}']:.3f}" for r in depths))
        moved = [r for r in depths if pr.get(f"pr/feature_change_depth_{r}") is not None]
        if moved:  # does a reconsidered depth compute anything else than depth 0?
            lines.append("||f^r-f^0||/||f^0|| | " + " | ".join("-" if r not in moved else f"{pr[f'pr/feature_change_depth_{r}']:.3f}" for r in depths))
            lines.append("argmax = depth 0's | " + " | ".join("-" if r not in moved else f"{pr[f'pr/argmax_agree_depth_{r}']:.3f}" for r in depths))
        lines.append(f"recovered share of depth-0 misses: {pr['pr/recovered_share']:.3f}")
        if pr.get("pr/recovered_outside_topk") is not None:
            lines.append(f"... of those outside depth 0's top-{RECOVER_TOPK} (a served one-pass miss): {pr['pr/recovered_outside_topk']:.3f}")
        lines.append("by depth-0 confidence | share | halt past 0 | " + " | ".join(f"acc d{r}" for r in depths) + " | recovered")
        for b in CONFIDENCE_BAND_NAMES:
            if pr.get(f"pr/conf_share_{b}") is None:
                continue
            cells = [pr.get(f"pr/conf_share_{b}"), pr.get(f"pr/halt_past_0_{b}"),
                     *(pr.get(f"pr/acc_depth_{r}_{b}") for r in depths), pr.get(f"pr/recovered_share_{b}")]
            lines.append(f"{b:21s} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in cells))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pr-specforge diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from pr_specforge.data.cli import positive_int

    p.add_argument("run_dir", help="a `pr-specforge train` output directory (holds resolved_recipe.yaml), a checkpoint "
                   "directory, or an export (`pr-specforge export --to hf` or `--to sglang`)")
    p.add_argument("--features", required=True, help="held-out feature directory (`pr-specforge data hidden-states`)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the run's newest step)")
    p.add_argument("--target", default=None, help="with an export: the target model directory (default: the features' manifest)")
    p.add_argument("--ttt-length", type=positive_int, default=None, help="with an export: TTT steps of the chain (default: the run's, which the export records; else SpecForge's)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out sample order and the halt-depth sampling "
                   "(a run and its export read the same samples at the same seed)")
    p.add_argument("--json", default=None, help="write the metrics here (atomically; a new file, or --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from pr_specforge.export import ExportError

    from pr_specforge.data.io import DataFormatError, check_writable_file

    try:
        if args.json:  # before any work (data.io's one rule): never one of its inputs, --overwrite or not
            check_writable_file("--json", args.json, overwrite=args.overwrite, fmt="JSON",
                                inputs=drafter_inputs(args.run_dir, args.checkpoint, args.features, args.target))
        report = diagnose(args.run_dir, args.features, args.checkpoint, args.limit, args.seed, not args.no_progress,
                          target=args.target, ttt_length=args.ttt_length)
    except (ConfigError, FileNotFoundError, ExportError, DataFormatError) as e:
        print(f"pr-specforge diagnose: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pr-specforge diagnose: interrupted; nothing was written (rerun the same command)", file=sys.stderr)
        return 130
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, report)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
