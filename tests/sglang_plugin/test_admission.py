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
