"""The regime study's serve plans: who is served in which report folder, at which cells, on which prompts, and in
rounds; and what a served folder has finished (its `summary.json`), which a round's stage and the report read.

`ReportServes` is the part of `regime_stages.Regime` that plans serves; it reads the regime's `args`, `build`,
`seed_dir` and `report_prompts`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

from pr_specforge.stages import Stage

from .common import tree_args
from .regime_settings import BASELINE, REPORT_DIRS, report_rounds


class ReportServes:
    """The screening and report serves of a regime (a mixin of `regime_stages.Regime`)."""

    def serve_settings(self, seed: int, prompts: Sequence[str], limit: int, budgets, temperatures, bw: int = 6,
                       drafters: Optional[Sequence[str]] = None, baseline_from: Sequence[Path] = ()) -> dict:
        args, sd = self.args, self.seed_dir(seed)
        names = [n for n in (args.drafters if drafters is None else drafters) if n in args.drafters]
        return dict(drafts={n: sd / "export" / n for n in names}, prompts=[str(p) for p in prompts], limit=limit,
                    budgets=list(budgets), temperatures=list(temperatures), max_new_tokens=args.serve_max_new_tokens,
                    extra=[*tree_args(bw), "--seed", seed, "--no-progress", "--also-one-pass",
                           *[a for d in baseline_from for a in ("--baseline-from", d)]])

    def report_drafters(self) -> Dict[str, List[str]]:
        """Who is served in which report folder (`REPORT_DIRS`' second field), from `--drafters`.

        `verdict`: the PR drafters and their matched baselines, in every cell (B 48 at T 0 and 1, B 24 at T 0).
        `b48`: they and the plain EAGLE-3 drafter at B 48 (the regime's EAGLE-3 tau, and both controls' base).
        `two_layer`: Table 3's control at B 48, T 0 (the cell Table 3 reports). `bw9`: Table 4's widened
        control, the plain EAGLE-3 drafter at B_w 9 (B 48, T 0 and T 1: Table 4 is at T 1).
        """
        names = self.args.drafters
        pr = [n for n in names if n in BASELINE]
        verdict = [n for n in names if n in pr or n in {BASELINE[p] for p in pr}]
        return {"verdict": verdict, "b48": [n for n in names if n in verdict or n == "eagle3"],
                "two_layer": [n for n in names if n == "eagle3-2layer"], "bw9": [n for n in names if n == "eagle3"]}

    def report_serves(self, seed: int, limit: Optional[int] = None) -> List[tuple]:
        """The report serves of `--report-dirs` at `--report-temperatures` (a folder left with none is not served),
        (name, out_dir, `serve_settings`), in `REPORT_DIRS` order, on the first `limit` problems (default `--report-limit`); every folder after the first lends the first one's target
        decodes (`eval --baseline-from`: same target, prompts and seeds; a problem it has not decoded yet is decoded
        anew), also when a second runner serves that first folder."""
        sd, who = self.seed_dir(seed), self.report_drafters()
        first = sd / REPORT_DIRS[0][0]
        # served here first, or by another runner: lent only once it has served something
        lends = REPORT_DIRS[0][0] in self.args.report_dirs or (first / "eval_config.json").exists()
        limit = self.args.report_limit if limit is None else limit
        only = getattr(self.args, "report_temperatures", None)  # --report-temperatures: a folder's other cells wait
        cells = [(out, group, budget, [t for t in temps if only is None or float(t) in only], bw)
                 for out, group, budget, temps, bw in REPORT_DIRS]
        return [(f"seed{seed} {out}", sd / out, self.serve_settings(seed, self.report_prompts(), limit, [budget], temps,
                                                                    bw=bw, drafters=who[group],
                                                                    baseline_from=[] if sd / out == first or not lends else [first]))
                for out, group, budget, temps, bw in cells if who[group] and temps and out in self.args.report_dirs]

    def serve_stage(self, name: str, out: Path, settings: dict) -> Stage:
        """`eval` of `settings` into `out`, done once the folder's summary counts `settings`' problems in every cell
        this serve makes (`served_cells`): a drafter added to a folder served before is served, not skipped."""
        stage = self.build.eval_stage(name, out, **settings)
        stage.done = lambda: (summary_prompts(out, served_cells(settings)) >= settings["limit"]
                              and self.build.served_by(out, settings["drafts"]))
        return stage

    def report_stages(self, seed: int) -> List[Stage]:
        """`report_serves` in rounds of `--report-step` problems (`report_rounds`): every folder reaches a round's
        problems before any goes on. A round's stage is done once its folder's summary counts that many problems in
        each of its cells."""
        return [self.serve_stage(name if limit == self.args.report_limit else f"{name} to {limit}", out, settings)
                for limit in report_rounds(self.args.report_limit, self.args.report_step)
                for name, out, settings in self.report_serves(seed, limit)]


def served_cells(settings: dict) -> Set[Tuple[str, int, float]]:
    """The (drafter, B, T) cells a serve of `serve_settings` makes: each drafter's, and a PR drafter's one-pass tree
    too (`--also-one-pass`)."""
    names = [*settings["drafts"], *(f"{n}/one-pass" for n in settings["drafts"] if n in BASELINE)]
    return {(n, int(b), float(t)) for n in names for b in settings["budgets"] for t in settings["temperatures"]}


def summary_prompts(eval_dir: Path, cells: Optional[Set[Tuple[str, int, float]]] = None) -> int:
    """How many problems an eval folder's last finished run served in every one of its cells, or of the (drafter, B,
    T) `cells` given (its `summary.json`; 0 while none has finished, or while one of `cells` has no entry)."""
    path = eval_dir / "summary.json"
    if not path.exists():
        return 0
    entries = json.loads(path.read_text()).get("results") or []
    if cells is not None:
        have = {(e["draft"], int(e["budget"]), float(e["temperature"])): e["prompts"] for e in entries}
        return min((have.get(c, 0) for c in cells), default=0)
    return min((e["prompts"] for e in entries), default=0)


def finished_by_drafter(eval_dir: Path) -> Dict[str, set]:
    """drafter -> the "set/prompt" keys each of its cells had finished at the folder's last finished run (its
    `summary.json`; {} when none has finished): a drafter added to a folder later is read up to its own rounds."""
    path = eval_dir / "summary.json"
    per: Dict[str, Dict[str, set]] = {}
    for e in (json.loads(path.read_text()).get("results") or []) if path.exists() else []:
        keys, sets = {f"{e['set']}/{p}" for p in e["per_prompt_tau"]}, per.setdefault(e["draft"], {})
        sets[e["set"]] = keys if e["set"] not in sets else sets[e["set"]] & keys
    return {d: set().union(*sets.values()) for d, sets in per.items()}


def finished_prompts(eval_dirs: Sequence[Path]) -> Optional[set]:
    """The "set/prompt" keys every cell of every folder given had finished at its last finished run (each folder's
    `summary.json`): rows past them belong to a round still running. None when no folder has finished one."""
    per_set: Dict[str, set] = {}  # a cell covers its own prompt set's prompts: intersect within a set, join the sets
    for d in eval_dirs:
        path = d / "summary.json"
        if not path.exists():
            if (d / "results.jsonl").exists():
                return set()  # a folder that has rows but no finished round holds the others back
            continue
        for e in json.loads(path.read_text()).get("results") or []:
            keys = {f"{e['set']}/{p}" for p in e["per_prompt_tau"]}
            per_set[e["set"]] = keys if e["set"] not in per_set else per_set[e["set"]] & keys
    return set().union(*per_set.values()) if per_set else None
