"""Issue 63: a derived stage (diagnose, headroom, the held-out measures, `run`'s control) is reused only while what
its output was made from is what its inputs are now, by content; else it runs again and says in one line what
changed. Before, each was "done" as soon as its file existed: after a retraining the old diagnose JSON was reused."""

import json
import logging
import shutil

import pytest

from pr_specforge.stages import StageBuilder, made_from_path, run_stages


def _counting_stage(tmp_path, source, seed=0):
    """A derived stage that copies `source` into `out.txt` (upper-cased) and counts its runs."""
    runs = []
    out = tmp_path / "out.txt"

    def run():
        runs.append(source.read_text())
        out.write_text(source.read_text().upper())
    return StageBuilder(tmp_path).derived_stage("copy", out, run, files=[source], seed=seed), runs, out


def test_a_derived_stage_reruns_when_its_input_changes_and_is_skipped_while_it_does_not(tmp_path, caplog):
    source = tmp_path / "in.txt"
    source.write_text("first")
    stage, runs, out = _counting_stage(tmp_path, source)
    run_stages([stage])
    record = json.loads(made_from_path(out).read_text())
    assert record["kind"] == "pr-specforge stage inputs" and set(record["made_from"]) == {"in.txt", "seed"}
    run_stages([_counting_stage(tmp_path, source)[0]])
    assert runs == ["first"] and stage.done()  # unchanged: skipped

    source.write_text("second")
    assert not stage.done() and "in.txt changed (sha256 " in stage.stale()
    with caplog.at_level(logging.WARNING, logger="pr_specforge.stages"):
        run_stages([stage])
    assert runs == ["first", "second"] and out.read_text() == "SECOND"
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    old, new = record["made_from"]["in.txt"]["sha256"], json.loads(made_from_path(out).read_text())["made_from"]["in.txt"]["sha256"]
    assert line == f"copy: in.txt changed (sha256 {old[:12]}.. -> {new[:12]}..): recomputing out.txt"
    assert stage.done()

    # a setting is an input too, named with both values
    other = _counting_stage(tmp_path, source, seed=1)[0]
    assert not other.done() and other.stale() == "seed changed (0 -> 1)"


def test_an_output_without_a_readable_record_is_made_again(tmp_path, caplog):
    source = tmp_path / "in.txt"
    source.write_text("x")
    stage, runs, out = _counting_stage(tmp_path, source)
    out.write_text("made before records were kept")  # an older workdir: the output, no record beside it
    assert not stage.done() and "has no record of what it was made from" in stage.stale()
    with caplog.at_level(logging.WARNING, logger="pr_specforge.stages"):
        run_stages([stage])
    assert runs == ["x"] and out.read_text() == "X" and "copy: out.txt has no record" in caplog.text
    made_from_path(out).write_text('{"made_from": {}}')  # no marker: not this mechanism's record
    assert not stage.done() and "not a readable record" in stage.stale()
    made_from_path(out).write_text("{torn")
    assert not stage.done()


