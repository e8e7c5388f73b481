"""`pr-specforge diagnose`: a trained checkpoint's objective telemetry on held-out features.

    pr-specforge diagnose RUN_DIR --features HELDOUT_FEATURES [--checkpoint CKPT] [--json OUT]

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

The drafter may be a run directory, a checkpoint directory or an HF export (`drafter_source`;
`pr-specforge headroom` rebuilds drafters the same way, with its own chain observer).

Owns: the aggregation and the table, `drafter_source`, `check_features_fit`. Does not own the metrics' definitions
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


def drafter_source(path: str, checkpoint: Optional[str] = None, features: Optional[str] = None,
                   target: Optional[str] = None, ttt_length: Optional[int] = None) -> DrafterSource:
    """A training run directory (its newest checkpoint, or `checkpoint`), a checkpoint directory (the
    recipe stored in it), or an HF export (`pr-specforge export --to hf`; needs the target: `target`,
    else the one the features' manifest names)."""
    import yaml

    p = Path(path)
    kind = source_kind(path)
    if kind == "run":
        raw = yaml.safe_load((p / "resolved_recipe.yaml").read_text()) or {}
        return DrafterSource(raw, str(p), _resolve_checkpoint(p, checkpoint))
    if checkpoint:
        raise ConfigError(f"--checkpoint needs a run directory; {path} holds no resolved_recipe.yaml")
    if kind == "checkpoint":
        from pr_specforge.export import read_checkpoint, stored_recipe

        raw = stored_recipe(read_checkpoint(str(p)), str(p))
        if raw is None:
            raise ConfigError(f"{path}: the checkpoint carries no recipe and no resolved_recipe.yaml is beside it")
        return DrafterSource(raw, str(p), str(p if p.is_dir() else p.parent))
    return DrafterSource(_export_recipe(p, features, target, ttt_length), str(p), str(p), hf=True)


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
    """The recipe an HF export is rebuilt with: its config as the draft config, the features' vocab map."""
    import json

    from pr_specforge.config import PR_CONFIG_KEY
    from pr_specforge.modeling.drafter import PR_ARCHITECTURE

    cfg = json.loads((export / "config.json").read_text())
    manifest = Path(features or "") / "manifest.json"
    recorded = json.loads(manifest.read_text()) if features and manifest.is_file() else {}
    target = target or (recorded.get("target") or {}).get("path")
    if not target or not Path(target).is_dir():
        raise ConfigError(f"{export} is an HF export: pass --target TARGET_DIR (the target model the features come from)")
    vocab = Path(features or "") / (recorded.get("vocab_mapping") or "vocab_mapping/vocab_mapping.pt")
    pr = (cfg.get("architectures") or [None])[0] == PR_ARCHITECTURE
    raw = {
        "model": {"target_model_path": str(target), "draft_model_config": str(export / "config.json"),
                  "vocab_mapping_path": str(vocab) if vocab.is_file() else "",
                  "torch_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")},  # as exported (as trained)
        "data": {"hidden_states_path": str(features), "max_length": int(recorded.get("max_length") or 2048),
                 "dataloader_num_workers": 0},
        "training": {"strategy": "pr" if pr else "eagle3", "batch_size": 1, "attention_backend": "sdpa",
                     "fsdp_sharding": "NO_SHARD", **({"ttt_length": ttt_length} if ttt_length else {})},
    }
    if pr:
        raw["pr"] = dict(cfg.get(PR_CONFIG_KEY) or {})
    return raw


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
    import json

    path = (raw.get("model") or {}).get("draft_model_config")
    if not path or not os.path.isfile(path):
        return
    draft = json.loads(Path(path).read_text())
    hidden = int(draft.get("target_hidden_size") or draft.get("hidden_size"))
    first = "the first feature file"
    for key, width in (("hidden_state", hidden), ("aux_hidden_state", 3 * hidden)):
        got = int(sample[key].shape[-1]) if key in sample else width
        if got != width:
            raise ConfigError(f"--features {features}: {first} has {key} width {got}, the drafter ({path}) expects "
                              f"{width} (target_hidden_size {hidden}); the features come from another target")
    manifest = Path(features) / "manifest.json"
    vocab = (json.loads(manifest.read_text()).get("target") or {}).get("vocab_size") if manifest.is_file() else None
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
        "training.eval_interval=0",
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
    from pr_specforge import _specforge as sf
    from pr_specforge.training.registration import _unwrap

    module = strategy.trainable_module()
    ckpt = source.checkpoint
    if source.hf:
        from safetensors.torch import load_file

        files = sorted(Path(ckpt).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{ckpt}: no *.safetensors weights in the HF export")
        state = {k: v for f in files for k, v in load_file(str(f)).items()}
    else:
        state = sf.CheckpointManager.read_resume_state(ckpt, require_full_state=False)["draft_state_dict"]
    draft = _unwrap(module).draft_model
    dtypes = {k: v.dtype for k, v in draft.state_dict().items()}
    state = {k: (v.to(dtypes[k]) if k in dtypes and v.is_floating_point() else v) for k, v in state.items()}
    result = draft.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("embed_tokens.")]
    if result.unexpected_keys or missing:
        raise ConfigError(f"{ckpt}: draft weights do not fit the run's drafter (unexpected "
                          f"{sorted(result.unexpected_keys)[:5]}, missing {missing[:5]})")
    module.eval()


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
    p.add_argument("run_dir", help="a `pr-specforge train` output directory (holds resolved_recipe.yaml)")
    p.add_argument("--features", required=True, help="held-out feature directory (`pr-specforge data hidden-states`)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the run's newest step)")
    p.add_argument("--limit", type=int, default=None, help="at most this many batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the halt-depth sampling")
    p.add_argument("--json", default=None, help="write the metrics here (atomically)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from pr_specforge.export import ExportError

    try:
        report = diagnose(args.run_dir, args.features, args.checkpoint, args.limit, args.seed, not args.no_progress)
    except (ConfigError, FileNotFoundError, ExportError) as e:
        print(f"pr-specforge diagnose: {e}", file=sys.stderr)
        return 2
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, report)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
