"""The two-layer EAGLE-3 control (Table 3): one function in training and serving, lossless, trained by `eagle3`."""

import json
import os

import pytest
import torch

from pr_specforge._specforge import LlamaForCausalLMEagle3
from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE, LlamaForCausalLMEagle3TwoLayer
from pr_specforge.serving import TREE_BUILDERS, DrafterRuntime, SpeculativeDecoder, TreeConfig, autoregressive_decode
from tests.conftest import tiny_llama_config
from tests.helpers import make_drafters, write_workspace
from tests.serving.test_serving_tree import sharpen, tiny_target


def two_layer_drafter(seed=0, sharp=True):
    """A tiny two-layer drafter whose M, fc and head are the tiny EAGLE-3 drafter's (sharpened), the second layer random."""
    from pr_specforge.modeling.drafter import rebuild_rope

    eagle, _, _ = make_drafters(max_depth=1, seed=seed)
    if sharp:
        sharpen(eagle)
    torch.manual_seed(seed + 1)
    two = LlamaForCausalLMEagle3TwoLayer(tiny_llama_config(architectures=[TWO_LAYER_ARCHITECTURE])).float()
    missing, unexpected = two.load_state_dict(eagle.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("second_layer.") for k in missing)
    with torch.no_grad():  # a second layer that changes the feature visibly
        for name, p in two.second_layer.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    rebuild_rope(two)
    return eagle.eval(), two.eval()


def causal_mask(t):
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def test_serving_runtime_runs_the_training_backbone():
    """`extend` over a context = the drafter's `backbone` (both layers) over the same sequence, as TTT step 0 runs it."""
    _, two = two_layer_drafter()
    target = tiny_target()
    g = torch.Generator().manual_seed(5)
    t = 9
    aux, toks = torch.randn(t, 3 * 64, generator=g), torch.randint(1, 97, (t,), generator=g)
    rt = DrafterRuntime(two, target)
    served = rt.extend(aux, toks)
    with torch.no_grad():
        hidden = two.project_hidden_states(aux)[None]
        emb = two.embed_input_ids(toks)[None]
        pos = torch.arange(t)[None]
        full = two.backbone(emb, hidden, None, causal_mask(t), pos)[0]
        ttt0 = two.backbone(emb, hidden, [[], []], causal_mask(t), pos)[0]  # SpecForge's TTT cache path, step 0
        one_layer = LlamaForCausalLMEagle3.backbone(two, emb, hidden, None, causal_mask(t), pos)[0]
    torch.testing.assert_close(served, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ttt0, full, rtol=1e-5, atol=1e-5)
    assert (full - one_layer).abs().max() > 1e-2  # the second layer really ran


