"""The experiment's statistics: PR's acceptance-length gain over EAGLE-3 with a paired bootstrap CI.

Owns: `paired_bootstrap_gain` (one set x budget x temperature cell, from the evaluator's
per-prompt rows), `decompose_gain` (the one rule splitting PR's gain into its one-pass and
mechanism parts, shared with `benchmarks/pilots.py`), `comparisons` (every cell of some `pr-specforge eval` output directories
that served both an `eagle3` and a `pr` drafter, split into one-pass and mechanism parts where
the PR drafter was also served at m = 0) and `seed_comparisons` (every training
seed evaluated in an experiment workdir).

Does not own: tau's definition (the evaluator's: sum of accepted tokens over sum of rounds)
or the report (`experiment_report`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from pr_specforge.data.io import read_jsonl_rows


def paired_bootstrap_gain(rows_a: Dict[str, dict], rows_b: Dict[str, dict], n: int = 2000, seed: int = 0) -> dict:
    """PR's relative tau gain over EAGLE-3, `tau_b / tau_a - 1`, with a 95% paired bootstrap CI.

    `rows_x[prompt] = {"accepted": int, "rounds": int}`; tau of a set of prompts is
    sum(accepted) / sum(rounds) (the evaluator's definition); prompts are resampled
    with replacement, the same prompts for both drafters (paired).
    """
    import numpy as np

    prompts = sorted(set(rows_a) & set(rows_b))
    if not prompts:
        raise ValueError("no prompt was evaluated for both drafters")
    acc = np.array([[rows_a[p]["accepted"], rows_b[p]["accepted"]] for p in prompts], dtype=float)
    rnd = np.array([[rows_a[p]["rounds"], rows_b[p]["rounds"]] for p in prompts], dtype=float)
    tau = acc.sum(0) / rnd.sum(0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(prompts), size=(n, len(prompts)))
    boot = acc[idx].sum(1) / rnd[idx].sum(1)  # [n, 2]
    gains = boot[:, 1] / boot[:, 0] - 1.0
    diffs = boot[:, 1] - boot[:, 0]
    return {
        "prompts": len(prompts),
        "tau_eagle3": float(tau[0]), "tau_pr": float(tau[1]),
        "gain_abs": float(tau[1] - tau[0]),
        "gain_rel": float(tau[1] / tau[0] - 1.0),
        "gain_rel_ci95": [float(np.percentile(gains, 2.5)), float(np.percentile(gains, 97.5))],
        "gain_abs_ci95": [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))],
    }


#: the PR drafter served with m = 0 (`eval --also-one-pass`): its one-pass tree
ONE_PASS = "pr/one-pass"


def decompose_gain(eagle: Optional[Dict[str, dict]], pr: Optional[Dict[str, dict]],
                   one_pass: Optional[Dict[str, dict]] = None, n: int = 2000, seed: int = 0) -> Dict[str, dict]:
    """PR's tau gain over EAGLE-3 and its split (issue 16, part A), each a `paired_bootstrap_gain`:

    `gain` (PR over EAGLE-3), `one_pass` (PR's m = 0 tree over EAGLE-3: what training PR did to
    the one-pass drafter), `mechanism` (PR over its m = 0 tree: what reconsideration did).
    Each argument maps a prompt key to its row (`accepted`, `rounds`), or is None (not served).

    The rule for missing rows: each part is paired over the prompts both of its drafters were
    served on, and a part one of whose drafters is missing, or that share no prompt, is left
    out. Served on the same prompts (every `eval --also-one-pass` run), the parts satisfy
    (1 + gain) = (1 + one_pass)(1 + mechanism) exactly.
    """
    out = {}
    for key, (a, b) in {"gain": (eagle, pr), "one_pass": (eagle, one_pass), "mechanism": (one_pass, pr)}.items():
        if a and b and set(a) & set(b):
            out[key] = paired_bootstrap_gain(a, b, n=n, seed=seed)
    return out


def served_rows(eval_dirs, suffix: str = "") -> Dict[tuple, Dict[str, dict]]:
    """(draft + suffix, budget, temperature) -> "set/prompt" -> row, over the eval out-dirs given that hold
    a `results.jsonl` (later dirs win a repeated key)."""
    out: Dict[tuple, Dict[str, dict]] = {}
    for d in eval_dirs:
        path = Path(d) / "results.jsonl"
        if path.exists():
            for r in read_jsonl_rows(path, repair=False):
                out.setdefault((r["draft"] + suffix, r["budget"], float(r["temperature"])), {})[f"{r['set']}/{r['prompt']}"] = r
    return out


def comparisons(eval_dirs, n: int, seed: int) -> List[dict]:
    """PR vs EAGLE-3 per set x budget x temperature from the evaluators' per-prompt rows.

    Where the PR drafter was also served at m = 0 (`pr/one-pass`), the cell also carries the
    decomposition of the gain (`decompose_gain`: `one_pass` and `mechanism`, each with its own
    paired CI). A cell needs both an `eagle3` and a `pr` row sharing a prompt; its gain's
    fields are the cell's own.
    """
    cells = []
    for eval_dir in eval_dirs:
        per_prompt: Dict[tuple, Dict[str, dict]] = {}
        for row in read_jsonl_rows(Path(eval_dir) / "results.jsonl", repair=False):
            per_prompt.setdefault((row["draft"], row["set"], row["budget"], row["temperature"]), {})[row["prompt"]] = row
        for (draft, set_name, budget, temp), rows in per_prompt.items():
            eagle = per_prompt.get(("eagle3", set_name, budget, temp))
            if draft != "pr" or eagle is None:
                continue
            parts = decompose_gain(eagle, rows, per_prompt.get((ONE_PASS, set_name, budget, temp)), n=n, seed=seed)
            if "gain" not in parts:
                continue  # no prompt served by both
            cells.append({"set": set_name, "budget": budget, "temperature": temp, **parts.pop("gain"), **parts})
    cells.sort(key=lambda c: (c["budget"], c["temperature"], c["set"]))
    return cells


def seed_comparisons(work: Path, n: int) -> Dict[int, List[dict]]:
    """Every training seed evaluated in `work` (finished `eval-b*-seedN` stages) -> its comparisons."""
    seeds: Dict[int, List[Path]] = {}
    for summary in sorted(work.glob("eval-b*-seed*/summary.json")):
        seed = summary.parent.name.rsplit("seed", 1)[-1]
        if seed.isdigit():
            seeds.setdefault(int(seed), []).append(summary.parent)
    return {seed: comparisons(dirs, n, seed) for seed, dirs in sorted(seeds.items())}
