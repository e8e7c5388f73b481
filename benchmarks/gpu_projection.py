"""PR_EAGLE3's round as a GPU would see it: measured device ops per round, projected onto the paper's setting.

    python benchmarks/gpu_projection.py --json benchmarks/results/gpu_projection.json \
        --md benchmarks/results/gpu_projection.md

No GPU timed this. It takes the device ops per served round that `benchmarks/serving_cost.py --ops` counted
(`--ops-json`, default `benchmarks/results/serving_cost.json`, whose `--ops also` counts hold the paper shape:
measured, on a CPU through the bridge; an op is one kernel launch on a GPU, inside a CUDA graph one of the graph's
nodes, `pr_specforge.sglang_plugin.op_counts`) and
assumed inputs, each a flag whose defaults have published sources. Two of them make a grid, every cell of which
is projected (the README and docs/serving.md quote the grid's range, not one cell of it):

  --round-ms 12 26.03  EAGLE-3's round. 12: SGLang's own H100 figure for an 8B model: its speculative decoding docs
                       (https://docs.sglang.io/advanced_features/speculative_decoding.html) print 373.25 tokens/s for
                       SGLang + EAGLE-3 on Llama-3.1-8B-Instruct, MT-Bench, one H100; a round is tokens per round /
                       throughput, about 12 ms at 4.5 tokens a round (10-13 ms at 3.7-4.9: the page prints no tokens
                       per round). 26.03: Appendix H, Table 9 of the paper (arXiv 2611.05724v1,
                       https://arxiv.org/html/2611.05724v1): t_cycle = tau / throughput, the time per verification
                       step, of EAGLE-3.1 on Qwen3-8B, one H200, temperature 0, B 48, B_w 6, gamma 8, N 3: 26.03 (PR
                       26.60, 1.022x; at B 24: 25.55 and 25.94, 1.015x). The table prints no unit; milliseconds is
                       the only one tau / throughput fits (Table 5, same model and B: tau 4.835 at 26.03 ms is 186
                       tokens/s). Neither gives a round time at other batch sizes, so the same time serves 4 and 16
                       requests: the verify of n trees takes no less than of one, so the ratios there are upper bounds.
  --per-op-us 1 2.5 4  a small op's cost inside a CUDA graph on an H100-class GPU. 1: the smallest kernels'
                       execution in a decode step replayed as a CUDA graph on an sm90 GPU, PyTorch's fill and a
                       device-to-device copy, 1 us a call (torch profiler table in
                       https://github.com/neuralmagic/nm-vllm/pull/332), above the graph's own cost per node, ~0.58 us
                       for a no-op kernel (https://github.com/ahrefs/ocannl/issues/488, an RTX 5070 Ti: the only
                       per-node figure found). 4: the same graph's small reduction, vLLM's rms_norm of one token
                       (#332). 2.5: the planning figure between them (issue 71, shared/design/ROUND_COST.md), not a
                       measurement. PR's round logic is sorts, gathers, scatters and small products over a few hundred
                       elements, between the ends; a sort launches more than one kernel, which the count does not see
                       (op counts are a lower bound of launches, for both algorithms).
  --coforward-us 0     the extra compute per round of the co-forwarded reconsideration rows (ways with m > 0): the
                       paper's Sec. 3.4 argues a forward of M is memory bound at small batch, so enlarging its batch
                       costs "t_step + epsilon for a negligible epsilon". An assumption, not a measurement.

Projection, per (shape, requests) cell, way, round time and per-op cost: round = round_ms + (way's draft ops -
eagle3's draft ops) x per-op cost (+ coforward_us for m > 0). Only the draft phase differs: verify and draft-extend
are SGLang's in both servers, and the script checks that each way's verify, extend and other ops equal eagle3's in
every cell (refused in one line otherwise). Two op counts per way: as counted (the shape's gamma) and scaled to the
paper's gamma (`--paper-gamma 8`, Sec. 6.1): the added ops per draft step x 8. Where the counted shape has gamma < 8
the first under-counts (the paper's round has more steps) and the second over-counts (the per-round parts, cut,
pack, encoding, are scaled too); a count of the paper shape makes them one. Ratios: PR's projected round over
EAGLE3's (round_ms), beside the paper's measured 1.015-1.022x (`--paper-ratios`); `grid` gathers them at the paper's
gamma (the cells whose shape has it, as counted) per round time and per-op cost, and their range. Break-even: the
extra ops per round the paper's budget (ratio - 1) x round_ms allows at each round time and per-op cost. Not
included: the co-forwarded rows' compute (assumed 0), memory-bound effects of wider batches, and any op a GPU runs
that a CPU count does not see.
Every input is labelled `measured` (the ops file, its content hash and the commit it was counted at) or `assumed`
(with its source); the outputs carry no date, so a rerun on the same inputs writes the same files.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "eagle3"
#: the phases that must count the same in every way (only the draft phase is projected)
SAME_PHASES = ("verify", "extend", "other")
PAPER = "Parallel Reconsideration paper (arXiv 2611.05724v1, https://arxiv.org/html/2611.05724v1)"
SGLANG_DOCS = "SGLang's speculative decoding docs (https://docs.sglang.io/advanced_features/speculative_decoding.html)"
#: each assumed input: its default and, per default value, the value's published source
DEFAULTS = {
    "round_ms": ((12.0, 26.03), {
        12.0: f"{SGLANG_DOCS}: SGLang + EAGLE-3 serves 373.25 tokens/s on Llama-3.1-8B-Instruct, MT-Bench, one H100; "
              "a round is tokens per round / throughput, about 12 ms at 4.5 tokens a round (10-13 ms at 3.7-4.9; the "
              "page prints no tokens per round, so 12 ms is the middle of that range, not a printed number)",
        26.03: f"{PAPER}, Appendix H, Table 9: EAGLE-3.1's t_cycle = tau/throughput on Qwen3-8B, one H200, T 0, B 48, "
               "B_w 6, gamma 8 (no unit printed; ms is the one tau/throughput fits: with Table 5's tau 4.835 it is 186 "
               "tokens/s)"}),
    "per_op_us": ((1.0, 2.5, 4.0), {
        1.0: "a floor: 1 us a call for the smallest kernels (fill, device-to-device copy) of a decode step replayed as "
             "a CUDA graph on an sm90 GPU, https://github.com/neuralmagic/nm-vllm/pull/332 (the profiler's kernel "
             "time, without the gap between kernels), above a graph's ~0.58 us per no-op node, "
             "https://github.com/ahrefs/ocannl/issues/488 (RTX 5070 Ti)",
        2.5: "a planning figure for PR's small ops between the two published ends (issue 71 and its design note, "
             "shared/design/ROUND_COST.md), not a measurement",
        4.0: "the same CUDA graph's small reduction, vLLM's rms_norm of one token, 4 us "
             "(https://github.com/neuralmagic/nm-vllm/pull/332)"}),
    "paper_gamma": (8, f"{PAPER}, Sec. 6.1 and D.1: gamma = 8 draft steps"),
    "coforward_us": (0.0, f"{PAPER}, Sec. 3.4: a co-forwarded pass costs t_step + a negligible epsilon at small "
                          "batch (memory bound); assumed, not measured"),
    "paper_ratios": ((1.015, 1.022), f"{PAPER}, Appendix H, Table 9: PR's whole-cycle time over EAGLE-3.1's, "
                                     "measured run for run, B 24 and B 48"),
}
#: what every round time leaves out, whichever its source
ROUND_CAVEAT = ("each is one round at one setting: the same time serves 4 and 16 requests, whose verify takes no "
                "less than one request's, so their ratios are upper bounds")


class Refused(ValueError):
    """A bad flag or input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise Refused(f"gpu_projection: {message}")


