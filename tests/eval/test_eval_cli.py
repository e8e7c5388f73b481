"""`pr-specforge eval` end to end on tiny random models: losslessness, JSON, report, resume, bad input."""

import json
import os

import pytest

from pr_specforge.eval.cli import main, select_prompts
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


def test_eval_end_to_end_lossless_json_report_and_resume(dirs, tmp_path, capsys):
    out = tmp_path / "out"
    args = base_args(dirs, out) + ["--budget", "4", "12", "--bw", "4", "--temperature", "0", "1", "--turns", "all", "--json", str(out / "s.json")]
    assert main(args) == 0
    summary = json.loads((out / "s.json").read_text())
    entries = summary["results"]
    assert (summary["kind"], summary["kind_version"]) == ("pr_specforge.eval_summary", 1)  # what a rerun recognises
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
    # ...but never reuses rows made another way: other tree settings, or other files under a drafter's name
    swapped = [a.replace(f"pr={dirs / 'pr'}", f"pr={dirs / 'eagle'}") for a in args]
    for rerun, needle in ((args + ["--m", "0"], "field 'm' is 3 but this run's is 0"), (swapped, "drafter 'pr'")):
        assert main(rerun) == 2
        assert needle in capsys.readouterr().err
    assert (out / "results.jsonl").read_text().splitlines() == lines


def _edit_prompts_empty(root, tmp, args):
    (tmp / "empty.jsonl").write_text("\n")
    args[args.index("--prompts") + 1] = str(tmp / "empty.jsonl")


def _edit_other_vocab_drafter(root, tmp, args):
    other, _, _ = make_drafters(vocab_size=120)
    other.save_pretrained(tmp / "other")
    args[args.index("--draft") + 1] = f"bad={tmp / 'other'}"


def _edit_target_without_config(root, tmp, args):
    (tmp / "t").mkdir()
    args[args.index("--target") + 1] = str(tmp / "t")


def _edit_out_dir_of_other_settings(root, tmp, args):
    (tmp / "o").mkdir(exist_ok=True)
    (tmp / "o" / "eval_config.json").write_text(json.dumps({"shared": {"m": 5}, "drafters": {}}))


def _edit_out_dir_with_other_drafter_files(root, tmp, args):
    from pr_specforge.eval.evaluator import EvalSettings, provenance
    from pr_specforge.serving import TreeConfig

    (tmp / "o").mkdir(exist_ok=True)
    settings = EvalSettings(max_new_tokens=16, shape=TreeConfig(k=6, bw=6, gamma=4, m=3))  # base_args' settings
    shared = provenance(settings, str(root / "target"), {}, "float32")["shared"]
    (tmp / "o" / "eval_config.json").write_text(json.dumps({"shared": shared, "drafters": {"pr": "0123456789abcdef"}}))


def _edit_prompt_after_its_rows(root, tmp, args):
    """Rows of an id-less prompts file (ids are line numbers), then its first prompt edited."""
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat on the mat"}) + "\n")
    args[args.index("--prompts") + 1] = str(prompts)
    assert main([*args, "--limit", "1", "--budget", "4", "--bw", "4"]) == 0
    prompts.write_text(json.dumps({"prompt": "the dog sat on the mat"}) + "\n")
    args += ["--limit", "1", "--budget", "4", "--bw", "4"]


#: every class of bad `eval` input: (extra args, edit of the arguments/files, what the one-line error says)
BAD_INPUTS = {
    "prompts file without a usable prompt": ([], _edit_prompts_empty, "no usable prompt"),
    "budget 0": (["--budget", "0"], None, "budget"),
    "k above the draft vocab": (["--k", "1000"], None, "draft_vocab_size"),
    "limit 0": (["--limit", "0"], None, "--limit must be >= 1"),
    "negative temperature": (["--temperature", "-1"], None, "temperatures must be >= 0"),
    "temperature nan": (["--temperature", "0", "nan"], None, "temperatures must be >= 0 and finite, got [0.0, nan]"),
    "temperature inf": (["--temperature", "inf"], None, "temperatures must be >= 0 and finite, got [inf]"),
    "drafter spec without NAME=": (["--draft", "nameless"], None, "NAME=DIR"),
    "drafter of another target vocab": ([], _edit_other_vocab_drafter, "vocab_size"),
    "target directory without config.json": ([], _edit_target_without_config, "no config.json"),
    "out-dir made with other settings": ([], _edit_out_dir_of_other_settings, "field 'm' is 5 but this run's is 3"),
    "prompt edited under its id since its rows were made": ([], _edit_prompt_after_its_rows,
                                                             "field 'prompt prompts/prompts-0' is"),
    "out-dir with other files under a drafter name": ([], _edit_out_dir_with_other_drafter_files, "drafter 'pr'"),
}


