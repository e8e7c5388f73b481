"""`pr-specforge eval`: acceptance length, speed and losslessness of drafters on prompt sets.

    pr-specforge eval --target TARGET_DIR --draft eagle3=DIR --draft pr=DIR \
        --prompts mtbench gsm8k humaneval --budget 24 48 --temperature 0 1 \
        --max-new-tokens 256 --limit 20 --out-dir runs/eval --json runs/eval/summary.json

Per-prompt rows go to OUT_DIR/results.jsonl (a rerun skips prompts already there, when made with the
same settings, drafter files and prompt text; otherwise it says what changed, and --start-over discards them);
the summary, report.md and plots are rewritten from all rows at the end (--json: a new file, or an earlier
eval summary, recognised by its "kind" marker; any other file there is refused before any work).
Exit codes: 0 ok, 2 bad arguments or inputs, 3 a temperature-0 output was not lossless, 130 interrupted.

speedup = tokens/s of speculative decoding over the target's own autoregressive decoding, on the
device used. Below 1x means drafting plus tree verification cost more time than the accepted tokens
save: expected on a CPU, where verifying a B-node tree costs several times one decode step (a GPU
verifies it in about the time of one step). tau (tokens accepted per round) is the
device-independent measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (transformers layout, with tokenizer)")
    p.add_argument("--draft", action="append", required=True, metavar="NAME=DIR", help="a drafter (repeatable)")
    p.add_argument("--prompts", nargs="+", required=True, help="mtbench | gsm8k | humaneval | PATH.jsonl (several allowed)")
    p.add_argument("--budget", nargs="+", type=int, default=[24, 48],
                   help="global-cut budgets B: the B highest-scoring draft nodes the target verifies per round")
    p.add_argument("--temperature", nargs="+", type=float, default=[0.0],
                   help="sampling temperatures T; at T = 0 every output is checked token for token against "
                        "the target's own greedy decode (exit 3 if one differs)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per user turn")
    p.add_argument("--limit", type=int, default=None, help="prompts per set")
    p.add_argument("--skip", type=int, default=0,
                   help="skip the first N prompts of each set (e.g. 40: a pilot check disjoint from a 40-prompt evaluation)")
    p.add_argument("--json", default=None, help="write the summary JSON here (a new file, or an earlier eval summary, "
                   "which a rerun rewrites; any other file that exists is refused)")
    p.add_argument("--out-dir", default="eval_out", help="per-prompt JSONL, report.md and plots")
    p.add_argument("--device", default="cpu", help="torch device for the target and the drafters (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of the target and the drafters")
    p.add_argument("--k", type=int, default=6, help="children each forwarded tree node offers (its top-k tokens)")
    p.add_argument("--bw", type=int, default=6,
                   help="beam width B_w: the highest-scoring nodes of the previous step forwarded at each step")
    p.add_argument("--gamma", type=int, default=8, help="drafting steps per round (the deepest draft token's depth)")
    p.add_argument("--m", type=int, default=3,
                   help="PR: pooled nodes carried one reconsideration depth deeper per drafting step (the m "
                        "highest bids); --m 0 turns reconsideration off, so a PR drafter drafts EAGLE-3's tree")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed at T > 0 (prompt i uses seed + i, the same for every drafter)")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="multi-turn prompts: the first user turn only, or every turn (each reply joins the history)")
    p.add_argument("--tree-builder", choices=["tensor", "object"], default="tensor",
                   help="draft-tree builder: tensor (default) or the object reference (same trees, slower)")
    p.add_argument("--batch-prompts", type=int, default=1, metavar="N",
                   help="decode N prompts together: each round drafts their trees as one batch (one host read per "
                        "round; the same outputs and acceptance as one by one; drafting time shared per round)")
    p.add_argument("--also-one-pass", action="store_true", help="also serve each PR drafter as plain EAGLE (NAME/one-pass)")
    p.add_argument("--decompose", action="store_true",
                   help="diagnostic: per round, also build the m=0 tree from the same drafter state and count frontier "
                        "slots taken by reconsidered branches, one-pass nodes displaced from the cut and accepted tokens "
                        "only reconsideration put under the cut (timings then include the extra tree: not speed numbers)")
    p.add_argument("--start-over", action="store_true",
                   help="discard the per-prompt rows already in --out-dir (without it they are reused, and refused "
                        "if made with other settings, drafter files or prompt text)")
    p.add_argument("--baseline-from", action="append", default=[], metavar="DIR",
                   help="reuse the target's own decodes of another --out-dir (repeatable) made with the same target, "
                        "--dtype, --max-new-tokens and --turns, for the same prompt text and, at T > 0, the same seed; "
                        "they are copied into this --out-dir (saves one target decode per prompt and temperature)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def select_prompts(source: str, skip: int, limit: Optional[int], turns: str) -> list:
    """Prompts `skip .. skip + limit - 1` of a set (all after `skip` without a limit)."""
    from pr_specforge.data.prompts import load_prompts

    prompts = load_prompts(source, limit=None if limit is None else skip + limit, turns=turns)[skip:]
    if not prompts:
        raise ValueError(f"prompts {source!r}: no usable prompt" + (f" after --skip {skip}" if skip else ""))
    return prompts


#: the marker (`data.io.own_kind`) of the summary `--json` writes: a rerun rewrites a file carrying it, and no other
EVAL_SUMMARY_KIND = "pr_specforge.eval_summary"


def check_summary_path(path: str, out_dir: str, inputs=()) -> None:
    """`--json`, before any work: a new file, or an earlier eval summary, which this run rewrites from all rows as it
    rewrites OUT_DIR's report. An earlier summary is recognised by its marker (`EVAL_SUMMARY_KIND`); one without it
    (written before the marker) only inside OUT_DIR when OUT_DIR is an eval out-dir (holds eval's own
    `eval_config.json`), whose report and plots eval rewrites anyway. Any other file that exists (a user's notes, a
    recipe, a results file of another command), one of this run's `inputs` (the target, a drafter, a prompt file,
    OUT_DIR's rows), a read-only file, a directory or a path under a file is refused in one line naming it."""
    from pr_specforge.data.io import check_writable_file
    from pr_specforge.eval.evaluator import PROVENANCE_FILE, ROW_FILES

    own_dir = out_dir if os.path.isfile(os.path.join(out_dir, PROVENANCE_FILE)) else None
    rows = [os.path.join(out_dir, name) for name in (*ROW_FILES, PROVENANCE_FILE)]
    check_writable_file("--json", path, kind=EVAL_SUMMARY_KIND, what="an eval summary", inputs=[*inputs, *rows],
                        own_dir=own_dir, fmt="JSON")


