"""The serving drafter (`core.eagle3.PRServingDrafter`, plain torch) computes what the training drafter
(SpecForge's `LlamaForCausalLMEagle3` plus the PR parts) computes, value for value, from an export's config."""

import pytest
import torch

from pr_specforge.core.eagle3 import PRServingDrafter, ServingDrafterError
from pr_specforge.export import sglang_config
from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
from tests.conftest import tiny_llama_config


def _pair(settings: PRDraftSettings, **cfg):
    torch.manual_seed(3)
    train = LlamaForCausalLMEagle3PR(build_pr_config(tiny_llama_config(**cfg), settings)).float().eval()
    with torch.no_grad():
        for p in train.parameters():  # every tensor away from its initial value (norms, gate, second head)
            p.add_(torch.randn_like(p) * 0.1)
    serve = PRServingDrafter.from_export_config(sglang_config(train.config.to_dict(), train, None, torch.float32)).eval()
    missing, unexpected = serve.load_state_dict(train.state_dict(), strict=False)
    assert not unexpected and not missing
    return train, serve


@pytest.mark.parametrize("settings,cfg", [
    (PRDraftSettings(max_depth=2), {}),
    (PRDraftSettings(max_depth=2, recon_head="separate", gate_reads_normed=True), {}),
    (PRDraftSettings(max_depth=1, post_norm_feedback=True), {}),
    (PRDraftSettings(max_depth=2), {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
@torch.no_grad()
def test_the_serving_drafter_equals_the_training_drafter_value_for_value(settings, cfg):
    train, serve = _pair(settings, **cfg)
    g = torch.Generator().manual_seed(0)
    emb, hidden = torch.randn(3, 5, 64, generator=g), torch.randn(3, 5, 64, generator=g)
    pos = torch.randint(0, 200, (3, 5), generator=g)
    for a, b in zip(train.layer_qkv(emb, hidden, pos), serve.layer_qkv(emb, hidden, pos)):
        assert torch.equal(a, b)
    out = torch.randn(3, 4, 5, 16, generator=g)
    feat = train.layer_finish(out, hidden)
    assert torch.equal(feat, serve.layer_finish(out, hidden))
    depth = torch.tensor([0, 1, 2])[:, None].expand(3, 5)
    assert torch.equal(train.depth_logits(feat, depth), serve.depth_logits(feat, depth))
    assert torch.equal(train.halt_probability(feat), serve.halt_probability(feat))
    for a, b in zip(train.reconsideration_inputs(feat), serve.reconsideration_inputs(feat)):
        assert torch.equal(a, b)
    aux = torch.randn(4, 3 * 64, generator=g)
    assert torch.equal(train.project_hidden_states(aux), serve.project_hidden_states(aux))
    assert torch.equal(train.d2t, serve.d2t)


def test_a_config_the_serving_drafter_cannot_build_is_refused_in_one_line():
    train, _ = _pair(PRDraftSettings(max_depth=2))
    cfg = sglang_config(train.config.to_dict(), train, None, torch.float32)
    with pytest.raises(ServingDrafterError, match="RoPE type 'yarn' is not served"):
        PRServingDrafter.from_export_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": None})
    with pytest.raises(ServingDrafterError, match="no 'hidden_size'"):
        PRServingDrafter.from_export_config({k: v for k, v in cfg.items() if k != "hidden_size"})
