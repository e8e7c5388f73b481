"""An `export --to vllm` served by stock vLLM (CPU build, float32, greedy, 127.0.0.1): outputs equal the target
alone's greedy decode (our evaluator's chain, whose outputs are the transformers target's greedy decode: no plain vLLM
server is started for it), and per prompt, vLLM's drafts and accepted tokens equal our evaluator's chain (k 1, gamma 3) with tolerance
zero. The traps this equality catches, each served for real: capture ids in SpecForge's convention (off by one:
outputs stay right, acceptance moves), a renamed tensor (vLLM refuses it at start-up) and a dropped one (`d2t`:
vLLM keeps its zeros, and every draft maps to another token)."""

from __future__ import annotations

import pytest

from pr_specforge.local_server import ServerFailed
from tests.vllm_live.conftest import COUNTERS, edited_export, serve_one_at_a_time, vllm_server


def _counts(rows):
    return [{k: r[k] for k in COUNTERS} for r in rows]


def test_the_export_serves_greedy_outputs_and_our_evaluators_acceptance_prompt_by_prompt(vllm_run, greedy_ids,
                                                                                         our_chain, tmp_path):
    assert vllm_run["summary"]["layer_ids"] == [2, 4, 5] and vllm_run["summary"]["specforge_ids"] == [1, 3, 4]
    with vllm_server(vllm_run["target"], vllm_run["vllm"], tmp_path / "pr.log") as port:
        served = serve_one_at_a_time(port, vllm_run["prompts"])
    assert [r["output_ids"] for r in served] == greedy_ids  # lossless: the target alone's greedy outputs
    assert [r["output_ids"] for r in our_chain] == greedy_ids
    assert _counts(served) == _counts(our_chain)  # per prompt, tolerance zero
    assert sum(r["num_accepted_tokens"] for r in served) > 0  # the drafter drafts what the target says


def test_ids_off_by_one_keep_outputs_but_break_the_acceptance_equality(vllm_run, greedy_ids, our_chain, tmp_path):
    """SpecForge's own ids ("output of layer X") written as they are: vLLM reads them as inputs, one layer early.
    Served from the export directory alone (`--model EXPORT`: the verifier travels in the export)."""
    off = edited_export(vllm_run["vllm"], tmp_path / "off-by-one",
                        config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=vllm_run["summary"]["specforge_ids"]))
    with vllm_server(vllm_run["target"], off, tmp_path / "off.log", model_alone=True) as port:
        served = serve_one_at_a_time(port, vllm_run["prompts"])
    assert [r["output_ids"] for r in served] == greedy_ids  # silent: the outputs stay right
    assert _counts(served) != _counts(our_chain)


def test_a_renamed_tensor_is_refused_at_start_up(vllm_run, tmp_path):
    renamed = edited_export(vllm_run["vllm"], tmp_path / "renamed",
                            tensors=lambda t: t.__setitem__("fc_proj.weight", t.pop("fc.weight")))
    with pytest.raises(ServerFailed):
        with vllm_server(vllm_run["target"], renamed, tmp_path / "renamed.log"):
            pass
    assert "no module or parameter named 'fc_proj'" in (tmp_path / "renamed.log").read_text()


def test_a_dropped_tensor_breaks_the_acceptance_equality(vllm_run, greedy_ids, our_chain, tmp_path):
    dropped = edited_export(vllm_run["vllm"], tmp_path / "dropped", tensors=lambda t: t.pop("d2t"))
    with vllm_server(vllm_run["target"], dropped, tmp_path / "dropped.log") as port:
        served = serve_one_at_a_time(port, vllm_run["prompts"])
    assert [r["output_ids"] for r in served] == greedy_ids
    assert _counts(served) != _counts(our_chain)
