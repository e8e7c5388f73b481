"""`benchmarks/gpu_projection.py`: the projection's arithmetic on a hand-made ops file, its refusals (verify/extend
that differ between the ways, bad flags, a bad ops file: one line, exit code 2), and that the committed
`benchmarks/results/gpu_projection.{json,md}` are what the script writes from the committed op counts."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu_projection")


def _ops_file(tmp_path, gamma=4, drafts=None, **phase_overrides):
    """A `serving_cost.py --ops` result in miniature: one shape of `gamma` steps, 1 and 4 requests."""
    drafts = drafts or {"eagle3": 100, "pr_m0": 150, "pr_m2": 300}
    cells = {}
    for n in (1, 4):
        ops = {w: {"draft": d, "verify": 40, "extend": 10 + n, "other": 0, "round": d + 50 + n,
                   "draft_names": {"rows": {"aten::item": 2}} if w != "eagle3" else {"model": {"aten::mm": d}}}
               for w, d in drafts.items()}
        cells[f"tiny/{n}"] = {"ops": ops}
    data = {"shapes": {"tiny": {"k": 2, "gamma": gamma, "budget": 6}}, "cells": cells, "commit": "abc1234",
            "date": "2026-01-01", "machine": "test", "device": "cpu", "dtype": "float32", "command": "python x", "m": 2}
    for (cell, way, phase), value in phase_overrides.get("set", {}).items():
        data["cells"][cell]["ops"][way][phase] = value
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(data))
    return path


def _run(bench, capsys, *argv):
    rc = bench.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_way_with_n_extra_draft_ops_at_cost_c_adds_n_times_c(bench, tmp_path, capsys):
    ops = _ops_file(tmp_path, gamma=4)
    out_json, out_md = tmp_path / "p.json", tmp_path / "p.md"
    rc, _, err = _run(bench, capsys, "--ops-json", ops, "--per-op-us", 2, 5, "--round-ms", 10, 20, "--paper-gamma", 8,
                      "--coforward-us", 7, "--json", out_json, "--md", out_md)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    for cell in ("tiny/1", "tiny/4"):
        for way, extra, m in (("pr_m0", 50, 0), ("pr_m2", 200, 2)):
            w = r["cells"][cell]["ways"][way]
            coforward = 7.0 if m else 0.0  # only a way with reconsideration rows carries them
            assert w["added_ops"] == extra and w["added_ops_at_paper_gamma"] == pytest.approx(extra / 4 * 8)
            assert sorted(w["by_round_ms"]) == ["10", "20"]
            for round_ms in (10, 20):
                for cost in (2, 5):
                    at = w["by_round_ms"][str(round_ms)][str(cost)]
                    assert at["added_us"]["counted"] == pytest.approx(extra * cost + coforward)
                    assert at["added_us"]["paper_gamma"] == pytest.approx(extra * 2 * cost + coforward)
                    assert at["round_ms"]["counted"] == pytest.approx(round_ms + (extra * cost + coforward) / 1000)
                    assert at["ratio"]["counted"] == pytest.approx(1 + (extra * cost + coforward) / (round_ms * 1000))
    # the break-even: (ratio - 1) x round less the co-forwarded compute, over the per-op cost, at each round time
    for round_ms in (10, 20):
        assert r["break_even"][str(round_ms)]["1.022"]["ops"]["5"] == pytest.approx((0.022 * round_ms * 1000 - 7) / 5)
    assert r["inputs"]["ops_per_round"]["label"] == "measured" and r["inputs"]["ops_per_round"]["commit"] == "abc1234"
    assert {k: v["label"] for k, v in r["inputs"].items() if k != "ops_per_round"} == dict.fromkeys(
        ("round_ms", "per_op_us", "paper_gamma", "coforward_us", "paper_ratios"), "assumed")
    for name in ("per_op_us", "round_ms"):  # values without a published source say so
        assert all("given on the command line" in v for v in r["inputs"][name]["sources"].values())
    # no cell has the paper's gamma: the grid takes every cell, scaled to it
    assert r["grid"]["ratio"] == "paper_gamma" and r["grid"]["shapes"] == ["tiny"]
    g = r["grid"]["ways"]["pr_m2"]
    assert g["by_round_ms"]["20"]["2"]["cells"] == {
        c: r["cells"][c]["ways"]["pr_m2"]["by_round_ms"]["20"]["2"]["ratio"]["paper_gamma"] for c in ("tiny/1", "tiny/4")}
    md = out_md.read_text()
    assert "| tiny (4) | 1 | pr_m2 | 100 -> 300 | +200 | +400 |" in md and "abc1234" in md
    assert "| pr_m2 | 5 us | " in md and "round 10 ms | round 20 ms" in md


def test_a_shape_at_the_paper_gamma_makes_the_grid_as_counted(bench, tmp_path, capsys):
    rc, _, err = _run(bench, capsys, "--ops-json", _ops_file(tmp_path, gamma=4), "--paper-gamma", 4,
                      "--json", tmp_path / "p.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["grid"]["ratio"] == "counted"
    for way, g in r["grid"]["ways"].items():
        every = [r["cells"][c]["ways"][way]["by_round_ms"][k][cost]["ratio"]["counted"]
                 for c in r["cells"] for k in g["by_round_ms"] for cost in g["by_round_ms"][k]]
        assert g["range"] == [min(every), max(every)]


def _committed():
    """The committed projection and the op counts it names."""
    committed = json.loads((RESULTS / "gpu_projection.json").read_text())
    ops = json.loads((ROOT / committed["inputs"]["ops_per_round"]["file"]).read_text())
    return committed, ops


def test_the_committed_grid_is_every_default_round_time_by_every_default_per_op_cost(bench):
    committed, _ = _committed()
    rounds, costs = bench.DEFAULTS["round_ms"], bench.DEFAULTS["per_op_us"]
    assert committed["inputs"]["round_ms"]["value"] == list(rounds[0])
    assert committed["inputs"]["per_op_us"]["value"] == list(costs[0])
    # each value named with its own published source
    assert committed["inputs"]["round_ms"]["sources"] == {f"{v:g}": rounds[1][v] for v in rounds[0]}
    assert committed["inputs"]["per_op_us"]["sources"] == {f"{v:g}": costs[1][v] for v in costs[0]}
    sources = committed["inputs"]["round_ms"]["sources"]
    assert "docs.sglang.io" in sources["12"] and "H100" in sources["12"]
    assert "Table 9" in sources["26.03"] and "arxiv.org" in sources["26.03"]
    for way in committed["grid"]["ways"].values():
        assert sorted(way["by_round_ms"], key=float) == [f"{v:g}" for v in rounds[0]]
        assert all(sorted(by, key=float) == [f"{v:g}" for v in costs[0]] for by in way["by_round_ms"].values())


def test_every_committed_grid_cell_is_computed_from_the_committed_counts():
    committed, ops = _committed()
    rounds, costs = committed["inputs"]["round_ms"]["value"], committed["inputs"]["per_op_us"]["value"]
    paper_gamma = committed["inputs"]["paper_gamma"]["value"]
    checked = 0
    for name, cell in committed["cells"].items():
        counts = ops["cells"][name]["ops"]
        gamma = ops["shapes"][name.split("/")[0]]["gamma"]
        for way, w in cell["ways"].items():
            added = counts[way]["draft"] - counts["eagle3"]["draft"]
            assert w["added_ops"] == added
            for round_ms in rounds:
                for cost in costs:
                    at = w["by_round_ms"][f"{round_ms:g}"][f"{cost:g}"]["ratio"]
                    round_us = round_ms * 1000.0
                    assert at["counted"] == (round_us + added * cost) / round_us
                    assert at["paper_gamma"] == (round_us + added / gamma * paper_gamma * cost) / round_us
                    checked += 1
    assert checked == len(committed["cells"]) * 2 * len(rounds) * len(costs)  # two ways a cell
    for way, g in committed["grid"]["ways"].items():
        for k, by in g["by_round_ms"].items():
            for cost, at in by.items():
                assert at["cells"] == {c: committed["cells"][c]["ways"][way]["by_round_ms"][k][cost]["ratio"]["counted"]
                                       for c in at["cells"]}
                assert {committed["cells"][c]["gamma"] for c in at["cells"]} == {paper_gamma}
                assert (at["min"], at["max"]) == (min(at["cells"].values()), max(at["cells"].values()))


def test_the_committed_grid_rises_with_the_per_op_cost_and_falls_with_the_round_time():
    committed, _ = _committed()
    rounds = [f"{v:g}" for v in committed["inputs"]["round_ms"]["value"]]
    costs = [f"{v:g}" for v in committed["inputs"]["per_op_us"]["value"]]
    for cell in committed["cells"].values():
        for w in cell["ways"].values():
            grid = w["by_round_ms"]
            for measure in ("counted", "paper_gamma"):
                ratio = {(k, c): grid[k][c]["ratio"][measure] for k in rounds for c in costs}
                if w["added_ops"] == 0:
                    assert set(ratio.values()) == {1.0}
                    continue
                assert w["added_ops"] > 0  # PR adds ops: its round is longer than EAGLE3's everywhere
                for k in rounds:  # strictly monotone in the per-op cost
                    assert all(ratio[(k, a)] < ratio[(k, b)] for a, b in zip(costs, costs[1:]))
                for c in costs:  # strictly decreasing in EAGLE-3's round time
                    assert all(ratio[(a, c)] > ratio[(b, c)] for a, b in zip(rounds, rounds[1:]))
    for g in committed["grid"]["ways"].values():  # the range: the cheapest op on the longest round, and back
        lo, hi = g["by_round_ms"][rounds[-1]][costs[0]]["min"], g["by_round_ms"][rounds[0]][costs[-1]]["max"]
        assert g["range"] == [lo, hi]


def test_the_readme_and_the_serving_doc_quote_the_grids_range():
    committed, _ = _committed()
    ways = {w: g for w, g in committed["grid"]["ways"].items() if g["range"][1] > 1.0}
    assert ways, "no reconsidering way in the grid"
    for way, g in ways.items():
        quoted = f"{g['range'][0]:.2f}x-{g['range'][1]:.2f}x"
        for doc in ("README.md", "docs/serving.md"):
            assert quoted in (ROOT / doc).read_text(), f"{doc} does not quote {way}'s grid range {quoted}"


def test_the_default_inputs_carry_their_published_sources(bench, tmp_path, capsys):
    rc, _, err = _run(bench, capsys, "--ops-json", _ops_file(tmp_path), "--json", tmp_path / "p.json",
                      "--per-op-source", "scripts/gpu_pr_eagle3_check.sh on an H100")
    assert rc == 0, err
    inputs = json.loads((tmp_path / "p.json").read_text())["inputs"]
    assert "Table 9" in inputs["round_ms"]["sources"]["26.03"] and "arxiv.org" in inputs["round_ms"]["sources"]["26.03"]
    assert "docs.sglang.io" in inputs["round_ms"]["sources"]["12"]
    assert set(inputs["per_op_us"]["sources"].values()) == {"scripts/gpu_pr_eagle3_check.sh on an H100"}
    assert "Sec. 3.4" in inputs["coforward_us"]["source"] and inputs["coforward_us"]["value"] == 0


@pytest.mark.parametrize("phase", ["verify", "extend", "other"])
def test_a_way_whose_verify_or_extend_differs_is_refused_in_one_line(bench, tmp_path, capsys, phase):
    ops = _ops_file(tmp_path, set={("tiny/4", "pr_m2", phase): 99})
    rc, out, err = _run(bench, capsys, "--ops-json", ops, "--json", tmp_path / "p.json")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"cells.tiny/4.ops.pr_m2.{phase} is 99 ops" in err and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("flags, says", [
    (["--per-op-us", "-1", "4"], "--per-op-us -1 4: needs values > 0 in ascending order"),
    (["--per-op-us", "5", "1"], "needs values > 0 in ascending order"),
    (["--per-op-us", "2", "2"], "needs values > 0 in ascending order"),
    (["--per-op-us", "x", "1"], "invalid float value: 'x'"),
    (["--round-ms", "0"], "--round-ms 0: needs values > 0 in ascending order (milliseconds)"),
    (["--round-ms", "26", "12"], "--round-ms 26 12: needs values > 0 in ascending order"),
    (["--paper-gamma", "0"], "--paper-gamma 0: must be >= 1"),
    (["--coforward-us", "-2"], "--coforward-us -2: must be >= 0"),
    (["--paper-ratios", "0.9", "1.02"], "needs 1 <= LOW <= HIGH"),
    (["--json", "out.md"], "--json out.md: this command writes JSON only"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_bad_flags_are_refused_in_one_line(bench, tmp_path, capsys, flags, says):
    rc, out, err = _run(bench, capsys, "--ops-json", _ops_file(tmp_path), *flags)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("gpu_projection: "), err
    assert says in err


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["cells"]["tiny/1"]["ops"]["eagle3"].pop("draft"), "cells.tiny/1.ops.eagle3.draft: expected a number"),
    (lambda d: d["cells"]["tiny/1"]["ops"].pop("eagle3"), "cells.tiny/1.ops: needs 'eagle3'"),
    (lambda d: d["cells"].update({"tiny": d["cells"]["tiny/1"]}), "cells.tiny: not SHAPE/REQUESTS"),
    (lambda d: d["cells"]["tiny/1"]["ops"].update(other=d["cells"]["tiny/1"]["ops"]["eagle3"]),
     "way 'other' is neither 'eagle3' nor pr_m<m>"),
    (lambda d: d.pop("cells"), "not a `serving_cost.py --ops` result"),
])
def test_a_bad_ops_file_is_refused_in_one_line_naming_the_field(bench, tmp_path, capsys, edit, says):
    path = _ops_file(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    rc, _, err = _run(bench, capsys, "--ops-json", path)
    assert rc == 2 and err.count("\n") == 1 and f"--ops-json {path}" in err and says in err, err
    path.write_text("{not json")
    rc, _, err = _run(bench, capsys, "--ops-json", path)
    assert rc == 2 and err.count("\n") == 1 and "not valid JSON" in err


def test_the_script_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_projection.py"), "--ops-json",
                           str(_ops_file(tmp_path)), "--round-ms", "-1"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and proc.stderr == ("gpu_projection: --round-ms -1: needs values > 0 in ascending order "
                                             "(milliseconds)\n")


def test_the_committed_projection_is_a_rerun_on_the_committed_op_counts(bench, tmp_path, capsys):
    """The committed table cannot drift from the op counts it names: new counts or a changed script mean a rerun
    (the command at the bottom of the .md)."""
    committed = json.loads((RESULTS / "gpu_projection.json").read_text())
    argv = shlex.split(committed["command"])[2:]
    assert argv[0] == "--ops-json" and argv[1].startswith("benchmarks/results/"), argv
    name = argv[1].split("/")[-1]
    argv[1] = str(RESULTS / name)
    rc, _, err = _run(bench, capsys, *argv, "--json", tmp_path / "p.json", "--md", tmp_path / "p.md")
    assert rc == 0, err
    assert json.loads((tmp_path / "p.json").read_text()) == committed, (
        "benchmarks/results/gpu_projection.json differs from a rerun: run the command in gpu_projection.md")
    assert (tmp_path / "p.md").read_text() == (RESULTS / "gpu_projection.md").read_text()
    ops = json.loads((RESULTS / name).read_text())
    assert f"counted at commit {ops['commit']}" in (RESULTS / "gpu_projection.md").read_text()


def test_the_ops_file_is_not_changed_by_a_run(bench, tmp_path, capsys):
    path = _ops_file(tmp_path)
    before = path.read_bytes()
    rc, _, _ = _run(bench, capsys, "--ops-json", path, "--json", path)
    assert rc == 2 and path.read_bytes() == before  # an input is never an output
