import json
import logging

import pytest
from conftest import write_jsonl

from pr_specforge.data.conversations import (
    iter_json_array,
    normalize_conversation,
    prepare_conversations,
)
from pr_specforge.data.io import DataFormatError, iter_jsonl

ULTRACHAT_ROW = {
    "prompt": "Tell me a joke.",
    "prompt_id": "u1",
    "messages": [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "To get to the other side."},
    ],
}
SHAREGPT_ROW = {
    "id": "s1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ],
}


def read(path):
    return [row for _, row in iter_jsonl(path)]


def test_ultrachat_and_sharegpt_schemas_normalise_to_role_content():
    u = normalize_conversation(ULTRACHAT_ROW)
    assert u["id"] == "u1"
    assert [m["role"] for m in u["conversations"]] == ["user", "assistant", "user", "assistant"]
    s = normalize_conversation(SHAREGPT_ROW)
    assert s == {"id": "s1", "conversations": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]}


def test_max_turns_keeps_the_first_user_turns_with_their_replies():
    row = normalize_conversation(ULTRACHAT_ROW, max_turns=1)
    assert [m["content"] for m in row["conversations"]] == ["Tell me a joke.", "Why did the chicken cross the road?"]


def test_role_order_violation_truncates_and_leading_assistant_is_dropped():
    row = {"id": "x", "conversations": [
        {"from": "gpt", "value": "stray"},
        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
        {"from": "gpt", "value": "a1 again"}, {"from": "human", "value": "q2"},
    ]}
    assert [m["content"] for m in normalize_conversation(row)["conversations"]] == ["q1", "a1"]


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path, caplog):
    src = write_jsonl(tmp_path / "in.jsonl", [
        SHAREGPT_ROW,
        "{not json",
        {"id": "nouser", "conversations": [{"from": "gpt", "value": "only me"}]},
        {"id": "weird", "conversations": [{"from": "narrator", "value": "?"}]},
        {"id": "empty", "conversations": []},
        {"id": "s1", "conversations": [{"from": "human", "value": "dup"}]},
        ULTRACHAT_ROW,
    ])
    with caplog.at_level(logging.WARNING):
        stats = prepare_conversations([str(src)], tmp_path / "out.jsonl", progress=False)
    assert f"{src}:2" in caplog.text  # file and line of the malformed line
    assert stats.written == 2
    assert stats.skipped == {"malformed_json": 1, "no_user_turn": 1, "unknown_role": 1,
                             "no_messages": 1, "duplicate_id": 1}
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["s1", "u1"]


def test_strict_mode_raises_with_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT_ROW, "{oops"])
    with pytest.raises(DataFormatError, match=r"in\.jsonl:2: malformed JSON"):
        prepare_conversations([str(src)], tmp_path / "out.jsonl", strict=True, progress=False)


def test_holdout_drops_conversations_whose_first_prompt_is_an_eval_prompt(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT_ROW, ULTRACHAT_ROW])
    stats = prepare_conversations([str(src)], tmp_path / "out.jsonl", holdout_prompts=["  tell me A joke. "], progress=False)
    assert stats.skipped["held_out"] == 1
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["s1"]


def test_limit_counts_output_rows(tmp_path):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(10)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare_conversations([str(src)], tmp_path / "out.jsonl", limit=4, progress=False)
    assert [r["id"] for r in read(tmp_path / "out.jsonl")] == ["0", "1", "2", "3"]


def test_held_out_set_takes_the_next_rows_disjoint_from_the_training_set(tmp_path):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(10)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare_conversations([str(src)], tmp_path / "train.jsonl", limit=4, progress=False)
    train_ids = {r["id"] for r in read(tmp_path / "train.jsonl")}
    stats = prepare_conversations([str(src)], tmp_path / "heldout.jsonl", limit=3, exclude_ids=train_ids, progress=False)
    assert [r["id"] for r in read(tmp_path / "heldout.jsonl")] == ["4", "5", "6"]
    assert stats.skipped["excluded_id"] == 4


def test_rerun_after_interruption_matches_an_uninterrupted_run(tmp_path):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare_conversations([str(src)], tmp_path / "full.jsonl", progress=False)
    # an interrupted run: 7 complete rows, then a torn line
    prepare_conversations([str(src)], tmp_path / "part.jsonl", limit=7, progress=False)
    with open(tmp_path / "part.jsonl", "a") as f:
        f.write('{"id": "7", "conversa')
    stats = prepare_conversations([str(src)], tmp_path / "part.jsonl", progress=False)
    assert stats.resumed == 7 and stats.written == 13
    assert (tmp_path / "part.jsonl").read_text() == (tmp_path / "full.jsonl").read_text()


def test_a_live_jsonl_file_is_read_without_touching_its_writers_row(tmp_path):
    from pr_specforge.data.io import read_jsonl_rows

    path = tmp_path / "rows.jsonl"
    live = '{"id": "0"}\n{"id": "1"}\n{"id": "2", "conv'  # another process is appending row 2
    path.write_text(live)
    assert [r["id"] for r in read_jsonl_rows(path, repair=False)] == ["0", "1"]
    assert path.read_text() == live  # its writer's half-written row is left alone
    path.write_text('{"id": "0"}\n[1]\n')
    with pytest.raises(DataFormatError, match=r"rows.jsonl:2: expected a JSON object"):
        read_jsonl_rows(path, repair=False)
    path.write_text(live)
    assert [r["id"] for r in read_jsonl_rows(path)] == ["0", "1"]  # the owner (resuming) cuts the torn row
    assert path.read_text() == '{"id": "0"}\n{"id": "1"}\n'


def test_truncated_json_array_yields_every_complete_record(tmp_path):
    recs = [dict(SHAREGPT_ROW, id=f"r{i}") for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"id": "r2"') + 5]  # cut inside the third record
    (tmp_path / "t.json").write_text(cut)
    assert [r["id"] for r in iter_json_array(tmp_path / "t.json")] == ["r0", "r1"]
    (tmp_path / "full.json").write_text(text)
    assert len(list(iter_json_array(tmp_path / "full.json"))) == 3


def test_malformed_record_in_a_complete_json_array_names_the_line(tmp_path):
    (tmp_path / "bad.json").write_text('[\n{"id": 1},\n{"id": oops},\n{"id": 3}\n]\n')
    with pytest.raises(DataFormatError, match=r"bad\.json:3"):
        list(iter_json_array(tmp_path / "bad.json"))


def test_parquet_in_ultrachat_schema_goes_through_datasets(tmp_path):
    import datasets

    datasets.Dataset.from_list([ULTRACHAT_ROW]).to_parquet(str(tmp_path / "u.parquet"))
    stats = prepare_conversations([str(tmp_path / "u.parquet")], tmp_path / "out.jsonl", progress=False)
    assert stats.written == 1
    assert read(tmp_path / "out.jsonl")[0]["conversations"][3]["content"] == "To get to the other side."


def test_packaged_sharegpt_dump_streams_its_complete_conversations(tmp_path):
    from pr_specforge.data.conversations import sharegpt_package_path

    n = sum(1 for _ in iter_json_array(sharegpt_package_path()))
    assert n == 17671
    stats = prepare_conversations(["sharegpt-package"], tmp_path / "out.jsonl", limit=50, progress=False)
    rows = read(tmp_path / "out.jsonl")
    assert stats.written == 50 and all(r["conversations"][0]["role"] in ("user", "system") for r in rows)
