"""`benchmarks/sim_honesty.py` (issue 26 item 3): simulated against served gains, on hand-built rows."""

import json

import pytest

from tests.helpers import current_umask, load_benchmark


@pytest.fixture(scope="module")
def sh():
    return load_benchmark("sim_honesty")


def _rows(accepted_rounds):
    return {f"screen/p{i}": {"accepted": a, "rounds": r} for i, (a, r) in enumerate(accepted_rounds)}


def _eval_dir(path, served):
    path.mkdir(parents=True)
    lines = []
    for draft, rows in served.items():
        for key, r in rows.items():
            s, p = key.split("/")
            lines.append(json.dumps({"draft": draft, "budget": 48, "temperature": 0.0, "set": s, "prompt": p, **r}))
            lines.append(json.dumps({"draft": draft, "budget": 24, "temperature": 0.0, "set": s, "prompt": p,
                                     "accepted": 1, "rounds": 1}))  # another cell: must be ignored
    (path / "results.jsonl").write_text("\n".join(lines) + "\n")


def _diag(path, **sim):
    path.write_text(json.dumps({"sim": {f"sim/{k}": v for k, v in sim.items()}, "strategy": "x"}))
    return path


def test_points_use_tau_of_the_chain_length_and_the_served_pairs(sh):
    sims = {"eagle3": {"acc_len_one_pass": 1.0, "acc_len_width2": 1.5},
            "pr": {"acc_len_one_pass": 1.2, "acc_len_width2": 1.6, "acc_len_pr": 1.4},
            "long": {"acc_len_one_pass": 1.1}}
    served = {"eagle3": _rows([(20, 10), (30, 10)]),  # tau 2.5
              "pr": _rows([(30, 10), (30, 10)]),  # tau 3.0
              "pr/one-pass": _rows([(28, 10), (27, 10)]),  # tau 2.75
              "long": _rows([(25, 10), (25, 10)])}  # tau 2.5
    rows = {(r["variant"], r["part"]): r for r in sh.points("eagle3", sims, served, n=200)}
    assert set(rows) == {("pr", "gain"), ("pr", "one_pass"), ("pr", "mechanism"), ("long", "gain")}
    assert rows[("pr", "gain")]["sim_gain"] == pytest.approx(2.4 / 2.0 - 1)
    assert rows[("pr", "gain")]["served_gain"] == pytest.approx(3.0 / 2.5 - 1)
    assert rows[("pr", "one_pass")]["sim_gain"] == pytest.approx(2.2 / 2.0 - 1)
    assert rows[("pr", "one_pass")]["served_gain"] == pytest.approx(2.75 / 2.5 - 1)
    assert rows[("pr", "mechanism")]["sim_gain"] == pytest.approx(2.4 / 2.2 - 1)
    assert rows[("pr", "mechanism")]["served_pair"] == ["pr/one-pass", "pr"]
    assert rows[("pr", "mechanism")]["served_gain"] == pytest.approx(3.0 / 2.75 - 1)
    assert rows[("long", "gain")]["served_gain"] == pytest.approx(0.0)
    assert rows[("long", "gain")]["error"] == pytest.approx(2.1 / 2.0 - 1)
    for r in rows.values():
        lo, hi = r["served_ci95"]
        assert lo <= r["served_gain"] <= hi and r["sim_in_ci"] == (lo <= r["sim_gain"] <= hi)


def test_a_part_without_served_rows_is_left_out(sh):
    sims = {"eagle3": {"acc_len_one_pass": 1.0}, "pr": {"acc_len_one_pass": 1.0, "acc_len_pr": 1.2}}
    served = {"eagle3": _rows([(20, 10)]), "pr": _rows([(22, 10)])}  # no pr/one-pass rows
    assert [(r["variant"], r["part"]) for r in sh.points("eagle3", sims, served, n=50)] == [("pr", "gain")]


