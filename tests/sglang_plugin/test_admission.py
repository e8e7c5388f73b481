"""`sglang_plugin.admission`: what a speculative server refuses per request (one line naming the field), what it
serves, and the per-request meta info a round adds. SGLang's own `SamplingParams` and `Req` (no server: the live
refusals are in tests/sglang_live/test_live_pr_eagle3_faults.py)."""

from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from pr_specforge.sglang_plugin.admission import (
    META_KEY, PRRequestError, record_round, request_shape, sampling_error, start_meta, worker_shape)
from pr_specforge.sglang_plugin.checks import PRServeShape

SERVER = PRServeShape(k=2, bw=2, m=1, gamma=3, budget=6)
ROOM = 10  # the live module's draft KV slots per request: 2 max(gamma k, B + 1) - (gamma + 1) under overlap
FIELD = "sampling_params.custom_params.pr_eagle3"


@pytest.mark.parametrize("own,shape", [(None, SERVER), ({"m": 0}, (2, 0)), ({"bw": 1}, (1, 1)), ({"m": 3}, (2, 3)),
                                       ({"bw": 4, "m": 1}, (4, 1)), ({}, SERVER)])
def test_a_request_may_set_its_own_bw_and_m(own, shape):
    got = request_shape(SERVER, None if own is None else {"pr_eagle3": own, "other": 1}, ROOM)
    assert got == (SERVER if shape is SERVER else PRServeShape(k=2, bw=shape[0], m=shape[1], gamma=3, budget=6))


@pytest.mark.parametrize("own,message", [
    ("junk", f"{FIELD} must be an object {{\"bw\": int, \"m\": int}}, got 'junk'"),
    ({"zz": 1}, f"{FIELD} has unknown key(s) 'zz' (known: bw, m)"),
    ({"m": "x"}, f"{FIELD}.m must be an integer, got 'x'"),
    ({"m": True}, f"{FIELD}.m must be an integer, got True"),
    ({"bw": 1.5}, f"{FIELD}.bw must be an integer, got 1.5"),
    ({"m": -1}, f"{FIELD}.m -1 is outside [0, 3]"),
    ({"m": 100}, f"{FIELD}.m 100 is outside [0, 3]"),
    ({"bw": 0}, f"{FIELD}.bw 0 is outside [1, 6]"),
    ({"bw": 1000}, f"{FIELD}.bw 1000 is outside [1, 6]"),
    ({"bw": 5, "m": 3}, f"{FIELD}.m 3: a round's (gamma - 1)(B_w + m) = 16 tree rows exceed the 10 draft KV slots"),
    ({"bw": 5}, f"{FIELD}.bw 5: a round's (gamma - 1)(B_w + m) = 12 tree rows exceed the 10 draft KV slots"),
])
def test_a_malformed_request_is_refused_in_one_line_naming_the_field(own, message):
    with pytest.raises(PRRequestError) as e:
        request_shape(SERVER, {"pr_eagle3": own}, ROOM)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_bw_whose_tree_cannot_fill_b_is_refused_and_without_a_row_limit_rows_are_not_checked():
    with pytest.raises(PRRequestError, match=r"\.bw 1: the tree \(k 2, gamma 3\) holds only 6 nodes for sure, fewer "
                                             r"than B = 7"):
        request_shape(PRServeShape(k=2, bw=2, m=1, gamma=3, budget=7), {"pr_eagle3": {"bw": 1}})
    assert request_shape(SERVER, {"pr_eagle3": {"bw": 5, "m": 3}}, None).bw == 5  # the `ours` row path


def _server(device="cpu", algorithm="PR_EAGLE3"):
    return SimpleNamespace(device=device, speculative_algorithm=algorithm)


@pytest.mark.parametrize("params,refused", [({"temperature": 0}, False), ({"temperature": 0.8, "top_k": 1}, False),
                                            ({"temperature": 0.8}, True), ({"temperature": 1.0, "top_k": 5}, True)])
def test_a_speculative_server_on_a_cpu_refuses_what_sglang_would_sample(params, refused):
    error = sampling_error(_server(), SamplingParams(**params))
    assert (error is not None) == refused
    if refused:
        assert error.startswith(f"sampling_params.temperature {params['temperature']:g}") and "\n" not in error
        assert "send temperature 0 or top_k 1" in error
    assert sampling_error(_server(device="cuda"), SamplingParams(**params)) is None  # SGLang's sampling verify
    assert sampling_error(_server(algorithm=None), SamplingParams(**params)) is None  # plain serving samples


def _req(own=None):
    return Req("r0", "", [1, 2, 3], SamplingParams(temperature=0, custom_params=own and {"pr_eagle3": own}),
               vocab_size=100)


