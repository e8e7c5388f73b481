"""PR_EAGLE3's round as a GPU would see it: measured device ops per round, projected onto the paper's setting.

    python benchmarks/gpu_projection.py --json benchmarks/results/gpu_projection.json \
        --md benchmarks/results/gpu_projection.md

No GPU timed this. It takes the device ops per served round that `benchmarks/serving_cost.py --ops` counted
(`--ops-json`, default `benchmarks/results/serving_cost.json`, whose `--ops also` counts hold the paper shape:
measured, on a CPU through the bridge; an op is one kernel launch on a GPU, inside a CUDA graph one of the graph's
nodes, `pr_specforge.sglang_plugin.op_counts`) and
three assumed inputs, each a flag whose default has a published source:

  --round-ms 26.03     EAGLE-3's round on the paper's GPU: Appendix H, Table 9 of the paper (arXiv 2611.05724v1,
                       https://arxiv.org/html/2611.05724v1): t_cycle = tau / throughput, the time per verification
                       step, of EAGLE-3.1 on Qwen3-8B, one H200, temperature 0, B 48, B_w 6, gamma 8, N 3: 26.03 (PR
                       26.60, 1.022x; at B 24: 25.55 and 25.94, 1.015x). The table prints no unit; milliseconds is
                       the only one tau / throughput fits (Table 5, same model and B: tau 4.835 at 26.03 ms is 186
                       tokens/s, 85 tokens/s autoregressive at its 2.184x speedup). The paper gives no round time at
                       other batch sizes (Table 2 gives speedups only), so the same time serves 4 and 16 requests: the
                       verify of n trees takes no less than of one, so the ratios there are upper bounds.
  --per-op-us 1 4      a small op's cost inside a CUDA graph on an H100-class GPU, low and high. Low: the smallest
                       kernels' execution in a decode step replayed as a CUDA graph on an sm90 GPU, PyTorch's fill and
                       a device-to-device copy, 1 us a call (torch profiler table in
                       https://github.com/neuralmagic/nm-vllm/pull/332), above the graph's own cost per node, ~0.58 us
                       for a no-op kernel (https://github.com/ahrefs/ocannl/issues/488, an RTX 5070 Ti: the only
                       per-node figure found). High: the same graph's small reduction, vLLM's rms_norm of one token,
                       4 us (#332). PR's round logic is sorts, gathers, scatters and small products over a few hundred
                       elements, between the two; a sort launches more than one kernel, which the count does not see
                       (op counts are a lower bound of launches, for both algorithms).
  --coforward-us 0     the extra compute per round of the co-forwarded reconsideration rows (ways with m > 0): the
                       paper's Sec. 3.4 argues a forward of M is memory bound at small batch, so enlarging its batch
                       costs "t_step + epsilon for a negligible epsilon". An assumption, not a measurement.

Projection, per (shape, requests) cell and way: round = round_ms + (way's draft ops - eagle3's draft ops) x per-op
cost (+ coforward_us for m > 0). Only the draft phase differs: verify and draft-extend are SGLang's in both servers,
and the script checks that each way's verify, extend and other ops equal eagle3's in every cell (refused in one
line otherwise). Two op counts per way: as counted (the shape's gamma) and scaled to the paper's gamma
(`--paper-gamma 8`, Sec. 6.1): the added ops per draft step x 8. Where the counted shape has gamma < 8 the first
under-counts (the paper's round has more steps) and the second over-counts (the per-round parts, cut, pack,
encoding, are scaled too); a count of the paper shape makes them one. Ratios: PR's projected round over EAGLE3's
(round_ms), beside the paper's measured 1.015-1.022x (`--paper-ratios`). Break-even: the extra ops per round the
paper's budget (ratio - 1) x round_ms allows at each per-op cost. Not included: the co-forwarded rows' compute
(assumed 0), memory-bound effects of wider batches, and any op a GPU runs that a CPU count does not see.
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
DEFAULTS = {
    "round_ms": (26.03, f"{PAPER}, Appendix H, Table 9: EAGLE-3.1's t_cycle = tau/throughput on Qwen3-8B, one H200, "
                        "T 0, B 48, B_w 6, gamma 8 (no unit printed; ms is the one tau/throughput fits: with Table 5's "
                        "tau 4.835 it is 186 tokens/s). The paper gives no round time at 4 or 16 requests; this one "
                        "serves them too, a lower bound of their round, so their ratios are upper bounds"),
    "per_op_us": ((1.0, 4.0), "low: 1 us a call for the smallest kernels (fill, device-to-device copy) of a decode step "
                              "replayed as a CUDA graph on an sm90 GPU, https://github.com/neuralmagic/nm-vllm/pull/332, "
                              "above a graph's ~0.58 us per no-op node, https://github.com/ahrefs/ocannl/issues/488 "
                              "(RTX 5070 Ti); high: 4 us, the same graph's rms_norm of one token (#332)"),
    "paper_gamma": (8, f"{PAPER}, Sec. 6.1 and D.1: gamma = 8 draft steps"),
    "coforward_us": (0.0, f"{PAPER}, Sec. 3.4: a co-forwarded pass costs t_step + a negligible epsilon at small "
                          "batch (memory bound); assumed, not measured"),
    "paper_ratios": ((1.015, 1.022), f"{PAPER}, Appendix H, Table 9: PR's whole-cycle time over EAGLE-3.1's, "
                                     "measured run for run, B 24 and B 48"),
}


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


def project_way(draft: float, base: float, gamma: int, m: int, s, host_reads: int = 0) -> dict:
    """One PR way's projection against EAGLE3's at one cell: the added draft ops as counted and scaled to the
    paper's gamma, the added time and the round ratio at each per-op cost."""
    added = draft - base
    at_paper = added / gamma * s.paper_gamma
    coforward = s.coforward_us if m > 0 else 0.0
    round_us = s.round_ms * 1000.0
    by_cost = {}
    for cost in s.per_op_us:
        plus = {"counted": added * cost + coforward, "paper_gamma": at_paper * cost + coforward}
        by_cost[f"{cost:g}"] = {
            "added_us": plus, "round_ms": {k: (round_us + v) / 1000.0 for k, v in plus.items()},
            "ratio": {k: (round_us + v) / round_us for k, v in plus.items()}}
    return {"m": m, "draft_ops": draft, "host_reads_in_draft": host_reads, "added_ops": added, "added_ops_per_step": added / gamma,
            "added_ops_at_paper_gamma": at_paper, "coforward_us": coforward, "by_per_op_us": by_cost}


