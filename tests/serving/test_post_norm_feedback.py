"""EAGLE-3.1 post-norm feedback (`pr.post_norm_feedback`): training, the serving runtime and the SGLang
export agree on what the next draft step and the next reconsideration depth read."""

import pytest
import torch

from pr_specforge.config import PRConfig
from pr_specforge.export import sglang_config
from pr_specforge.serving import DrafterRuntime
from pr_specforge.training.objective.ttt import OnlinePRModel
from tests.helpers import make_batch
from tests.recipe_options.test_drafter_options import pr_drafter, randomise


def _drafter(post_norm: bool):
    eagle, pr = pr_drafter(post_norm_feedback=post_norm, recon_head="separate")
    randomise(pr.pr_self_query, 0.2)
    with torch.no_grad():  # a final norm that is not the identity on the direction either
        pr.norm.weight.copy_(torch.linspace(0.5, 2.0, pr.norm.weight.numel()))
    return eagle, pr.eval()


def _train_logits(pr, batch):
    model = OnlinePRModel(pr, length=2, pr=PRConfig(max_depth=2, post_norm_feedback=pr.pr_settings.post_norm_feedback,
                                                     recon_head="separate"),
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(**batch, return_logits=True)


def _serve_logits(pr, batch, p):
    """Serving runtime, row `p`: its context feature, TTT step 1 (the next draft step), depth 1 of step 0."""
    rt = DrafterRuntime(pr)
    feats = rt.extend(batch["hidden_states"][0, : p + 1], batch["input_ids"][0, : p + 1])
    f0 = feats[p : p + 1]
    empty = torch.zeros(0, pr.midlayer.self_attn.num_heads, pr.midlayer.self_attn.head_dim)
    step1, _, _ = rt.forward_rows(rt.embed(batch["input_ids"][0, p + 1 : p + 2]), rt.feedback(f0), torch.tensor([p + 1]),
                                  p + 1, empty, empty, [[]])
    r_emb, r_hidden = rt.reconsideration_inputs(f0)
    deep, _, _ = rt.forward_rows(r_emb, r_hidden, torch.tensor([p]), p, empty, empty, [[]],
                                 recon_rows=torch.ones(1, dtype=torch.bool))
    return rt.depth_logits(f0, 0), rt.depth_logits(step1, 0), rt.depth_logits(deep, 1)


@pytest.mark.parametrize("post_norm", [False, True])
def test_training_and_serving_logits_agree(post_norm):
    eagle, pr = _drafter(post_norm)
    batch = make_batch(eagle.config, batch=1, seq=12)
    batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
    out = _train_logits(pr, batch)
    for p in (3, 9):
        serve0, serve1, serve_deep = _serve_logits(pr, batch, p)
        torch.testing.assert_close(serve0[0], out.logits[0][0, p], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(serve1[0], out.logits[1][0, p], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(serve_deep[0], out.depth_logits[0][1][0, p], rtol=1e-4, atol=1e-5)


def test_post_norm_feedback_changes_what_the_next_step_and_depth_read_but_not_step_0():
    eagle, off = _drafter(False)
    _, on = _drafter(True)
    on.load_state_dict(off.state_dict())
    batch = make_batch(eagle.config, batch=1, seq=12)
    a, b = _train_logits(off, batch), _train_logits(on, batch)
    torch.testing.assert_close(a.logits[0], b.logits[0], rtol=0, atol=0)  # step 0 reads the target's features
    assert (a.logits[1] - b.logits[1]).abs().max() > 1e-3
    assert (a.depth_logits[0][1] - b.depth_logits[0][1]).abs().max() > 1e-3
    f = torch.randn(3, 64)
    torch.testing.assert_close(on.feedback(f), on.norm(f))
    assert torch.equal(off.feedback(f), f)


@pytest.mark.parametrize("post_norm", [False, True])
def test_sglang_export_writes_norm_output_as_the_feedback(post_norm):
    eagle, pr = _drafter(post_norm)
    draft_cfg = {**eagle.config.to_dict(), "norm_output": True}  # SpecForge's meaning: normed logits
    cfg = sglang_config(draft_cfg, pr, None, torch.float32)
    assert cfg.get("norm_output", False) is post_norm  # SGLang's meaning: the next step reads the normed feature
    assert cfg["pr_config"]["post_norm_feedback"] is post_norm


def test_post_norm_feedback_must_be_a_boolean():
    from pr_specforge.config import ConfigError

    with pytest.raises(ConfigError, match="post_norm_feedback"):
        PRConfig.from_mapping({"post_norm_feedback": "yes"})