def test_a_requests_meta_info_holds_its_state_after_each_round_one_entry_per_output_token():
    req = _req({"m": 0})
    start_meta(req, request_shape(SERVER, req.sampling_params.custom_params, ROOM))
    first = {"bw": 2, "m": 0, "rounds": 0, "recon_rows": 0, "recon_kept": 0}
    assert worker_shape(req, SERVER, ROOM).m == 0 and req.customized_info[META_KEY][0] == first
    req.output_ids = [5]  # the prefill's token, then a round that emits 3 and one that emits 1
    record_round(req, 2, 1)
    req.output_ids += [6, 7, 8]
    record_round(req, 1, 0)
    req.output_ids += [9]
    info = req.customized_info[META_KEY]
    assert info[0] == first
    assert info[1:4] == [{"bw": 2, "m": 0, "rounds": 1, "recon_rows": 2, "recon_kept": 1}] * 3
    assert info[4] == {"bw": 2, "m": 0, "rounds": 2, "recon_rows": 3, "recon_kept": 1}
    assert len(info) >= len(req.output_ids) + SERVER.gamma + 1  # room for the next round's tokens


def test_the_worker_drafts_a_request_admission_did_not_see_at_its_own_shape_or_the_servers():
    assert worker_shape(_req({"m": 0}), SERVER, ROOM).m == 0
    assert worker_shape(_req({"m": "x"}), SERVER, ROOM) == SERVER  # logged, never raised in the scheduler


def test_every_request_of_a_pr_server_gets_the_meta_info_key_refused_or_finished_ones_too(monkeypatch):
    """`admit` on SGLang's own `Req` (its `set_finish_with_abort` asks the tensor-parallel rank, which only a server
    has: rank 0 here); the server's limits are put where `limits` caches them (no export is read)."""
    import sglang.srt.managers.schedule_batch as schedule_batch

    from pr_specforge.sglang_plugin import admission
    from pr_specforge.sglang_plugin.admission import admit

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    server = SimpleNamespace(device="cpu", speculative_algorithm="PR_EAGLE3")
    admission._LIMITS[id(server)] = SERVER, ROOM
    scheduler = SimpleNamespace(server_args=server)
    good, bad, done = _req({"m": 0}), _req({"m": -1}), _req()
    done.set_finish_with_abort("refused by SGLang itself")
    for req in (good, bad, done):
        admit(scheduler, req)
        assert META_KEY in req.customized_info
    assert good.to_finish is None and good.pr_shape.m == 0
    assert bad.to_finish.message.startswith(f"{FIELD}.m -1 is outside [0, 3]")
    assert done.to_finish.message == "refused by SGLang itself"
    admission._LIMITS.pop(id(server))


# ----------------------------------------------------------------------------- prompts and bodies (issue 74)
def test_the_sampling_refusal_names_the_sglang_line_it_runs_on():
    from importlib.metadata import version

    from pr_specforge.sglang_plugin.admission import sampling_why

    error = sampling_error(_server(), SamplingParams(temperature=0.8))
    assert f"(SGLang {version('sglang')}'s sampling verify needs sgl-kernel's" in error
    assert sampling_why("SGLang 0.5.14") == "SGLang 0.5.14's sampling verify needs sgl-kernel's CUDA ops"
    assert sampling_why("SGLang 0.5.23").startswith("SGLang 0.5.23's sampling verify needs sgl-kernel's sampling op")


