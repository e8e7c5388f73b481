"""`pr-specforge diagnose` reproduces SpecForge's own held-out eval loop and adds PR's per-depth metrics."""

import json
import os
import sys

import pytest
import yaml

from tests.helpers import run_cli, write_features, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def _cli(*args, cwd):
    return run_cli(*args, cwd=cwd, env=ENV)


@pytest.mark.parametrize("strategy", ["pr", "eagle3"])
def test_diagnose_matches_specforges_eval_loop_on_the_same_checkpoint(tmp_path, strategy):
    from transformers import AutoModelForCausalLM

    recipe = write_workspace(str(tmp_path), strategy=strategy, steps=4,
                             pr_section={"max_depth": 2} if strategy == "pr" else None)
    held = tmp_path / "heldout"
    write_features(AutoModelForCausalLM.from_pretrained(str(tmp_path / "target")), str(held), n=5, seed=11)
    # bf16 weights, as the SmolLM2 recipes train: SpecForge's eagle3 eval loop feeds bf16 features uncast
    rc, out_train = _cli("train", "-c", recipe, "training.save_interval=4",
                          "model.torch_dtype=bfloat16",
                          f"data.eval_hidden_states_path={held}", "training.eval_interval=4", cwd=tmp_path)
    assert rc == 0, out_train[-3000:]
    resolved = yaml.safe_load((tmp_path / "out" / "resolved_recipe.yaml").read_text())
    assert ("pr" in resolved) == (strategy == "pr")  # an eagle3 run's resolved recipe reloads as eagle3
    evals = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl") if '"eval/' in line]
    assert [e["step"] for e in evals] == [4]
    rc, out = _cli("diagnose", str(tmp_path / "out"), "--features", str(held),
                    "--json", str(tmp_path / "diag.json"), "--no-progress", cwd=tmp_path)
    assert rc == 0, out[-3000:]
    diag = json.loads((tmp_path / "diag.json").read_text())
    assert diag["checkpoint"].endswith("step4") and diag["batches"] == 5
    spec = [evals[0][f"eval/per_position_acc/{j}"] for j in range(3)]
    assert diag["one_pass_acc"] == pytest.approx(spec, abs=1e-9)
    assert diag["simulated_acc_len"] == pytest.approx(evals[0]["eval/simulated_acc_len"], abs=1e-9)
    # the acceptance simulator at the eval interval: its one-pass chain is SpecForge's own number
    assert evals[0]["sim/acc_len_one_pass"] == evals[0]["eval/simulated_acc_len"]
    assert evals[0]["sim/acc_len_width2"] >= evals[0]["sim/acc_len_one_pass"]
    assert ("sim/acc_len_pr" in evals[0]) == (strategy == "pr")
    for key in ("sim/acc_len_one_pass", "sim/acc_len_width2"):  # the same checkpoint on the same features
        assert diag["sim"][key] == pytest.approx(evals[0][key], abs=1e-9)
    if strategy == "pr":
        assert diag["sim"]["sim/acc_len_pr"] >= diag["sim"]["sim/acc_len_one_pass"]
    assert "sim len one_pass/width2" in out_train and "width2" in out
    if strategy == "pr":
        pr = diag["pr"]
        assert sum(pr[f"pr/depth_marginal_{r}"] for r in range(3)) == pytest.approx(1.0)
        assert sum(pr[f"pr/conf_share_{b}"] for b in ("conf_lt50", "conf_50to90", "conf_ge90")) == pytest.approx(1.0)
        assert 0.0 <= pr["pr/recovered_share"] <= 1.0
        assert "depth 2" in out and "recovered share" in out
        # before serving: how far depth r's feature moved from depth 0's, and how often its top-1 is depth 0's
        assert all(pr[f"pr/feature_change_depth_{r}"] > 0 and 0 <= pr[f"pr/argmax_agree_depth_{r}"] <= 1 for r in (1, 2))
        assert "||f^r-f^0||/||f^0||" in out and "argmax = depth 0's" in out
    else:
        assert diag["pr"] == {}


def test_diagnose_names_a_missing_run_or_feature_directory(tmp_path):
    rc, out = _cli("diagnose", str(tmp_path / "nope"),
                    "--features", str(tmp_path), cwd=tmp_path)
    assert rc != 0 and "no resolved_recipe.yaml" in out and "Traceback" not in out
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "resolved_recipe.yaml").write_text("{}")
    rc, out = _cli("diagnose", str(tmp_path / "run"),
                    "--features", str(tmp_path / "nofeatures"), cwd=tmp_path)
    assert rc == 2 and "--features" in out and "not a directory" in out and "Traceback" not in out


# ---- issue 43's audit rows (one block, for merging)
@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    from tests.helpers import smollm2_layout_run

    return smollm2_layout_run(tmp_path_factory.mktemp("tied"), _cli)


