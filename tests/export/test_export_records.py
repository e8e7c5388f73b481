"""Issue 63: an export records what it holds (the dtype of its tensors, the run's settings that `diagnose` /
`headroom` rebuild it with, its target by name and fingerprint, never a path), so both commands give a run's numbers
on its exports with default flags, and its fingerprint does not depend on the directory it was made in."""

import json
import os
import shutil

import pytest

from tests.helpers import run_cli, write_features, write_manifest_of, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def _bf16_run(root, strategy):
    """A 2-step bf16 run (TTT 4, batch 2: neither a default), its held-out features (their manifest names the
    target, as `data hidden-states` writes it) and its HF and SGLang exports."""
    from transformers import AutoModelForCausalLM

    recipe = write_workspace(str(root), strategy=strategy, steps=2, pr_section={"max_depth": 2} if strategy == "pr" else None,
                             extra={"model": {"torch_dtype": "bfloat16"}, "training": {"ttt_length": 4, "batch_size": 2}})
    write_features(AutoModelForCausalLM.from_pretrained(str(root / "target")), str(root / "held"), n=4, seed=11)
    write_manifest_of(str(root / "held"), str(root / "target"))
    for argv in (["train", "-c", recipe, "training.save_interval=2"],
                 ["export", str(root / "out"), str(root / "hf"), "--to", "hf", "--target", str(root / "target")],
                 ["export", str(root / "out"), str(root / "sglang"), "--to", "sglang", "--target", str(root / "target")]):
        rc, out = run_cli(*argv, cwd=root, env=ENV)
        assert rc == 0, out[-3000:]
    return root


@pytest.fixture(scope="module")
def pr_bf16(tmp_path_factory):
    return _bf16_run(tmp_path_factory.mktemp("pr_bf16"), "pr")


@pytest.fixture(scope="module")
def eagle3_bf16(tmp_path_factory):
    return _bf16_run(tmp_path_factory.mktemp("eagle3_bf16"), "eagle3")


def _measure(root, name, tmp_path, capsys):
    """`diagnose` and `headroom` with default flags on `root/name`: (diagnose's metrics, headroom's pooled counts)."""
    from pr_specforge.eval.headroom import main as headroom
    from pr_specforge.training.diagnose import main as diagnose

    out = tmp_path / name
    assert diagnose([str(root / name), "--features", str(root / "held"), "--json", f"{out}.json", "--no-progress"]) == 0
    assert headroom([str(root / name), "--features", str(root / "held"), "--out", f"{out}-h", "--no-progress"]) == 0
    capsys.readouterr()
    got = json.loads(open(f"{out}.json").read())
    return {k: v for k, v in got.items() if k not in ("run", "checkpoint")}, json.loads(open(f"{out}-h.json").read())["pooled"]


def test_diagnose_and_headroom_on_a_bf16_pr_run_and_its_exports_give_identical_numbers(pr_bf16, tmp_path, capsys):
    """The HF export is the PR drafter: every metric equal. The SGLang export is the EAGLE-3 drafter SGLang serves:
    its one-pass chain (depth 0) is the run's, at the run's TTT length."""
    run, run_pooled = _measure(pr_bf16, "out", tmp_path, capsys)
    hf, hf_pooled = _measure(pr_bf16, "hf", tmp_path, capsys)
    sglang, _ = _measure(pr_bf16, "sglang", tmp_path, capsys)
    assert len(run["one_pass_acc"]) == 4 and run["pr"]  # the run's TTT length, not SpecForge's 7
    assert hf == run and hf_pooled == run_pooled
    assert sglang["strategy"] == "eagle3"
    for key in ("positions", "batches", "one_pass_acc", "simulated_acc_len"):
        assert sglang[key] == run[key], key


def test_diagnose_and_headroom_on_a_bf16_eagle3_run_and_its_exports_give_identical_numbers(eagle3_bf16, tmp_path, capsys):
    run = _measure(eagle3_bf16, "out", tmp_path, capsys)
    assert len(run[0]["one_pass_acc"]) == 4
    for name in ("hf", "sglang"):
        assert _measure(eagle3_bf16, name, tmp_path, capsys) == run, name


def test_an_export_records_its_dtype_the_runs_settings_and_its_target_by_name_never_a_path(pr_bf16):
    from safetensors import safe_open

    from pr_specforge.data.io import dir_fingerprint
    from pr_specforge.export import RUN_RECORD_KEY

    for name, key in (("hf", "dtype"), ("sglang", "torch_dtype")):
        text = (pr_bf16 / name / "config.json").read_text()
        cfg = json.loads(text)
        with safe_open(str(pr_bf16 / name / "model.safetensors"), framework="pt") as f:
            dtypes = {str(f.get_tensor(k).dtype) for k in f.keys() if f.get_tensor(k).is_floating_point()}
        assert dtypes == {"torch.bfloat16"} and cfg[key] == "bfloat16", name
        assert str(pr_bf16) not in text and "/target" not in text, name  # no path of this machine
        target = cfg["pr_specforge_target"]
        assert target["name"] == "target" and target["fingerprint"] == dir_fingerprint(str(pr_bf16 / "target"))
        run = cfg[RUN_RECORD_KEY]
        assert (run["ttt_length"], run["batch_size"], run["torch_dtype"], run["pr"]["max_depth"]) == (4, 2, "bfloat16", 2)


