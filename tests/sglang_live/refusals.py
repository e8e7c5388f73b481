"""The refusal table of docs/export.md sent to one live server (issue 74), shared by the live modules of both SGLang
lines (test_live_pr_eagle3_faults.py on 0.5.14, test_live_pr_eagle3_0523.py on 0.5.23): each bad request must get
HTTP 400 with one line (the first words given here), and right after each the same server must answer a good request
with plain greedy serving's tokens. Empty `text` killed the whole server before issue 74; a malformed body got a
multi-line dump naming a server path."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Callable, List, Sequence, Tuple

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
EMPTY_TEXT = "text: the prompt is empty (0 tokens after tokenization); send at least one token"


def prompt_table(context: int, ids: Sequence[int]) -> List[Tuple[str, object, str]]:
    """(what, body: a dict sent as JSON or bytes sent as they are, the start of its one-line refusal) for the
    prompt and body refusals, on a server whose context length is `context` tokens (`ids`: a good prompt)."""
    long_ids = (list(ids) * (context // max(len(ids), 1) + 2))[: context + 20]
    too_long = "too long for this server's context length of {} tokens".format(context)
    return [
        ("empty text", {"text": "", "sampling_params": GREEDY}, EMPTY_TEXT),
        ("empty input_ids", {"input_ids": [], "sampling_params": GREEDY}, "input_ids cannot be empty"),  # SGLang's own
        ("malformed JSON", b'{"text": "Hello", "sampling_params": {', "request body: not valid JSON ("),
        ("a body that is not an object", b"[1, 2]", "request body: must be a JSON object"),
        ("text of the wrong type", {"text": 5, "sampling_params": GREEDY}, "text: Input should be a valid string"),
        ("over-long input_ids", {"input_ids": long_ids, "sampling_params": GREEDY},
         f"input_ids: the prompt is {len(long_ids)} tokens after tokenization, {too_long}"),
        ("over-long text", {"text": " hello" * (context + 20), "sampling_params": GREEDY}, "text: the prompt is "),
    ]


def refused(port: int, body, timeout: float = 300) -> Tuple[int, str]:
    """(HTTP status, the refusal's message) of a request the server must refuse."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()[:300]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


def assert_each_refused_then_greedy(port: int, table, good: Callable[[], list], plain: list) -> List[str]:
    """Send each bad request of `table` ((what, body, start)); each must be HTTP 400 with one line starting `start`
    (an over-long text also saying `too long`), and `good()` right after it must equal `plain`. -> the messages."""
    messages = []
    for what, body, start in table:
        code, message = refused(port, body)
        assert code == 400, f"{what}: HTTP {code} {message}"
        assert "\n" not in message and "Traceback" not in message and 'File "' not in message, f"{what}: {message!r}"
        assert message.startswith(start), f"{what}: {message!r}"
        if what == "over-long text":
            assert "too long for this server's context length" in message, message
        assert good() == plain, f"after {what}, the server's greedy output differs from plain greedy serving's"
        messages.append(message)
    return messages
