"""The offline teacher head scores stored features in their own dtype (`training.target_head`): bf16 features exactly
as SpecForge's bf16 `TargetHead` does, float32 features with the target's lm_head in float32, so an offline float32
drafter trains (SpecForge 0.2.0 alone stops it at the first step)."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import make_tiny_target, write_workspace
from tests.integration.test_train_cli import ENV, _steps


def _config(target):
    from pr_specforge._specforge import Config

    return Config.model_validate({"model": {"target_model_path": str(target), "draft_model_config": "unused.json",
                                            "lm_head_key": "lm_head.weight"},
                                  "data": {"hidden_states_path": "unused"}})


def test_bf16_features_score_as_specforge_and_float32_ones_in_float32(tmp_path):
    from pr_specforge._specforge import TargetHead
    from pr_specforge.training.target_head import FeatureDtypeTargetHead

    make_tiny_target(tmp_path / "target")
    specforge = TargetHead.from_pretrained(str(tmp_path / "target"))
    assert specforge.fc.weight.dtype == torch.bfloat16  # SpecForge 0.2.0's head is bf16 whatever the recipe says
    head = FeatureDtypeTargetHead.around(specforge, _config(tmp_path / "target"))
    assert head.fc is specforge.fc and not [p for p in head.parameters() if p.requires_grad]
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    # bf16 features: SpecForge's own forward, bit for bit
    assert torch.equal(head(hidden.bfloat16()), specforge(hidden.bfloat16()))
    # float32 features: the stored float32 lm_head, never rounded through bf16
    weight = load_file(str(tmp_path / "target" / "model.safetensors"))["lm_head.weight"]
    assert weight.dtype == torch.float32
    rng = torch.get_rng_state()
    out = head(hidden)
    assert torch.equal(torch.get_rng_state(), rng)  # the float32 read draws nothing: a resume stays exact
    assert out.dtype == torch.float32 and torch.equal(out, torch.nn.functional.linear(hidden, weight))
    assert not torch.equal(out, specforge(hidden.bfloat16()).float())
    with pytest.raises(RuntimeError, match="same dtype"):
        specforge(hidden)  # what SpecForge alone does with float32 features


@pytest.mark.parametrize("strategy", ["pr", "eagle3"])
def test_an_offline_float32_drafter_trains_on_float32_features(tmp_path, strategy):
    pr = {"max_depth": 1} if strategy == "pr" else None
    recipe = write_workspace(str(tmp_path), strategy=strategy, steps=4, pr_section=pr, feature_dtype=torch.float32)
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "training.save_interval=0"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = _steps(tmp_path / "out")
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps.values())