def break_even(s) -> dict:
    """How many extra ops per round the paper's budget, (ratio - 1) x round_ms less the co-forwarded compute,
    allows at each per-op cost, for each end of the paper's ratio."""
    out = {}
    for ratio in s.paper_ratios:
        budget_us = (ratio - 1.0) * s.round_ms * 1000.0 - s.coforward_us
        out[f"{ratio:g}"] = {"budget_us": budget_us,
                             "ops": {f"{c:g}": budget_us / c for c in s.per_op_us}}
    return out


def _assumed(s, name: str, value, source_flag) -> dict:
    default, source = DEFAULTS[name]
    given = tuple(value) if isinstance(value, list) else value
    if source_flag:
        source = source_flag
    elif given != default:
        source = f"given on the command line (the default {default} has this source: {source})"
    return {"label": "assumed", "value": value, "source": source}


def canonical_command(s, ops_file: str) -> str:
    """The command that rewrites these results (outputs left out: any path writes the same content)."""
    args = ["--ops-json", ops_file, "--per-op-us", *[f"{c:g}" for c in s.per_op_us],
            "--round-ms", f"{s.round_ms:g}", "--paper-gamma", str(s.paper_gamma), "--coforward-us",
            f"{s.coforward_us:g}", "--paper-ratios", *[f"{r:g}" for r in s.paper_ratios]]
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
    inputs = {
        "ops_per_round": dict(ops["provenance"], label="measured",
                              source="benchmarks/serving_cost.py --ops (device ops per served round, counted on a CPU "
                                     "through the bridge; one op = one kernel launch on a GPU)"),
        "round_ms": _assumed(s, "round_ms", s.round_ms, s.round_source),
        "per_op_us": _assumed(s, "per_op_us", list(s.per_op_us), s.per_op_source),
        "paper_gamma": _assumed(s, "paper_gamma", s.paper_gamma, None),
        "coforward_us": _assumed(s, "coforward_us", s.coforward_us, None),
        "paper_ratios": _assumed(s, "paper_ratios", list(s.paper_ratios), None),
    }
    return {"what": "PR_EAGLE3's round over SGLang's EAGLE3's on a GPU, projected (not measured): round_ms + "
                    "(way's draft ops - eagle3's) x per-op cost (+ coforward_us for m > 0)",
            "inputs": inputs, "cells": cells, "break_even": break_even(s), "command": canonical_command(s, ops["provenance"]["file"])}


def _ops(x: float) -> str:
    return f"{x:+.0f}" if x else "0"


def _reads(cells: dict) -> str:
    seen = sorted({w["host_reads_in_draft"] for c in cells.values() for w in c["ways"].values()})
    return f"{seen[0]} to {seen[-1]}" if len(seen) > 1 else str(seen[0])