def _number(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Refused(f"{where}: expected a number, got {x!r}")
    return float(x)


def _way_m(way: str, where: str) -> int:
    match = re.fullmatch(r"pr_m(\d+)", way)
    if not match:
        raise Refused(f"{where}: way {way!r} is neither {BASELINE!r} nor pr_m<m>")
    return int(match.group(1))


def _host_reads(names) -> int:
    """The host reads (`aten::item`) among one counted round's draft ops by name (`draft_names`: part -> name ->
    count): an eager round's, which a captured round does not make."""
    if not isinstance(names, dict):
        return 0
    return sum(int(n.get("aten::item", 0)) for n in names.values() if isinstance(n, dict))


def _named(names, op: str) -> int:
    """How many of one counted round's draft ops (`draft_names`: part -> name -> count) are operator `op`."""
    if not isinstance(names, dict):
        return 0
    return sum(int(n.get(op, 0)) for n in names.values() if isinstance(n, dict))


def read_ops(path: str) -> dict:
    """The op counts of a `serving_cost.py --ops` JSON, checked: `{"provenance": ..., "cells": [{"cell", "shape",
    "requests", "gamma", "ways": {way: {"draft", "verify", "extend", "other"}}}]}`; one `Refused` line naming the
    file and field otherwise, also when a way's verify, extend or other ops differ from eagle3's."""
    from pr_specforge.data.io import DataFormatError, file_digest, read_json_object

    where = f"--ops-json {path}"
    try:
        data = read_json_object(path, "--ops-json")
    except DataFormatError as e:
        raise Refused(str(e)) from None
    shapes, cells = data.get("shapes"), data.get("cells")
    if not isinstance(shapes, dict) or not isinstance(cells, dict) or not cells:
        raise Refused(f"{where}: no \"shapes\" and \"cells\" objects (not a `serving_cost.py --ops` result)")
    out = []
    for name, cell in cells.items():
        shape, _, n = name.partition("/")
        gamma = (shapes.get(shape) or {}).get("gamma") if isinstance(shapes.get(shape), dict) else None
        if not n.isdigit() or not isinstance(gamma, int) or gamma < 1:
            raise Refused(f"{where}: cells.{name}: not SHAPE/REQUESTS with the shape's gamma in \"shapes\"")
        ops = cell.get("ops") if isinstance(cell, dict) else None
        if not isinstance(ops, dict) or BASELINE not in ops or len(ops) < 2:
            raise Refused(f"{where}: cells.{name}.ops: needs {BASELINE!r} and at least one PR way (run with --ops)")
        ways = {}
        for way, counts in ops.items():
            field = f"{where}: cells.{name}.ops.{way}"
            if way != BASELINE:
                _way_m(way, field)
            if not isinstance(counts, dict):
                raise Refused(f"{field}: expected an object")
            ways[way] = {ph: _number(counts.get(ph), f"{field}.{ph}") for ph in ("draft",) + SAME_PHASES}
            ways[way]["host_reads"] = _host_reads(counts.get("draft_names"))
            ways[way]["new_empty"] = _named(counts.get("draft_names"), "aten::new_empty")
        for way, counts in ways.items():
            for ph in SAME_PHASES:
                if counts[ph] != ways[BASELINE][ph]:
                    raise Refused(f"{where}: cells.{name}.ops.{way}.{ph} is {counts[ph]:g} ops, {BASELINE}'s "
                                  f"{ways[BASELINE][ph]:g}: only the draft phase is projected, and {ph} must count "
                                  "the same in both servers")
        out.append({"cell": name, "shape": shape, "requests": int(n), "gamma": gamma, "ways": ways})
    out.sort(key=lambda c: (c["shape"], c["requests"]))
    provenance = {k: data.get(k) for k in ("commit", "date", "machine", "device", "dtype", "command", "m")}
    try:
        rel = os.path.relpath(os.path.realpath(path), ROOT)
    except ValueError:  # another drive
        rel = path
    provenance.update(file=path if rel.startswith("..") else rel, sha256=file_digest(path))
    return {"provenance": provenance, "cells": out}


def _key(x: float) -> str:
    return f"{x:g}"


def project_way(draft: float, base: float, gamma: int, m: int, s, host_reads: int = 0) -> dict:
    """One PR way's projection against EAGLE3's at one cell: the added draft ops as counted and scaled to the
    paper's gamma, and at each EAGLE-3 round time and per-op cost of the grid the added time, the round and the
    round ratio."""
    added = draft - base
    at_paper = added / gamma * s.paper_gamma
    coforward = s.coforward_us if m > 0 else 0.0
    grid = {}
    for round_ms in s.round_ms:
        round_us = round_ms * 1000.0
        by_cost = grid.setdefault(_key(round_ms), {})
        for cost in s.per_op_us:
            plus = {"counted": added * cost + coforward, "paper_gamma": at_paper * cost + coforward}
            by_cost[_key(cost)] = {
                "added_us": plus, "round_ms": {k: (round_us + v) / 1000.0 for k, v in plus.items()},
                "ratio": {k: (round_us + v) / round_us for k, v in plus.items()}}
    return {"m": m, "draft_ops": draft, "host_reads_in_draft": host_reads, "added_ops": added,
            "added_ops_per_step": added / gamma, "added_ops_at_paper_gamma": at_paper, "coforward_us": coforward,
            "by_round_ms": grid}


def break_even(s) -> dict:
    """How many extra ops per round the paper's budget, (ratio - 1) x round less the co-forwarded compute, allows at
    each round time and per-op cost of the grid, for each end of the paper's ratio."""
    out = {}
    for round_ms in s.round_ms:
        for ratio in s.paper_ratios:
            budget_us = (ratio - 1.0) * round_ms * 1000.0 - s.coforward_us
            out.setdefault(_key(round_ms), {})[_key(ratio)] = {
                "budget_us": budget_us, "ops": {_key(c): budget_us / c for c in s.per_op_us}}
    return out


def grid_summary(cells: dict, s) -> dict:
    """The grid of round ratios each PR way gives at the paper's setting: the cells whose shape has the paper's gamma
    as counted (else every cell, scaled to the paper's gamma), per round time and per-op cost over the requests,
    and its range over everything."""
    at_gamma = [c for c in cells.values() if c["gamma"] == s.paper_gamma]
    measure = "counted" if at_gamma else "paper_gamma"
    chosen = at_gamma or list(cells.values())
    ways = {}
    for way in sorted({w for c in chosen for w in c["ways"]}, key=lambda w: _way_m(w, "grid")):
        grid, every = {}, []
        for round_ms in s.round_ms:
            for cost in s.per_op_us:
                by_n = {f"{c['shape']}/{c['requests']}": c["ways"][way]["by_round_ms"][_key(round_ms)][_key(cost)]
                        ["ratio"][measure] for c in chosen if way in c["ways"]}
                grid.setdefault(_key(round_ms), {})[_key(cost)] = {
                    "cells": by_n, "min": min(by_n.values()), "max": max(by_n.values())}
                every += by_n.values()
        ways[way] = {"range": [min(every), max(every)], "by_round_ms": grid}
    return {"shapes": sorted({c["shape"] for c in chosen}), "ratio": measure, "ways": ways}


def _assumed(s, name: str, value, source_flag) -> dict:
    default, source = DEFAULTS[name]
    given = tuple(value) if isinstance(value, list) else value
    if source_flag:
        source = source_flag
    elif given != default:
        source = f"given on the command line (the default {default} has this source: {source})"
    return {"label": "assumed", "value": value, "source": source}


def _assumed_grid(name: str, values, source_flag, unit: str) -> dict:
    """A grid input: its values, and each value's source (the default's published one, the source flag's, or
    `given on the command line`)."""
    _, known = DEFAULTS[name]
    sources = {}
    for v in values:
        if source_flag:
            sources[_key(v)] = source_flag
        elif v in known:
            sources[_key(v)] = known[v]
        else:
            sources[_key(v)] = "given on the command line (no published source)"
    return {"label": "assumed", "value": list(values), "unit": unit, "sources": sources,
            "source": "; ".join(f"{k} {unit}: {v}" for k, v in sources.items())}


def canonical_command(s, ops_file: str) -> str:
    """The command that rewrites these results (outputs left out: any path writes the same content)."""
    args = ["--ops-json", ops_file, "--per-op-us", *[_key(c) for c in s.per_op_us],
            "--round-ms", *[_key(r) for r in s.round_ms], "--paper-gamma", str(s.paper_gamma), "--coforward-us",
            _key(s.coforward_us), "--paper-ratios", *[_key(r) for r in s.paper_ratios]]
    for flag, value in (("--per-op-source", s.per_op_source), ("--round-source", s.round_source)):
        if value:
            args += [flag, value]
    return "python benchmarks/gpu_projection.py " + shlex.join(args)


def build(s) -> dict:
    ops = read_ops(s.ops_json)
    cells = {}
    for c in ops["cells"]:
        base = c["ways"][BASELINE]["draft"]
        ways = {w: project_way(v["draft"], base, c["gamma"], _way_m(w, "--ops-json"), s, v["host_reads"])
                for w, v in c["ways"].items() if w != BASELINE}
        cells[c["cell"]] = {"shape": c["shape"], "requests": c["requests"], "gamma": c["gamma"],
                            "eagle3_draft_ops": base, "same_phases": {ph: c["ways"][BASELINE][ph] for ph in SAME_PHASES},
                            "ways": ways}
    new_empty = sum(v["new_empty"] for c in ops["cells"] for v in c["ways"].values())
    inputs = {
        "ops_per_round": dict(ops["provenance"], label="measured",
                              source="benchmarks/serving_cost.py --ops (device ops per served round, counted on a CPU "
                                     "through the bridge; one op = one kernel launch on a GPU)",
                              new_empty_in_draft_names=new_empty),
        "round_ms": _assumed_grid("round_ms", s.round_ms, s.round_source, "ms"),
        "per_op_us": _assumed_grid("per_op_us", s.per_op_us, s.per_op_source, "us"),
        "paper_gamma": _assumed(s, "paper_gamma", s.paper_gamma, None),
        "coforward_us": _assumed(s, "coforward_us", s.coforward_us, None),
        "paper_ratios": _assumed(s, "paper_ratios", list(s.paper_ratios), None),
    }
    return {"what": "PR_EAGLE3's round over SGLang's EAGLE3's on a GPU, projected (not measured) over a grid of "
                    "EAGLE-3 round times and per-op costs: round_ms + (way's draft ops - eagle3's) x per-op cost "
                    "(+ coforward_us for m > 0)",
            "inputs": inputs, "cells": cells, "grid": grid_summary(cells, s), "break_even": break_even(s),
            "command": canonical_command(s, ops["provenance"]["file"])}


def _ops(x: float) -> str:
    return f"{x:+.0f}" if x else "0"


def _reads(cells: dict) -> str:
    seen = sorted({w["host_reads_in_draft"] for c in cells.values() for w in c["ways"].values()})
    return f"{seen[0]} to {seen[-1]}" if len(seen) > 1 else str(seen[0])


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3f}x" if f"{lo:.3f}" == f"{hi:.3f}" else f"{lo:.3f}-{hi:.3f}x"