def test_summary_on_points_that_lie_on_a_line(sh):
    rows = [{"variant": f"v{i}", "part": "gain", "sim_gain": g, "served_gain": 2 * g + 0.01, "error": g - (2 * g + 0.01),
             "sim_in_ci": False} for i, g in enumerate([-0.1, 0.0, 0.05, 0.2])]
    s = sh.summarise(rows)
    assert s["points"] == 4 and s["pearson_r"] == pytest.approx(1.0)
    assert s["largest_error"]["variant"] == "v3" and s["largest_error"]["error"] == pytest.approx(-0.21)
    assert s["sign_agrees"] == 3  # sim 0.0 is not > 0, served 0.01 is
    assert sh.pearson([1.0, 2.0], [1.0, 2.0]) is None and sh.pearson([1, 1, 1], [1, 2, 3]) is None
    assert sh.summarise([]) == {"points": 0}


def test_the_command_writes_md_and_json_and_reads_one_cell(sh, tmp_path):
    _eval_dir(tmp_path / "serve", {"eagle3": _rows([(20, 10), (24, 10), (22, 10)]),
                                   "pr": _rows([(22, 10), (25, 10), (22, 10)]),
                                   "pr/one-pass": _rows([(21, 10), (24, 10), (22, 10)])})
    base = _diag(tmp_path / "e.json", acc_len_one_pass=0.9, acc_len_width2=1.3)
    pr = _diag(tmp_path / "p.json", acc_len_one_pass=0.92, acc_len_width2=1.3, acc_len_pr=0.95,
               acc_len_width6=2.0, acc_len_width6_pr=2.0)
    out = tmp_path / "res" / "sim-honesty.gsm8k"
    assert sh.main(["--baseline", f"eagle3={base}", "--variant", f"pr={pr}", "--served", str(tmp_path / "serve"),
                    "--out", str(out), "--bootstrap", "100"]) == 0
    report = json.loads((tmp_path / "res" / "sim-honesty.gsm8k.json").read_text())
    assert report["summary"]["points"] == 3 and {r["prompts"] for r in report["points"]} == {3}
    (wide,) = [r for r in report["points"] if r["part"] == "mechanism_width6"]  # read apart, not in the summary
    assert wide["sim_gain"] == 0.0 and wide["served_pair"] == ["pr/one-pass", "pr"]
    assert report["alternative"]["mechanism_width6"]["points"] == 1
    assert report["points"][0]["tau"] == [pytest.approx(2.2), pytest.approx(23 / 10)]  # B 24 rows ignored
    assert "| pr | mechanism | pr over pr/one-pass | 3 |" in (tmp_path / "res" / "sim-honesty.gsm8k.md").read_text()


