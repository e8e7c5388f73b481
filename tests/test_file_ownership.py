"""Issue 65, items 1 and 3: what a command may write is one rule (`pr_specforge.data.io.check_writable_file` /
`check_output_dir`), applied by every command before any work.

Each row of `REFUSED` is a command line that must be refused in ONE line (exit 2, no traceback, the line naming the
flag and the path) before any work, leaving every file as it was; the tests after it show what the rule lets through
(an earlier output of the command's own kind, `--overwrite` on a file of the user's, a replaced file's mode).
Workspaces are tiny (`tests.helpers.write_workspace`); nothing here trains or measures anything.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from tests.helpers import load_benchmark, run_cli, write_manifest_of, write_workspace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PAPER_PR = os.path.join(REPO, "recipes", "_base", "paper-pr.yaml")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny workspace (target, features, recipe) and a run directory as `train` leaves it (its resolved recipe and
    metrics: what plot, diagnose and headroom read)."""
    root = tmp_path_factory.mktemp("own")
    recipe = write_workspace(str(root), strategy="eagle3", steps=2)
    write_manifest_of(root / "features", root / "target")
    run = root / "run"
    run.mkdir()
    shutil.copy(recipe, run / "resolved_recipe.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "acc_0": s / 10}) + "\n"
                                               for s in range(1, 4)))
    (run / "epoch_0_step_2").mkdir()
    (run / "epoch_0_step_2" / "training_state.pt").write_bytes(b"not read: the refusal comes first")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "hello"}) + "\n")
    return {"root": root, "recipe": recipe, "run": run, "features": root / "features", "target": root / "target",
            "prompts": prompts}


def _read_only_dir(tmp):
    d = tmp / "locked"
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o555)
    return d


def _eval(ws, tmp, *extra):
    return ["eval", "--target", ws["target"], "--draft", f"d={ws['root']}", "--prompts", ws["prompts"],
            "--out-dir", tmp / "o", *extra]


def _file(tmp, name, text="a user's own file\n", mode=None):
    path = tmp / name
    path.write_text(text)
    if mode is not None:
        os.chmod(path, mode)
    return path


