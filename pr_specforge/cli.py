"""`pr-specforge`: one console script, heavy imports inside each branch (fast `--help`).

    pr-specforge train -c RECIPE.yaml [section.field=value ...] [pr.field=value ...]
    pr-specforge data {conversations,regenerate,hidden-states,smollm2-target,validate} ...
    pr-specforge export CKPT OUT_DIR --to {sglang,hf,vllm}
    pr-specforge eval --target DIR --draft NAME=DIR ... --prompts mtbench ...
    pr-specforge plot RUN_DIR
    pr-specforge run [--workdir DIR] [--conversations N] [--max-steps N] ...   # SmolLM2 on CPU, end to end
    pr-specforge diagnose RUN_DIR --features DIR
    pr-specforge headroom DRAFTER --features DIR --out PREFIX   # the paper's Figure 1 / Table 7 on held-out features
    pr-specforge experiment --workdir DIR      # the SmolLM2 EAGLE-3 vs PR experiment
    pr-specforge control --recipe RECIPE.yaml  # does the recipe's PR objective learn a second pass? (exit 1: no)

Under torchrun every rank runs `python -m pr_specforge.cli train ...`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, List, Optional

# Sub-commands whose argument parsing lives with their entry function (they take the rest of argv).
_DELEGATED = {
    "data": "prepare data: conversations, regeneration, hidden states, validation",
    "eval": "offline acceptance-length evaluation (EAGLE-3 vs PR)",
    "export": "export a training checkpoint for SGLang, vLLM or as an HF directory",
    "plot": "render a run's metrics JSONL to PNG",
    "run": "the embedded default: SmolLM2-135M on CPU, prepare -> train -> export -> evaluate",
    "diagnose": "a checkpoint's per-depth accuracy, gate use and recovered share on held-out features",
    "headroom": "can reconsideration pay? acceptance by confidence, the reject pool, what PR recovers (Fig. 1 / Table 7)",
    "experiment": "the SmolLM2 EAGLE-3 vs PR experiment (resumable stages)",
    "control": "a positive control: does a recipe's PR objective learn a second pass? (minutes on CPU)",
}


def _entry(command: str) -> Callable[[List[str]], int]:
    """A delegated sub-command's `main(argv)`, imported only when that command runs."""
    if command == "data":
        from pr_specforge.data.cli import main
    elif command == "eval":
        from pr_specforge.eval.cli import main
    elif command == "export":
        from pr_specforge.export_vllm import main
    elif command == "plot":
        from pr_specforge.training.telemetry import main
    elif command == "run":
        from pr_specforge.pipeline import main
    elif command == "diagnose":
        from pr_specforge.training.diagnose import main
    elif command == "headroom":
        from pr_specforge.eval.headroom import main
    elif command == "control":
        from pr_specforge.control.cli import main
    else:
        from pr_specforge.experiment import main
    return main


_TRAIN_FLAGS = ("--dry-run", "--start-over")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pr-specforge", description="Parallel Reconsideration drafters on SpecForge")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a drafter from a recipe (SpecForge config + pr: section)")
    train.add_argument("-c", "--config", required=True, help="recipe YAML")
    train.add_argument("--dry-run", action="store_true", help="load and validate the recipe, then stop")
    train.add_argument("--start-over", action="store_true",
                       help="discard the checkpoints and metrics already in output_dir and train from step 0 "
                            "(without it, a run directory holding checkpoints is resumed from the newest)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=20 pr.max_depth=2")
    for name, help_text in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _configure_compile() -> None:
    """On CPU, run SpecForge's `torch.compile`d helpers eagerly unless the user chose otherwise.

    Compiling them costs ~10 s per new shape on CPU and buys nothing at these sizes; on CUDA
    they stay compiled. `TORCHDYNAMO_DISABLE=0/1` in the environment always wins.
    """
    import os

    if "TORCHDYNAMO_DISABLE" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        import torch._dynamo

        torch._dynamo.config.disable = True


class _Interrupts:
    """Ctrl-C as Python's default handler takes it (KeyboardInterrupt), remembered: an interrupt inside an
    import can surface as another error (a half-imported module's ImportError), still an interrupt."""

    seen = False

    @classmethod
    def install(cls) -> None:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, cls._handle)

    @classmethod
    def _handle(cls, signum, frame):
        cls.seen = True
        raise KeyboardInterrupt


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _Interrupts.seen = False
    _Interrupts.install()
    try:
        return _main(argv)
    except Exception:
        if not _Interrupts.seen:  # else: the error an interrupt caused (e.g. mid-import), said as the interrupt
            raise
    except KeyboardInterrupt:  # before a command's own handler (e.g. while importing): nothing was written
        pass
    print(f"pr-specforge {argv[0] if argv else ''}: interrupted".replace("  ", " "), file=sys.stderr)
    return 130


def _main(argv: List[str]) -> int:
    if not {"-h", "--help"} & set(argv):
        _configure_compile()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in _DELEGATED:
        return int(_entry(argv[0])(argv[1:]) or 0)
    if argv and argv[0] == "train":  # flags may follow the overrides (`train -c R x.y=1 --start-over`)
        flags = [a for a in argv[1:] if a in _TRAIN_FLAGS]
        argv = [argv[0], *flags, *(a for a in argv[1:] if a not in _TRAIN_FLAGS)]
    args = _parser().parse_args(argv)
    if args.command == "train":
        from pr_specforge.config import ConfigError
        from pr_specforge.data.io import DataFormatError
        from pr_specforge.lock import OutputBusy
        from pr_specforge.training.errors import NonFiniteTraining, RankFailed, TrainingInterrupted
        from pr_specforge.training.train import hand_to_launcher, run_train

        def say(error: Exception, code: int) -> int:
            if not hand_to_launcher(str(error), code):  # a self-launched rank: the launcher says it, once
                print(f"pr-specforge train: {error}", file=sys.stderr)
            return code

        try:
            return run_train(args.config, args.overrides, dry_run=args.dry_run, start_over=args.start_over)
        except (ConfigError, DataFormatError, OutputBusy) as e:  # a recipe value, a row of its data, a second writer
            return say(e, 2)
        except NonFiniteTraining as e:
            return say(e, 1)
        except RankFailed as e:  # what a rank of a self-launched run handed over
            return say(e, e.code)
        except TrainingInterrupted as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"pr-specforge train: {e}", file=sys.stderr)
            return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
