"""`pr-specforge eval --batch-prompts N`: prompts decoded together (their trees drafted as one batch per round)
give the rows that one-by-one decoding gives, timings aside; bad settings and resumes are refused."""

import json

import pytest

from pr_specforge.eval.cli import main
from pr_specforge.eval.evaluator import EvalSettings
from tests.eval.test_eval_cli import base_args, dirs  # noqa: F401 (dirs: a fixture)

TIMINGS = ("draft_s", "verify_s", "total_s", "ar_s")


def rows(out):
    lines = (out / "results.jsonl").read_text().splitlines()
    return {(r["draft"], r["budget"], r["temperature"], r["prompt"]): {k: v for k, v in r.items() if k not in TIMINGS}
            for r in map(json.loads, lines)}


def pr_args(root, out):
    """`test_eval_cli`'s arguments with the PR drafter only."""
    args = base_args(root, out)
    i = args.index(f"eagle3={root / 'eagle'}")
    return args[: i - 1] + args[i + 1 :]


def test_batched_prompts_give_the_one_by_one_rows(dirs, tmp_path, capsys):
    extra = ["--budget", "12", "--temperature", "0", "1", "--turns", "all", "--limit", "3"]
    one, many = tmp_path / "one", tmp_path / "many"
    assert main(pr_args(dirs, one) + extra) == 0
    assert main(pr_args(dirs, many) + extra + ["--batch-prompts", "3", "--baseline-from", str(one)]) == 0
    got, ref = rows(many), rows(one)
    assert len(ref) == 2 * 3 and got == ref  # two temperatures, three prompts (one of them of two turns)
    assert sum(r["recon_kept"] for r in got.values()) > 0
    assert json.loads((many / "eval_config.json").read_text())["shared"]["batch_prompts"] == 3
    capsys.readouterr()
    assert main(pr_args(dirs, one) + extra + ["--batch-prompts", "2"]) == 2  # rows made one by one: not resumed batched
    assert "field 'batch_prompts'" in capsys.readouterr().err


def test_batch_prompts_needs_the_tensor_builder():
    for bad in (dict(batch_prompts=0), dict(batch_prompts=2, tree_builder="object"), dict(batch_prompts=2, decompose=True)):
        with pytest.raises(ValueError, match="batch_prompts"):
            EvalSettings(**bad)