#: name -> (argv(ws, tmp) for `pr-specforge`, or ("regimes", argv) for benchmarks/regimes.py; needles of the line)
REFUSED = {
    # 1. files a user owns are overwritten
    "eval --json onto a committed results file (an experiment report)": (
        lambda ws, t: _eval(ws, t, "--json", shutil.copy(os.path.join(RESULTS, "smollm2-cpu.json"), t / "s.json")),
        ["--json", "s.json", "is not an eval summary", "its kind is 'pr_specforge.experiment_report'"]),
    "eval --json onto a JSON with a results list but no marker": (
        lambda ws, t: _eval(ws, t, "--json", _file(t, "r.json", json.dumps({"results": [], "settings": {}}))),
        ["--json", "r.json", 'no "kind": "pr_specforge.eval_summary" marker']),
    "eval --json onto its own out-dir's rows": (
        lambda ws, t: _eval(ws, t, "--json", (t / "o").mkdir() or _file(t / "o", "results.jsonl", "{}\n")),
        ["--json", "results.jsonl", "is an input of this command"]),
    "regimes report --out P onto a user's P.md": (
        lambda ws, t: ("regimes", ["report", "--sharegpt", os.path.join(RESULTS, "regime-sharegpt"),
                                   "--out", str(_file(t, "notes.md").with_suffix(""))]),
        ["--out", "notes.md", "is not an earlier regimes report", "--overwrite"]),
    "plot -o its own metrics.jsonl, --overwrite": (
        lambda ws, t: ["plot", ws["run"], "-o", ws["run"] / "metrics.jsonl", "--overwrite"],
        ["-o", "metrics.jsonl", "is an input of this command", "--overwrite or not"]),
    "plot -o the metrics JSONL it was given, --overwrite": (
        lambda ws, t: ["plot", ws["run"] / "metrics.jsonl", "-o", ws["run"] / "metrics.jsonl", "--overwrite"],
        ["-o", "metrics.jsonl", "is an input of this command"]),
    "diagnose --json the run's resolved_recipe.yaml, --overwrite": (
        lambda ws, t: ["diagnose", ws["run"], "--features", ws["features"], "--json",
                       ws["run"] / "resolved_recipe.yaml", "--overwrite"],
        ["--json", "resolved_recipe.yaml", "is an input of this command"]),
    "diagnose --json a checkpoint's file, --overwrite": (
        lambda ws, t: ["diagnose", ws["run"], "--features", ws["features"], "--json",
                       ws["run"] / "epoch_0_step_2" / "training_state.pt", "--overwrite"],
        ["--json", "training_state.pt", "a file of the input"]),
    "headroom --out onto a feature file's prefix, --overwrite": (
        lambda ws, t: ["headroom", ws["run"], "--features", ws["features"], "--out", ws["features"] / "manifest",
                       "--overwrite"],
        ["--out", "manifest.json", "is an input of this command"]),
    "control --json the recipe, --overwrite": (
        lambda ws, t: ["control", "--recipe", shutil.copy(PAPER_PR, t / "r.yaml"), "--json", t / "r.yaml", "--overwrite"],
        ["--json", "r.yaml", "is an input of this command"]),
    "diagnose --json a read-only file, --overwrite": (
        lambda ws, t: ["diagnose", ws["run"], "--features", ws["features"], "--json", _file(t, "ro.json", "{}", 0o444),
                       "--overwrite"],
        ["--json", "ro.json", "is read-only"]),
    "control --json a read-only file, --overwrite": (
        lambda ws, t: ["control", "--recipe", PAPER_PR, "--json", _file(t, "ro.json", "{}", 0o444), "--overwrite"],
        ["--json", "ro.json", "is read-only"]),
    "plot -o a read-only file, --overwrite": (
        lambda ws, t: ["plot", ws["run"], "-o", _file(t, "ro.png", "png", 0o444), "--overwrite"],
        ["-o", "ro.png", "is read-only"]),
    "plot -o x.pdf": (lambda ws, t: ["plot", ws["run"], "-o", t / "x.pdf"], ["-o", "x.pdf", "PNG only", ".png"]),
    "plot -o x.jpg": (lambda ws, t: ["plot", ws["run"], "-o", t / "x.jpg"], ["-o", "x.jpg", "PNG only"]),
    "plot -o a symbolic link, --overwrite": (
        lambda ws, t: ["plot", ws["run"], "-o", os.symlink(_file(t, "real.png"), t / "link.png") or t / "link.png",
                       "--overwrite"],
        ["-o", "link.png", "is a symbolic link"]),
    "export --overwrite onto a symbolic link": (
        lambda ws, t: ["export", ws["run"], (t / "real").mkdir() or os.symlink(t / "real", t / "link") or t / "link",
                       "--to", "hf", "--overwrite"],
        ["OUT_DIR", "link", "is a symbolic link", "never a link"]),
    "diagnose --json x.png": (
        lambda ws, t: ["diagnose", ws["run"], "--features", ws["features"], "--json", t / "x.png"],
        ["--json", "x.png", "writes JSON only (PNG, by its name)"]),
    "control --json notes.md": (
        lambda ws, t: ["control", "--recipe", PAPER_PR, "--json", t / "notes.md"],
        ["--json", "notes.md", "writes JSON only (Markdown, by its name)"]),
    "export --overwrite onto a read-only export directory": (
        lambda ws, t: ["export", ws["run"], _read_only_dir(t), "--to", "hf", "--overwrite"],
        ["OUT_DIR", "locked", "is read-only"]),
    # 3. an output directory that cannot be written
    "plot -o into a read-only directory": (
        lambda ws, t: ["plot", ws["run"], "-o", _read_only_dir(t) / "p.png"], ["-o", "locked", "not writable"]),
    "diagnose --json into a read-only directory": (
        lambda ws, t: ["diagnose", ws["run"], "--features", ws["features"], "--json", _read_only_dir(t) / "d.json"],
        ["--json", "locked", "not writable"]),
    "headroom --out into a read-only directory": (
        lambda ws, t: ["headroom", ws["run"], "--features", ws["features"], "--out", _read_only_dir(t) / "h"],
        ["--out", "locked", "not writable"]),
    "control --json into a read-only directory": (
        lambda ws, t: ["control", "--recipe", PAPER_PR, "--json", _read_only_dir(t) / "c.json"],
        ["--json", "locked", "not writable"]),
    "eval --json into a read-only directory": (
        lambda ws, t: _eval(ws, t, "--json", _read_only_dir(t) / "s.json"), ["--json", "locked", "not writable"]),
    "eval --out-dir in a read-only directory": (
        lambda ws, t: [*_eval(ws, t)[:-1], _read_only_dir(t) / "o"], ["--out-dir", "locked", "not writable"]),
    "eval --out-dir a read-only directory": (
        lambda ws, t: [*_eval(ws, t)[:-1], _read_only_dir(t)], ["--out-dir", "locked", "not writable"]),
    "export into a read-only directory": (
        lambda ws, t: ["export", ws["run"], _read_only_dir(t) / "e", "--to", "hf"], ["OUT_DIR", "locked", "not writable"]),
    # 3. an output path that is an existing file, or lies under one
    "eval --out-dir FILE": (lambda ws, t: [*_eval(ws, t)[:-1], _file(t, "f")], ["--out-dir", "f: is a file"]),
    "eval --out-dir under a file": (lambda ws, t: [*_eval(ws, t)[:-1], _file(t, "f") / "o"], ["--out-dir", "is a file"]),
    "regimes save --to FILE": (
        lambda ws, t: ("regimes", ["save", "--workdir", str(t), "--to", str(_file(t, "f"))]), ["--to", "f: is a file"]),
    "regimes restore --workdir FILE": (
        lambda ws, t: ("regimes", ["restore", "--from", os.path.join(RESULTS, "regime-gsm8k"), "--workdir",
                                   str(_file(t, "f"))]), ["--workdir", "f: is a file"]),
    "regimes report --out FILE/x": (
        lambda ws, t: ("regimes", ["report", "--sharegpt", os.path.join(RESULTS, "regime-sharegpt"),
                                   "--out", str(_file(t, "f") / "x")]), ["--out", "is a file, not a directory"]),
    "regimes report --out a regime folder's own file": (
        lambda ws, t: ("regimes", ["report", "--sharegpt", str(shutil.copytree(
            os.path.join(RESULTS, "regime-sharegpt"), t / "kept")), "--out", str(t / "kept" / "data_settings"),
            "--overwrite"]), ["--out", "data_settings.json", "is an input of this command"]),
    # 3. sizes and seeds refused before the work (not a traceback, not a 76.8 GB allocation)
    "control --seed 2**64": (lambda ws, t: ["control", "--recipe", PAPER_PR, "--seed", str(2 ** 64)],
                             ["control seed", str(2 ** 64)]),
    "control --pool 100000000": (lambda ws, t: ["control", "--recipe", PAPER_PR, "--pool", "100000000"],
                                 ["control size", "M = 100000000", "--pool"]),
}


