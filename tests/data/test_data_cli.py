import json
import subprocess
import sys

import pytest
import torch
from conftest import CONVERSATIONS, write_jsonl
from test_data_regenerate import FakeOpenAI

from pr_specforge.data.cli import main
from pr_specforge.data.io import iter_jsonl
from pr_specforge.data.validate import validate_features

COMMANDS = ["conversations", "regenerate", "hidden-states", "smollm2-target", "validate"]
WRAPPERS = ["prepare_conversations", "regenerate", "prepare_hidden_states", "make_smollm2_target", "validate_features"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_answers_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


@pytest.mark.parametrize("script", WRAPPERS)
def test_data_prep_wrappers_answer_help_fast(script):
    res = subprocess.run([sys.executable, f"data_prep/{script}.py", "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "usage: pr-specforge data" in res.stdout
    assert "torch" not in res.stderr


def test_pipeline_end_to_end_through_the_cli(tmp_path, tiny_target, capsys):
    raw = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"id": c["id"], "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                           "value": m["content"]} for m in c["conversations"]]}
        for c in CONVERSATIONS])
    prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "What is the capital of France?"}])
    conv, regen, feats = tmp_path / "conv.jsonl", tmp_path / "regen.jsonl", tmp_path / "features"

    assert main(["conversations", "--source", str(raw), "--output", str(conv), "--holdout-prompts", str(prompts)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == {"held_out": 1}
    with FakeOpenAI(fail=[429]) as srv:
        assert main(["regenerate", "--input", str(conv), "--output", str(regen), "--server", srv.url,
                     "--model", "tiny", "--turns", "all", "--concurrency", "2"]) == 0
    assert len([r for _, r in iter_jsonl(regen)]) == 4
    assert main(["hidden-states", "--input", str(regen), "--output", str(feats), "--target", str(tiny_target),
                 "--dtype", "float32", "--draft-vocab-size", "64", "--batch-size", "3"]) == 0
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["counts"]["samples"] == 4 and manifest["status"] == "complete"
    assert manifest["target"]["hidden_size"] == 32 and manifest["dtype"] == "float32"
    assert validate_features(feats, str(tiny_target)).ok
    assert main(["validate", str(feats)]) == 0
    # a rerun writes nothing new
    capsys.readouterr()
    assert main(["hidden-states", "--input", str(regen), "--output", str(feats), "--target", str(tiny_target),
                 "--dtype", "float32", "--draft-vocab-size", "64"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 0


def _features(tmp_path, tiny_target):
    """A finished features directory (2 conversations) to spoil."""
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    assert main(["hidden-states", "--input", str(src), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
                 "--dtype", "float32", "--draft-vocab-size", "16"]) == 0
    return tmp_path / "f"


def _manifest_edit(**fields):
    def edit(tmp_path, tiny_target):
        feats = _features(tmp_path, tiny_target)
        manifest = json.loads((feats / "manifest.json").read_text())
        (feats / "manifest.json").write_text(json.dumps({**manifest, **fields}))
        return ["validate", str(feats)]
    return edit


def _empty_map(tmp_path, tiny_target):
    feats = _features(tmp_path, tiny_target)
    path = feats / "vocab_mapping" / "vocab_mapping.pt"
    m = torch.load(path)
    torch.save({"t2d": m["t2d"] & False, "d2t": m["d2t"][:0]}, path)
    return ["validate", str(feats)]


def _nonempty_dir(tmp_path, tiny_target):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    return ["smollm2-target", "--output", str(tmp_path / "mine")]


def _not_a_model_dir(tmp_path, tiny_target):
    return [*_nonempty_dir(tmp_path, tiny_target), "--overwrite"]


def _empty_file(command):
    def edit(tmp_path, tiny_target):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        out = str(tmp_path / "out")
        return {"conversations": ["conversations", "--source", str(empty), "--output", out],
                "regenerate": ["regenerate", "--input", str(empty), "--output", out, "--server", "http://127.0.0.1:9"],
                "hidden-states": ["hidden-states", "--input", str(empty), "--output", out, "--target", str(tiny_target),
                                  "--draft-vocab-size", "16"]}[command]
    return edit


def _malformed(tmp_path, tiny_target):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"id": "x", "conversations": ['])
    return ["hidden-states", "--input", str(bad), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
            "--draft-vocab-size", "16"]


def _features_of_another_input(tmp_path, tiny_target):
    """Features made from 2 conversations, then the command rerun over them with another input file."""
    _features(tmp_path, tiny_target)
    other = write_jsonl(tmp_path / "other.jsonl", CONVERSATIONS[2:4])
    return ["hidden-states", "--input", str(other), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
            "--dtype", "float32", "--draft-vocab-size", "16"]


def _regenerated_with_other_settings(tmp_path, tiny_target):
    """Replies regenerated with --max-new-tokens 16, then the command rerun with 32."""
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    argv = ["regenerate", "--input", str(src), "--output", str(tmp_path / "r.jsonl"), "--model", "tiny"]
    with FakeOpenAI() as srv:
        assert main([*argv, "--server", srv.url, "--max-new-tokens", "16"]) == 0
        return [*argv, "--server", srv.url, "--max-new-tokens", "32"]


def _conversations_of_another_source(tmp_path, tiny_target):
    a = write_jsonl(tmp_path / "a.jsonl", CONVERSATIONS[:2])
    assert main(["conversations", "--source", str(a), "--output", str(tmp_path / "c.jsonl")]) == 0
    b = write_jsonl(tmp_path / "b.jsonl", CONVERSATIONS[2:4])
    return ["conversations", "--source", str(b), "--output", str(tmp_path / "c.jsonl")]


def _target_of_another_dtype(tmp_path, tiny_target):
    """A finished float32 target directory, and `smollm2-target` asked for bfloat16 (its default) there."""
    import shutil

    from pr_specforge.data.smollm2 import write_index_json

    shutil.copytree(tiny_target, tmp_path / "t32")
    write_index_json(tmp_path / "t32")
    return ["smollm2-target", "--output", str(tmp_path / "t32")]


def _own_input(command, start_over=True):
    """`command` with --output naming one of its own inputs (`--start-over` would delete it)."""
    def edit(tmp_path, tiny_target):
        src = str(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2]))
        flag = ["--start-over"] if start_over else []
        return {"conversations": ["conversations", "--source", src, "--output", src, *flag],
                "regenerate": ["regenerate", "--input", src, "--output", src, "--server", "http://127.0.0.1:9", *flag],
                "hidden-states": ["hidden-states", "--input", src, "--output", src, "--target", str(tiny_target),
                                  "--draft-vocab-size", "16", *flag],
                "hidden-states --output the target": ["hidden-states", "--input", src, "--output", str(tiny_target),
                                                      "--target", str(tiny_target), "--draft-vocab-size", "16", *flag],
                "hidden-states --output in the target": ["hidden-states", "--input", src, "--output",
                                                         str(tiny_target / "config.json"), "--target",
                                                         str(tiny_target), "--draft-vocab-size", "16"],
                }[command]
    return edit


def _rows_of_someone_else(tmp_path, tiny_target):
    """A JSONL of rows `conversations` did not write (no .resume.json beside it), named as --output --start-over."""
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    theirs = write_jsonl(tmp_path / "theirs.jsonl", CONVERSATIONS[2:4])
    return ["conversations", "--source", str(src), "--output", str(theirs), "--start-over"]


def _foreign_dir(tmp_path, tiny_target):
    """hidden-states into a directory that holds something else (here a run's notes), --start-over or not."""
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    return ["hidden-states", "--input", str(src), "--output", str(tmp_path / "mine"), "--target", str(tiny_target),
            "--draft-vocab-size", "16", "--start-over"]


def _read_only_dir(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    return ["conversations", "--source", str(src), "--output", str(tmp_path / "ro" / "c.jsonl")]


#: every class of bad `data` input: (argv builder, exit code, what the error says); nothing half-made is left behind
BAD_INPUTS = {
    "conversations --limit -3": (lambda t, tt: ["conversations", "--source", "x.jsonl", "--output", "o", "--limit", "-3"],
                                 2, "must be at least 1, got -3"),
    "hidden-states --draft-vocab-size 0": (lambda t, tt: ["hidden-states", "--input", "i", "--output", "o",
                                                          "--target", "t", "--draft-vocab-size", "0"], 2, "at least 1"),
    "conversations from an empty file": (_empty_file("conversations"), 2, "no usable conversation"),
    "regenerate an empty file": (_empty_file("regenerate"), 2, "no rows to regenerate"),
    "hidden-states of an empty file": (_empty_file("hidden-states"), 2, "no usable conversation"),
    "malformed JSONL line": (_malformed, 2, "bad.jsonl:1: malformed JSON"),
    "exclude-ids file that does not exist": (
        lambda t, tt: ["conversations", "--source", "x.jsonl", "--output", str(t / "o"), "--exclude-ids", str(t / "train.jsonl")],
        2, "train.jsonl: no such file"),
    "smollm2-target over a non-empty directory": (_nonempty_dir, 2, "pass --overwrite to replace it"),
    "smollm2-target over a target of another dtype": (_target_of_another_dtype, 2,
                                                       "holds a float32 target, not the bfloat16 one asked for"),
    "smollm2-target --overwrite of a non-model directory": (_not_a_model_dir, 2, "not a model directory"),
    "validate a directory that does not exist": (lambda t, tt: ["validate", str(t / "nothing")], 1, "no manifest.json"),
    "validate unfinished features": (_manifest_edit(status="in_progress"), 1, "did not finish"),
    "validate an empty vocab map": (_empty_map, 1, "empty vocab map"),
    "hidden-states over features of another input": (_features_of_another_input, 2,
                                                      "field 'resume.input' is"),
    "regenerate over replies made with other settings": (_regenerated_with_other_settings, 2,
                                                          "field 'max_new_tokens' is 16 but this run's is 32"),
    "conversations over rows of another source": (_conversations_of_another_source, 2, "field 'sources'"),
    "validate a vocab map the features were not made with": (_manifest_edit(vocab_fingerprint="0123456789abcdef"), 1,
                                                              "not the map these features were made with"),
    # issue 73: one ownership rule (data.io, as eval and export): an input is never an output, --start-over or not
    "conversations --start-over into its own --source": (_own_input("conversations"), 2,
                                                         "is an input of this command (itself)"),
    "regenerate --start-over into its own --input": (_own_input("regenerate"), 2, "is an input of this command (itself)"),
    "hidden-states into its own --input": (_own_input("hidden-states", start_over=False), 2,
                                           "is an input of this command (itself)"),
    "hidden-states --start-over into the target directory": (_own_input("hidden-states --output the target"), 2,
                                                             "is an input of this command (itself)"),
    "hidden-states into a file of the target": (_own_input("hidden-states --output in the target"), 2,
                                                "is an input of this command (a file of the input"),
    "hidden-states --start-over into a non-features directory": (_foreign_dir, 2, "is not a features directory "
                                                                                  "(it holds notes.txt)"),
    "conversations --start-over over rows it did not write": (_rows_of_someone_else, 2,
                                                              "holds rows this command did not write"),
    "conversations into a read-only directory": (_read_only_dir, 2, "is not writable"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_in_one_line(tmp_path, tiny_target, capsys, monkeypatch, case):
    build, code, needle = BAD_INPUTS[case]
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path, tiny_target)
    before = _snapshot(tmp_path, tiny_target)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusal (usage + one error line)
        rc = e.code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == code and needle in text and "Traceback" not in text, text
    if case.startswith(("hidden-states over", "regenerate over", "conversations over")):  # a mismatch says how to start over
        assert "--start-over" in text and len(captured.err.strip().splitlines()) == 1, text
    assert not (tmp_path / "out").exists()  # an empty output would read as a finished stage
    if "non-" in case:
        assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert _snapshot(tmp_path, tiny_target) == before  # refused before any work: nothing deleted, nothing written


def _snapshot(*roots):
    """Every file under `roots` and its bytes."""
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def test_ctrl_c_in_hidden_states_keeps_the_files_and_says_how_to_resume(tmp_path, tiny_target, capsys, monkeypatch):
    import pr_specforge.data.hidden_states as hs

    calls = []
    original = hs.atomic_torch_save

    def save_then_interrupt(obj, path):
        original(obj, path)
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(hs, "atomic_torch_save", save_then_interrupt)
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    argv = ["hidden-states", "--input", str(src), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
            "--dtype", "float32", "--draft-vocab-size", "16", "--batch-size", "1"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert "interrupted" in err[-1] and "rerun the same command" in err[-1]
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["status"] == "in_progress"
    monkeypatch.setattr(hs, "atomic_torch_save", original)
    assert main(argv) == 0  # resumes: the 2 kept files are not written again
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resumed"] == 2


def test_bf16_features_are_written_in_bf16(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    assert main(["hidden-states", "--input", str(src), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
                 "--dtype", "bfloat16", "--draft-vocab-size", "16"]) == 0
    d = torch.load(next((tmp_path / "f").rglob("data_0.ckpt")), weights_only=True)
    assert d["hidden_state"].dtype == torch.bfloat16 and d["aux_hidden_state"].dtype == torch.bfloat16


def test_start_over_rewrites_an_output_made_from_another_input(tmp_path, tiny_target, capsys):
    """The issue-25 case: features of A, rerun on B: refused; with --start-over, every file holds B
    and the manifest and vocab map are B's, as a fresh run on B makes them."""
    feats = _features(tmp_path, tiny_target)  # from CONVERSATIONS[:2]
    other = write_jsonl(tmp_path / "other.jsonl", CONVERSATIONS[2:4])
    argv = ["hidden-states", "--input", str(other), "--output", str(feats), "--target", str(tiny_target),
            "--dtype", "float32", "--draft-vocab-size", "16"]
    assert main(argv) == 2
    capsys.readouterr()
    assert main([*argv, "--start-over"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 2
    assert main([*argv[:4], str(tmp_path / "fresh"), *argv[5:]]) == 0
    for rel in ("rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt", "vocab_mapping/vocab_mapping.pt"):
        a, b = torch.load(feats / rel, weights_only=True), torch.load(tmp_path / "fresh" / rel, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
    assert main(argv) == 0  # resumes now: same input, same settings