def test_row_forwards_agree_with_extend_in_both_layers():
    """A row through `forward_rows` and through `forward_tree_rows` equals the same row appended by `extend`."""
    _, two = two_layer_drafter()
    target = tiny_target()
    g = torch.Generator().manual_seed(6)
    rt = DrafterRuntime(two, target)
    rt.extend(torch.randn(6, 3 * 64, generator=g), torch.randint(1, 97, (6,), generator=g))
    assert rt.k_cache.shape[0] == 2 * two.midlayer.self_attn.num_heads
    aux, tok = torch.randn(1, 3 * 64, generator=g), torch.tensor([11])
    with torch.no_grad():
        hidden = two.project_hidden_states(aux)
    empty = rt.k_cache[:, :0].transpose(0, 1)
    row, k, _ = rt.forward_rows(rt.embed(tok), hidden, torch.tensor([6]), 6, empty, empty, [[]])
    assert k.shape == (1, 2 * two.midlayer.self_attn.num_heads, two.midlayer.self_attn.head_dim)
    rt.reserve(7)
    mask = torch.zeros(1, 7)
    tree_row = rt.forward_tree_rows(rt.embed(tok), hidden, torch.tensor([6]), 6, mask, 6)
    ext = rt.extend(aux, tok)
    torch.testing.assert_close(row, ext, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_row, ext, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("builder", TREE_BUILDERS)
def test_two_layer_decode_is_lossless(builder):
    _, two = two_layer_drafter()
    target = tiny_target(seed=1)
    for prompt in ([5, 17, 33, 2, 9, 41, 8], [60, 3, 3, 71, 12]):
        ref, _ = autoregressive_decode(target, prompt, 24)
        res = SpeculativeDecoder(target, two, TreeConfig(budget=16), tree_builder=builder).generate(prompt, 24)
        assert res.tokens == ref


def test_specforge_eagle3_ttt_trains_the_second_layer_and_zeroed_it_is_eagle3():
    """SpecForge's own TTT loop (OnlineEagle3Model) on the two-layer drafter: gradients reach the second layer;
    with its output projections zeroed it is the identity, and the loss equals the one-layer drafter's exactly."""
    from pr_specforge._specforge import OnlineEagle3Model
    from tests.helpers import make_batch

    eagle, two = two_layer_drafter(sharp=False)
    cfg = tiny_llama_config()
    batch = make_batch(cfg, seq=16)

    def loss_of(drafter):
        plosses = OnlineEagle3Model(drafter.train(), length=3)(**batch)[0]
        return sum(0.8 ** i * p for i, p in enumerate(plosses))

    loss = loss_of(two)
    loss.backward()
    grads = [p.grad for p in two.second_layer.parameters()]
    assert all(gr is not None for gr in grads) and sum(float(gr.abs().sum()) for gr in grads) > 0
    with torch.no_grad():
        two.second_layer.self_attn.o_proj.weight.zero_()
        two.second_layer.mlp.down_proj.weight.zero_()
    torch.testing.assert_close(loss_of(two), loss_of(eagle), rtol=1e-6, atol=1e-6)


def test_train_export_reload_and_sglang_refusal(tmp_path):
    """`pr-specforge train` (strategy eagle3) on a two-layer draft config, `export --to hf` reloads as the
    two-layer class, and `--to sglang` is refused in one line (SGLang would drop the second layer)."""
    from pr_specforge.export import main as export_main
    from pr_specforge.modeling import load_drafter
    from pr_specforge.training.preflight import latest_checkpoint
    from pr_specforge.training.train import run_train

    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=3)
    draft_json = tmp_path / "draft.json"
    cfg = json.loads(draft_json.read_text())
    cfg["architectures"] = [TWO_LAYER_ARCHITECTURE]
    draft_json.write_text(json.dumps(cfg))
    assert run_train(recipe, ["model.torch_dtype=bfloat16"]) == 0  # SpecForge's eagle3 step feeds bf16 features uncast
    ckpt = latest_checkpoint(tmp_path / "out")
    out = tmp_path / "export"
    assert export_main([str(ckpt), str(out), "--to", "hf", "--target", str(tmp_path / "target")]) == 0
    drafter = load_drafter(str(out))
    assert isinstance(drafter, LlamaForCausalLMEagle3TwoLayer)
    assert json.loads((out / "config.json").read_text())["architectures"] == [TWO_LAYER_ARCHITECTURE]
    # the reloaded second layer has working RoPE (a from_pretrained drafter would otherwise attend uniformly)
    attn = drafter.second_layer.self_attn
    assert torch.isfinite(attn.rotary_emb.inv_freq).all() and float(attn.rotary_emb.inv_freq[0]) == pytest.approx(1.0)
    rc = export_main([str(ckpt), str(tmp_path / "sg"), "--to", "sglang"])
    assert rc != 0 and not os.path.exists(tmp_path / "sg")


def test_pr_strategy_refuses_the_two_layer_config(tmp_path, capsys):
    from pr_specforge.cli import main

    recipe = write_workspace(str(tmp_path), strategy="pr", steps=1, pr_section={"max_depth": 1})
    draft_json = tmp_path / "draft.json"
    cfg = json.loads(draft_json.read_text())
    cfg["architectures"] = [TWO_LAYER_ARCHITECTURE]
    draft_json.write_text(json.dumps(cfg))
    assert main(["train", "-c", recipe, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "two-layer control trains with strategy eagle3" in err and "Traceback" not in err