def _snapshot(*dirs):
    """Every file under `dirs` (and its mode): what a refused command must leave as it was."""
    out = {}
    for d in dirs:
        for root, _, files in os.walk(d):
            for name in files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    with open(path, "rb") as f:
                        out[path] = (f.read(), os.stat(path).st_mode)
    return out


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_in_one_line_before_any_work(ws, tmp_path, capsys, case):
    make, needles = REFUSED[case]
    argv = make(ws, tmp_path)
    before = _snapshot(tmp_path, ws["run"], ws["features"])
    try:
        if isinstance(argv, tuple):
            rc = load_benchmark("regimes").main(argv[1])
            captured = capsys.readouterr()
            text = captured.out + captured.err
        else:
            rc, text = run_cli(*argv, cwd=tmp_path)
    finally:
        for d in (tmp_path / "locked",):
            if d.exists():
                os.chmod(d, 0o755)
    lines = [x for x in text.strip().splitlines() if "flash_attn" not in x and "flash-attn" not in x]
    assert rc == 2 and "Traceback" not in text and len(lines) == 1, (case, rc, text[-3000:])
    assert all(n in lines[0] for n in needles), (case, lines[0])
    assert _snapshot(tmp_path, ws["run"], ws["features"]) == before, case  # nothing written, nothing replaced
    assert not (tmp_path / "o").exists() or case == "eval --json onto its own out-dir's rows"


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umask(ws, tmp_path):
    """`--overwrite` on a user's file: replaced (a PNG now), its mode kept (was: made 0644 whatever it was)."""
    from pr_specforge.data.io import atomic_write_json

    mine = _file(tmp_path, "mine.png", "old", 0o640)
    rc, text = run_cli("plot", ws["run"], "-o", mine, "--overwrite", cwd=tmp_path)
    assert rc == 0, text
    assert mine.read_bytes()[:4] == b"\x89PNG" and stat.S_IMODE(os.stat(mine).st_mode) == 0o640
    j = _file(tmp_path, "j.json", "{}", 0o600)
    atomic_write_json(j, {"a": 1})
    assert stat.S_IMODE(os.stat(j).st_mode) == 0o600 and json.loads(j.read_text()) == {"a": 1}
    rc, text = run_cli("plot", ws["run"], "-o", mine, cwd=tmp_path)  # without --overwrite: refused, as before
    assert rc == 2 and "exists; pass --overwrite" in text


