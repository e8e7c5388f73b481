"""A drafter export with a renamed and a missing tensor does not serve through SGLang's EAGLE-3 engine on this CPU,
and both tensors are named (SGLang's loader skips unknown and missing keys silently; the bridge's loader does not):
one server start-up."""

from __future__ import annotations

import pytest

from tests.sglang_live.conftest import ServerFailed, edit_export, spec_args
from tests.sglang_live.eagle3 import CHAIN_STEPS, serve_prompts


def _rename_one_and_drop_another(tensors):
    tensors["midlayer.mlp.down_proj.w"] = tensors.pop("midlayer.mlp.down_proj.weight")
    tensors.pop("midlayer.self_attn.o_proj.weight")


def test_a_drafter_with_a_renamed_and_a_missing_tensor_does_not_serve_and_both_are_named(live_run, tmp_path):
    """One server start for both faults: the bridge's loader reports every problem at once, each through its
    own check (a tensor SGLang's loader skipped: the renamed name; parameters left random: the renamed
    tensor's target and the dropped one), so each name below fails the test if its check stops working."""
    broken = edit_export(live_run["eagle3"], tmp_path / "broken", _rename_one_and_drop_another)
    with pytest.raises(ServerFailed) as failed:
        serve_prompts(live_run, tmp_path / "server.log", *spec_args(broken, CHAIN_STEPS, 1, CHAIN_STEPS + 1))
    assert "DraftLoadError" in str(failed.value), str(failed.value)[-2000:]
    skipped, _, unloaded = str(failed.value).partition("parameters left unloaded")
    assert "midlayer.mlp.down_proj.w" in skipped  # the renamed tensor, skipped by SGLang's loader
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert name in unloaded  # the renamed tensor's parameter and the missing one, left random
