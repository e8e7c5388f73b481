"""The regime study's definitions: GSM8K's disjoint splits by index, the drafters and their matched baselines, the
report folders and the cells a verdict reads; and the two data steps of the study's own (the GSM8K splits, the chat
regime's shortest prompts).

Owns: what each regime trains and serves. Does not own the stages (`regime_stages`, `regime_serves`) or the rules
the verdict applies (`regime_verdict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .common import ISOLATED_SEPARATE_ADAPTER16, RECIPES

#: GSM8K test-split indices of each disjoint set (half-open ranges)
SPLITS: Dict[str, range] = {"train": range(40, 1040), "screen": range(1040, 1160), "report": range(1160, 1319)}
#: `pr-warm`'s options: the pilots' best variant
WARM_OPTIONS = list(ISOLATED_SEPARATE_ADAPTER16)
#: paper-pr.yaml's options that only trade memory for compute (same gradients): left out of the CPU regime, whose
#: 135M drafter fits without them; each would cost a further forward of M per call
MEMORY_ONLY = ("gradient_checkpointing",)


def paper_options(path: Path = RECIPES / "_base" / "paper-pr.yaml") -> List[str]:
    """The paper's PR options (`recipes/_base/paper-pr.yaml`'s `pr:` section) as overrides of the SmolLM2 CPU recipe,
    read from that file so the regime trains what the paper recipes do (less `MEMORY_ONLY`)."""
    import yaml

    pr = (yaml.safe_load(path.read_text()) or {}).get("pr") or {}
    return [f"pr.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in pr.items() if k not in MEMORY_ONLY]


#: the PR drafters, by name: (overrides of the SmolLM2 CPU PR recipe, warm: starts on this seed's `eagle3`). A from-
#: scratch drafter's matched baseline is `eagle3` (the same epochs), a warm start's `eagle3-long` (the same `eagle3`
#: checkpoint trained as many epochs more). One more variant is one more line here (e.g. the positive control's
#: favoured options, issue 40: `"pr-paper-mixed": ([*PAPER_OPTIONS, "pr.one_pass_loss_on_mixed=true"], False)`).
PAPER_OPTIONS = paper_options()
PR_VARIANTS: Dict[str, Tuple[List[str], bool]] = {
    "pr": ([], False),                       # the default PR recipe
    "pr-warm": (WARM_OPTIONS, True),         # the pilots' best: isolated, second head, rank-16 adapter
    "pr-paper": (PAPER_OPTIONS, False),      # the paper's options (issue 40), from scratch
    "pr-paper-warm": (PAPER_OPTIONS, True),  # the paper's options with full gradients, on this seed's eagle3
}
#: drafter -> (recipe, extra overrides, warm start: None | "pr" (pr.init_from) | "eagle3" (SpecForge's draft_checkpoint_path))
DRAFTERS: Dict[str, tuple] = {
    "eagle3": ("smollm2-135m-cpu-eagle3.yaml", [], None),
    "eagle3-2layer": ("smollm2-135m-cpu-eagle3-2layer.yaml", [], None),
    **{name: ("smollm2-135m-cpu.yaml", list(options), "pr" if warm else None) for name, (options, warm) in PR_VARIANTS.items()},
    "eagle3-long": ("smollm2-135m-cpu-eagle3.yaml", [], "eagle3"),
}
#: PR drafter -> its matched EAGLE-3 baseline (trained as many total steps on the same data)
BASELINE = {name: "eagle3-long" if warm else "eagle3" for name, (_, warm) in PR_VARIANTS.items()}
#: `--until`: the stage groups, in the order they run
STAGE_GROUPS = ("data", "train", "screen", "report")
#: the report serves: (folder, who (`GSM8KRegime.report_drafters`), B, temperatures, B_w), in the order they run
REPORT_DIRS = (("report-b48", "b48", 48, [0, 1], 6), ("report-b24", "verdict", 24, [0], 6),
               ("report-b48-2layer", "two_layer", 48, [0], 6), ("report-bw9-b48", "bw9", 48, [0, 1], 9))
REPORT_FOLDERS = tuple(d[0] for d in REPORT_DIRS)
#: the cells (B, T) of a seed's report serves
CELLS = ((48, 0.0), (24, 0.0), (48, 1.0))
#: the screening serve's one cell
SCREEN_CELLS = ((48, 0.0),)


def gsm8k_problems() -> List[str]:
    """The 1,319 GSM8K test questions, in file order (index = line number)."""
    from pr_specforge.data.prompts import load_prompts

    return [p.turns[0] for p in load_prompts("gsm8k")]


def write_splits(out_dir: Path) -> None:
    """`train.jsonl`, `screen.jsonl`, `report.jsonl`: one single-turn conversation per problem, id `gsm8k-INDEX`
    (the `data regenerate` input and, for screen/report, an `eval --prompts` file)."""
    from pr_specforge.data.io import atomic_write_text

    problems = gsm8k_problems()
    if len(problems) != 1319:
        raise ValueError(f"gsm8k: expected the 1,319-problem test split, found {len(problems)} problems")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, idx in SPLITS.items():
        rows = [json.dumps({"id": f"gsm8k-{i}", "conversations": [{"role": "user", "content": problems[i]}]},
                           ensure_ascii=False) for i in idx]
        atomic_write_text(out_dir / f"{name}.jsonl", "\n".join(rows) + "\n")
    atomic_write_text(out_dir / "splits.json", json.dumps(
        {name: [idx.start, idx.stop - 1] for name, idx in SPLITS.items()}, indent=1) + "\n")


def keep_shortest(src: Path, dst: Path, keep: int, max_prompt_chars: int) -> None:
    """Write the `keep` conversations of `src` that `data regenerate` would take first (the usable ones, shortest
    prompt first, as its batches run) to `dst`, in `src`'s order: so regenerating `dst` forms the same batches a
    regeneration of `src` stopped after `keep` conversations did (the pilots' data)."""
    from pr_specforge.data.io import atomic_write_text
    from pr_specforge.data.regenerate import prompt_chars, usable_rows

    rows = usable_rows(src, max_prompt_chars)
    if len(rows) < keep:
        raise ValueError(f"{src}: {len(rows)} usable conversations (prompts of at most {max_prompt_chars} characters), "
                         f"fewer than --keep {keep}")
    kept = {r["id"] for r in sorted(rows, key=lambda r: prompt_chars(r["conversations"]))[:keep]}
    atomic_write_text(dst, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows if r["id"] in kept))


def report_rounds(limit: int, step: Optional[int]) -> List[int]:
    """The problem counts the report serves stop at: step, 2 step, ..., limit (just `limit` without a step)."""
    if step is not None and step < 1:
        raise ValueError(f"--report-step must be at least 1, not {step}")
    return list(range(step, limit, step)) + [limit] if step else [limit]
