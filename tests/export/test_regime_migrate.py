"""Issue 63: a kept study drafter rebuilt in another directory is accepted by its fingerprint. Kept folders served
before exports recorded their target by name hold the legacy fingerprint (the export's files, the target's absolute
path inside); `regimes.py migrate` carries it over to the rebuild's fingerprint only when rows served again by the
rebuild equal the kept rows, and then the study's kept-fingerprint stage and `eval` resuming the folder accept it."""

import json
import os
import shutil

import pytest

from tests.helpers import load_benchmark, run_cli, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
SERVE = ["--budget", "6", "--temperature", "0", "--max-new-tokens", "8", "--k", "2", "--bw", "2", "--gamma", "3",
         "--m", "0", "--no-progress"]


def _cli(*argv, cwd):
    rc, out = run_cli(*argv, cwd=cwd, env=ENV)
    assert rc == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A 2-step eagle3 run exported in one directory (`first`, as the kept study's was), its rows served into a kept
    folder recorded the old way, and the same checkpoint exported again elsewhere (`rebuilt`, another target path)."""
    from pr_specforge.eval.evaluator import PROVENANCE_FILE
    from pr_specforge.export import export_fingerprints

    from tests.data.conftest import build_tokenizer

    root = tmp_path_factory.mktemp("migrate")
    tok = build_tokenizer()
    recipe = write_workspace(str(root), strategy="eagle3", steps=2, extra={"model": {"torch_dtype": "bfloat16"}},
                             target=dict(vocab=len(tok), tokenizer=tok))
    _cli("train", "-c", recipe, "training.save_interval=2", cwd=root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(("hello there", "what is two and two", "tell me a story"))))
    _cli("export", str(root / "out"), str(root / "first"), "--to", "hf", "--target", str(root / "target"), cwd=root)
    cfg = json.loads((root / "first" / "config.json").read_text())  # as exports made before issue 63 recorded it
    cfg["pr_specforge_target"]["path"] = str(root / "target")
    del cfg["pr_specforge_run"]
    (root / "first" / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copytree(root / "target", root / "elsewhere" / "target")
    _cli("export", str(root / "out"), str(root / "elsewhere" / "rebuilt"), "--to", "hf", "--target",
         str(root / "elsewhere" / "target"), cwd=root)
    kept = root / "kept"
    (kept / "seed1").mkdir(parents=True)
    (kept / "data_settings.json").write_text(json.dumps({"max_new_tokens": 8}))
    for folder, bw in (("report-b6", "2"), ("screen-b6", "2"), ("report-bw1-b6", "1")):  # the last: other settings
        out = kept / "seed1" / folder
        serve = [*SERVE[:SERVE.index("--bw") + 1], bw, *SERVE[SERVE.index("--bw") + 2:]]
        _cli("eval", "--target", str(root / "target"), "--draft", f"eagle3={root / 'first'}", "--prompts", str(prompts),
             "--out-dir", str(out), *serve, cwd=root)
        record = json.loads((out / PROVENANCE_FILE).read_text())  # as a folder served before issue 63 recorded it
        record["drafters"]["eagle3"] = export_fingerprints(str(root / "first"))[1]
        (out / PROVENANCE_FILE).write_text(json.dumps(record))
    # a second eagle3 build with other weights served another folder: nothing checks it, so nothing migrates it
    (kept / "seed1" / "report-b3").mkdir()
    (kept / "seed1" / "report-b3" / PROVENANCE_FILE).write_text(json.dumps({"drafters": {"eagle3": "0123456789abcdef"}}))
    return {"root": root, "prompts": prompts, "kept": kept}


def _serve(study, export, out, limit):
    root = study["root"]
    _cli("eval", "--target", str(root / "elsewhere" / "target"), "--draft", f"eagle3={export}", "--prompts",
         str(study["prompts"]), "--out-dir", str(out), "--limit", str(limit), *SERVE, cwd=root)


def test_a_rebuild_elsewhere_is_refused_by_the_legacy_records_then_migrated_on_equal_rows_and_accepted(study, tmp_path):
    regimes = load_benchmark("regimes")  # puts benchmarks/ on the path: study.*
    from study.regime_keep import kept_fingerprint_check

    from pr_specforge.eval.evaluator import PROVENANCE_FILE
    from pr_specforge.export import export_fingerprints
    from pr_specforge.stages import StageFailed

    kept = tmp_path / "kept"
    shutil.copytree(study["kept"], kept)
    sd, rebuilt = kept / "seed1", study["root"] / "elsewhere" / "rebuilt"
    legacy = export_fingerprints(str(study["root"] / "first"))[1]
    new = export_fingerprints(str(rebuilt))[0]
    assert export_fingerprints(str(rebuilt))[1] != legacy and new == export_fingerprints(str(study["root"] / "first"))[0]
    with pytest.raises(StageFailed, match="regimes.py migrate"):  # the kept rows name the first build the old way
        kept_fingerprint_check(sd, "eagle3", rebuilt, tmp_path / "fp.json")
    check = tmp_path / "recheck"
    _serve(study, rebuilt, check, limit=2)
    argv = ["migrate", "--kept", str(kept), "--seed", "1", "--drafter", "eagle3", "--export", str(rebuilt),
            "--check", str(check), "--machine", "test machine"]
    assert regimes.main(argv) == 0
    record = json.loads((sd / "fingerprints" / "eagle3.json").read_text())
    assert record["fingerprint"] == new and record["stands_for"] == [legacy]
    # the B_w 1 folder: the same files, served otherwise (its rows not compared); report-b3's other build: left alone
    assert record["folders"] == {"report-b6": legacy, "report-bw1-b6": legacy, "screen-b6": legacy}
    assert record["checked_by"]["rows_compared"] == {legacy: 4} and "accepted" in record["checked_by"]["fields"]
    assert "total_s" not in record["checked_by"]["fields"]
    rows = [json.loads(line) for line in (sd / "fingerprints" / "eagle3-recheck.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["p0", "p1"]
    for folder in ("report-b6", "screen-b6", "report-bw1-b6"):
        cfg = json.loads((sd / folder / PROVENANCE_FILE).read_text())
        assert cfg["drafters"]["eagle3"] == new and cfg["drafters_migrated"]["eagle3"]["from"] == legacy
    assert json.loads((sd / "report-b3" / PROVENANCE_FILE).read_text())["drafters"]["eagle3"] == "0123456789abcdef"
    # accepted by its fingerprint: the study's stage, and eval resuming the kept folder (one more prompt, none redone)
    with pytest.raises(StageFailed, match="report-b3"):
        kept_fingerprint_check(sd, "eagle3", rebuilt, tmp_path / "fp.json")  # the unchecked build still refuses
    shutil.rmtree(sd / "report-b3")
    kept_fingerprint_check(sd, "eagle3", rebuilt, tmp_path / "fp.json")
    assert json.loads((tmp_path / "fp.json").read_text())["fingerprint"] == new
    before = (sd / "report-b6" / "results.jsonl").read_text()
    _serve(study, rebuilt, sd / "report-b6", limit=3)
    assert (sd / "report-b6" / "results.jsonl").read_text() == before  # all three prompts were kept rows: reused


def test_a_rebuild_whose_rows_differ_is_not_migrated_and_nothing_is_written(study, tmp_path, capsys):
    regimes = load_benchmark("regimes")
    kept = tmp_path / "kept"
    shutil.copytree(study["kept"], kept)
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    rebuilt = study["root"] / "elsewhere" / "rebuilt"
    check = tmp_path / "recheck"
    _serve(study, rebuilt, check, limit=1)
    rows = [json.loads(line) for line in (check / "results.jsonl").read_text().splitlines()]
    rows[0]["rounds"] += 1  # a drafter that served otherwise
    (check / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["migrate", "--kept", str(kept), "--seed", "1", "--drafter", "eagle3", "--export", str(rebuilt), "--check"]
    assert regimes.main([*argv, str(check)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "re-served row has rounds =" in err and "nothing migrated" in err
    # no row of that drafter, and a seed that is not kept: one line each
    (tmp_path / "empty").mkdir()
    assert regimes.main([*argv, str(tmp_path / "empty")]) == 1 and "no row of drafter 'eagle3'" in capsys.readouterr().err
    assert regimes.main([*argv[:4], "7", *argv[5:], str(check)]) == 1 and "no seed7/" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before
