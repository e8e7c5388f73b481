"""`PRDraftWorker._settle`: the host's part of a round, which `draft` leaves pending so that nothing in the draft
waits for the device (SGLang's overlap schedule), settled at the next draft: each request's encoding check and its
counters. Without a round log this is the path a server takes; the live tests, which keep a round log, settle
right after the verify instead. The worker's own state only: SGLang's draft worker is not built here."""

import pytest
import torch

from pr_specforge.sglang_plugin.checks import PRServeShape
from pr_specforge.sglang_plugin.worker import PRDraftWorker, _Pending, _to_host

SHAPE = PRServeShape(k=2, bw=2, m=1, gamma=3, budget=6)


def _worker():
    w = PRDraftWorker.__new__(PRDraftWorker)
    w.pr_shape, w.pr_rows = SHAPE, None
    w.pr_counting(None)
    return w


def _pending(rows):
    summary = torch.tensor(rows)  # per request: kept nodes, groups, most children of a kind; 3 counters
    return _Pending(*_to_host(summary), [f"r{i}" for i in range(len(rows))], [40] * len(rows), ["off"] * len(rows),
                    [len(rows)] * len(rows), None, [])


def test_a_pending_round_is_summed_once_at_the_next_settle():
    w = _worker()
    w.pr_pending = _pending([[7, 3, 2, 3, 1, 0], [7, 2, 1, 2, 0, 1]])
    assert w.pr_totals["rounds"] == 0  # nothing read while the round is pending
    w._settle()
    assert w.pr_totals == {"rounds": 2, "recon_rows": 5, "recon_kept": 1, "repriced_kept": 1}
    assert w.pr_pending is None
    w._settle()  # nothing pending: nothing counted twice
    assert w.pr_totals["rounds"] == 2


@pytest.mark.parametrize("row,message", [([6, 3, 2, 0, 0, 0], "a round kept 5 nodes, not B=6"),
                                         ([7, 3, 3, 0, 0, 0], "more than k=2 children of one kind")])
def test_a_broken_encoding_is_refused_at_the_settle_one_round_late(row, message):
    w = _worker()
    w.pr_pending = _pending([[7, 3, 2, 0, 0, 0], row])
    with pytest.raises((RuntimeError, ValueError), match=message):
        w._settle()