# issue 44: JSON errors name their file
def _edit_out_dir_record_not_json(root, tmp, args):
    (tmp / "o").mkdir(exist_ok=True)
    (tmp / "o" / "eval_config.json").write_text("{not json")


def _edit_drafter_config_not_json(root, tmp, args):
    import shutil

    shutil.copytree(root / "eagle", tmp / "broken")
    (tmp / "broken" / "config.json").write_text("{not json")
    args[args.index("--draft") + 1] = f"eagle3={tmp / 'broken'}"


#: issue 44's rows of the bad-input table (JSON errors name their file)
BAD_INPUTS.update({
    "out-dir record that is not JSON": ([], _edit_out_dir_record_not_json, "eval_config.json: not valid JSON"),
    "drafter config that is not JSON": ([], _edit_drafter_config_not_json, "config.json: not valid JSON"),
})


# ---- issue 43's audit rows (one block, for merging)
def _edit_out_dir_config_a_list(root, tmp, args):
    (tmp / "o").mkdir(exist_ok=True)
    (tmp / "o" / "eval_config.json").write_text("[]")


def _lender(root, tmp, args, config=None, row=None):
    """A --baseline-from dir made with base_args' settings, with `config` as its eval_config.json or `row` in it."""
    from pr_specforge.eval.evaluator import EvalSettings, provenance
    from pr_specforge.serving import TreeConfig

    lender = tmp / "lender"
    lender.mkdir()
    settings = EvalSettings(max_new_tokens=16, shape=TreeConfig(k=6, bw=6, gamma=4, m=3))  # base_args' settings
    record = provenance(settings, str(root / "target"), {}, "float32")  # with the target's content hash
    (lender / "eval_config.json").write_text(config if config is not None else json.dumps(record))
    (lender / "baseline.jsonl").write_text(json.dumps(row or {}) + "\n")
    args += ["--baseline-from", str(lender)]


def _edit_baseline_row_without_set(root, tmp, args):
    _lender(root, tmp, args, row={"prompt": "p0", "temperature": 0.0, "outputs": [[1]], "tokens": 1, "seconds": 0.1})


def _edit_baseline_config_a_list(root, tmp, args):
    _lender(root, tmp, args, config="[1, 2]")


BAD_INPUTS.update({
    "B_w above the budget": (["--budget", "4", "--bw", "5"], None, "--bw 5 exceeds the budget --budget 4"),
    "out-dir whose eval_config.json is a JSON list": ([], _edit_out_dir_config_a_list, "expected a JSON object, got a list"),
    "baseline-from row without set": ([], _edit_baseline_row_without_set, "row 1: no field 'set'"),
    "baseline-from eval_config.json a JSON list": ([], _edit_baseline_config_a_list, "expected a JSON object, got a list"),
    "--batch-prompts 0": (["--batch-prompts", "0"], None, "--batch-prompts must be >= 1, got 0"),
    "negative --batch-prompts": (["--batch-prompts", "-2"], None, "--batch-prompts must be >= 1, got -2"),
})

def _edit_json_a_users_file(root, tmp, args):
    (tmp / "notes.md").write_text("a user's notes\n")
    args += ["--json", str(tmp / "notes.md")]


def _edit_json_another_json_object(root, tmp, args):
    (tmp / "recipe.json").write_text(json.dumps({"model": {"results": "not a list"}}))
    args += ["--json", str(tmp / "recipe.json")]


def _edit_json_a_directory(root, tmp, args):
    args += ["--json", str(tmp)]