def run_inputs(args: argparse.Namespace, lent: bool = True) -> list:
    """What eval reads: the target, each drafter, the prompt files named by path, and (`lent`) the out-dirs lending
    baselines (left out for OUT_DIR itself: a folder lent its own target decodes only reads them again)."""
    return [args.target, *(spec.partition("=")[2] for spec in args.draft),
            *(p for p in args.prompts if os.path.exists(p)), *(args.baseline_from if lent else ())]


def check_args(args: argparse.Namespace) -> None:
    """The arguments' own checks, before any work: one ValueError line each."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.skip < 0:
        raise ValueError(f"--skip must be >= 0, got {args.skip}")
    if args.batch_prompts < 1:
        raise ValueError(f"--batch-prompts must be >= 1, got {args.batch_prompts}")
    from pr_specforge.data.io import check_output_dir

    check_output_dir("--out-dir", args.out_dir, inputs=run_inputs(args, lent=False))
    if args.json:
        check_summary_path(args.json, args.out_dir, run_inputs(args))


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pr_specforge.eval.evaluator import (
        EvalSettings,
        Evaluator,
        LosslessnessError,
        borrowed_baselines,
        check_out_dir,
        discard_rows,
        load_draft_entries,
        provenance,
        load_target,
    )
    from pr_specforge.eval.report import markdown_table, write_report
    from pr_specforge.serving import TreeConfig

    dtype = getattr(torch, args.dtype)
    try:
        check_args(args)
        settings = EvalSettings(
            budgets=args.budget,
            temperatures=args.temperature,
            max_new_tokens=args.max_new_tokens,
            shape=TreeConfig(k=args.k, bw=args.bw, gamma=args.gamma, m=args.m),
            seed=args.seed,
            turns=args.turns,
            tree_builder=args.tree_builder,
            decompose=args.decompose,
            batch_prompts=args.batch_prompts,
        )
        prompt_sets = {}
        for source in args.prompts:
            name = os.path.splitext(os.path.basename(source))[0] if os.path.exists(source) else source.lower()
            prompts = select_prompts(source, args.skip, args.limit, args.turns)
            prompt_sets[name] = prompts
        target, tokenizer = load_target(args.target, args.device, dtype)
        drafts = load_draft_entries(args.draft, args.device, dtype, args.also_one_pass)
        evaluator = Evaluator(target, tokenizer, drafts, settings, args.out_dir, progress=not args.no_progress)
        paths = dict(spec.partition("=")[::2] for spec in args.draft)
        current = provenance(settings, args.target, paths, args.dtype)
        evaluator.borrowed = borrowed_baselines(args.baseline_from, current)  # refused before --out-dir is touched
        if args.start_over:
            discard_rows(args.out_dir)
        check_out_dir(args.out_dir, current)
    except (ValueError, FileNotFoundError) as e:
        print(f"pr-specforge eval: {e}", file=sys.stderr)
        return 2
    try:
        summary = evaluator.run(prompt_sets)
    except ValueError as e:  # rows of an edited prompt (`check_prompts`)
        print(f"pr-specforge eval: {e}", file=sys.stderr)
        return 2
    except LosslessnessError as e:
        print(f"pr-specforge eval: NOT LOSSLESS: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"pr-specforge eval: interrupted; the finished prompts are kept in {args.out_dir}/results.jsonl; "
              "rerun the same command to evaluate the rest", file=sys.stderr)
        return 130
    write_report(summary, args.out_dir)
    if args.json:
        from pr_specforge.data.io import atomic_write_json, own_kind

        atomic_write_json(args.json, {**own_kind(EVAL_SUMMARY_KIND), **summary})
    print(markdown_table(summary))
    print(SPEEDUP_NOTE)
    failed = [f"{e['draft']} B={e['budget']} on {e['set']}" for e in summary["results"] if e["lossless"] is False]
    if failed:  # rows stored by an earlier run count as much as this run's: every run that reports them fails
        print(f"pr-specforge eval: NOT LOSSLESS: {', '.join(failed)}: a speculative output in {args.out_dir}/results.jsonl "
              "differs from the target's greedy decode at temperature 0", file=sys.stderr)
        return 3
    return 0


SPEEDUP_NOTE = ("speedup: tokens/s over the target's own decoding on this device; below 1x, drafting and tree "
                "verification cost more than they save here (usual on a CPU, where verifying a B-node tree costs "
                "several decode steps); tau is the device-independent measure.")


if __name__ == "__main__":
    raise SystemExit(main())
