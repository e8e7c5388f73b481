"""Render the result tables of `docs/results/*.md` from the committed JSON in `benchmarks/results/`.

    python benchmarks/render_results.py            # rewrite every rendered block in docs/results/
    python benchmarks/render_results.py --check    # exit 1, naming the page, if a page differs from its JSON

A page holds prose written by hand and tables rendered here. A rendered table sits between

    <!-- render: NAME key=value ... -->
    ...
    <!-- end render -->

and NAME is one of `RENDERERS` below; the keys are its arguments (`file` is a path under
`benchmarks/results/`). Everything outside the blocks is left as it is, so a page's numbers can
only be edited by changing the JSON they come from (`tests/test_docs.py` checks that every
committed page equals its rendering).

Owns: the tables of the results pages. Does not own the JSON (each study's own script writes it)
nor `benchmarks/results/*.md` (the studies' full reports, rendered by those scripts).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/study: what the studies share

from pr_specforge.eval.experiment_report import format_gain
from study.common import REPO_ROOT as ROOT, RESULTS
from study.regime_settings import CELLS  # the served cells in the order the pages show them: (B, T), then the sets

PAGES = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end render -->)", re.S)
SETS = {"mtbench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval"}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _f(x: Optional[float], fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _ordered(comparisons: List[dict]) -> List[dict]:
    key = {(b, t, s): i for i, (b, t, s) in enumerate((b, t, s) for b, t in CELLS for s in SETS)}
    return sorted(comparisons, key=lambda c: key[(c["budget"], float(c["temperature"]), c["set"])])


def served(file: str, seed: str, tau_gain: str = "no") -> str:
    """One seed's served cells: both drafters' tau and PR's relative gain with its 95% paired CI."""
    header = ["set", "B", "T", "tau EAGLE-3", "tau PR", "gain [95% CI]"] + (["gain in tau"] if tau_gain == "yes" else [])
    rows = []
    for c in _ordered(_load(file)["seeds"][seed]):
        row = [SETS[c["set"]], c["budget"], f"{c['temperature']:g}", f"{c['tau_eagle3']:.3f}", f"{c['tau_pr']:.3f}", format_gain(c)]
        rows.append(row + ([f"{c['gain_abs']:+.3f}"] if tau_gain == "yes" else []))
    return _table(header, rows)


def seeds(file: str) -> str:
    """Every seed's gain side by side, and the mean gain."""
    by_seed = _load(file)["seeds"]
    names = sorted(by_seed)
    rows = []
    for c in _ordered(by_seed[names[0]]):
        cell = (c["set"], c["budget"], c["temperature"])
        mine = [next(x for x in by_seed[s] if (x["set"], x["budget"], x["temperature"]) == cell) for s in names]
        mean = sum(x["gain_rel"] for x in mine) / len(mine)
        rows.append([SETS[c["set"]], c["budget"], f"{c['temperature']:g}", *(format_gain(x) for x in mine), f"{100 * mean:+.1f}%"])
    return _table(["set", "B", "T", *(f"seed {s}" for s in names), "mean"], rows)


def heldout(files: str) -> str:
    """`pr-specforge diagnose` of the final checkpoints on the held-out features, one column pair per report."""
    reports = [_load(f)["heldout"] for f in files.split(",")]

    def both(fn: Callable[[dict], str], drafter: str) -> str:
        return " / ".join(fn(r[drafter]) for r in reports)

    def pr(key: str) -> Callable[[dict], str]:
        return lambda d: _f(d["pr"].get(key))

    def depths(band: str = "") -> Callable[[dict], str]:
        return lambda d: " / ".join(_f(d["pr"].get(f"pr/acc_depth_{r}{band}")) for r in range(3))

    rows = [
        ["positions", both(lambda d: f"{d['positions']:,.0f}", "eagle3"), both(lambda d: f"{d['positions']:,.0f}", "pr")],
        ["one-pass acc, TTT step 0", both(lambda d: _f(d["one_pass_acc"][0]), "eagle3"), both(lambda d: _f(d["one_pass_acc"][0]), "pr")],
        ["one-pass acc, TTT step 6", both(lambda d: _f(d["one_pass_acc"][6]), "eagle3"), both(lambda d: _f(d["one_pass_acc"][6]), "pr")],
        ["simulated acc len (one-pass chain)", both(lambda d: _f(d["simulated_acc_len"]), "eagle3"), both(lambda d: _f(d["simulated_acc_len"]), "pr")],
        ["PR mixed rollout: acc depth 0 / 1 / 2", "", " and ".join(depths()(r["pr"]) for r in reports)],
        ["PR, conf < 0.5 band: share of positions", "", both(pr("pr/conf_share_conf_lt50"), "pr")],
        ["PR, conf < 0.5 band: acc depth 0 / 1 / 2", "", " and ".join(depths("_conf_lt50")(r["pr"]) for r in reports)],
        ["PR: halt past 0, all / conf < 0.5 band", "", " and ".join(f"{pr('pr/halt_past_0')(r['pr'])} / {pr('pr/halt_past_0_conf_lt50')(r['pr'])}" for r in reports)],
        ["PR: q_bar 0 / 1 / 2", "", " and ".join(" / ".join(_f(r["pr"]["pr"].get(f"pr/depth_marginal_{i}")) for i in range(3)) for r in reports)],
        ["PR: share of depth-0 misses some depth >= 1 gets right", "", both(pr("pr/recovered_share"), "pr")],
    ]
    return _table(["held-out, final checkpoints", "EAGLE-3 " + " / ".join(f"seed {i}" for i in range(len(reports))),
                   "PR " + " / ".join(f"seed {i}" for i in range(len(reports)))], rows)


