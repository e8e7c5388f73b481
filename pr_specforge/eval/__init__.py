"""Offline evaluation of drafters: acceptance length, speed, losslessness, diagnostics."""

from pr_specforge.eval.evaluator import (  # noqa: F401
    DraftEntry,
    EvalSettings,
    Evaluator,
    LosslessnessError,
    load_draft_entries,
    load_target,
    summarize,
)
