"""One-line readings of measured numbers, for the last screen of `pr-specforge run`.

* `speedup_line`: why the speedup is what it is on this device, from the same measured values the eval
  table shows (a round's draft and verify time, the target's own decode step, tau): speculative decoding
  gains about `tau / (round time in target steps)`, so it is below 1x wherever a round costs more target
  steps than it accepts tokens (a CPU verifies a B-node tree in several steps; a GPU in about one).
* `gate_line`: what the gate's means say, from the training run's last logged halt-depth distribution q
  (`pr/depth_marginal_r`) and mean halt probability at depth 0 (`pr/gate_mean_depth_0`), beside the
  served tau of the PR drafter and of the same drafter served one-pass. The wording is chosen by
  `HALTS_AT_ZERO` and `RECONSIDERS`, the thresholds on q_0.

Owns the wording and its thresholds. Does not own the numbers (`eval.evaluator.summarize`,
`training.objective.metrics`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

#: q_0 (the share of positions halting at depth 0) at or above which the gate counts as closed: the drafter
#: (nearly) always keeps its one-pass guess, so reconsideration has (nearly) nothing to change
HALTS_AT_ZERO = 0.9
#: q_0 at or below which the gate counts as open: most positions are reconsidered past depth 0
RECONSIDERS = 0.5
#: two taus closer than this (relative) read as the same
SAME_TAU = 0.002
#: the suffix `eval --also-one-pass` gives the PR drafter served as plain EAGLE-3
ONE_PASS_SUFFIX = "/one-pass"


def speedup_line(row: Dict) -> Optional[str]:
    """Why `row`'s speedup (an `eval` summary entry) is what it is, from its own timings; None without them."""
    ar_tps, tau = row.get("ar_tokens_per_s") or 0.0, row.get("tau")
    draft_s, verify_s = row.get("draft_s_per_round"), row.get("verify_s_per_round")
    if ar_tps <= 0 or tau is None or draft_s is None or verify_s is None:
        return None
    step = 1.0 / ar_tps  # one target decode step on this device
    cost = (draft_s + verify_s) / step
    head = (f"speedup {row['speedup']:.2f}x ({row['draft']}, B={row['budget']}): a round costs {cost:.1f} target "
            f"decode steps here (draft {1e3 * draft_s:.0f} ms + verify {1e3 * verify_s:.0f} ms, one step "
            f"{1e3 * step:.0f} ms) and accepts tau={tau:.2f} tokens")
    if tau < cost:
        return (head + f"; below 1x because tau < {cost:.1f}: verifying the tree costs {verify_s / step:.1f} steps on "
                "this device (about one on a GPU); tau is the device-independent measure")
    return head + f"; above 1x because tau > {cost:.1f}"


def halt_depths(metrics: Dict) -> List[float]:
    """The logged halt-depth marginals q = (q_0, q_1, ...) of a training's metrics row ([] for EAGLE-3)."""
    q: List[float] = []
    while isinstance(metrics.get(f"pr/depth_marginal_{len(q)}"), (int, float)):
        q.append(float(metrics[f"pr/depth_marginal_{len(q)}"]))
    return q


def paired_taus(rows: Sequence[Dict]) -> Optional[tuple]:
    """`(pr row, one-pass row)`: the first PR drafter served with and without reconsideration in one cell."""
    cells = {(r.get("draft"), r.get("set"), r.get("budget"), r.get("temperature")): r for r in rows}
    for (draft, *cell), row in cells.items():
        one = cells.get((f"{draft}{ONE_PASS_SUFFIX}", *cell))
        if one is not None:
            return row, one
    return None


def gate_line(metrics: Dict, rows: Sequence[Dict] = ()) -> Optional[str]:
    """What the last logged gate statistics mean (None for a run that logs no halt depths: EAGLE-3)."""
    q = halt_depths(metrics)
    if len(q) < 2:
        return None
    lam = metrics.get("pr/gate_mean_depth_0")
    head = (f"gate: mean halt probability at depth 0 {lam:.2f}, " if isinstance(lam, (int, float)) else "gate: ")
    head += "halt depths q = " + "/".join(f"{x:.2f}" for x in q) + f" (step {metrics.get('step', '?')})"
    q0 = q[0]
    if q0 >= HALTS_AT_ZERO:
        verdict = f"the drafter halts at depth 0 at {q0:.0%} of positions, so reconsideration rarely runs"
    elif q0 <= RECONSIDERS:
        verdict = f"{1 - q0:.0%} of positions are reconsidered past depth 0: the mechanism is at work"
    else:
        verdict = f"{1 - q0:.0%} of positions are reconsidered past depth 0: the mechanism is partly at work"
    pair = paired_taus(rows)
    if pair is not None:
        pr, one = pair
        same = abs(pr["tau"] - one["tau"]) <= SAME_TAU * max(one["tau"], 1e-12)
        change = ("the same tau: reconsideration changed nothing here" if same
                  else f"tau {pr['tau'] / one['tau'] - 1:+.1%} from reconsideration")
        verdict += f"; served, {pr['draft']} tau {pr['tau']:.3f} vs {one['draft']} {one['tau']:.3f}: {change}"
    return f"{head}: {verdict}"