def test_a_metrics_file_that_is_not_text_is_one_line_naming_it(ws, tmp_path):
    """What the next `plot` said after its metrics were replaced by PNG bytes: a codec error naming no file."""
    (tmp_path / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    rc, text = run_cli("plot", tmp_path, "-o", tmp_path / "p.png", cwd=tmp_path)
    assert rc == 2 and "Traceback" not in text and f"{tmp_path / 'metrics.jsonl'}: not a metrics file" in text, text


def test_own_kind_is_recognised_by_its_marker_never_by_shape(tmp_path):
    """eval --json rewrites an earlier summary carrying its marker; one without it only inside an eval out-dir (written
    there by a version before the marker: the kept regime folders); the shape of a summary alone is not enough."""
    from pr_specforge.data.io import DataFormatError, own_kind
    from pr_specforge.eval.cli import EVAL_SUMMARY_KIND, check_summary_path

    out = tmp_path / "o"
    out.mkdir()
    marked = _file(tmp_path, "marked.json", json.dumps({**own_kind(EVAL_SUMMARY_KIND), "results": []}))
    check_summary_path(str(marked), str(out))
    newer = _file(tmp_path, "newer.json", json.dumps({**own_kind(EVAL_SUMMARY_KIND, version=2), "results": []}))
    with pytest.raises(DataFormatError, match="written by a newer version of this command"):
        check_summary_path(str(newer), str(out))
    legacy = _file(out, "summary.json", json.dumps({"results": []}))
    with pytest.raises(DataFormatError, match="no \"kind\""):
        check_summary_path(str(legacy), str(out))  # out is no eval out-dir yet: nothing recognises it
    (out / "eval_config.json").write_text("{}")
    check_summary_path(str(legacy), str(out))  # eval's own out-dir: its earlier summary is rewritten
    other = _file(out, "other.json", json.dumps({**own_kind("pr_specforge.experiment_report"), "results": []}))
    with pytest.raises(DataFormatError, match="its kind is 'pr_specforge.experiment_report'"):
        check_summary_path(str(other), str(out))  # another command's marked file, even there
    # and the other way round: experiment --report accepted any JSON with a results list and settings
    from pathlib import Path

    from pr_specforge.eval.experiment_report import check_report_prefix

    summary = _file(tmp_path, "exp.json", json.dumps({**own_kind(EVAL_SUMMARY_KIND), "results": [], "settings": {}}))
    with pytest.raises(DataFormatError, match="exp.json: exists and is not an earlier experiment report"):
        check_report_prefix(Path(str(summary)[:-len(".json")]))


def test_committed_reports_carry_their_marker_so_their_commands_rewrite_them():
    """The committed results a documented command rewrites at its default path carry the marker that command writes
    (their readers read them as before: the marker is two more keys)."""
    from pr_specforge.eval.experiment_report import EXPERIMENT_REPORT_KIND, check_report_prefix

    regimes = load_benchmark("regimes")
    from study.regime_render import REGIMES_REPORT_KIND, check_report_out

    from pathlib import Path

    for name in ("smollm2-cpu", "smollm2-cpu-seed1", "smollm2-cpu-best"):
        check_report_prefix(Path(RESULTS) / name)
        assert json.loads(Path(RESULTS, name + ".json").read_text())["kind"] == EXPERIMENT_REPORT_KIND
    check_report_out(Path(RESULTS) / "regimes")
    report = json.loads(Path(RESULTS, "regimes.json").read_text())
    assert report["kind"] == REGIMES_REPORT_KIND and regimes.render(report).startswith("#")


def test_regimes_report_overwrite_replaces_a_users_file_and_marks_its_own(tmp_path, capsys):
    regimes = load_benchmark("regimes")
    notes = _file(tmp_path, "r.md")
    argv = ["report", "--sharegpt", os.path.join(RESULTS, "regime-sharegpt"), "--out", str(tmp_path / "r")]
    assert regimes.main(argv) == 2 and notes.read_text() == "a user's own file\n"
    assert regimes.main([*argv, "--overwrite"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "pr_specforge.regimes_report"
    assert regimes.main(argv) == 0  # its own report now: rewritten without --overwrite
    capsys.readouterr()


def test_eagle3_in_float32_on_bf16_features_is_refused_by_the_dry_run(tmp_path):
    """It passed --dry-run, then failed at step 1 (82 lines): SpecForge's eagle3 step does not cast the features."""
    import torch

    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=1)
    for name in os.listdir(tmp_path / "features"):
        if name.endswith(".ckpt"):
            path = tmp_path / "features" / name
            data = torch.load(path)
            for key in ("hidden_state", "aux_hidden_state"):
                data[key] = data[key].to(torch.bfloat16)
            torch.save(data, path)
    rc, text = run_cli("train", "-c", recipe, "--dry-run", cwd=tmp_path)
    lines = [x for x in text.strip().splitlines() if x.startswith("pr-specforge")]  # SpecForge's import warnings aside
    assert rc == 2 and "Traceback" not in text and len(lines) == 1, text[-3000:]
    assert "data.hidden_states_path: features are torch.bfloat16 but model.torch_dtype is float32" in lines[0], lines


def _system_python_runs_the_study(env) -> bool:
    """`python` on `env`'s PATH imports torch and pr_specforge: past its checks regime_paper.sh would start a sitting."""
    return subprocess.run(["bash", "-c", "command -v python && python -c 'import torch, pr_specforge'"], env=env,
                          capture_output=True).returncode == 0


def test_regime_paper_without_the_venv_on_path_stops_before_restoring(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WORK": str(tmp_path / "w"), "ALLOW_EMULATED_BF16": "1"}
    if _system_python_runs_the_study(env):
        pytest.skip("this machine's system python imports torch and pr_specforge")
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "study", "regime_paper.sh"), "0", "data"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot import torch and pr_specforge" in proc.stderr and not (tmp_path / "w").exists()


@pytest.mark.parametrize("flags, refused", [("fpu sse avx avx2 fma", True), ("fpu avx2 avx512f avx512_bf16", False)])
def test_regime_paper_on_a_cpu_without_native_bf16_stops_before_any_work(tmp_path, flags, refused):
    """The kept drafters trained in bf16 on CPUs with native bf16; elsewhere `auto` is float32, and forced bf16 is emulated
    (a study training step took 56 s, not 1 s)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WORK": str(tmp_path / "w"), "CPUINFO": str(cpuinfo)}
    if not refused and _system_python_runs_the_study(env):
        pytest.skip("this machine's system python imports torch and pr_specforge: past the check the sitting would run")
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "study", "regime_paper.sh"), "0", "data"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("no native bf16" in proc.stderr) is refused and not (tmp_path / "w").exists()
    if not refused:  # past the bf16 check: the next one (no venv on this PATH) speaks
        assert "cannot import torch and pr_specforge" in proc.stderr