def render(r: dict) -> str:
    ins, cells = r["inputs"], r["cells"]
    ops, costs = ins["ops_per_round"], [f"{c:g}" for c in ins["per_op_us"]["value"]]
    gamma, paper = ins["paper_gamma"]["value"], ins["paper_ratios"]["value"]
    paper_cell = f"{paper[0]:.3f}-{paper[-1]:.3f}"
    lines = ["# PR_EAGLE3's round on a GPU, projected from measured op counts (a projection, not a GPU measurement)",
             "",
             f"Ops per round (measured): `{ops['file']}` (sha256 {ops['sha256']}), counted at commit {ops['commit']} on "
             f"{ops['date']} ({ops['machine']}, device {ops['device']}, {ops['dtype']}). Projected round = EAGLE-3's "
             "round at the paper's setting + (way's draft ops - eagle3's draft ops) x per-op cost (+ the co-forwarded "
             "rows' compute for m > 0). Verify, draft-extend and the round's other ops are SGLang's in both servers: "
             "they count the same in every cell (" + ", ".join(
                 f"{name}: {'/'.join(f'{v:g}' for v in c['same_phases'].values())}" for name, c in cells.items())
             + " verify/extend/other ops, checked).", "",
             "| input | value | measured or assumed | source |", "|---|---|---|---|",
             f"| device ops per round | per cell below | measured | `{ops['command']}` at {ops['commit']} |",
             f"| EAGLE-3's round time | {ins['round_ms']['value']:g} ms | assumed | {ins['round_ms']['source']} |",
             f"| per-op cost inside a CUDA graph | {' and '.join(costs)} us | assumed | {ins['per_op_us']['source']} |",
             f"| the paper's gamma | {gamma} | assumed | {ins['paper_gamma']['source']} |",
             f"| co-forwarded rows' compute | {ins['coforward_us']['value']:g} us a round | assumed | "
             f"{ins['coforward_us']['source']} |",
             f"| the paper's PR / EAGLE-3 round | {paper_cell}x | assumed | {ins['paper_ratios']['source']} |", "",
             f"PR's round over EAGLE3's, each ratio as counted (the shape's gamma) / scaled to gamma {gamma} (added ops "
             f"per draft step x {gamma}):", "",
             "| shape (gamma) | requests | way | draft ops: eagle3 -> way | added | added at gamma "
             f"{gamma} | " + " | ".join(f"PR / EAGLE3 at {c} us/op" for c in costs) + " | paper |",
             "|---|---|---|---|---|---|" + "---|" * len(costs) + "---|"]
    for c in cells.values():
        for way, w in c["ways"].items():
            ratios = [f"{w['by_per_op_us'][k]['ratio']['counted']:.3f} / {w['by_per_op_us'][k]['ratio']['paper_gamma']:.3f}"
                      for k in costs]
            lines.append(f"| {c['shape']} ({c['gamma']}) | {c['requests']} | {way} | {c['eagle3_draft_ops']:g} -> "
                         f"{w['draft_ops']:g} | {_ops(w['added_ops'])} | {_ops(w['added_ops_at_paper_gamma'])} | "
                         + " | ".join(ratios) + f" | {paper_cell} |")
    lines += ["", "Break-even: the extra ops per round the paper's measured cost of reconsideration allows, "
                  f"(ratio - 1) x {ins['round_ms']['value']:g} ms less the co-forwarded rows' compute, at each per-op cost:",
              "", "| per-op cost | " + " | ".join(f"ops at {float(k):.3f}x ({v['budget_us']:.0f} us)"
                                                    for k, v in r["break_even"].items()) + " |",
              "|---|" + "---|" * len(r["break_even"])]
    for cost in costs:
        lines.append(f"| {cost} us | " + " | ".join(f"{v['ops'][cost]:.0f}" for v in r["break_even"].values()) + " |")
    lines += ["", "Not included: the co-forwarded rows' compute (assumed as above), memory-bound effects of a wider "
                  "draft batch, a GPU's launches that one counted op hides (a sort launches several kernels: the "
                  "count is a lower bound for both algorithms), and the verify's growth with the batch (the paper's "
                  "round time is for its Table 9 setting; at 4 and 16 requests the real round is longer and these "
                  "ratios smaller). The counts come from eager rounds on a CPU: PR's draft includes the eager attention "
                  f"plan's host reads (`aten::item`, {_reads(cells)} a round), which a captured round does not make; "
                  "they are left in.", "",
              f"Command: `{r['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops-json", default="benchmarks/results/serving_cost.json",
                   help="a `benchmarks/serving_cost.py --ops` result (measured device ops per round)")
    p.add_argument("--per-op-us", type=float, nargs=2, metavar=("LOW", "HIGH"), default=list(DEFAULTS["per_op_us"][0]),
                   help="a small op's cost inside a CUDA graph, us (default 1 4: " + DEFAULTS["per_op_us"][1] + ")")
    p.add_argument("--per-op-source", default=None, help="where --per-op-us comes from, when not the default's source "
                                                         "(e.g. scripts/gpu_pr_eagle3_check.sh on a named GPU)")
    p.add_argument("--round-ms", type=float, default=DEFAULTS["round_ms"][0],
                   help="EAGLE-3's round on the paper's GPU, ms (default 26.03: the paper's Table 9)")
    p.add_argument("--round-source", default=None, help="where --round-ms comes from, when not the paper's Table 9")
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

    low, high = args.per_op_us
    if not 0 < low <= high:
        raise Refused(f"--per-op-us {low:g} {high:g}: needs 0 < LOW <= HIGH (microseconds per op)")
    if not args.round_ms > 0:
        raise Refused(f"--round-ms {args.round_ms:g}: must be > 0 (milliseconds)")
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