def _tokenizer_manager(context_len: int, reserved: int, truncate: bool = False):
    """SGLang's own `TokenizerManager`, not started (no model, no scheduler): the attributes its length check reads."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = TokenizerManager.__new__(TokenizerManager)
    tm.context_len, tm.num_reserved_tokens, tm.validate_total_tokens, tm.is_generation = context_len, reserved, True, True
    tm.allow_auto_truncate = truncate  # 0.5.23 reads it here, 0.5.14 from its server arguments
    tm.server_args = SimpleNamespace(allow_auto_truncate=truncate)
    return tm


def _generate(**fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(sampling_params={"temperature": 0, "max_new_tokens": 1}, **fields)


def test_an_empty_or_over_long_prompt_is_refused_in_one_line_naming_the_field_before_the_scheduler():
    from pr_specforge.sglang_plugin.admission import check_prompt

    tm = _tokenizer_manager(context_len=128, reserved=7)
    with pytest.raises(ValueError) as e:  # `{"text": ""}`: no token after tokenization
        check_prompt(tm, _generate(text=""), [])
    assert str(e.value) == "text: the prompt is empty (0 tokens after tokenization); send at least one token"
    with pytest.raises(ValueError) as e:
        check_prompt(tm, _generate(input_ids=[1] * 121), [1] * 121)
    assert str(e.value) == ("input_ids: the prompt is 121 tokens after tokenization, too long for this server's context "
                            "length of 128 tokens (at most 120 prompt tokens: SGLang keeps 7 of the 128 for "
                            "speculative drafts)")
    check_prompt(tm, _generate(input_ids=[1] * 120), [1] * 120)  # the longest prompt SGLang's own check passes
    tm._validate_one_request(_generate(input_ids=[1] * 120), [1] * 120)
    with pytest.raises(ValueError, match="longer than the model's context length"):  # SGLang's own, one more token
        tm._validate_one_request(_generate(input_ids=[1] * 121), [1] * 121)
    plain = _tokenizer_manager(context_len=128, reserved=0)
    with pytest.raises(ValueError, match=r"^text: the prompt is 128 tokens .* \(at most 127 prompt tokens\)$"):
        check_prompt(plain, _generate(text="x"), [1] * 128)
    check_prompt(_tokenizer_manager(128, 0, truncate=True), _generate(text="x"), [1] * 500)  # SGLang truncates it
    check_prompt(plain, _generate(text="x"), None)  # input embeddings: no token ids to count


def test_the_prompt_checks_run_inside_sglangs_own_tokenizer_manager_through_its_hook_registry():
    """`install` registers `check_texts` on `TokenizerManager._tokenize_texts` and `check_prompt` on its
    `_validate_one_request`; SGLang's hook registry applies them (as `load_plugins` does in the server's process) and
    SGLang's own methods then refuse an empty prompt in our line (0.5.14's own words for an empty text were "texts
    cannot be empty and tokenizer must be initialized")."""
    import asyncio

    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins.hook_registry import HookRegistry

    from pr_specforge.sglang_plugin import admission

    targets = {admission.PROMPT_HOOK_TARGET: "_validate_one_request", admission.TEXTS_HOOK_TARGET: "_tokenize_texts"}
    originals = {name: getattr(TokenizerManager, name) for name in targets.values()}
    tm = _tokenizer_manager(128, 7)
    with pytest.raises(ValueError, match="texts cannot be empty"):  # SGLang's own, without the hook
        asyncio.run(tm._tokenize_texts(""))
    admission.install()
    assert set(targets) <= set(HookRegistry._hooks)
    try:
        HookRegistry.apply_hooks()
        with pytest.raises(ValueError, match=r"^text: the prompt is empty \(0 tokens after tokenization\)"):
            tm._validate_one_request(_generate(text=""), [])
        with pytest.raises(ValueError, match=r"^text: the prompt is empty \(0 tokens after tokenization\)"):
            asyncio.run(tm._tokenize_texts(""))
    finally:
        for target, name in targets.items():
            setattr(TokenizerManager, name, originals[name])
            HookRegistry._patched.discard(target)


def test_an_empty_prompt_that_reaches_the_scheduler_is_refused_there(monkeypatch):
    import sglang.srt.managers.schedule_batch as schedule_batch

    from pr_specforge.sglang_plugin.admission import admit

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)
    empty = Req("r1", "", [], SamplingParams(temperature=0), vocab_size=100)
    admit(SimpleNamespace(server_args=SimpleNamespace(device="cpu", speculative_algorithm=None)), empty)
    assert empty.to_finish.message == "input_ids: the prompt is empty (0 tokens after tokenization); send at least one token"


@pytest.mark.parametrize("errors,line", [
    ([{"type": "json_invalid", "loc": ("body", 9), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}],
     "request body: not valid JSON (Expecting value at character 9)"),
    ([{"type": "string_type", "loc": ("body", "text", "str"), "msg": "Input should be a valid string"},
      {"type": "list_type", "loc": ("body", "text", "list[str]"), "msg": "Input should be a valid list"}],
     "text: Input should be a valid string or Input should be a valid list"),
    ([{"type": "dataclass_type", "loc": ("body",), "msg": "Input should be a dictionary or an instance of X"}],
     "request body: must be a JSON object"),
    ([{"type": "int_type", "loc": ("body", "input_ids", 2), "msg": "Input should be\na valid integer"},
      {"type": "dict_type", "loc": ("body", "sampling_params", "dict[str,any]"), "msg": "Input should be a dict"}],
     "input_ids[2]: Input should be a valid integer (and 1 more field)"),
])
def test_a_malformed_body_is_one_line_naming_the_field(errors, line):
    from pr_specforge.sglang_plugin.admission import body_error

    assert body_error(errors) == line


def test_sglangs_own_http_app_answers_a_malformed_generate_body_in_one_line():
    """SGLang's FastAPI app itself (no server: its request validation runs before any endpoint), with the refusal
    `install` puts before SGLang's handler: `/generate` answers one line, other routes keep SGLang's answer."""
    from fastapi.testclient import TestClient
    import sglang.srt.entrypoints.http_server as http_server

    from pr_specforge.sglang_plugin.admission import install_body_refusal

    install_body_refusal(http_server)
    install_body_refusal(http_server)  # once per app
    client = TestClient(http_server.app)
    headers = {"Content-Type": "application/json"}
    for body, start in [('{"text": ', "request body: not valid JSON ("), ('[1, 2]', "request body: must be a JSON object"),
                        ('{"text": 5}', "text: Input should be a valid string")]:
        r = client.post("/generate", content=body, headers=headers)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert message.startswith(start) and "\n" not in message and "File" not in message, message
    r = client.post("/v1/chat/completions", content='{"x": ', headers=headers)
    assert r.status_code == 400 and "json_invalid" in r.json()["message"]  # SGLang's own answer, unchanged
