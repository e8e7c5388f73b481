"""`PR_EAGLE3` live under faults and load on this CPU: one server (k 2, B_w 2, m 1, gamma 3, B 6) whose KV pool
(`--max-total-tokens 256`) is too small for its concurrent requests, whose admission is optimistic
(`SGLANG_INIT_NEW_TOKEN_RATIO`) so that it runs out and retracts, and whose context is 128 tokens.

Each refusal (`sglang_plugin.admission`, through SGLang's own abort path) is one line naming the field, with HTTP
400, and the server keeps serving; so is every prompt and body refusal of the table (issue 74: empty text, which
killed the whole server, empty input_ids, a body that is not JSON or not an object, a field of the wrong type, an
over-long prompt as token ids and as text; `tests.sglang_live.refusals`), each followed by a good request that
must equal plain greedy; a request asking to sample (temperature 0.8), which killed the scheduler before
admission refused it, is refused the same way. Then, at once: eight greedy requests with mixed per-request m
(0, 1, 2, the server's), more than the pool holds, so SGLang retracts some; a client that disconnects from a
streamed request mid-generation; every bad request again, interleaved; a prompt exactly at the context limit and
one over it (SGLang's own refusal). Afterwards every good output equals plain greedy serving
(`scripts/sglang_cpu_serve_plain.sh`), each response's `meta_info["pr_eagle3"]` says the B_w and m it was drafted
at and its counters (`rounds` = SGLang's `spec_verify_ct`, no reconsideration row at m = 0), the server answers
`/health`, holds no KV slot (SGLang's `/v1/loads`: `num_used_tokens` back to what it was before the load),
logged no leak (SGLang's idle memory check) and no round whose verify result never reached the worker. No round
log and no host-read check here: this is the server as a user runs it.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pr_specforge.sglang_plugin.admission import UNREPORTED_LINE
from tests.sglang_live.conftest import LIVE_DEVICE, greedy, post
from tests.sglang_live.pr_eagle3 import Shape, shared_pr
from tests.sglang_live.refusals import assert_each_refused_then_greedy, prompt_table, refused

SHAPE = Shape(k=2, bw=2, m=1, gamma=3, budget=6)
POOL, CONTEXT, NEW = 256, 128, 96
#: SGLang admits a request while the pool holds its prompt and this share of its max_new_tokens (0.7 by default,
#: which queues rather than overcommits this pool): at 0.05 it admits them all, and the pool running out as they
#: decode retracts some ("KV cache pool is full. Retract requests."), which is what this module tests
OPTIMISM = "0.05"
#: the context-limit prompt: SGLang holds a speculative request to input + max(gamma k, B + 1) reserved + new tokens
#: <= the context (`TokenizerManager.num_reserved_tokens`); this prompt fills it exactly, one more token is refused
RESERVED = max(SHAPE.gamma * SHAPE.k, SHAPE.budget + 1)
LIMIT_NEW = 8
FIELD = "sampling_params.custom_params.pr_eagle3"
#: (custom_params["pr_eagle3"] or a sampling override, the start of its one-line refusal)
BAD = [({"m": -1}, f"{FIELD}.m -1 is outside [0, 3]"), ({"m": "x"}, f"{FIELD}.m must be an integer, got 'x'"),
       ({"bw": 1000}, f"{FIELD}.bw 1000 is outside [1, 6]"), ({"bw": 0}, f"{FIELD}.bw 0 is outside [1, 6]"),
       ({"m": 100}, f"{FIELD}.m 100 is outside [0, 3]"), ("junk", f"{FIELD} must be an object"),
       ({"zz": 1}, f"{FIELD} has unknown key(s) 'zz'"),
       ({"bw": 5, "m": 3}, f"{FIELD}.m 3: a round's (gamma - 1)(B_w + m) = 16 tree rows exceed the 14 draft KV slots")]
if LIVE_DEVICE == "cpu":  # on a GPU SGLang's sampling verify serves it (test_live_pr_eagle3_sampling.py)
    BAD.append(({"temperature": 0.8}, "sampling_params.temperature 0.8 (top_k all): this speculative server on a CPU "
                                      "verifies greedily only"))


@pytest.fixture
def server(live_run, shared):
    """The session's PR server of this launch: (port, its log)."""
    env = {"PR_EAGLE3_CHECK_HOST_READS": "off", "SGLANG_INIT_NEW_TOKEN_RATIO": OPTIMISM}
    srv, _, _ = shared_pr(shared, live_run, SHAPE, env=env, rounds=False, name="pr-k2-faults",
                          args=("--max-total-tokens", str(POOL), "--context-length", str(CONTEXT)))
    return srv.port, srv.log


def _body(ids, new=NEW, bad=None, m=None, stream=False):
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    if isinstance(bad, dict) and "temperature" in bad:
        params.update(bad)
    elif bad is not None:
        params["custom_params"] = {"pr_eagle3": bad}
    elif m is not None:
        params["custom_params"] = {"pr_eagle3": {"m": m}}
    return {"input_ids": list(ids), "sampling_params": params, "stream": stream}


def _refused(port, body) -> str:
    """The one-line message of a request the server must refuse with HTTP 400."""
    with pytest.raises(urllib.error.HTTPError) as e:
        post(port, "/generate", body, timeout=300)
    assert e.value.code == 400
    message = json.loads(e.value.read())["error"]["message"]
    assert "\n" not in message, message
    return message