@pytest.mark.parametrize("case,needle", [
    ("missing-diag", "no such diagnose file"),
    ("not-diag", "not a `pr-specforge diagnose --json` output"),
    ("no-eval", "no results.jsonl"),
    ("bad-name", "expected NAME=DIAGNOSE.json"),
    ("baseline-not-served", "baseline 'eagle3' was not served"),
])
def test_bad_input_is_one_line(sh, tmp_path, capsys, case, needle):
    _eval_dir(tmp_path / "serve", {"eagle3": _rows([(20, 10)]), "pr": _rows([(22, 10)])})
    base = _diag(tmp_path / "e.json", acc_len_one_pass=0.9)
    pr = _diag(tmp_path / "p.json", acc_len_one_pass=0.9, acc_len_pr=1.0)
    served, variant, baseline = tmp_path / "serve", f"pr={pr}", f"eagle3={base}"
    if case == "missing-diag":
        variant = f"pr={tmp_path / 'nope.json'}"
    elif case == "not-diag":
        (tmp_path / "x.json").write_text("[1, 2]")
        variant = f"pr={tmp_path / 'x.json'}"
    elif case == "no-eval":
        served = tmp_path
    elif case == "bad-name":
        variant = str(pr)
    elif case == "baseline-not-served":
        _eval_dir(tmp_path / "serve2", {"pr": _rows([(22, 10)])})
        served = tmp_path / "serve2"
    rc = sh.main(["--baseline", baseline, "--variant", variant, "--served", str(served), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


# ---------------------------------------------------------------- issue 44: more bad input, and no overwrite with less
def _edit_diag_folder(tmp, a):
    a["variant"] = f"pr={tmp}"


def _edit_sim_null(tmp, a):
    (tmp / "n.json").write_text(json.dumps({"sim": None}))
    a["variant"] = f"pr={tmp / 'n.json'}"


def _edit_sim_not_a_number(tmp, a):
    a["variant"] = f"pr={_diag(tmp / 'n.json', acc_len_one_pass='high', acc_len_pr=1.0)}"


def _edit_results_not_jsonl(tmp, a):
    with open(tmp / "serve" / "results.jsonl", "a") as f:
        f.write("{torn\n" + json.dumps({"draft": "pr", "budget": 48, "temperature": 0.0, "set": "s", "prompt": "q",
                                         "accepted": 1, "rounds": 1}) + "\n")


def _edit_row_without_accepted(tmp, a):
    _eval_dir(tmp / "serve3", {"eagle3": {"screen/p0": {"rounds": 10}}, "pr": _rows([(22, 10)])})
    a["served"] = str(tmp / "serve3")


def _edit_unwritable_out(tmp, a):
    (tmp / "afile").write_text("x")
    a["out"] = str(tmp / "afile" / "o")


def _edit_variant_named_as_baseline(tmp, a):
    a["variant"] = a["variant"].replace("pr=", "eagle3=")


def _edit_out_holding_more_points(tmp, a):
    (tmp / "o.json").write_text(json.dumps({"points": [{}] * 5}))


#: case -> (edit of the arguments/files, what the one line says)
MORE_BAD = {
    "diagnose file is a folder": (_edit_diag_folder, "a directory, not a diagnose file"),
    "sim is null": (_edit_sim_null, "its `sim` is null"),
    "sim figure not a number": (_edit_sim_not_a_number, "sim figure 'sim/acc_len_one_pass' is \"high\""),
    "results.jsonl with a malformed line": (_edit_results_not_jsonl, "results.jsonl:5: malformed JSON"),
    "served row without accepted": (_edit_row_without_accepted, "field 'accepted' is null"),
    "unwritable --out": (_edit_unwritable_out, "cannot write there"),
    "variant with the baseline's name": (_edit_variant_named_as_baseline, "has the baseline's name"),
    "--out holding more points than this run": (_edit_out_holding_more_points, "holds 5 rows and this run has 1"),
}


@pytest.mark.parametrize("case", sorted(MORE_BAD))
def test_more_bad_input_is_one_line_and_writes_nothing(sh, tmp_path, capsys, case):
    _eval_dir(tmp_path / "serve", {"eagle3": _rows([(20, 10)]), "pr": _rows([(22, 10)])})
    a = {"baseline": f"eagle3={_diag(tmp_path / 'e.json', acc_len_one_pass=0.9)}",
         "variant": f"pr={_diag(tmp_path / 'p.json', acc_len_one_pass=0.9, acc_len_pr=1.0)}",
         "served": str(tmp_path / "serve"), "out": str(tmp_path / "o")}
    edit, needle = MORE_BAD[case]
    edit(tmp_path, a)
    before = (tmp_path / "o.json").read_text() if (tmp_path / "o.json").exists() else None
    rc = sh.main([x for k, v in a.items() for x in (f"--{k}", v)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert ((tmp_path / "o.json").read_text() if (tmp_path / "o.json").exists() else None) == before
    assert not (tmp_path / "o.md").exists()


def test_replacing_a_report_with_fewer_points_needs_the_flag_that_says_so(sh, tmp_path):
    _eval_dir(tmp_path / "serve", {"eagle3": _rows([(20, 10)]), "pr": _rows([(22, 10)]), "long": _rows([(21, 10)])})
    args = ["--baseline", f"eagle3={_diag(tmp_path / 'e.json', acc_len_one_pass=0.9)}",
            "--variant", f"pr={_diag(tmp_path / 'p.json', acc_len_one_pass=0.9, acc_len_pr=1.0)}",
            "--served", str(tmp_path / "serve"), "--out", str(tmp_path / "o"), "--bootstrap", "50"]
    long = ["--variant", f"long={_diag(tmp_path / 'l.json', acc_len_one_pass=0.95)}"]
    assert sh.main(args + long) == 0 and len(json.loads((tmp_path / "o.json").read_text())["points"]) == 2
    assert sh.main(args + long) == 0  # as many points: replaced
    assert sh.main(args) == 2  # one variant fewer: refused
    assert len(json.loads((tmp_path / "o.json").read_text())["points"]) == 2
    assert sh.main(args + ["--replace-with-fewer"]) == 0
    assert len(json.loads((tmp_path / "o.json").read_text())["points"]) == 1
    assert oct((tmp_path / "o.json").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())  # readable by others