BAD_INPUTS.update({  # issue 58 item 6: eval rewrites its own summary on a rerun, never another file
    "--json naming a user's file": ([], _edit_json_a_users_file, "notes.md: this command writes JSON only (Markdown"),
    "--json naming another JSON object": ([], _edit_json_another_json_object, "recipe.json: exists and is not an eval summary"),
    "--json naming a directory": ([], _edit_json_a_directory, "is a directory; name a file"),
})


def test_json_never_replaces_a_file_that_is_not_an_eval_summary(dirs, tmp_path, capsys):
    """Refused before any work, the file left as it was (an earlier summary is rewritten: the end-to-end test's rerun)."""
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    assert main(base_args(dirs, tmp_path / "o") + ["--json", str(notes)]) == 2
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if x.startswith("pr-specforge eval:")] == [
        f"pr-specforge eval: --json {notes}: exists and is not an eval summary (it carries no \"kind\": "
        "\"pr_specforge.eval_summary\" marker; this command replaces only its own); name a new file, or move this one"], err
    assert notes.read_text() == '{"mine": 1}\n' and not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_line(dirs, tmp_path, capsys, case):
    extra, edit, needle = BAD_INPUTS[case]
    args = base_args(dirs, tmp_path / "o") + extra
    if edit is not None:
        edit(dirs, tmp_path, args)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    if "edited" in case:  # the rows of the old text are discarded on request, then the new text is evaluated
        assert "--start-over" in err and main([*args, "--start-over"]) == 0
        rows = [json.loads(line) for line in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
        assert {r["prompt_sha"] for r in rows} == {select_prompts(args[args.index("--prompts") + 1], 0, 1, "first")[0].digest}


def test_ctrl_c_says_what_is_kept_and_how_to_resume(dirs, tmp_path, capsys, monkeypatch):
    from pr_specforge.eval.evaluator import Evaluator

    def interrupted(self, prompt_sets):
        raise KeyboardInterrupt

    monkeypatch.setattr(Evaluator, "run", interrupted)
    assert main(base_args(dirs, tmp_path / "o")) == 130
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "results.jsonl" in last and "rerun the same command" in last, err


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


def test_baseline_from_lends_the_target_decodes_of_another_out_dir(dirs, tmp_path, capsys):
    def lines(d, name):
        return [json.loads(line) for line in (d / name).read_text().splitlines()]

    def args(out, *extra):  # one drafter, one prompt: the decodes are what is under test
        argv = base_args(dirs, out)
        i = argv.index(f"pr={dirs / 'pr'}")
        return argv[:i - 1] + argv[i + 1:] + ["--limit", "1", *extra]

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(args(a, "--budget", "4", "--bw", "4", "--temperature", "0", "1")) == 0
    lent = lines(a, "baseline.jsonl")
    assert {r["seed"] for r in lent} == {0}  # prompt i samples with seed + i
    # another budget and B_w: every decode is a's (its timing too), copied, and T = 0 is still checked against it
    assert main(args(b, "--budget", "12", "--bw", "3", "--temperature", "0", "1", "--baseline-from", str(a))) == 0
    key = lambda r: (r["prompt"], r["temperature"])  # noqa: E731
    assert sorted(lines(b, "baseline.jsonl"), key=key) == sorted(lent, key=key)
    rows = lines(b, "results.jsonl")
    assert len(rows) == 2 and {r["ar_s"] for r in rows} <= {r["seconds"] for r in lent}
    assert all(r["lossless"] for r in rows if r["temperature"] == 0)
    # another --seed: the T = 0 decodes are lent, the T = 1 ones (other samples) are decoded anew
    assert main(args(c, "--budget", "4", "--bw", "4", "--seed", "5", "--temperature", "0", "1", "--baseline-from", str(a))) == 0
    mine = {key(r): r for r in lines(c, "baseline.jsonl")}
    assert all(mine[key(r)] == r for r in lent if r["temperature"] == 0)
    assert {r["seed"] for r in mine.values() if r["temperature"] == 1} == {5}
    # refused in one line: a dir of another --max-new-tokens, and one that is no eval out-dir
    for extra, needle in ((["--max-new-tokens", "8", "--baseline-from", str(a)], "field 'max_new_tokens' is 16"),
                          (["--baseline-from", str(tmp_path)], "no eval_config.json there")):
        assert main(args(tmp_path / "d", "--budget", "4", "--bw", "4", *extra)) == 2
        err = capsys.readouterr().err
        assert "--baseline-from" in err and needle in err and "Traceback" not in err, err
        assert not (tmp_path / "d" / "eval_config.json").exists()  # a refused run records nothing


# ---------------------------------------------------------------- issue 44: lossless reruns, --baseline-from, --start-over
def _one_drafter(root, out, *extra):
    """base_args with the EAGLE-3 drafter only, one prompt, B 4 (B_w 4: at most B), T 0."""
    argv = base_args(root, out)
    i = argv.index(f"pr={root / 'pr'}")
    return argv[:i - 1] + argv[i + 1:] + ["--limit", "1", "--budget", "4", "--bw", "4", "--temperature", "0", *extra]


def test_a_stored_non_lossless_row_fails_every_rerun_that_reports_it(dirs, tmp_path, capsys):
    out = tmp_path / "o"
    args = _one_drafter(dirs, out)
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows[0]["lossless"] = False  # what a run that exited 3 leaves behind
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    for _ in range(2):  # the identical command reuses the row, reports it, and still fails
        assert main(args) == 3
        io = capsys.readouterr()
        assert "| NO |" in io.out and "NOT LOSSLESS: eagle3 B=4 on prompts" in io.err and "Traceback" not in io.err


def _scaled_target(root, dst):
    """A copy of the target with one layer's weights x3: the same file names and sizes, other weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(root / "target", dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"] * 3
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == (root / "target" / "model.safetensors").stat().st_size
    return dst


def test_baseline_from_refuses_a_target_of_other_weights_with_the_same_file_sizes(dirs, tmp_path, capsys):
    lender, out = tmp_path / "a", tmp_path / "b"
    assert main(_one_drafter(dirs, lender)) == 0
    other = _scaled_target(dirs, tmp_path / "scaled")
    args = _one_drafter(dirs, out, "--baseline-from", str(lender))
    args[args.index("--target") + 1] = str(other)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--baseline-from {lender}: made with a target of other weights" in err and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir())  # refused before anything is written
    # the same out-dir resumed with the scaled target is refused too (its rows decode another model)
    assert main(_one_drafter(dirs, out)) == 0
    resumed = _one_drafter(dirs, out)
    resumed[resumed.index("--target") + 1] = str(other)
    assert main(resumed) == 2 and "made with a target of other weights" in capsys.readouterr().err


def test_baseline_from_an_out_dir_without_a_content_record_is_refused(dirs, tmp_path, capsys):
    lender = tmp_path / "a"
    assert main(_one_drafter(dirs, lender)) == 0
    record = json.loads((lender / "eval_config.json").read_text())
    del record["target_weights"]  # as an older version wrote it
    (lender / "eval_config.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(_one_drafter(dirs, tmp_path / "b", "--baseline-from", str(lender))) == 2
    assert "records no content hash of its target" in capsys.readouterr().err
    assert main(_one_drafter(dirs, lender)) == 0  # its own rerun records it (same names and sizes: trusted once)
    assert main(_one_drafter(dirs, tmp_path / "b", "--baseline-from", str(lender))) == 0


def test_start_over_with_a_bad_baseline_from_refuses_before_touching_the_out_dir(dirs, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(_one_drafter(dirs, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".jsonl", ".json")}
    capsys.readouterr()
    assert main(_one_drafter(dirs, out, "--start-over", "--baseline-from", str(tmp_path / "nonexistent"))) == 2
    err = capsys.readouterr().err
    assert "--baseline-from" in err and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".jsonl", ".json")} == before


def test_recovered_by_bucket_png_has_a_title(tmp_path, monkeypatch):
    from pr_specforge.eval import report

    saved = {}

    def keep(fig, out_dir, name):
        saved[name] = fig._suptitle.get_text() if fig._suptitle else ""
        return name

    monkeypatch.setattr(report, "_save", keep)
    entry = {"draft": "pr", "recover": [[[4, 1], [2, 0], [0, 0]]] * 3}
    report._plot_recovered([entry], ["pr"], str(tmp_path))
    assert saved["recovered_by_bucket.png"] == report.RECOVERED_TITLE and "Table 7" in report.RECOVERED_TITLE
