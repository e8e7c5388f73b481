import gzip
import json

import pytest
from conftest import write_jsonl

from pr_specforge.data.io import DataFormatError
from pr_specforge.data.prompts import Prompt, load_prompts


def test_mtbench_has_80_questions_of_two_turns():
    first = load_prompts("mtbench")
    both = load_prompts("mtbench", turns="all")
    assert len(first) == len(both) == 80
    assert all(len(p.turns) == 1 for p in first) and all(len(p.turns) == 2 for p in both)
    assert first[0].turns[0] == both[0].turns[0] and first[0].id == "81"


def test_gsm8k_and_humaneval_counts_and_limit():
    assert len(load_prompts("gsm8k")) == 1319
    he = load_prompts("humaneval", limit=3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def has_close_elements" in he[0].turns[0]


def test_jsonl_prompt_files_in_all_three_shapes(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "one"},
        {"id": "t", "turns": ["two", "two-b"]},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "three"},
                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "three-b"}]},
    ])
    assert load_prompts(str(path)) == [Prompt("p-0", ["one"]), Prompt("t", ["two"]), Prompt("p-2", ["three"])]
    assert load_prompts(str(path), turns="all")[2].turns == ["three", "three-b"]
    gz = tmp_path / "p.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"prompt": "zipped"}) + "\n")
    assert load_prompts(str(gz))[0].turns == ["zipped"]


def test_bad_prompt_files_name_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "{broken"])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2"):
        load_prompts(str(path))
    path = write_jsonl(tmp_path / "nofield.jsonl", [{"text": "no prompt field"}])
    with pytest.raises(DataFormatError, match=r"nofield\.jsonl:1: no 'prompt'"):
        load_prompts(str(path))
    with pytest.raises(FileNotFoundError, match="neither"):
        load_prompts("no-such-benchmark")
