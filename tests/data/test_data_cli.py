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


def test_cli_reports_bad_input_without_a_traceback(tmp_path, tiny_target, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"id": "x", "conversations": ['])
    assert main(["hidden-states", "--input", str(bad), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
                 "--draft-vocab-size", "16"]) == 2
    assert "bad.jsonl:1: malformed JSON" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nothing")]) == 1
    assert main(["conversations", "--source", str(bad), "--output", str(tmp_path / "o.jsonl"),
                 "--exclude-ids", str(tmp_path / "train.jsonl")]) == 2
    assert "train.jsonl: no such file" in capsys.readouterr().err


def test_bf16_features_are_written_in_bf16(tmp_path, tiny_target):
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    assert main(["hidden-states", "--input", str(src), "--output", str(tmp_path / "f"), "--target", str(tiny_target),
                 "--dtype", "bfloat16", "--draft-vocab-size", "16"]) == 0
    d = torch.load(next((tmp_path / "f").rglob("data_0.ckpt")), weights_only=True)
    assert d["hidden_state"].dtype == torch.bfloat16 and d["aux_hidden_state"].dtype == torch.bfloat16
