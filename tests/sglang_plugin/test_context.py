"""`DrafterRuntime.load_context`: a committed context read from an outside KV cache in SGLang's pool layout
(`[L, H_kv, Dh]`, KV heads not repeated) drafts the same tree as the context our own `extend` wrote."""

import torch

from pr_specforge.serving import DrafterRuntime, TensorTreeBuilder, TreeConfig
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)


def test_a_context_loaded_from_pool_layout_drafts_the_same_tree(models):
    target, _, pr = models
    eager_gate(pr, -2.0)
    cfg = TreeConfig(budget=16, k=4, bw=4, gamma=4, m=2)
    rt, root, feat = primed_runtime(pr, target)
    rep = rt.num_heads // pr.config.num_key_value_heads
    assert rep > 1, "the tiny drafter should use grouped KV heads, or the head layout goes untested"
    pool_k = rt.k_cache[::rep].transpose(0, 1).clone()  # [L, H_kv, Dh]: what SGLang's pool holds per slot
    pool_v = rt.v_cache[::rep].transpose(0, 1).clone()
    ref = TensorTreeBuilder(rt, cfg).build(root, feat, torch.Generator().manual_seed(0))
    other = DrafterRuntime(pr)
    other.load_context(pool_k, pool_v)
    assert other.length == rt.length
    got = TensorTreeBuilder(other, cfg).build(root, feat, torch.Generator().manual_seed(0))
    assert (got.tokens(), got.parents(), got.scores) == (ref.tokens(), ref.parents(), ref.scores)
    assert got.recon_rows > 0
