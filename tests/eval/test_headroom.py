"""`pr-specforge headroom`: exact buckets on hand-built logits; the command on a tiny real run
(run dir, checkpoint, HF export give the same report); bad input gets one line (rc 2)."""

import json
import math
import os
import shutil
import sys

import pytest
import torch

from pr_specforge.eval.headroom import Headroom
from pr_specforge.training.simulate import depth_rows, one_pass_rows
from tests.helpers import run_cli

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")

# per row: drafter distribution, target distribution, depth-1 distribution (4 tokens, all in the draft vocab)
ROWS = [
    ([0.95, 0.02, 0.02, 0.01], [0.95, 0.02, 0.02, 0.01], [0.9, 0.05, 0.03, 0.02]),  # accepted, c_d bucket 9
    ([0.55, 0.35, 0.06, 0.04], [0.03, 0.92, 0.03, 0.02], [0.2, 0.7, 0.06, 0.04]),  # reject at rank 2, recovered
    ([0.40, 0.30, 0.20, 0.10], [0.20, 0.10, 0.10, 0.60], [0.2, 0.1, 0.1, 0.6]),  # reject outside top 3, recovered
    ([0.05, 0.85, 0.06, 0.04], [0.05, 0.90, 0.03, 0.02], [0.1, 0.8, 0.06, 0.04]),  # accepted, bucket 8
    ([0.31, 0.27, 0.23, 0.19], [0.30, 0.20, 0.40, 0.10], [0.5, 0.2, 0.2, 0.1]),  # reject at rank 3, not recovered
    ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]),  # unscored
]