def test_diagnose_on_the_exports_of_a_tied_target_matches_the_run(tied, tmp_path):
    """HF and SGLang exports of a SmolLM2-layout target (no lm_head.weight in its index) are diagnosed; the HF
    export (the same PR drafter) gives the run's numbers; the SGLang one is the EAGLE-3 drafter SGLang serves."""
    held = str(tied["held"])
    got = {}
    # an export names its target by fingerprint, not path: features without a manifest need --target
    for name, extra in (("run", []), ("hf", ["--target", str(tied["target"])]), ("sglang", ["--target", str(tied["target"])])):
        rc, out = _cli("diagnose", str(tied[name]), "--features", held, "--json", str(tmp_path / f"{name}.json"),
                       "--no-progress", *extra, cwd=tmp_path)
        assert rc == 0, out[-3000:]
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert got["hf"]["one_pass_acc"] == pytest.approx(got["run"]["one_pass_acc"], abs=1e-9)
    # the export carries the run's objective settings (and TTT length): the same PR metrics
    assert got["hf"]["pr"] == got["run"]["pr"] and sum(got["hf"]["pr"][f"pr/depth_marginal_{r}"] for r in range(3)) == pytest.approx(1.0)
    assert got["sglang"]["strategy"] == "eagle3" and got["sglang"]["pr"] == {}
    assert got["sglang"]["positions"] == got["run"]["positions"]


def test_diagnose_audit_bad_inputs_answer_in_one_line(tied, capsys):
    from pr_specforge.training.diagnose import main
    from tests.helpers import drafter_bad_inputs

    run, held, afile = str(tied["run"]), str(tied["held"]), tied["root"] / "draft.json"
    kept = afile.read_bytes()
    own = {"--json naming a directory": ([run, "--features", held, "--json", str(tied["root"])], ("--json", "is a directory; name a file")),
           "--json under a file": ([run, "--features", held, "--json", str(afile / "d.json")], ("--json", "is a file, not a directory")),
           "--json naming a file that exists": ([run, "--features", held, "--json", str(afile)],
                                                (f"--json {afile}: exists", "pass --overwrite"))}
    for case, (argv, needles) in {**drafter_bad_inputs(tied), **own}.items():  # in process: an uncaught error fails the test
        try:
            rc = main([*argv, "--no-progress"])
        except SystemExit as e:  # argparse's refusals
            rc = e.code
        out = capsys.readouterr().err
        lines = [x for x in out.splitlines() if x.startswith("pr-specforge diagnose:")]
        assert rc == 2 and "Traceback" not in out and len(lines) == 1, f"{case}: {out[-1500:]}"
        assert all(n in lines[0] for n in needles), f"{case}: {lines[0]}"
    assert afile.read_bytes() == kept  # the user's file is left as it was


def test_diagnose_overwrite_replaces_an_existing_json(tied, tmp_path, capsys):
    from pr_specforge.training.diagnose import main

    out = tmp_path / "d.json"
    out.write_text("a user's notes\n")
    argv = [str(tied["run"]), "--features", str(tied["held"]), "--json", str(out), "--no-progress", "--limit", "1"]
    assert main(argv) == 2 and out.read_text() == "a user's notes\n"
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads(out.read_text())["batches"] == 1


def test_diagnose_interrupted_writes_no_json_and_the_rerun_cleans_a_killed_writers_temp(tied, tmp_path, capsys, monkeypatch):
    """Ctrl-C mid-forward: one line, exit 130, no --json file; a writer of it killed mid-write leaves its temp
    file; the same command again writes the JSON whole and removes that temp file."""
    from pr_specforge.training.diagnose import main
    from tests.helpers import interrupted_run, kill_a_writer_mid_write

    out = tmp_path / "d.json"
    argv = [str(tied["run"]), "--features", str(tied["held"]), "--json", str(out), "--no-progress"]
    interrupted_run(main, argv, capsys, monkeypatch, "diagnose")
    assert not out.exists()
    assert kill_a_writer_mid_write(out, env=ENV) and not out.exists()
    import socket

    live = tmp_path / f".d.json.{socket.gethostname()}-{os.getpid()}.x.tmp"  # a live writer's (this process) is kept
    live.write_text("in flight")
    assert main(argv) == 0
    assert json.loads(out.read_text())["batches"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d.json", live.name])


def test_diagnose_and_headroom_measure_the_same_samples_on_a_run_and_its_export(tied, tmp_path, capsys):
    """Issue 58: the run's recipe seeded the held-out sampler with its training.seed (0), an export's rebuilt recipe
    with SpecForge's default (42), so with --limit they read other samples (0.222 against 0.356 at step 0). Both now
    seed it with --seed."""
    from pr_specforge.eval.headroom import main as headroom
    from pr_specforge.training.diagnose import main as diagnose

    held, target = str(tied["held"]), str(tied["target"])
    for limit in ("1", "2"):
        got, pooled = {}, {}
        for name, extra in (("run", []), ("hf", ["--target", target, "--ttt-length", "3"])):
            out = tmp_path / f"{name}-{limit}"
            assert diagnose([str(tied[name]), "--features", held, "--limit", limit, "--json", f"{out}.json",
                             "--no-progress", *extra]) == 0
            got[name] = json.loads(open(f"{out}.json").read())
            assert headroom([str(tied[name]), "--features", held, "--limit", limit, "--out", f"{out}-h",
                             "--no-progress", *extra]) == 0
            pooled[name] = json.loads(open(f"{out}-h.json").read())["pooled"]
        capsys.readouterr()
        for key in ("positions", "one_pass_acc", "pr_counts", "sim"):
            assert got["hf"][key] == got["run"][key], (limit, key)
        assert pooled["hf"] == pooled["run"], limit