def pilots(file: str) -> str:
    """Each PR pilot against its matched EAGLE-3 pilot: served tau at m 3 and m 0, and the gain's two parts."""
    data = _load(file)
    tau = {r["variant"]: r for r in data["rows"]}
    rows = []
    for c in data["comparisons"]:
        v, base = tau[c["variant"]], tau[c["baseline"]]
        rows.append([f"`{c['variant']}` vs `{c['baseline']}` ({base['tau_mean']:.3f})", f"{v['tau_mean']:.3f}",
                     _f(v["tau_mean_m0"]), c["gain"]["prompts"], format_gain(c["gain"]), format_gain(c["one_pass"]),
                     format_gain(c["mechanism"])])
    return _table(["variant vs its baseline (served tau)", "tau m = 3", "tau m = 0", "prompts", "gain [95% CI]",
                   "one-pass part", "mechanism part"], rows)


def pilot_heldout(file: str) -> str:
    """Every pilot's held-out figures (`pr-specforge diagnose`) and served mean tau, ranked by served tau."""
    rows = [[f"`{r['variant']}`", _f(r["tau_mean"]), _f(r["one_pass_acc0"]), _f(r["sim_acc_len"]),
             " / ".join(_f(r[f"acc_depth_{i}"]) for i in range(3)) if r["acc_depth_0"] is not None else "-",
             _f(r["recovered_share"]), _f(r["recovered_outside_topk"])]
            for r in sorted(_load(file)["rows"], key=lambda r: -r["tau_mean"])]
    return _table(["pilot", "served tau", "held-out one-pass acc0", "sim. acc len", "acc depth 0 / 1 / 2",
                   "recovered share", "recovered outside top 6"], rows)


def best(file: str) -> str:
    """Part D: every seed's cell, the gain over the matched EAGLE-3 and its one-pass / mechanism parts."""
    rows = []
    for seed, cs in sorted(_load(file)["seeds"].items()):
        for c in _ordered(cs):
            rows.append([seed, SETS[c["set"]], c["budget"], f"{c['temperature']:g}", f"{c['tau_eagle3']:.3f}",
                         f"{c['tau_pr']:.3f}", format_gain(c), format_gain(c.get("one_pass")), format_gain(c.get("mechanism"))])
    return _table(["seed", "set", "B", "T", "tau EAGLE-3", "tau PR", "gain [95% CI]", "one-pass part", "mechanism part"], rows)


def regime(file: str, name: str, seed: str, split: str = "report", drafter: str = "pr-warm") -> str:
    """One regime's seed, served: EAGLE-3's tau, each control over it, and a PR `drafter` (default `pr-warm`) over its
    matched baseline (`BASELINE`)."""
    found = next(r for r in _load(file)["regimes"] if r["regime"] == name)
    cells = (found["seeds"] if split == "report" else found["screening"])[seed]["cells"]
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/study
    from study.regime_settings import BASELINE

    if drafter not in BASELINE:
        raise ValueError(f"drafter={drafter}: not a PR drafter of the regime study (one of {', '.join(BASELINE)})")
    base = BASELINE[drafter]
    rows = []
    for c in sorted(cells, key=lambda c: CELLS.index((c["budget"], float(c["temperature"])))):
        tau = c.get("tau") or {}
        rows.append([f"B {c['budget']}, T {c['temperature']:g}", _f(tau.get("eagle3")),
                     (c.get("prompts") or {}).get(drafter, "-"), format_gain(c.get("eagle3-2layer")),
                     format_gain(c.get("eagle3@bw9")), format_gain(c.get("eagle3-long")), format_gain(c.get(drafter)),
                     format_gain(c.get(f"{drafter}/one-pass")), format_gain(c.get(f"{drafter}/mechanism"))])
    return _table(["cell", "`eagle3` tau", "problems", "`eagle3-2layer` over it", "`eagle3@bw9` over it",
                   "`eagle3-long` over it", f"`{drafter}` over `{base}`", "one-pass part", "mechanism"], rows)


RENDERERS: Dict[str, Callable[..., str]] = {
    "served": served, "seeds": seeds, "heldout": heldout, "pilots": pilots, "pilot_heldout": pilot_heldout,
    "best": best, "regime": regime,
}


def render_page(text: str, where: str = "page") -> str:
    """The page with every rendered block replaced by its table; a bad block raises ValueError naming it."""
    def one(m: re.Match) -> str:
        name, *args = m.group("spec").split()
        if name not in RENDERERS:
            raise ValueError(f"{where}: unknown table '{name}' (known: {', '.join(RENDERERS)})")
        try:
            kwargs = dict(a.split("=", 1) for a in args)
            body = RENDERERS[name](**kwargs)
        except (KeyError, TypeError, ValueError, StopIteration, OSError) as e:
            raise ValueError(f"{where}: table '{m.group('spec')}' cannot be rendered: {type(e).__name__}: {e}") from None
        return m.group(1) + body + m.group(4)
    return BLOCK.sub(one, text)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs from its rendering")
    args = ap.parse_args(argv)
    stale = []
    for page in sorted(PAGES.glob("*.md")):
        text = page.read_text()
        try:
            new = render_page(text, str(page.relative_to(ROOT)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                tmp = page.with_suffix(".md.tmp")
                tmp.write_text(new)
                tmp.replace(page)
    verb = "differ from their JSON" if args.check else "re-rendered"
    print(f"{len(stale)} page(s) {verb}" + (": " + ", ".join(stale) if stale else ""))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