def test_an_export_rebuilt_in_another_directory_has_the_same_fingerprint(pr_bf16, tmp_path):
    """Another target directory (same files) and another OUT_DIR: the same fingerprint. An export made before
    targets were recorded by name (its target's path inside) keeps the fingerprint it was recorded with as its
    legacy one, and its current one is the rebuild's."""
    from pr_specforge.export import export_fingerprints

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(pr_bf16 / "target", elsewhere / "model")
    rc, out = run_cli("export", str(pr_bf16 / "out"), str(elsewhere / "hf"), "--to", "hf", "--target",
                      str(elsewhere / "model"), cwd=tmp_path, env=ENV)
    assert rc == 0, out[-3000:]
    here, there = export_fingerprints(str(pr_bf16 / "hf")), export_fingerprints(str(elsewhere / "hf"))
    assert here[0] == there[0]
    old = tmp_path / "old-export"
    shutil.copytree(pr_bf16 / "hf", old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["pr_specforge_target"]["path"] = "/home/someone/target"
    del cfg["pr_specforge_run"]
    (old / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    legacy = export_fingerprints(str(old))
    assert legacy[0] == here[0] and legacy[1] != here[1]
    (old / "model.safetensors").write_bytes((old / "model.safetensors").read_bytes()[:-1] + b" ")  # other weights
    assert export_fingerprints(str(old))[0] != here[0]


def test_eval_and_the_study_accept_a_legacy_fingerprint_and_record_the_current_one(pr_bf16, tmp_path):
    """Rows kept under the fingerprint an export had as files (with its target's path inside) still resume, and the
    record is migrated to the current fingerprint; another drafter under that name is still refused."""
    import sys

    from pr_specforge.eval.evaluator import LEGACY_DRAFTERS, PROVENANCE_FILE, check_out_dir
    from pr_specforge.export import export_fingerprints

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from study.regime_keep import kept_fingerprint_check

    current_fp, as_files = export_fingerprints(str(pr_bf16 / "hf"))
    legacy = "0123456789abcdef"
    out = tmp_path / "eval"
    out.mkdir()
    (out / PROVENANCE_FILE).write_text(json.dumps({"shared": {"k": 6}, "drafters": {"pr": legacy}, "target_weights": "t"}))
    current = {"shared": {"k": 6}, "drafters": {"pr": current_fp}, "target_weights": "t", LEGACY_DRAFTERS: {"pr": legacy}}
    check_out_dir(str(out), current)
    record = json.loads((out / PROVENANCE_FILE).read_text())
    assert record["drafters"] == {"pr": current_fp} and LEGACY_DRAFTERS not in record
    with pytest.raises(ValueError, match="drafter 'pr' there was made from other files"):
        check_out_dir(str(out), {**current, "drafters": {"pr": "fedcba9876543210"}, LEGACY_DRAFTERS: {"pr": legacy}})
    sd = tmp_path / "seed0"
    (sd / "report-b48").mkdir(parents=True)
    (sd / "report-b48" / "eval_config.json").write_text(json.dumps({"drafters": {"pr": as_files}}))
    kept_fingerprint_check(sd, "pr", pr_bf16 / "hf", sd / "fingerprints" / "pr.json")
    assert json.loads((sd / "fingerprints" / "pr.json").read_text())["fingerprint"] == current_fp


def test_an_export_stage_is_done_only_for_the_runs_newest_checkpoint(pr_bf16, tmp_path):
    """`run`'s, `experiment`'s and the study's export stage: an export of other weights (the training ran again) is
    made again, not reused."""
    from pr_specforge.export import export_is_of
    from pr_specforge.stages import StageBuilder
    from pr_specforge.training.preflight import latest_checkpoint

    ckpt = latest_checkpoint(pr_bf16 / "out")
    assert StageBuilder(pr_bf16).export_done(pr_bf16 / "out", pr_bf16 / "hf", pr_bf16 / "sglang")
    again = tmp_path / "again" / os.path.basename(ckpt)
    shutil.copytree(ckpt, again)
    assert export_is_of(str(pr_bf16 / "hf"), str(again))  # the same checkpoint's content
    with open(again / "training_state.pt", "ab") as f:
        f.write(b"\0")  # retrained: other content under the same name
    assert not export_is_of(str(pr_bf16 / "hf"), str(again))
    assert not StageBuilder(tmp_path).export_done(tmp_path / "no-run", pr_bf16 / "hf")


def test_an_eval_stage_is_done_only_when_its_rows_were_served_by_these_exports(pr_bf16, tmp_path):
    from pr_specforge.export import export_fingerprints
    from pr_specforge.stages import StageBuilder

    out = tmp_path / "eval"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    stage = StageBuilder(tmp_path).eval_stage("evaluate", out, drafts={"pr": pr_bf16 / "hf"})
    assert not stage.done()  # no record of who served it
    (out / "eval_config.json").write_text(json.dumps({"drafters": {"pr": "0123456789abcdef"}}))
    assert not stage.done()  # served by other weights: run again (eval refuses those rows in one line)
    (out / "eval_config.json").write_text(json.dumps({"drafters": {"pr": export_fingerprints(str(pr_bf16 / "hf"))[1]}}))
    assert stage.done()  # a legacy record of this export is its own


def test_a_warm_started_runs_record_keeps_its_settings_and_not_the_path_it_started_from():
    """Issue 73: `pr.init_from=/abs/path` never reaches an export's config.json; the rebuild of the objective from the
    record (`diagnose`, `headroom`) still validates, with `freeze_one_pass` (which needs init_from) left out too."""
    from pr_specforge.config import PRConfig
    from pr_specforge.export_records import run_record

    recipe = {"pr": {"max_depth": 2, "init_from": "/abs/machine/path/eagle3-step3", "freeze_one_pass": True}}
    record = run_record(recipe, "pr")
    assert "/abs/machine" not in json.dumps(record)
    assert record["pr"] == {"max_depth": 2} and record["warm_start"] == {"freeze_one_pass": True}
    assert PRConfig.from_mapping(record["pr"], where="record").max_depth == 2
    assert "warm_start" not in run_record({"pr": {"max_depth": 2}}, "pr")
