"""`pr.init_from` + `pr.freeze_one_pass`: a PR drafter started from a trained EAGLE-3 drafter, end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pr_specforge.export import export_checkpoint
from pr_specforge.modeling import PR_PARAM_PREFIXES
from pr_specforge.training.warm_start import InitFromError, init_one_pass_from
from tests.export.conftest import ENV
from tests.helpers import write_workspace

EXPORT_TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "export")


def _train(recipe, cwd, *overrides):
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, *overrides], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _state(ckpt):
    return torch.load(os.path.join(ckpt, "training_state.pt"), weights_only=False)["draft_state_dict"]


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_run")
    recipe = write_workspace(str(root), strategy="eagle3", steps=3)
    _train(recipe, str(root), "model.torch_dtype=bfloat16")  # SpecForge's eagle3 step feeds bf16 features uncast
    return root, str(root / "out" / "specforge-run-step3")


def test_frozen_warm_start_keeps_every_eagle3_tensor_bit_identical_and_trains_the_pr_parts(eagle3_run, tmp_path):
    root, ckpt = eagle3_run
    recipe = write_workspace(str(tmp_path), strategy="pr", steps=3, pr_section={
        "max_depth": 2, "init_from": ckpt, "freeze_one_pass": True, "recon_head": "separate", "recon_grad": "isolated",
        "recon_adapter_rank": 2, "gate_init_bias": -1.0, "balance_norm": "per_position"})
    _train(recipe, str(tmp_path))
    source, trained = _state(ckpt), _state(str(tmp_path / "out" / "specforge-run-step3"))
    one_pass = [k for k in trained if not k.startswith(PR_PARAM_PREFIXES) and "embed" not in k]
    assert one_pass and set(one_pass) <= set(source)
    for k in one_pass:
        assert torch.equal(trained[k], source[k].to(trained[k].dtype)), k
    # the reconsideration-only parts did train (the gate moved off its initial bias, the adapter off zero,
    # the second head off its copy of the one-pass head)
    assert not torch.equal(trained["pr_halt_gate.linear.bias"], torch.tensor([-1.0]))
    assert trained["pr_halt_gate.linear.weight"].abs().sum() > 0
    assert trained["pr_recon_adapter.q.up.weight"].abs().sum() > 0
    assert not torch.equal(trained["pr_recon_head.lm_head.weight"], trained["lm_head.weight"])
    # stock SGLang still loads the export as plain EAGLE-3, skipping every new pr_ tensor
    out = tmp_path / "sglang"
    export_checkpoint(str(tmp_path / "out" / "specforge-run-step3"), str(out), "sglang")
    # issue 73: the exports record that the run was warm-started, never the path it started from
    hf = export_checkpoint(str(tmp_path / "out" / "specforge-run-step3"), str(tmp_path / "hf"), "hf")
    for export in (str(out), hf):
        text = open(os.path.join(export, "config.json")).read()
        assert ckpt not in text and "init_from" not in text, export
        assert json.loads(text)["pr_specforge_run"]["warm_start"] == {"freeze_one_pass": True}
    proc = subprocess.run([sys.executable, os.path.join(EXPORT_TESTS, "sglang_load.py"), str(out)],
                          env=dict(ENV, SGLANG_USE_CPU_ENGINE="1"), capture_output=True, text=True, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("SGLANG_REPORT ")]
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(line[0].split(" ", 1)[1])
    assert report["mismatched"] == [] and report["unfilled"] == [] and report["hot_token_id_ok"], report
    names = report["pr_tensors"]
    assert "pr_recon_head.lm_head.weight" in names and "pr_recon_adapter.mlp_out.up.weight" in names
    assert len([n for n in names if n.startswith("pr_recon_adapter.")]) == 14


def test_init_from_an_hf_export_loads_its_one_pass_tensors_and_copies_the_second_head(eagle3_run, tmp_path):
    from transformers import LlamaConfig

    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    root, ckpt = eagle3_run
    hf = export_checkpoint(ckpt, str(tmp_path / "hf"), "hf")
    with open(root / "draft.json") as f:
        cfg = json.load(f)
    settings = PRDraftSettings(max_depth=2, recon_head="separate")
    draft = LlamaForCausalLMEagle3PR(build_pr_config(LlamaConfig.from_dict(cfg), settings)).float()
    source = _state(ckpt)
    draft.t2d.copy_(source["t2d"])
    draft.d2t.copy_(source["d2t"])
    init_one_pass_from(draft, hf)
    for k, v in draft.state_dict().items():
        if k in source and "embed" not in k:
            assert torch.equal(v, source[k].to(v.dtype)), k
    assert torch.equal(draft.pr_recon_head.lm_head.weight, source["lm_head.weight"].float())
    assert torch.equal(draft.pr_recon_head.norm.weight, source["norm.weight"].float())
    with torch.no_grad():
        draft.d2t.add_(1)
    with pytest.raises(InitFromError, match="d2t differs"):
        init_one_pass_from(draft, hf)
    with pytest.raises(InitFromError, match="no such file"):
        init_one_pass_from(draft, str(tmp_path / "nowhere"))
