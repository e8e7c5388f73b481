"""`PR_EAGLE3` in SGLang 0.5.14's registry: the entry point, EAGLE-3 answers, and each start-up refusal in one line.

The refusals run SGLang's real `ServerArgs` (its `__post_init__` is what `launch_server` runs before it starts
anything) on this CPU, so no server starts; `test_live_pr_eagle3.py` has one refusal through a real launch.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import entry_points

import pytest
import torch

from tests.sglang_live.conftest import edit_export

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pyproject_declares_the_plugin_entry_point_and_it_resolves():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]
    assert declared == {"pr_eagle3": "pr_specforge.sglang_plugin:register"}
    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "pr_eagle3"]
    assert ours and ours[0].value == "pr_specforge.sglang_plugin:register", \
        "the installed pr_specforge metadata lacks the entry point (reinstall the package)"
    ours[0].load()()


def test_the_algorithm_answers_as_eagle3_and_has_what_the_scheduler_calls():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from pr_specforge.sglang_plugin import register

    register()
    register()  # idempotent: SGLang refuses a second registration of a name
    algo = SpeculativeAlgorithm.from_string("pr_eagle3")
    builtin = SpeculativeAlgorithm.EAGLE3
    assert algo.is_eagle() and algo.is_eagle3() and algo.is_speculative() and not algo.is_none()
    assert algo.need_topk() == builtin.need_topk() and algo.has_draft_kv() == builtin.has_draft_kv()
    assert algo.carries_draft_hidden_states() == builtin.carries_draft_hidden_states()
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    future = algo.create_future_map(torch.device("cpu"), ReqToTokenPool(4, 16, "cpu", False), False)
    assert type(future).__name__ == "FutureMap" and future.spec_algo is algo and future.req_pool_size == 5
    missing = [n for n in vars(SpeculativeAlgorithm) if not n.startswith("_") and callable(getattr(builtin, n, None))
               and n not in ("from_string", "register") and not hasattr(algo, n)]
    assert not missing, f"SpeculativeAlgorithm methods the plugin lacks: {missing}"


def _server_args(live_run, draft, *, steps=3, topk=2, tokens=7, **extra):
    from sglang.srt.server_args import ServerArgs

    from pr_specforge.sglang_plugin import register

    register()
    return ServerArgs(model_path=live_run["target"], device="cpu", dtype="float32",
                      attention_backend=extra.pop("attention_backend", "torch_native"),
                      disable_cuda_graph=True, disable_overlap_schedule=extra.pop("disable_overlap_schedule", True),
                      speculative_algorithm="PR_EAGLE3", speculative_draft_model_path=draft,
                      speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                      **extra)


@pytest.fixture
def cpu_engine(monkeypatch):
    """SGLang's CPU engine switch for this test (`is_cpu` caches its first answer: cleared on both sides)."""
    from sglang.srt.utils.common import is_cpu

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    is_cpu.cache_clear()
    yield
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    is_cpu.cache_clear()


def test_a_good_launch_passes_and_takes_its_shape_from_the_flags_and_the_environment(live_run, cpu_engine, monkeypatch):
    from pr_specforge.sglang_plugin.checks import check_server_args

    args = _server_args(live_run, live_run["pr"], steps=4, topk=4, tokens=17)
    assert check_server_args(args) == _shape(k=4, bw=4, m=3, gamma=4, budget=16)  # B_w = k and m = 3 by default
    monkeypatch.setenv("PR_EAGLE3_BW", "3")
    monkeypatch.setenv("PR_EAGLE3_M", "0")
    assert check_server_args(args) == _shape(k=4, bw=3, m=0, gamma=4, budget=16)


def _shape(**kw):
    from pr_specforge.sglang_plugin.checks import PRServeShape

    return PRServeShape(**kw)


def _drop_pr(tensors):
    for name in [n for n in tensors if n.startswith("pr_")]:
        tensors.pop(name)


def _rename_pr(tensors):
    name = next(n for n in tensors if n.startswith("pr_halt_gate."))
    tensors[name.replace("pr_halt_gate.", "pr_halt_gates.")] = tensors.pop(name)


def _drop_one_pr(tensors):
    tensors.pop(next(n for n in tensors if n.startswith("pr_self_query.")))


