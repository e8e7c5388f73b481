import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import CONVERSATIONS, write_jsonl

from pr_specforge.data.io import iter_jsonl
from pr_specforge.data.regenerate import (
    OpenAIChatBackend,
    RegenerationError,
    SamplingConfig,
    TransformersBackend,
    regenerate_conversations,
)


class FakeOpenAI:
    """A bounded local OpenAI-compatible server: replies deterministically,
    answers the first `fail` requests with the given status codes, and shuts
    itself down after `lifetime_s` even if a test forgets to."""

    def __init__(self, fail=(), lifetime_s=60.0):
        self.fail = list(fail)
        self.requests = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append((self.path, body))
                    status = outer.fail.pop(0) if outer.fail else 200
                if status != 200:
                    self.send_response(status)
                    self.end_headers()
                    self.wfile.write(b'{"error": "busy"}')
                    return
                msgs = body["messages"]
                reply = f"reply {sum(m['role'] == 'user' for m in msgs)} to {msgs[-1]['content'][:12]}"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.timer = threading.Timer(lifetime_s, self.server.shutdown)
        self.timer.daemon = True

    def __enter__(self):
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


def rows_of(path):
    return [r for _, r in iter_jsonl(path)]


def backend(url, **kw):
    kw.setdefault("backoff", 0.01)
    kw.setdefault("concurrency", 3)
    return OpenAIChatBackend(url, "tiny", timeout=5, **kw)


def test_server_backend_regenerates_first_turn(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    with FakeOpenAI() as srv:
        stats = regenerate_conversations(src, tmp_path / "out.jsonl", backend(srv.url), progress=False)
    assert stats.written == 5
    out = rows_of(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [r["id"] for r in CONVERSATIONS]  # input order despite threads
    b = out[1]["conversations"]
    assert [m["role"] for m in b] == ["system", "user", "assistant"]
    assert b[2]["content"] == "reply 1 to Write a poem"
    path, body = srv.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "tiny" and body["temperature"] == 0.0


def test_all_turns_feed_the_regenerated_history(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS[1:2])
    with FakeOpenAI() as srv:
        regenerate_conversations(src, tmp_path / "out.jsonl", backend(srv.url), turns="all", progress=False)
    conv = rows_of(tmp_path / "out.jsonl")[0]["conversations"]
    assert [m["content"] for m in conv[1:]] == [
        "Write a poem about the sea.", "reply 1 to Write a poem", "And the wind?", "reply 2 to And the wind"]
    second = srv.requests[1][1]["messages"]
    assert second[2]["content"] == "reply 1 to Write a poem"  # the regenerated reply, not the dataset's


def test_server_errors_are_retried_with_backoff(tmp_path):
    with FakeOpenAI(fail=[500, 429]) as srv:
        b = backend(srv.url, max_retries=3)
        reply = b.complete([{"role": "user", "content": "hi"}], SamplingConfig())
    assert reply == "reply 1 to hi" and len(srv.requests) == 3
    with FakeOpenAI(fail=[503] * 5) as srv:
        with pytest.raises(RegenerationError, match="after 3 attempts .*HTTP 503"):
            backend(srv.url, max_retries=2).complete([{"role": "user", "content": "hi"}], SamplingConfig())
    with FakeOpenAI(fail=[400]) as srv:
        with pytest.raises(RegenerationError, match="HTTP 400"):
            backend(srv.url, max_retries=3).complete([{"role": "user", "content": "hi"}], SamplingConfig())
        assert len(srv.requests) == 1  # a client error is not retried


def test_unreachable_server_fails_rows_without_crashing(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS[:2])
    with FakeOpenAI() as srv:
        url = srv.url
    stats = regenerate_conversations(src, tmp_path / "out.jsonl", backend(url, max_retries=1), progress=False)
    assert stats.skipped["failed"] == 2 and stats.written == 0


def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path):
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", rows + [{"id": "nouser", "conversations": [{"role": "assistant", "content": "x"}]}])
    with FakeOpenAI() as srv:
        regenerate_conversations(src, tmp_path / "full.jsonl", backend(srv.url), progress=False)
        regenerate_conversations(src, tmp_path / "part.jsonl", backend(srv.url), limit=5, progress=False)
        with open(tmp_path / "part.jsonl", "a") as f:
            f.write('{"id": "r5", "conv')  # killed mid-write
        stats = regenerate_conversations(src, tmp_path / "part.jsonl", backend(srv.url), progress=False)
    assert stats.resumed == 5 and stats.written == 7 and stats.skipped["no_user_turn"] == 1
    assert (tmp_path / "part.jsonl").read_text() == (tmp_path / "full.jsonl").read_text()


def test_transformers_backend_batched_matches_one_by_one(tmp_path, tiny_model, tokenizer):
    be = TransformersBackend(tiny_model, tokenizer)
    msgs = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "What is the capital of France?"}]]
    sampling = SamplingConfig(max_new_tokens=6)
    batched = be.generate(msgs, sampling)
    single = [be.generate([m], sampling)[0] for m in msgs]
    assert batched == single and all(batched)
    # and it is the target's own greedy continuation
    ids = tokenizer.apply_chat_template(msgs[0], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = tiny_model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert single[0] == tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


def test_transformers_backend_end_to_end_all_turns(tmp_path, tiny_model, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    be = TransformersBackend(tiny_model, tokenizer)
    stats = regenerate_conversations(src, tmp_path / "out.jsonl", be, turns="all", batch_size=2,
                                     sampling=SamplingConfig(max_new_tokens=4), progress=False)
    out = rows_of(tmp_path / "out.jsonl")
    assert stats.written + stats.skipped.get("empty_reply", 0) == 5
    for r in out:
        src_row = next(c for c in CONVERSATIONS if c["id"] == r["id"])
        users = [m["content"] for m in src_row["conversations"] if m["role"] == "user"]
        assert [m["content"] for m in r["conversations"] if m["role"] == "user"] == users
        assert sum(m["role"] == "assistant" for m in r["conversations"]) == len(users)


class RecordingBackend:
    """An in-process backend that records the batches it is given (no `concurrency`)."""

    name = "recording"

    def __init__(self):
        self.batches = []

    def generate(self, batch, sampling):
        self.batches.append([m[-1]["content"] for m in batch])
        return [f"reply to {m[-1]['content'][:8]}" for m in batch]


def test_in_process_batches_group_prompts_by_length_and_skip_overlong_ones(tmp_path):
    lengths = [50, 3, 400, 7, 60, 5, 9000, 45]
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": "x" * n}]} for i, n in enumerate(lengths)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    be = RecordingBackend()
    stats = regenerate_conversations(src, tmp_path / "out.jsonl", be, batch_size=3, max_prompt_chars=1000, progress=False)
    assert stats.skipped["prompt_too_long"] == 1 and stats.written == 7
    sizes = [[len(p) for p in b] for b in be.batches]
    assert sizes == [[3, 5, 7], [45, 50, 60], [400]]
    written = {row["id"] for _, row in iter_jsonl(tmp_path / "out.jsonl")}
    assert written == {f"r{i}" for i, n in enumerate(lengths) if n <= 1000}
    # a rerun resumes: nothing is regenerated twice, the over-long row stays skipped
    be2 = RecordingBackend()
    again = regenerate_conversations(src, tmp_path / "out.jsonl", be2, batch_size=3, max_prompt_chars=1000, progress=False)
    assert again.resumed == 7 and again.written == 0 and be2.batches == []
