"""What the studies under `benchmarks/` share (`regimes.py`, `pilots.py`, `best.py`): where the repository, its
recipes and committed results are; the final evaluation's prompt sets; the served tree's settings; the pilots'
best PR options; and how a warm start and its matched EAGLE-3 baseline continue one checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import List

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes"
RESULTS = REPO_ROOT / "benchmarks" / "results"
#: the final evaluation's prompt sets (`eval --prompts`)
SETS = ("mtbench", "gsm8k", "humaneval")
#: the pilots' best PR options (`warm-isolated-separate-adapter16` without its warm start): the second head is
#: trained in isolation from the one-pass drafter, with a rank-16 adapter
ISOLATED_SEPARATE_ADAPTER16 = ("pr.recon_grad=isolated", "pr.recon_head=separate", "pr.recon_adapter_rank=16")


def tree_args(bw: int = 6) -> List:
    """`eval`'s tree settings of the studies' served comparisons: width 6, B_w `bw`, gamma 8, m 3."""
    return ["--k", 6, "--bw", bw, "--gamma", 8, "--m", 3]


def continue_from(checkpoint, pr: bool) -> str:
    """The override that starts a training from an EAGLE-3 `checkpoint` (with a fresh optimiser): a PR drafter's
    one-pass weights (`pr.init_from`), or its matched EAGLE-3 baseline's (SpecForge's `model.draft_checkpoint_path`),
    so the two train as many total steps from the same weights."""
    return f"pr.init_from={checkpoint}" if pr else f"model.draft_checkpoint_path={checkpoint}"
