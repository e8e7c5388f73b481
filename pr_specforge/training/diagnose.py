"""`pr-specforge diagnose`: a trained checkpoint's objective telemetry on held-out features.

    pr-specforge diagnose RUN_DIR --features HELDOUT_FEATURES [--checkpoint CKPT] [--json OUT]

Answers, on features the drafter never trained on: does the gate open (halt past depth 0,
per depth-0 confidence band)? Do reconsidered depths out-predict depth 0 (top-1 accuracy per
depth, and the share of depth-0 misses some depth recovers)? And the one-pass chain's
per-TTT-step accuracy with SpecForge's simulated acceptance length, for EAGLE-3 runs too, so
two drafters trained on the same data compare on the same held-out positions.

How: the run's resolved recipe is rebuilt by SpecForge's own assembly with the held-out
features as its training data (so batches are prepared exactly as in training), the
checkpoint's draft weights are loaded, and the strategy's `forward_loss` runs over every
batch under `no_grad` in eval mode. PR's telemetry comes out as (numerator, denominator)
sums; they are summed over the whole set before dividing.

Owns: the aggregation and the table. Does not own the metrics' definitions
(`pr_specforge.training.objective.ttt`) or the data pipeline (SpecForge's).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from pr_specforge.config import ConfigError


def _resolve_checkpoint(run_dir: Path, checkpoint: Optional[str]) -> str:
    from pr_specforge.training.preflight import latest_checkpoint

    if checkpoint:
        if not Path(checkpoint).exists():
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no such checkpoint")
        return checkpoint
    return latest_checkpoint(run_dir)


def diagnose(run_dir: str, features: str, checkpoint: Optional[str] = None, limit: Optional[int] = None,
             seed: int = 0, progress: bool = True) -> Dict:
    """Run the checkpoint's training objective over `features` without updating it; return the metrics."""
    import yaml

    from pr_specforge.training.preflight import check_feature_dir

    run = Path(run_dir)
    recipe_path = run / "resolved_recipe.yaml"
    if not recipe_path.exists():
        raise FileNotFoundError(f"{run}: no resolved_recipe.yaml; is this a `pr-specforge train` output directory?")
    check_feature_dir("--features", features, None, None)
    ckpt = _resolve_checkpoint(run, checkpoint)
    raw = yaml.safe_load(recipe_path.read_text())
    if (raw.get("training") or {}).get("strategy") != "pr":
        raw.pop("pr", None)  # eagle3 runs trained before c2ad539 wrote a pr: section, which load_recipe refuses
    data = raw.get("data") or {}
    if data.pop("online", None):  # an online run: diagnose reads the held-out feature files instead
        data.pop("online_dtype", None)
        data["train_data_path"] = ""
    with tempfile.TemporaryDirectory(prefix="pr-diagnose-") as scratch:
        recipe_path = Path(scratch) / "resolved_recipe.yaml"
        recipe_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return _diagnose(recipe_path, scratch, run, ckpt, features, limit, seed, progress)


def _diagnose(recipe_path: Path, scratch: str, run: Path, ckpt: str, features: str, limit: Optional[int],
              seed: int, progress: bool) -> Dict:
    import dataclasses

    import torch

    from pr_specforge import _specforge as sf
    from pr_specforge.training.recipe import load_recipe
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
    with assembled_run(recipe) as (strategy, loader):
        _load_draft_weights(strategy, ckpt)
        torch.manual_seed(seed)
        correct, denom, ratios, batches = _sums(strategy, loader, limit, progress)
    if not batches:
        raise ConfigError(f"--features {features}: no batch was read (fewer samples than training.batch_size?)")
    acc = [c / d if d else 0.0 for c, d in zip(correct, denom)]
    return {
        "run": str(run), "checkpoint": ckpt, "features": str(features), "strategy": cfg.training.strategy,
        "batches": batches, "positions": denom[0] if denom else 0,
        "one_pass_acc": acc, "simulated_acc_len": sf.simulated_acc_len(acc),
        "pr": {k: (n / d if d else None) for k, (n, d) in sorted(ratios.items())},
        "pr_counts": {k: [n, d] for k, (n, d) in sorted(ratios.items())},
    }


def _load_draft_weights(strategy, ckpt: str) -> None:
    """The checkpoint's draft weights into the assembled run's drafter (eval mode)."""
    from pr_specforge import _specforge as sf
    from pr_specforge.training.registration import _unwrap

    module = strategy.trainable_module()
    state = sf.CheckpointManager.read_resume_state(ckpt, require_full_state=False)["draft_state_dict"]
    result = _unwrap(module).draft_model.load_state_dict(state, strict=False)
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
    pr = report["pr"]
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in pr if k.startswith("pr/acc_depth_") and k.rsplit("_", 1)[1].isdigit())
    if depths:
        lines.append("mixed rollout      | " + " | ".join(f"depth {r}" for r in depths))
        lines.append("top-1 acc          | " + " | ".join(f"{pr[f'pr/acc_depth_{r}']:.3f}" for r in depths))
        lines.append("q_bar              | " + " | ".join(f"{pr[f'pr/depth_marginal_{r}']:.3f}" for r in depths))
        lines.append("halt share         | " + " | ".join(f"{pr[f'pr/halt_share_depth_{r}']:.3f}" for r in depths))
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
    try:
        report = diagnose(args.run_dir, args.features, args.checkpoint, args.limit, args.seed, not args.no_progress)
    except (ConfigError, FileNotFoundError) as e:
        print(f"pr-specforge diagnose: {e}", file=sys.stderr)
        return 2
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, report)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
