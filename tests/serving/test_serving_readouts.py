"""Readouts read in one call for every running request (`tensor_tree.batch_step_readouts`) against request by request
(`step_readouts`), the rows' padding (`DrafterRuntime.READOUT_ROWS`, `GATE_SIGMOID_PAD`), and the machine's probe
(`drafter_runtime.readouts_row_invariant`), which must see a readout whose kernel depends on the call's row count."""

import dataclasses

import pytest
import torch

from pr_specforge.serving import TreeConfig
from pr_specforge.serving.drafter_runtime import DrafterRuntime, readouts_row_invariant
from pr_specforge.serving.tensor_tree import TreeShape, batch_root_readout, batch_step_readouts, root_readout, step_readouts
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)


def feats(n, d, seed=3):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 13])
def test_padded_readouts_are_the_rows_readouts(models, n):
    """The zero rows a readout is padded with never reach its result: `n` rows in, `n` rows out, each the row's own
    readout within float rounding (the unpadded head's), and a gate of `n` lambdas in (0, 1)."""
    target, _, pr = models
    eager_gate(pr, -1.0)
    rt, _, _ = primed_runtime(pr, target)
    x = feats(n, pr.config.hidden_size)
    logp, lam = rt.readout_and_halt(x)
    own = torch.log_softmax(pr.compute_logits(x).float(), -1)
    assert logp.shape == (n, rt.draft_vocab_size) and lam.shape == (n,)
    torch.testing.assert_close(logp, own, rtol=0, atol=1e-5)
    torch.testing.assert_close(lam, pr.halt_probability(x), rtol=0, atol=1e-6)
    assert torch.equal(rt.log_probs(x, 0), logp) and torch.equal(rt.halt_probability(x), lam)
    assert bool(((lam > 0) & (lam < 1)).all())


@pytest.mark.parametrize("m", [0, 2])
def test_one_call_for_the_batch_gives_each_request_its_own_readouts(models, m):
    """Four requests' step rows read at once equal each request's rows read alone: bit for bit where this machine's
    probe says a row's readout does not depend on its call, within float rounding anywhere."""
    target, _, pr = models
    eager_gate(pr, -1.0)
    rt, _, _ = primed_runtime(pr, target)
    tb = TreeShape(rt, TreeConfig(budget=16, k=4, bw=4, m=m, gamma=4))
    b, p, d, v = 4, tb.per_step, pr.config.hidden_size, rt.draft_vocab_size
    x = feats(b * p, d).view(b, p, d)
    ref = torch.zeros(b, p, v)
    ref_lam = [step_readouts(tb, rt, x[i], ref[i])[1] for i in range(b)]
    got = torch.full((b, p + 1, v), float("nan"))[:, :p]  # a strided slice of a bigger buffer, as a round's rows are
    got_lam = batch_step_readouts(tb, rt, x, got)
    exact = readouts_row_invariant(rt)
    check = torch.equal if exact else (lambda a, c: torch.allclose(a, c, rtol=0, atol=1e-5))
    assert check(got, ref)
    if m:
        assert got_lam.dtype == torch.float64 and check(got_lam, torch.stack(ref_lam))
    else:
        assert got_lam is None and all(lam is None for lam in ref_lam)
    roots = torch.zeros(b, 1, v)
    lam0 = batch_root_readout(rt, x[:, :1], True, roots)
    for i in range(b):
        one, l0 = root_readout(rt, x[i, :1], True, None)
        assert check(roots[i], one) and check(lam0[i], l0)


def test_the_probe_sees_a_readout_whose_kernel_depends_on_the_row_count(models, monkeypatch):
    """A head that sums in another order below 8 rows (as a BLAS's small-count kernel does): the probe answers
    False; given the runtime's own readouts back, it answers as before."""
    target, _, pr = models
    rt, _, _ = primed_runtime(pr, target)
    padded = readouts_row_invariant(rt)
    w = pr.lm_head.weight

    def small_count_kernel(feature, depth=0):
        x = pr.norm(feature)
        return (x[:, None, :] * w[None]).sum(-1) if x.shape[0] < 8 else x @ w.t()

    monkeypatch.setattr(rt, "depth_logits", small_count_kernel)
    assert readouts_row_invariant(rt) is False
    monkeypatch.undo()
    assert readouts_row_invariant(rt) is padded


def test_the_split_readout_reads_each_part_with_its_own_head_in_one_call(models):
    """A drafter with a second head (`pr.recon_head: separate`): the batch's one-pass rows through the first head,
    its reconsideration rows through the second, each one call; equal to request by request."""
    from tests.recipe_options.test_drafter_options import pr_drafter, randomise

    target, _, _ = models
    _, pr = pr_drafter(recon_head="separate")
    randomise(pr.pr_recon_head, 0.5)
    pr = pr.eval()
    rt, _, _ = primed_runtime(pr, target)
    tb = TreeShape(rt, TreeConfig(budget=6, k=2, bw=2, m=1, gamma=3))
    assert tb.split_readout
    b, p, d, v = 3, tb.per_step, pr.config.hidden_size, rt.draft_vocab_size
    x = feats(b * p, d, seed=7).view(b, p, d)
    ref = torch.zeros(b, p, v)
    ref_lam = torch.stack([step_readouts(tb, rt, x[i], ref[i])[1] for i in range(b)])
    got = torch.zeros(b, p, v)
    got_lam = batch_step_readouts(tb, rt, x, got)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_lam, ref_lam, rtol=0, atol=1e-6)
    one_pass = rt.log_probs(x[:, tb.bw :].reshape(-1, d), 0).view(b, p - tb.bw, v)
    assert not torch.allclose(got[:, tb.bw :], one_pass, atol=1e-3)  # the reconsideration rows read the second head