def render(r: dict) -> str:
    ins, cells, grid = r["inputs"], r["cells"], r["grid"]
    ops = ins["ops_per_round"]
    rounds, costs = [_key(x) for x in ins["round_ms"]["value"]], [_key(c) for c in ins["per_op_us"]["value"]]
    gamma, paper = ins["paper_gamma"]["value"], ins["paper_ratios"]["value"]
    paper_cell = f"{paper[0]:.3f}-{paper[-1]:.3f}"
    measure = "as counted" if grid["ratio"] == "counted" else f"scaled to gamma {gamma}"
    lines = ["# PR_EAGLE3's round on a GPU, projected from measured op counts (a projection, not a GPU measurement)",
             "",
             f"Ops per round (measured): `{ops['file']}` (sha256 {ops['sha256']}), counted at commit {ops['commit']} on "
             f"{ops['date']} ({ops['machine']}, device {ops['device']}, {ops['dtype']}). Projected round = EAGLE-3's "
             "round + (way's draft ops - eagle3's draft ops) x per-op cost (+ the co-forwarded rows' compute for "
             "m > 0), over a grid of EAGLE-3 round times and per-op costs, each from its own source. Verify, "
             "draft-extend and the round's other ops are SGLang's in both servers: they count the same in every cell ("
             + ", ".join(f"{name}: {'/'.join(f'{v:g}' for v in c['same_phases'].values())}" for name, c in cells.items())
             + " verify/extend/other ops, checked).", "",
             "| input | value | measured or assumed | source |", "|---|---|---|---|",
             f"| device ops per round | per cell below | measured | `{ops['command']}` at {ops['commit']} |"]
    lines += [f"| EAGLE-3's round time | {k} ms | assumed | {v} |" for k, v in ins["round_ms"]["sources"].items()]
    lines += [f"| per-op cost inside a CUDA graph | {k} us | assumed | {v} |"
              for k, v in ins["per_op_us"]["sources"].items()]
    lines += [f"| the paper's gamma | {gamma} | assumed | {ins['paper_gamma']['source']} |",
              f"| co-forwarded rows' compute | {ins['coforward_us']['value']:g} us a round | assumed | "
              f"{ins['coforward_us']['source']} |",
              f"| the paper's PR / EAGLE-3 round | {paper_cell}x | assumed | {ins['paper_ratios']['source']} |", "",
              f"Round times: {ROUND_CAVEAT}.", ""]
    lines += [f"## The grid: PR / EAGLE3 round at the paper's gamma ({', '.join(grid['shapes'])} shape, {measure}; "
              "the range over the cells' requests)", "",
              "| way | per-op cost | " + " | ".join(f"round {k} ms" for k in rounds) + " |",
              "|---|---|" + "---|" * len(rounds)]
    for way, g in grid["ways"].items():
        for cost in costs:
            lines.append(f"| {way} | {cost} us | " + " | ".join(
                _span(g["by_round_ms"][k][cost]["min"], g["by_round_ms"][k][cost]["max"]) for k in rounds) + " |")
    lines += [""] + [f"Range over the grid, {way}: **{_span(*g['range'])}** EAGLE3's round (paper {paper_cell}x)."
                     for way, g in grid["ways"].items()]
    pairs = [(k, c) for k in rounds for c in costs]
    lines += ["", f"Every cell, each ratio as counted (the shape's gamma) / scaled to gamma {gamma} (added ops per "
                  f"draft step x {gamma}):", "",
              "| shape (gamma) | requests | way | draft ops: eagle3 -> way | added | added at gamma "
              f"{gamma} | " + " | ".join(f"{k} ms, {c} us/op" for k, c in pairs) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(pairs)]
    for c in cells.values():
        for way, w in c["ways"].items():
            ratios = [f"{w['by_round_ms'][k][cost]['ratio']['counted']:.3f} / "
                      f"{w['by_round_ms'][k][cost]['ratio']['paper_gamma']:.3f}" for k, cost in pairs]
            lines.append(f"| {c['shape']} ({c['gamma']}) | {c['requests']} | {way} | {c['eagle3_draft_ops']:g} -> "
                         f"{w['draft_ops']:g} | {_ops(w['added_ops'])} | {_ops(w['added_ops_at_paper_gamma'])} | "
                         + " | ".join(ratios) + " |")
    be = r["break_even"]
    heads = [(k, ratio, v) for k, by in be.items() for ratio, v in by.items()]
    lines += ["", "Break-even: the extra ops per round the paper's measured cost of reconsideration allows, "
                  "(ratio - 1) x EAGLE-3's round less the co-forwarded rows' compute, at each per-op cost:", "",
              "| per-op cost | " + " | ".join(f"{k} ms at {float(ratio):.3f}x ({v['budget_us']:.0f} us)"
                                            for k, ratio, v in heads) + " |",
              "|---|" + "---|" * len(heads)]
    for cost in costs:
        lines.append(f"| {cost} us | " + " | ".join(f"{v['ops'][cost]:.0f}" for _, _, v in heads) + " |")
    lines += ["", "Not included: the co-forwarded rows' compute (assumed as above), memory-bound effects of a wider "
                  "draft batch, a GPU's launches that one counted op hides (a sort launches several kernels: the "
                  "count is a lower bound for both algorithms), and the verify's growth with the batch. The counts "
                  "come from eager rounds on a CPU: PR's draft includes the eager attention "
                  f"plan's host reads (`aten::item`, {_reads(cells)} a round), which a captured round does not make; "
                  "they are left in.", "",
              "The op counter now counts `aten::new_empty` as an allocation (no launch, "
              "`pr_specforge.sglang_plugin.op_counts.NO_KERNEL`); these counts were made before that change, and "
              f"their recorded draft rounds hold {ops['new_empty_in_draft_names']} `aten::new_empty` (SGLang 0.5.14), "
              "so they stand as counted. A recount at the commit that cuts PR's ops is pending: it needs live "
              "servers (`benchmarks/serving_cost.py --ops`).", "",
              f"Command: `{r['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops-json", default="benchmarks/results/serving_cost.json",
                   help="a `benchmarks/serving_cost.py --ops` result (measured device ops per round)")
    p.add_argument("--per-op-us", type=float, nargs="+", metavar="US", default=list(DEFAULTS["per_op_us"][0]),
                   help="the grid's small-op costs inside a CUDA graph, us, ascending (default 1 2.5 4, each with "
                        "its source)")
    p.add_argument("--per-op-source", default=None, help="where --per-op-us comes from, when not the defaults' sources "
                                                         "(e.g. scripts/gpu_pr_eagle3_check.sh on a named GPU)")
    p.add_argument("--round-ms", type=float, nargs="+", metavar="MS", default=list(DEFAULTS["round_ms"][0]),
                   help="the grid's EAGLE-3 round times, ms, ascending (default 12: SGLang's H100 8B figure, 26.03: "
                        "the paper's Table 9)")
    p.add_argument("--round-source", default=None, help="where --round-ms comes from, when not the defaults' sources")
    p.add_argument("--paper-gamma", type=int, default=DEFAULTS["paper_gamma"][0], help="the paper's draft steps (8)")
    p.add_argument("--coforward-us", type=float, default=DEFAULTS["coforward_us"][0],
                   help="extra compute per round of the co-forwarded rows (m > 0), us (default 0: the paper's Sec. 3.4)")
    p.add_argument("--paper-ratios", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   default=list(DEFAULTS["paper_ratios"][0]), help="the paper's PR / EAGLE-3 round (Table 9)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    try:
        args = p.parse_args(argv)
        check_args(args)
        result = build(args)
    except Refused as e:
        print(str(e) if str(e).startswith("gpu_projection:") else f"gpu_projection: {e}", file=sys.stderr)
        return 2
    text = render(result)
    print(text)
    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    if args.json:
        atomic_write_json(args.json, result)
    if args.md:
        atomic_write_text(args.md, text)
    return 0


def check_args(args) -> None:
    """The flags' ranges, and the outputs by the project's ownership rule, before any work; one `Refused` line."""
    from pr_specforge.data.io import DataFormatError, check_writable_file

    for flag, values, unit in (("--per-op-us", args.per_op_us, "microseconds per op"),
                               ("--round-ms", args.round_ms, "milliseconds")):
        if not all(v > 0 for v in values) or any(a >= b for a, b in zip(values, values[1:])):
            raise Refused(f"{flag} {' '.join(_key(v) for v in values)}: needs values > 0 in ascending order ({unit})")
    if args.paper_gamma < 1:
        raise Refused(f"--paper-gamma {args.paper_gamma}: must be >= 1")
    if not args.coforward_us >= 0:
        raise Refused(f"--coforward-us {args.coforward_us:g}: must be >= 0")
    if not 1 <= args.paper_ratios[0] <= args.paper_ratios[1]:
        raise Refused(f"--paper-ratios {args.paper_ratios[0]:g} {args.paper_ratios[1]:g}: needs 1 <= LOW <= HIGH")
    try:
        for flag, path, fmt in (("--json", args.json, "JSON"), ("--md", args.md, "Markdown")):
            if path:
                check_writable_file(flag, path, fmt=fmt, inputs=[args.ops_json])
    except DataFormatError as e:
        raise Refused(str(e)) from None


if __name__ == "__main__":
    raise SystemExit(main())