def _hand_built():
    drafter, target, depth1 = (torch.tensor([[r[i] for r in ROWS]]).log() for i in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    d2t = torch.zeros(4, dtype=torch.long)
    views = dict(target_p_on_draft=target.softmax(-1), target_token_ids=target.argmax(-1),
                 position_mask=mask[..., None], loss_mask=mask[..., None])
    h = Headroom(k=3)
    h.start(1, 1)
    q = torch.tensor([0.5, 0.5]).expand(1, 6, 2)
    h.add([one_pass_rows(d2t, h.topk, logits=drafter, **views)], {0: depth_rows(0, [drafter, depth1], q, d2t)})
    return h.report()


def test_headroom_buckets_on_hand_built_logits():
    rep = _hand_built()
    p = rep["pooled"]
    assert p["scored"] == 5 and p["accepted"] == 2 and p["acceptance"] == pytest.approx(0.4)
    counts = {r["bucket"]: (r["count"], r["accepted"]) for r in p["fig1a"] if r["count"]}
    assert counts == {"0.3-0.4": (1, 0), "0.4-0.5": (1, 0), "0.5-0.6": (1, 0), "0.8-0.9": (1, 1), "0.9-1.0": (1, 1)}
    f = p["fig1b"]
    assert f["rejects"] == 3 and f["oov_rejects"] == 0 and f["pool"] == 3
    third = pytest.approx(1 / 3)
    expected_cells = {(1, 2), (0, 1), (0, 0)}  # (c_d band, c_t band) of the three rejects
    for d in range(3):
        for t in range(3):
            assert f["shares"][d][t] == (third if (d, t) in expected_cells else 0.0)
    g = p["second_guess"]
    assert (g["misses"], g["rank2"], g["outside_topk"], g["recon_top1"], g["recon_only"]) == (
        3, third, third, pytest.approx(2 / 3), third)
    t7 = p["table7"]
    assert t7["recovered"][1][2] == 1.0 and t7["recovered"][0][1] == 1.0 and t7["recovered"][0][0] == 0.0
    assert t7["recovered"][0][3] == 0.5 and t7["recovered"][3][3] == pytest.approx(2 / 3)
    assert t7["recovered_at_halt"][1][2] == 0.5 and t7["recovered"][2][3] is None
    assert t7["delta_recovered"] == [None, pytest.approx(0.6 - 0.4), pytest.approx(0.7 - 0.55), pytest.approx(0.175)]
    assert t7["delta_not_recovered"] == [pytest.approx(0.5 - 0.31), None, None, pytest.approx(0.19)]
    assert rep["per_step"][0]["fig1b"] == p["fig1b"]  # one step: pooled == step 0


def _cli(*args, cwd):
    return run_cli(*args, cwd=cwd, env=ENV)


def _one_line_error(rc, out, *needles):
    assert rc == 2 and "Traceback" not in out, out[-2000:]
    line = [x for x in out.splitlines() if x.startswith("pr-specforge headroom:")]
    assert len(line) == 1 and all(n in line[0] for n in needles), out[-2000:]


def _train(root, strategy):
    from transformers import AutoModelForCausalLM

    from tests.helpers import write_features, write_workspace

    recipe = write_workspace(str(root), strategy=strategy, steps=2, pr_section={"max_depth": 2} if strategy == "pr" else None)
    held = root / "heldout"
    write_features(AutoModelForCausalLM.from_pretrained(str(root / "target")), str(held), n=3, seed=11)
    # SpecForge's eagle3 step feeds the (bf16) features to the drafter uncast: train it in bf16, as the recipes do
    dtype = ["model.torch_dtype=bfloat16"] if strategy == "eagle3" else []
    rc, out = _cli("train", "-c", recipe, "training.save_interval=2", *dtype, cwd=root)
    assert rc == 0, out[-3000:]
    return root / "out", held


def test_headroom_command_on_a_run_a_checkpoint_and_an_export(tmp_path):
    run, held = _train(tmp_path, "pr")
    rc, out = _cli("headroom", str(run), "--features", str(held), "--out", str(tmp_path / "rep" / "run"), "--no-progress",
                   cwd=tmp_path)
    assert rc == 0, out[-3000:]
    for suffix in (".md", ".json", "-acceptance.png", "-reject-pool.png"):
        assert (tmp_path / "rep" / f"run{suffix}").stat().st_size > 0
    rep = json.loads((tmp_path / "rep" / "run.json").read_text())
    md = (tmp_path / "rep" / "run.md").read_text()
    assert "95.6%" in md and "(17.7%)" in md and "Table 7" in md  # the paper's figures beside ours
    pooled = rep["pooled"]
    assert pooled["scored"] == sum(r["count"] for r in pooled["fig1a"]) > 0
    assert sum(s["scored"] for s in rep["per_step"]) == pooled["scored"] and len(rep["per_step"]) == 3
    assert math.isclose(sum(v for row in pooled["fig1b"]["shares"] for v in row), 1.0)
    assert rep["sim"]["sim/acc_len_one_pass"] == pytest.approx(rep["simulated_acc_len"], abs=1e-12)
    ckpt = next(run.glob("*-step2"))
    rc, out = _cli("headroom", str(ckpt), "--features", str(held), "--out", str(tmp_path / "rep" / "ckpt"),
                   "--no-progress", cwd=tmp_path)
    assert rc == 0, out[-3000:]
    assert json.loads((tmp_path / "rep" / "ckpt.json").read_text())["pooled"] == pooled
    rc, out = _cli("export", str(run), str(tmp_path / "hf"), "--to", "hf", "--target", str(tmp_path / "target"), cwd=tmp_path)
    assert rc == 0, out[-3000:]
    rc, out = _cli("headroom", str(tmp_path / "hf"), "--features", str(held), "--target", str(tmp_path / "target"),
                   "--ttt-length", "3", "--out", str(tmp_path / "rep" / "hf"), "--no-progress", cwd=tmp_path)
    assert rc == 0, out[-3000:]
    hf = json.loads((tmp_path / "rep" / "hf.json").read_text())
    assert hf["pooled"]["fig1a"] == pooled["fig1a"] and hf["pooled"]["fig1b"] == pooled["fig1b"]

    # bad input: one line each
    # an export records its target: no --target needed; one that records none (an older export) needs it
    legacy = tmp_path / "hf-legacy"
    shutil.copytree(tmp_path / "hf", legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg.pop("pr_specforge_target")
    (legacy / "config.json").write_text(json.dumps(cfg))
    rc, out = _cli("headroom", str(legacy), "--features", str(held), "--out", str(tmp_path / "x"), cwd=tmp_path)
    _one_line_error(rc, out, "--target")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "resolved_recipe.yaml", bare / "resolved_recipe.yaml")
    rc, out = _cli("headroom", str(bare), "--features", str(held), "--out", str(tmp_path / "x"), cwd=tmp_path)
    _one_line_error(rc, out, "no checkpoint")
    from tests.helpers import make_tiny_target, write_features

    other = make_tiny_target(str(tmp_path / "other-target"), hidden=32)
    write_features(other, str(tmp_path / "other-features"), n=2)
    rc, out = _cli("headroom", str(run), "--features", str(tmp_path / "other-features"), "--out", str(tmp_path / "x"),
                   cwd=tmp_path)
    _one_line_error(rc, out, "another target", "width")
    rc, out = _cli("headroom", str(run), "--features", str(held), "--k", "1", "--out", str(tmp_path / "x"), cwd=tmp_path)
    _one_line_error(rc, out, "--k")
    assert not (tmp_path / "x.json").exists()


def test_headroom_on_an_eagle3_drafter_omits_or_refuses_the_pr_tables(tmp_path):
    run, held = _train(tmp_path, "eagle3")
    rc, out = _cli("headroom", str(run), "--features", str(held), "--out", str(tmp_path / "e"), "--no-progress",
                   cwd=tmp_path)
    assert rc == 0, out[-3000:]
    rep = json.loads((tmp_path / "e.json").read_text())
    assert rep["pooled"]["table7"] is None and rep["pooled"]["second_guess"]["recon_top1"] is None
    assert "Table 7 and the reconsidered columns" in (tmp_path / "e.md").read_text()
    assert "sim/acc_len_pr" not in rep["sim"] and "sim/acc_len_width2" in rep["sim"]
    rc, out = _cli("headroom", str(run), "--features", str(held), "--pr-tables", "--out", str(tmp_path / "f"), cwd=tmp_path)
    _one_line_error(rc, out, "--pr-tables", "EAGLE-3")
    assert not (tmp_path / "f.json").exists()
    # issue 44: a --k above the draft vocabulary (48 tokens here) is refused before any forward
    rc, out = _cli("headroom", str(run), "--features", str(held), "--k", "49", "--out", str(tmp_path / "g"), cwd=tmp_path)
    _one_line_error(rc, out, "--k 49 is above the drafter's draft vocabulary of 48 tokens")
    assert not (tmp_path / "g.json").exists()



# ---- issue 43's audit rows (one block, for merging)
@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    from tests.helpers import smollm2_layout_run

    return smollm2_layout_run(tmp_path_factory.mktemp("tied"), _cli)


def test_headroom_measures_every_drafter_kind_of_a_tied_target(tied, tmp_path):
    """A run, its HF export and its SGLang export of a SmolLM2-layout target (no lm_head.weight in its index: SpecForge
    reads the tied embedding) are all measured; an export records its target by name and fingerprint, not by path, so
    features without a manifest take --target (checked against that fingerprint), and the run's TTT length."""
    held, target = str(tied["held"]), str(tied["target"])
    reports = {}
    for name, extra in (("run", []), ("hf", ["--target", target]), ("sglang", ["--target", target])):
        out = tmp_path / name  # an existing directory: written as DIR/headroom.*, never hidden DIR/.md
        out.mkdir()
        rc, log = _cli("headroom", str(tied[name]), "--features", held, "--out", f"{out}{os.sep}", "--no-progress",
                       *extra, cwd=tmp_path)
        assert rc == 0, log[-3000:]
        assert not (out / ".md").exists() and f"{out / 'headroom.md'}:" in log
        reports[name] = json.loads((out / "headroom.json").read_text())
    run, hf, sg = reports["run"], reports["hf"], reports["sglang"]
    assert run["pooled"]["scored"] > 0 and hf["pooled"]["fig1a"] == run["pooled"]["fig1a"]
    assert hf["pooled"]["table7"] is not None  # the HF export is the PR drafter
    # the SGLang export is what SGLang serves, plain EAGLE-3: the same positions, no reconsidered depths
    assert sg["strategy"] == "eagle3" and sg["pooled"]["table7"] is None
    assert sg["pooled"]["scored"] == run["pooled"]["scored"]


def test_headroom_audit_bad_inputs_answer_in_one_line(tied, tmp_path, capsys):
    from pr_specforge.eval.headroom import main
    from tests.helpers import drafter_bad_inputs

    for case, (argv, needles) in drafter_bad_inputs(tied).items():  # in process: an uncaught error fails the test
        try:
            rc = main([*argv, "--out", str(tmp_path / "x"), "--no-progress"])
        except SystemExit as e:  # argparse's refusals
            rc = e.code
        err = capsys.readouterr().err
        try:
            _one_line_error(rc, err, *needles)
        except AssertionError:
            raise AssertionError(f"{case}: {err[-1500:]}") from None
    assert not list(tmp_path.glob("x*"))  # a refused run writes nothing
    run, held, afile = str(tied["run"]), str(tied["held"]), tied["root"] / "draft.json"
    for argv, needles in (([run, "--features", held, "--out", str(afile / "h")], ("--out", "is a file, not a directory")),
                          ([run, "--features", held, "--out", str(tmp_path / "y"), "--k", "0"], ("--k must be at least 2",))):
        rc = main([*argv, "--no-progress"])
        _one_line_error(rc, capsys.readouterr().err, *needles)
    assert not list(tmp_path.glob("y*"))


def test_headroom_refuses_an_out_whose_files_exist_unless_overwrite(tied, tmp_path, capsys):
    """Any one of the four files --out PREFIX (or --out DIR/) writes, already there: one line naming it, before any
    work, the file left as it was and nothing else written; --overwrite replaces it."""
    from pr_specforge.eval.headroom import OUTPUTS, main

    run, held = str(tied["run"]), str(tied["held"])
    (tmp_path / "d").mkdir()
    for out, name in [*((str(tmp_path / f"z{i}"), f"z{i}{suffix}") for i, suffix in enumerate(OUTPUTS)),
                      (f"{tmp_path / 'd'}{os.sep}", f"d/headroom{OUTPUTS[-1]}")]:
        mine, before = tmp_path / name, set(tmp_path.rglob("*"))
        mine.write_text("a user's notes\n")
        rc = main([run, "--features", held, "--out", out, "--no-progress"])
        _one_line_error(rc, capsys.readouterr().err, f"--out {mine}: exists", "pass --overwrite")
        assert mine.read_text() == "a user's notes\n" and set(tmp_path.rglob("*")) == before | {mine}
    assert main([run, "--features", held, "--out", str(tmp_path / "z0"), "--limit", "1", "--no-progress", "--overwrite"]) == 0
    assert json.loads((tmp_path / "z0.json").read_text())["batches"] == 1
    assert all((tmp_path / f"z0{suffix}").stat().st_size > 0 for suffix in OUTPUTS)


def _whole_outputs(prefix):
    """PREFIX's outputs that exist, each checked whole: the JSON parses, the markdown names its positions, the PNGs
    end in their IEND chunk."""
    found = {}
    for suffix in (".json", ".md", "-acceptance.png", "-reject-pool.png"):
        path = prefix.parent / f"{prefix.name}{suffix}"
        if path.exists():
            data = path.read_bytes()
            if suffix == ".json":
                json.loads(data)
            elif suffix == ".md":
                assert data.rstrip().endswith(b"|") or data.endswith(b"\n"), data[-200:]
            else:
                assert data.startswith(b"\x89PNG") and data[-12:-4] == b"\x00\x00\x00\x00IEND", path
            found[suffix] = path
    return found


def test_headroom_killed_or_interrupted_mid_run_leaves_no_partial_file_and_the_rerun_completes(tied, tmp_path, capsys,
                                                                                               monkeypatch):
    """kill -9 once PREFIX.json is written (the other files mid-write or not yet), kill -9 a writer inside its
    write of PREFIX.md (its temp file left), Ctrl-C mid-forward: every output left is whole, the interrupt is one
    line; the same command refuses the files left in one line, and with --overwrite writes all four and removes the
    killed writer's temp file."""
    from pr_specforge.eval.headroom import main
    from tests.helpers import interrupted_run, kill_a_writer_mid_write, sigkill_when

    prefix = tmp_path / "h"
    argv = [str(tied["run"]), "--features", str(tied["held"]), "--out", str(prefix), "--no-progress"]
    sigkill_when([sys.executable, "-m", "pr_specforge.cli", "headroom", *argv], (tmp_path / "h.json").exists, env=ENV)
    assert ".json" in _whole_outputs(prefix)
    capsys.readouterr()
    _one_line_error(main(argv), capsys.readouterr().err, f"--out {prefix}.json: exists", "--overwrite")  # what it left
    argv.append("--overwrite")
    assert kill_a_writer_mid_write(tmp_path / "h.md", env=ENV)  # its temp file is left...
    _whole_outputs(prefix)  # ...and h.md, if the killed run wrote it, is still whole
    assert "rerun the same command" in interrupted_run(main, argv, capsys, monkeypatch, "headroom")
    assert main(argv) == 0
    assert set(_whole_outputs(prefix)) == {".json", ".md", "-acceptance.png", "-reject-pool.png"}
    assert json.loads((tmp_path / "h.json").read_text())["pooled"]["scored"] > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the killed writer's temp file is gone
