"""`PRDraftWorker.pr_verified` / `_settle`: the host's part of a round, which `draft` leaves pending so that nothing
in the draft waits for the device (SGLang's overlap schedule), settled when SGLang has the round's verify result on
the host (`on_verify_complete_cpu`): each request's encoding check, its counters and its meta info. The live tests,
which keep a round log, settle right after the verify (`_settle`) and record at the verify result. The worker's own
state only: SGLang's draft worker is not built here."""

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


def _pending(rows, reqs=()):
    summary = torch.tensor(rows)  # per request: kept nodes, groups, most children of a kind; 3 counters
    return _Pending(*_to_host(summary), [f"r{i}" for i in range(len(rows))], [40] * len(rows), ["off"] * len(rows),
                    [len(rows)] * len(rows), None, [], list(reqs))


class _Req:
    """What `pr_verified` reads of SGLang's `Req`: finished or retracted, and the meta info `admission` keeps."""

    def __init__(self, finished=False):
        self.done, self.is_retracted, self.output_ids, self.pr_shape = finished, False, [1], SHAPE
        self.customized_info = {"pr_eagle3": [{"bw": 2, "m": 1, "rounds": 0, "recon_rows": 0, "recon_kept": 0}] * 5}

    def finished(self):
        return self.done


def test_a_pending_round_is_summed_once_and_recorded_when_sglang_has_its_verify_result():
    w = _worker()
    live, done = _Req(), _Req(finished=True)
    w.pr_pending.append(_pending([[7, 3, 2, 3, 1, 0], [7, 2, 1, 2, 0, 1]], [live, done]))
    assert w.pr_totals["rounds"] == 0  # nothing read while the round is pending
    w._settle()  # a round log's settle: counted, not yet recorded per request
    assert w.pr_totals == {"rounds": 2, "recon_rows": 5, "recon_kept": 1, "repriced_kept": 1}
    w.pr_verified()
    assert not w.pr_pending and w.pr_totals["rounds"] == 2  # nothing counted twice
    assert live.customized_info["pr_eagle3"][-1] == {"bw": 2, "m": 1, "rounds": 1, "recon_rows": 3, "recon_kept": 1}
    assert done.customized_info["pr_eagle3"][-1]["rounds"] == 0  # a finished request's dropped round
    w.pr_verified()  # nothing pending: nothing recorded twice
    assert live.customized_info["pr_eagle3"][-1]["rounds"] == 1


def test_under_the_overlap_schedule_the_oldest_round_is_the_one_verified():
    w = _worker()
    req = _Req()
    w.pr_pending.extend([_pending([[7, 3, 2, 1, 0, 0]], [req]), _pending([[7, 3, 2, 2, 1, 0]], [req])])
    w.pr_verified()
    assert req.customized_info["pr_eagle3"][-1]["recon_rows"] == 1 and len(w.pr_pending) == 1


@pytest.mark.parametrize("row,message", [([6, 3, 2, 0, 0, 0], "a round kept 5 nodes, not B=6"),
                                         ([7, 3, 3, 0, 0, 0], "more than k=2 children of one kind")])
def test_a_broken_encoding_is_refused_at_the_settle_one_round_late(row, message):
    w = _worker()
    w.pr_pending.append(_pending([[7, 3, 2, 0, 0, 0], row]))
    with pytest.raises((RuntimeError, ValueError), match=message):
        w.pr_verified()