REFUSALS = [
    ("tp", dict(tp_size=2), None, "--tp-size 2 is not supported"),
    ("topk1", dict(topk=1, tokens=4), None, "needs --speculative-eagle-topk >= 2"),
    ("page", dict(page_size=4), None, "needs --page-size 1, got 4"),
    ("short-tree", dict(steps=3, topk=2, tokens=12), None, "holds only 10 nodes for sure, fewer than B=11"),
    ("eagle3-export", {}, "eagle3", "not a PR drafter export"),
    ("no-pr-tensors", {}, _drop_pr, "holds no PR tensors"),
    ("renamed-pr-tensor", {}, _rename_pr, "missing ['pr_halt_gate."),
    ("missing-pr-tensor", {}, _drop_one_pr, "missing ['pr_self_query."),
    ("fa3-draft", dict(speculative_draft_attention_backend="fa3"), None, "FA3's draft decode cannot express"),
    ("fa3", dict(attention_backend="fa3"), None, "FA3's draft decode cannot express"),
]


@pytest.mark.parametrize("flags,draft,message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_each_unsupported_launch_is_refused_in_one_line(flags, draft, message, live_run, cpu_engine, tmp_path):
    from pr_specforge.sglang_plugin.checks import PRServeError

    if draft == "eagle3":
        path = live_run["eagle3"]
    elif draft is not None:
        path = edit_export(live_run["pr"], tmp_path / "edited", draft)
    else:
        path = live_run["pr"]
    with pytest.raises(PRServeError) as refused:
        _server_args(live_run, path, **flags)
    text = str(refused.value)
    assert message in text and "\n" not in text and text.startswith("PR_EAGLE3")


def test_a_renamed_tensor_names_both_sides(live_run, cpu_engine, tmp_path):
    from pr_specforge.sglang_plugin.checks import PRServeError

    path = edit_export(live_run["pr"], tmp_path / "edited", _rename_pr)
    with pytest.raises(PRServeError, match=r"unknown \['pr_halt_gates\."):
        _server_args(live_run, path)


def test_an_export_with_norm_output_is_refused(live_run, cpu_engine, tmp_path):
    from pr_specforge.sglang_plugin.checks import PRServeError

    path = tmp_path / "normed"
    shutil.copytree(live_run["pr"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["norm_output"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PRServeError, match="sets norm_output; the PR round reads pre-norm features"):
        _server_args(live_run, str(path))


def test_the_export_may_carry_its_serving_defaults(live_run, cpu_engine, tmp_path):
    from pr_specforge.sglang_plugin.checks import check_server_args

    path = tmp_path / "with-defaults"
    shutil.copytree(live_run["pr"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["pr_serving"] = {"bw": 3, "m": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    args = _server_args(live_run, str(path), steps=4, topk=4, tokens=17)
    assert check_server_args(args) == _shape(k=4, bw=3, m=1, gamma=4, budget=16)


def test_the_rows_switch_refuses_a_bad_value_and_rows_that_outgrow_the_draft_slots(live_run, cpu_engine, monkeypatch):
    from pr_specforge.sglang_plugin.checks import PRServeError, check_server_args

    from pr_specforge.sglang_plugin.checks import rows_for

    args = _server_args(live_run, live_run["pr"], steps=5, topk=2, tokens=7)
    assert rows_for(args) == "sglang"  # the default where SGLang's runner can serve the shape
    monkeypatch.setenv("PR_EAGLE3_M", "4")
    assert check_server_args(args).m == 4 and rows_for(args) == "ours"  # unset: 24 rows > 20 slots, our rows serve
    monkeypatch.setenv("PR_EAGLE3_ROWS", "sglang")
    with pytest.raises(PRServeError, match=r"round's 24 tree rows \(\(gamma - 1\)\(B_w \+ m\)\) exceed the 20 draft KV slots"):
        check_server_args(args)
    monkeypatch.setenv("PR_EAGLE3_M", "2")
    assert check_server_args(args).m == 2  # 16 rows fit
    args.disable_overlap_schedule = False  # the overlap schedule reserves from a length up to gamma + 1 behind
    with pytest.raises(PRServeError, match=r"16 tree rows .* exceed the 14 draft KV slots SGLang reserves per decode "
                                           r"under the overlap schedule"):
        check_server_args(args)
    args.disable_overlap_schedule = True
    monkeypatch.setenv("PR_EAGLE3_ROWS", "theirs")
    with pytest.raises(PRServeError, match="PR_EAGLE3_ROWS='theirs' is not one of ours, sglang"):
        check_server_args(args)


def test_the_readouts_switch_defaults_to_batched_and_refuses_a_bad_value(live_run, cpu_engine, monkeypatch):
    from pr_specforge.sglang_plugin.checks import PRServeError, check_readouts, check_server_args

    args = _server_args(live_run, live_run["pr"], steps=5, topk=2, tokens=7)
    monkeypatch.delenv("PR_EAGLE3_READOUTS", raising=False)
    assert check_readouts() == "batched"
    monkeypatch.setenv("PR_EAGLE3_READOUTS", " Request ")
    assert check_readouts() == "request" and check_server_args(args).k == 2
    monkeypatch.setenv("PR_EAGLE3_READOUTS", "grouped")
    with pytest.raises(PRServeError, match="PR_EAGLE3_READOUTS='grouped' is not one of batched, request$"):
        check_server_args(args)


def test_the_m0_draft_switch_defaults_to_sglangs_own_draft_and_refuses_a_bad_value(live_run, cpu_engine, monkeypatch):
    from pr_specforge.sglang_plugin.checks import PRServeError, check_m0_draft, check_server_args

    args = _server_args(live_run, live_run["pr"], steps=5, topk=2, tokens=7)
    monkeypatch.delenv("PR_EAGLE3_M0_DRAFT", raising=False)
    assert check_m0_draft() == "sglang"
    monkeypatch.setenv("PR_EAGLE3_M0_DRAFT", " PR ")
    assert check_m0_draft() == "pr" and check_server_args(args).k == 2
    for bad in ("eagle3", "0"):
        monkeypatch.setenv("PR_EAGLE3_M0_DRAFT", bad)
        with pytest.raises(PRServeError, match=f"PR_EAGLE3_M0_DRAFT='{bad}' is not one of sglang, pr$"):
            check_server_args(args)


def test_the_row_attention_switch_picks_triton_on_cuda_and_refuses_a_bad_value(live_run, cpu_engine, monkeypatch):
    from pr_specforge.sglang_plugin.checks import PRServeError, check_row_attention, check_server_args

    args = _server_args(live_run, live_run["pr"], steps=5, topk=2, tokens=7)
    monkeypatch.delenv("PR_EAGLE3_ROW_ATTENTION", raising=False)
    assert check_row_attention() == "auto"
    assert check_row_attention("cpu") == "torch_native" and check_row_attention("cuda:0") == "triton"
    monkeypatch.setenv("PR_EAGLE3_ROW_ATTENTION", " Triton ")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_row_attention("cpu") == "triton" and check_server_args(args).k == 2
    monkeypatch.delenv("TRITON_INTERPRET")  # Triton off CUDA only runs in its interpreter
    with pytest.raises(PRServeError, match="PR_EAGLE3_ROW_ATTENTION=triton on cpu runs SGLang's Triton kernel in "
                                           "Triton's interpreter: set TRITON_INTERPRET=1"):
        check_row_attention("cpu")
    monkeypatch.setenv("PR_EAGLE3_ROW_ATTENTION", "flashinfer")
    with pytest.raises(PRServeError, match="PR_EAGLE3_ROW_ATTENTION='flashinfer' is not one of auto, torch_native, "
                                           "triton$"):
        check_server_args(args)


@pytest.mark.parametrize("version", ["0.5.13", "0.5.24", "0.6.0"])
def test_an_sglang_outside_the_supported_range_is_refused_in_one_line(version, live_run, cpu_engine, monkeypatch):
    """`seam.check_version` at argument resolution: the line names the range and the version it found."""
    from pr_specforge.sglang_plugin import seam

    monkeypatch.setattr(seam, "installed_version", lambda: version)
    with pytest.raises(seam.UnsupportedSGLang) as e:
        _server_args(live_run, live_run["pr"])
    assert str(e.value) == f"PR_EAGLE3 supports SGLang 0.5.14, 0.5.15.post1 and 0.5.16-0.5.23; this is SGLang {version}"
    assert seam.check_version("0.5.15.post1") == "0.5.15.post1" and seam.check_version("0.5.23") == "0.5.23"