def _used_tokens(port) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/loads?include=core", timeout=30) as r:
        loads = json.loads(r.read())["loads"]
    return sum(load["num_used_tokens"] for load in loads)


def _idle(port, before: int, timeout: float = 120) -> int:
    """`num_used_tokens` once the server holds no more than before the load (or what it holds at `timeout`)."""
    deadline = time.time() + timeout
    used = _used_tokens(port)
    while used > before and time.time() < deadline:
        time.sleep(1)
        used = _used_tokens(port)
    return used


def _disconnect(port, ids) -> int:
    """Stream a long request, read until two chunks of tokens arrived, and hang up: -> the chunks read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/generate", json.dumps(_body(ids, new=CONTEXT - RESERVED - len(ids), stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    chunks = 0
    while chunks < 2:
        line = resp.readline()
        if not line:
            break
        chunks += line.startswith(b"data: {")
    conn.sock.close()
    conn.close()
    return chunks


def test_each_refusal_is_one_line_naming_the_field_and_the_server_keeps_serving(live_run, server, plain_server):
    port, _ = server
    prompt = live_run["prompts"][0]
    for bad, start in BAD:
        message = _refused(port, _body(prompt, bad=bad))
        assert message.startswith(start), message
    out = post(port, "/generate", _body(prompt))
    assert out["output_ids"] == greedy(plain_server, prompt, NEW)["output_ids"]
    assert out["meta_info"]["pr_eagle3"][-1]["rounds"] == out["meta_info"]["spec_verify_ct"]


def test_every_bad_request_of_the_table_is_one_line_and_the_next_good_request_equals_plain_greedy(
        live_run, server, plain_server):
    """On SGLang 0.5.14: the prompt and body refusals (issue 74) and this server's own (`BAD`), one after another
    on the one server; after each, a good request equals plain greedy serving's."""
    port, log = server
    prompt, new = live_run["prompts"][0], 8
    table = prompt_table(CONTEXT, prompt) + [(f"custom/sampling {bad!r}", _body(prompt, new=4, bad=bad), start)
                                             for bad, start in BAD]
    plain = greedy(plain_server, prompt, new)["output_ids"]
    messages = assert_each_refused_then_greedy(port, table, lambda: greedy(port, prompt, new)["output_ids"], plain)
    assert "(at most 120 prompt tokens: SGLang keeps 7 of the 128 for speculative drafts)" in messages[5]
    assert "SGLang 0.5.14's sampling verify" in messages[-1] or LIVE_DEVICE != "cpu"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
    assert "Traceback" not in log.read_text()
    # the plain reference server (no draft: the CPU bridge and the plugin's entry point load the same admission)
    for what, body, start in table[:4]:
        code, message = refused(plain_server, body)
        assert code == 400 and message.startswith(start), f"plain server, {what}: {code} {message}"
    assert greedy(plain_server, prompt, new)["output_ids"] == plain


def _limit_prompt(live_run):
    ids = [t for p in live_run["prompts"] for t in p] * 20
    return ids[: CONTEXT - RESERVED - LIMIT_NEW]


def test_load_retraction_a_disconnect_and_bad_requests_leave_every_good_output_greedy_and_no_slot_held(
        live_run, server, plain_server):
    port, log = server
    before = _idle(port, 0, timeout=30)
    prompts = live_run["prompts"] * 2
    ms = [0, 1, 2, None] * 2  # None: the server's m (1)
    limit = _limit_prompt(live_run)
    with ThreadPoolExecutor(16) as pool:
        good = [pool.submit(post, port, "/generate", _body(p, m=m)) for p, m in zip(prompts, ms)]
        at_limit = pool.submit(post, port, "/generate", _body(limit, new=LIMIT_NEW))
        hung_up = pool.submit(_disconnect, port, prompts[3])
        bad = [pool.submit(_refused, port, _body(prompts[i % 4], bad=b)) for i, (b, _) in enumerate(BAD)]
        over = pool.submit(_refused, port, _body(limit + [limit[0]], new=LIMIT_NEW))
        outs = [f.result() for f in good]
        limit_out = at_limit.result()
        assert hung_up.result() == 2
        for f, (_, start) in zip(bad, BAD):
            assert f.result().startswith(start)
        assert "context length" in over.result()
    assert "KV cache pool is full. Retract requests." in log.read_text()
    assert sum(o["meta_info"]["num_retractions"] for o in outs + [limit_out]) > 0, \
        f"a {POOL}-token pool should have retracted some of the 8 requests"
    plain = [greedy(plain_server, p, NEW)["output_ids"] for p in live_run["prompts"]] * 2
    assert [o["output_ids"] for o in outs] == plain
    assert limit_out["output_ids"] == greedy(plain_server, limit, LIMIT_NEW)["output_ids"]
    for out, m in zip(outs, ms):
        meta = out["meta_info"]
        mine = meta["pr_eagle3"][-1]
        assert (mine["bw"], mine["m"]) == (SHAPE.bw, SHAPE.m if m is None else m)
        assert mine["rounds"] == meta["spec_verify_ct"] > 0
        assert mine["recon_kept"] <= mine["recon_rows"] <= meta["spec_verify_ct"] * (SHAPE.gamma - 1) * mine["m"]
    assert sum(o["meta_info"]["pr_eagle3"][-1]["recon_rows"] for o, m in zip(outs, ms) if m != 0) > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
    assert _idle(port, before) == before, "KV slots still held after every request ended"
    text = log.read_text()
    assert "memory leak detected" not in text and "Traceback" not in text and UNREPORTED_LINE not in text