def test_a_failed_run_leaves_the_stage_to_run_again(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("one")
    stage, runs, out = _counting_stage(tmp_path, source)
    run_stages([stage])
    source.write_text("two")

    def fails():
        out.write_text("half")  # the output replaced, then the work fails: the record still names the old input
        raise RuntimeError("killed")
    broken = StageBuilder(tmp_path).derived_stage("copy", out, fails, files=[source], seed=0)
    with pytest.raises(RuntimeError):
        run_stages([broken])
    assert not stage.done() and "in.txt changed" in stage.stale()


def test_features_are_recorded_by_their_manifest_fingerprint_not_where_or_how_they_were_written(tmp_path):
    from pr_specforge.stages import features_record

    feats = tmp_path / "features"
    feats.mkdir()
    manifest = {"status": "complete", "input": str(tmp_path / "a.jsonl"), "target": {"path": "/x", "config_fingerprint": "c1"},
                "resume": {"input": "d1", "max_length": 64}, "vocab_fingerprint": "v1", "draft_vocab_size": 48,
                "counts": {"written": 8, "resumed": 0, "samples": 8, "loss_tokens": 100}}
    (feats / "manifest.json").write_text(json.dumps(manifest))
    first = features_record(feats)
    # resumed instead of written in one go, from the same input by another path, another target path: the same
    (feats / "manifest.json").write_text(json.dumps({**manifest, "input": "/elsewhere/a.jsonl", "target": {
        "path": "/y", "config_fingerprint": "c1"}, "counts": {"written": 3, "resumed": 5, "samples": 8, "loss_tokens": 100}}))
    assert features_record(feats) == first
    for change in ({"resume": {"input": "d2", "max_length": 64}}, {"vocab_fingerprint": "v2"}, {"status": "in_progress"}):
        (feats / "manifest.json").write_text(json.dumps({**manifest, **change}))
        assert features_record(feats) != first, change
    assert features_record(tmp_path / "none") is None


def test_runs_control_stage_is_made_again_when_its_recipe_content_changes(tmp_path, monkeypatch):
    """`run`'s control stage records the recipe by content and the pr.* overrides (the stage itself: one minute of
    training, run by test_control's tests; here its command line is recorded, and its file written as it would be)."""
    from pr_specforge import pipeline

    shutil.copytree(pipeline.DEFAULT_RECIPE.parent, tmp_path / "recipes")
    recipe = tmp_path / "recipes" / pipeline.DEFAULT_RECIPE.name
    text = recipe.read_text()
    calls = []

    def call(self, command, main, argv):
        calls.append([str(a) for a in argv])
        (self.work / pipeline.CONTROL_JSON).write_text(json.dumps({"run": len(calls)}))
    monkeypatch.setattr(StageBuilder, "call", call)
    args = pipeline._parser().parse_args(["--workdir", str(tmp_path), "--recipe", str(recipe), "--skip-eval", "pr.gate_init_bias=-1"])

    def control():
        return [s for s in pipeline.stages(args, StageBuilder(tmp_path)) if s.name == "control"][0]
    run_stages([control()])
    run_stages([control()])
    assert len(calls) == 1 and calls[0][-1] == "--overwrite"
    recipe.write_text(text.replace("max_depth: 2", "max_depth: 1"))
    assert control().stale() == "recipe changed (pr.max_depth 2 -> 1)"
    run_stages([control()])
    assert len(calls) == 2 and json.loads((tmp_path / pipeline.CONTROL_JSON).read_text()) == {"run": 2}
    args.overrides = ["pr.gate_init_bias=-2"]
    assert "overrides changed" in control().stale()


def test_the_regime_records_what_its_diagnose_headroom_and_measures_were_made_from(tmp_path):
    from tests.helpers import load_benchmark

    regimes = load_benchmark("regimes")
    r = regimes.GSM8KRegime(regimes._parser().parse_args(["gsm8k", "--workdir", str(tmp_path), "--dry-run",
                                                          "--drafters", "pr-paper"]))
    stages = {s.name.split(": ")[1]: s for s in r.drafter_stages(0)}
    diag, head, measures = (stages[n].made_from() for n in ("diagnose", "headroom", "held-out measures"))
    checkpoint, feats = "seed0/runs/pr-paper's newest checkpoint", "features screen/features"
    assert set(diag) == set(head) == {checkpoint, feats, "seed"}
    assert set(measures) == {checkpoint, "seed0/diagnose/pr-paper.json", "seed0/headroom/pr-paper.json"}


def test_experiments_diagnose_is_made_again_after_the_run_is_trained_again(tmp_path, caplog):
    """End to end, with real trainings: the experiment's diagnose stage, its run trained again (same step, other
    weights): the diagnose JSON is the new checkpoint's, not the one the old weights gave."""
    from transformers import AutoModelForCausalLM

    from pr_specforge.experiment import Experiment, _parser
    from pr_specforge.training.diagnose import main as diagnose
    from pr_specforge.training.train import run_train
    from tests.helpers import write_features, write_workspace

    recipe = write_workspace(str(tmp_path / "ws"), strategy="pr", steps=3, pr_section={"max_depth": 2})
    exp = Experiment(_parser().parse_args(["--workdir", str(tmp_path / "work"), "--heldout", "3"]))
    write_features(AutoModelForCausalLM.from_pretrained(str(tmp_path / "ws" / "target")), str(exp.held / "features"),
                   n=3, seed=11)

    def train(seed):
        shutil.rmtree(exp.runs["pr"], ignore_errors=True)
        assert run_train(recipe, [f"output_dir={exp.runs['pr']}", f"training.seed={seed}"]) == 0
    train(0)
    shutil.copytree(exp.runs["pr"], exp.runs["eagle3"])  # the stage diagnoses both runs; this one stays as it is

    def stage():
        return [s for s in exp.seeded_stages() if s.name == "diagnose"][0]
    run_stages([stage()])
    first = json.loads(exp.diags["pr"].read_text())
    eagle3 = exp.diags["eagle3"].read_text()
    assert stage().done()

    train(1)
    assert not stage().done()
    with caplog.at_level(logging.WARNING, logger="pr_specforge.stages"):
        run_stages([stage()])
    assert "diagnose: runs/pr-seed0's newest checkpoint changed (sha256 " in caplog.text
    assert "eagle3-seed0" not in caplog.text  # only what changed is named
    fresh = tmp_path / "fresh.json"
    assert diagnose([str(exp.runs["pr"]), "--features", str(exp.held / "features"), "--json", str(fresh), "--seed", "0",
                     "--no-progress"]) == 0
    now = json.loads(exp.diags["pr"].read_text())
    assert now == json.loads(fresh.read_text()) and now["pr"] != first["pr"]
    assert exp.diags["eagle3"].read_text() == eagle3  # rewritten (--overwrite) from the same weights: the same
    assert stage().done()
