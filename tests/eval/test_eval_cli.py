"""`pr-specforge eval` end to end on tiny random models: losslessness, JSON, report, resume, bad input."""

import json
import os

import pytest

from pr_specforge.eval.cli import main
from tests.helpers import make_drafters
from tests.serving.test_serving_tree import eager_gate, sharpen, strong_self_query, tiny_target

WORDS = "the a cat dog sat on mat what is two plus three write code for sorting list numbers tell me story".split()


def save_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target = tiny_target(seed=2)
    target.save_pretrained(root / "target")
    save_tokenizer(str(root / "target"), target.config.vocab_size)
    eagle, pr, _ = make_drafters(max_depth=2)
    sharpen(eagle, pr)
    strong_self_query(pr)
    eager_gate(pr, -2.0)
    eagle.save_pretrained(root / "eagle")
    pr.save_pretrained(root / "pr")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "p0", "prompt": "the cat sat on the mat"},
                {"id": "p1", "turns": ["what is two plus three", "tell me a story"]},
                {"id": "p2", "prompt": "write code for sorting a list of numbers"},
            ]
        )
        + "\n"
    )
    return root


def base_args(root, out):
    return [
        "--target", str(root / "target"),
        "--draft", f"eagle3={root / 'eagle'}",
        "--draft", f"pr={root / 'pr'}",
        "--prompts", str(root / "prompts.jsonl"),
        "--max-new-tokens", "16", "--limit", "2", "--gamma", "4",
        "--out-dir", str(out), "--no-progress",
    ]


def test_eval_end_to_end_lossless_json_report_and_resume(dirs, tmp_path):
    out = tmp_path / "out"
    args = base_args(dirs, out) + ["--budget", "4", "12", "--temperature", "0", "1", "--turns", "all", "--json", str(out / "s.json")]
    assert main(args) == 0
    summary = json.loads((out / "s.json").read_text())
    entries = summary["results"]
    assert len(entries) == 2 * 2 * 2  # drafters x budgets x temperatures (one prompt set)
    for e in entries:
        for key in ("tau", "rounds", "tokens", "draft_s_per_round", "verify_s_per_round", "tokens_per_s",
                    "ar_tokens_per_s", "speedup", "per_prompt_tau"):
            assert key in e
        assert e["tau"] >= 1.0 and set(e["per_prompt_tau"]) == {"p0", "p1"}
        assert e["lossless"] is (True if e["temperature"] == 0 else None)
    pr_rows = [e for e in entries if e["draft"] == "pr"]
    assert sum(sum(c[0] for row in e["recover"] for c in row) for e in pr_rows) > 0
    for name in ("report.md", "tau.png", "acceptance_by_confidence.png", "recovered_by_bucket.png"):
        assert os.path.isfile(out / name)
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2 * 2
    # a rerun skips every prompt already in results.jsonl
    assert main(args) == 0
    assert (out / "results.jsonl").read_text().splitlines() == lines


def test_prompts_file_without_usable_prompt_is_a_clear_error(dirs, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = base_args(dirs, tmp_path / "o")
    args[args.index("--prompts") + 1] = str(empty)
    assert main(args) == 2
    assert "no usable prompt" in capsys.readouterr().err


def test_bad_budget_and_k_are_clear_errors(dirs, tmp_path, capsys):
    assert main(base_args(dirs, tmp_path / "o") + ["--budget", "0"]) == 2
    assert "budget" in capsys.readouterr().err
    assert main(base_args(dirs, tmp_path / "o") + ["--k", "1000"]) == 2
    assert "draft_vocab_size" in capsys.readouterr().err


def test_mismatched_drafter_is_a_clear_error(dirs, tmp_path, capsys):
    other, _, _ = make_drafters(vocab_size=120)
    other.save_pretrained(tmp_path / "other")
    args = base_args(dirs, tmp_path / "o")
    args[args.index("--draft") + 1] = f"bad={tmp_path / 'other'}"
    assert main(args) == 2
    assert "vocab_size" in capsys.readouterr().err


def test_help_answers():
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_decomposition_counters_are_summarised_per_round_and_tabled():
    from pr_specforge.eval.evaluator import summarize
    from pr_specforge.eval.report import decomposition_table

    def row(prompt, decomposition):
        r = {"draft": "pr", "budget": 48, "temperature": 0.0, "set": "s", "prompt": prompt, "accepted": 6, "rounds": 2,
             "tokens": 8, "draft_s": 0.1, "verify_s": 0.1, "total_s": 0.3, "ar_tokens": 8, "ar_s": 0.4, "recon_rows": 3,
             "lossless": True, "tau": 3.0, "conf_hist": [[0, 0]] * 10, "recover": [[[0, 0]] * 3] * 3}
        return {**r, "decomposition": decomposition} if decomposition else r

    counts = {"frontier_slots": 10, "frontier_recon": 4, "displaced": 2, "gained_proposal": 1}
    entry = summarize([row("a", counts), row("b", {**counts, "displaced": 6})])["results"][0]
    assert entry["decomposition"]["displaced_per_round"] == 2.0 and entry["decomposition"]["frontier_slots_per_round"] == 5.0
    assert "| pr | s | 48 | 0 | 5.000 | 2.000 |" in decomposition_table({"results": [entry]})
    plain = summarize([row("a", None)])
    assert "decomposition" not in plain["results"][0] and decomposition_table(plain) == ""


def test_skip_selects_the_prompts_after_the_first_n(dirs):
    from pr_specforge.eval.cli import select_prompts

    path = str(dirs / "prompts.jsonl")
    assert [p.id for p in select_prompts(path, 1, None, "first")] == ["p1", "p2"]
    assert [p.id for p in select_prompts(path, 1, 1, "first")] == ["p1"]
    assert [p.id for p in select_prompts(path, 0, 2, "first")] == ["p0", "p1"]
    with pytest.raises(ValueError, match="after --skip 3"):
        select_prompts(path, 3, 5, "first")
