"""`pr-specforge train` end to end: SpecForge's trainer, gloo/DDP on 2 ranks under torchrun."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss [0-9.]+  acc0 [0-9.]+", re.M)


def _steps(out_dir, skip=0):
    """{step: metrics row} of the run's metrics.jsonl, from its `skip`-th line on (a resumed run appends)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f.read().splitlines()[skip:]]
    return {r["step"]: r for r in rows}


def _run(args, cwd, timeout=300):
    proc = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "pr_specforge.cli", "train", *args]


@pytest.mark.slow
def test_torchrun_two_ranks_trains_checkpoints_and_resumes(tmp_path):
    recipe = write_workspace(str(tmp_path), steps=16, nproc=2, pr_section={"max_depth": 2, "balance_coef": 0.01}, n=4)
    rc, out = _run(_torchrun(2, "-c", recipe, "training.save_interval=8", "training.num_epochs=20"), tmp_path)
    assert rc == 0, out[-4000:]
    outdir = tmp_path / "out"
    steps = _steps(outdir)
    assert sorted(steps)[-1] == 16, sorted(steps)
    # the console: one short line per logged step (rank 0 only), not SpecForge's whole metrics dict
    assert [int(m.group(1)) for m in STEP_LINE.finditer(out)] == list(range(1, 17)) and "{'" not in out, out[-3000:]
    # each rank sees the same 2 samples every 2 steps: compare like with like
    first = sum(steps[s]["pr/loss_total"] for s in (1, 2, 3, 4)) / 4
    last = sum(steps[s]["pr/loss_total"] for s in (13, 14, 15, 16)) / 4
    assert last < first, (first, last)
    for r in range(3):
        assert 0.0 < steps[16][f"pr/depth_marginal_{r}"] < 1.0
    assert (outdir / "specforge-run-step16").is_dir() and (outdir / "specforge-run-step8").is_dir()
    resolved = yaml.safe_load((outdir / "resolved_recipe.yaml").read_text())
    assert resolved["pr"]["max_depth"] == 2 and resolved["training"]["strategy"] == "pr"

    # Resume from the step-8 checkpoint (SpecForge refuses a changed schedule): the log continues at step 9.
    rc, out2 = _run(_torchrun(2, "-c", recipe, "training.save_interval=8",
                              "training.num_epochs=20", f"training.resume_from={outdir / 'specforge-run-step8'}"), tmp_path)
    assert rc == 0, out2[-4000:]
    resumed = _steps(outdir, skip=16)
    assert min(resumed) == 9 and max(resumed) == 16, sorted(resumed)
    # The resumed run reproduces the original run's steps 9..16 (same data order, same weights).
    for s in range(9, 17):
        assert abs(resumed[s]["ploss_0"] - steps[s]["ploss_0"]) < 1e-3 * max(1.0, abs(steps[s]["ploss_0"])), s


def test_single_process_train_runs_in_process(tmp_path):
    recipe = write_workspace(str(tmp_path), steps=3, pr_section={"max_depth": 1})
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "training.save_interval=0"], tmp_path)
    assert rc == 0, out[-4000:]
    assert sorted(_steps(tmp_path / "out")) == [1, 2, 3]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_ws")
    return write_workspace(str(root), steps=3, pr_section={"max_depth": 1})


def _root(recipe):
    return os.path.dirname(recipe)


def _write_map(tmp, name, mapping):
    import torch

    torch.save(mapping, tmp / name)
    return [f"model.vocab_mapping_path={tmp / name}"]


def _own_map(recipe):
    import torch

    return torch.load(os.path.join(_root(recipe), "features", "vocab_mapping", "vocab_mapping.pt"))


def _draft_edit(**fields):
    def edit(recipe, tmp):
        draft = json.loads(open(os.path.join(_root(recipe), "draft.json")).read())
        draft.update(fields)
        (tmp / "draft.json").write_text(json.dumps(draft))
        return [f"model.draft_model_config={tmp / 'draft.json'}"]
    return edit


def _features_copy(recipe, tmp, corrupt=None, manifest=None):
    import shutil

    feats = tmp / "features"
    shutil.copytree(os.path.join(_root(recipe), "features"), feats)
    if corrupt is not None:
        victim = sorted(feats.glob("rows_*/data_*.ckpt"))[corrupt]
        victim.write_bytes(victim.read_bytes()[:200])
    if manifest is not None:
        (feats / "manifest.json").write_text(json.dumps(manifest))
    return feats


def _other_run_map(recipe, tmp):
    """A map of the same sizes from another run, while the features' manifest records their own map."""
    import torch

    from pr_specforge.data.vocab import vocab_fingerprint

    own = _own_map(recipe)
    feats = _features_copy(recipe, tmp, manifest={"status": "complete", "vocab_fingerprint": vocab_fingerprint(own)})
    other = {"t2d": own["t2d"].roll(1), "d2t": None}
    ids = torch.nonzero(other["t2d"]).flatten()
    other["d2t"] = ids - torch.arange(len(ids))
    return [f"data.hidden_states_path={feats}", *_write_map(tmp, "other.pt", other)]


def _drafter_of_another_shape(recipe, tmp):
    """An HF EAGLE-3 drafter directory whose MLP is twice the draft config's width."""
    from transformers import LlamaConfig

    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    cfg = json.loads(open(os.path.join(_root(recipe), "draft.json")).read())
    cfg["intermediate_size"] *= 2
    LlamaForCausalLMEagle3PR(build_pr_config(LlamaConfig.from_dict(cfg), PRDraftSettings(max_depth=1))).save_pretrained(
        tmp / "wide")
    return [f"pr.init_from={tmp / 'wide'}"]


#: every class of bad `train` input caught before the first step: (edit -> extra overrides, the one-line error)
BAD_INPUTS = {
    "unknown pr key": (lambda r, t: ["pr.bogus=1"], "unknown key"),
    "pr.max_depth below 0": (lambda r, t: ["pr.max_depth=-1"], "pr.max_depth"),
    "pr.max_depth above the cap": (lambda r, t: ["pr.max_depth=9"], "pr.max_depth"),
    "negative pr.balance_coef": (lambda r, t: ["pr.balance_coef=-0.1"], "pr.balance_coef"),
    "training.batch_size 0": (lambda r, t: ["training.batch_size=0"], "training.batch_size"),
    "override of a field that does not exist": (lambda r, t: ["training.max_stepz=5"], "no field 'max_stepz'"),
    "pr section on the eagle3 strategy": (lambda r, t: ["training.strategy=eagle3"], "training.strategy=pr"),
    "features of another target width": (_draft_edit(target_hidden_size=96), "aux_hidden_state width 192"),
    "draft config that is not EAGLE-3": (_draft_edit(architectures=["Qwen3ForCausalLM"]), "strategy does not train"),
    "corrupt first feature file": (lambda r, t: [f"data.hidden_states_path={_features_copy(r, t, corrupt=0)}"],
                                   "does not load"),
    "features whose preparation did not finish": (
        lambda r, t: [f"data.hidden_states_path={_features_copy(r, t, manifest={'status': 'in_progress'})}"],
        "did not finish"),
    "target directory without config.json": (lambda r, t: (t / "empty").mkdir() or [f"model.target_model_path={t / 'empty'}"],
                                              "no config.json"),
    "target that does not exist": (lambda r, t: [f"model.target_model_path={t / 'nowhere'}"], "does not exist"),
    "missing vocab map": (lambda r, t: [f"model.vocab_mapping_path={t / 'none.pt'}"], "does not exist"),
    "vocab map that is not a map": (lambda r, t: _write_map(t, "x.pt", [1, 2]), "not a vocab map"),
    "truncated vocab map": (lambda r, t: (t / "cut.pt").write_bytes(b"PK\x03\x04") and [f"model.vocab_mapping_path={t / 'cut.pt'}"],
                            "not a readable vocab map"),
    "vocab map of another draft size": (
        lambda r, t: _write_map(t, "small.pt", {"t2d": _own_map(r)["t2d"], "d2t": _own_map(r)["d2t"][:40]}),
        "d2t has 40 entries but the draft vocab size is 48"),
    "empty vocab map": (lambda r, t: _write_map(t, "empty.pt", {"t2d": _own_map(r)["t2d"] & False,
                                                                "d2t": _own_map(r)["d2t"][:0]}), "empty vocab map"),
    "vocab map of another run, same sizes": (_other_run_map, "is not the map the features"),
    "pr.gate_init_bias NaN": (lambda r, t: ["pr.gate_init_bias=.nan"], "pr.gate_init_bias: expected a finite number"),
    "pr.balance_coef inf": (lambda r, t: ["pr.balance_coef=.inf"], "pr.balance_coef: expected a finite number"),
    "training.learning_rate inf": (lambda r, t: ["training.learning_rate=inf"],
                                   "training.learning_rate: expected a finite number"),
    "pr.init_from a path that does not exist": (lambda r, t: [f"pr.init_from={t / 'nowhere'}"], "no such file"),
    "pr.init_from a directory that is not a drafter": (lambda r, t: (t / "notes").mkdir() or [f"pr.init_from={t / 'notes'}"],
                                                       "neither an HF drafter directory"),
    "pr.init_from tensors of another shape": (_drafter_of_another_shape, "tensor shapes differ from the draft config"),
    "pr.freeze_one_pass without pr.init_from": (lambda r, t: ["pr.freeze_one_pass=true"], "without pr.init_from"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_naming_the_field(workspace, tmp_path, capsys, case):
    from pr_specforge.cli import main

    edit, needle = BAD_INPUTS[case]
    assert main(["train", "-c", workspace, *edit(workspace, tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_held_out_eval_features_are_checked_before_training(tmp_path):
    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=1)
    feats = str(tmp_path / "features")
    base = [sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "--dry-run", "training.eval_interval=1"]
    rc, out = _run([*base, f"data.eval_hidden_states_path={tmp_path / 'nowhere'}", "model.torch_dtype=bfloat16"],
                   tmp_path)
    assert rc == 2 and "data.eval_hidden_states_path" in out and "not a directory" in out and "Traceback" not in out
    # bf16 features + fp32 weights would fail inside SpecForge's eagle3 training and eval loops at the first step
    rc, out = _run([*base, f"data.eval_hidden_states_path={feats}"], tmp_path)
    assert rc == 2 and "model.torch_dtype=bfloat16" in out and "Traceback" not in out, out[-2000:]
    rc, out = _run([*base, f"data.eval_hidden_states_path={feats}", "model.torch_dtype=bfloat16"], tmp_path)
    assert rc == 0, out[-2000:]


def test_pr_strategy_defaults_to_sdpa_and_refuses_an_explicit_other_backend(tmp_path):
    from pr_specforge.config import ConfigError
    from pr_specforge.training.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"target_model_path": "t"}, "data": {"hidden_states_path": "f"},
                                    "training": {"strategy": "pr"}}))
    assert load_recipe(str(path)).config.training.attention_backend == "sdpa"
    with pytest.raises(ConfigError, match="training.attention_backend=sdpa"):
        load_recipe(str(path), ["training.attention_backend=flex_attention"])


@pytest.fixture
def clean_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_rerun_resumes_start_over_discards_ctrl_c_and_bad_files_are_one_line(workspace, tmp_path, capsys, clean_env,
                                                                            monkeypatch):
    import signal
    import time

    from pr_specforge.cli import main
    from pr_specforge.training.telemetry import MetricsSink

    out = tmp_path / "out"
    cmd = ["train", "-c", workspace, f"output_dir={out}", "training.save_interval=1"]
    assert main(cmd) == 0
    first = (out / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 3
    # the same command again: resumes at the finished step 3 (no step redone, no checkpoint rewound)
    assert main(cmd) == 0
    assert (out / "metrics.jsonl").read_text().splitlines() == first
    assert sorted(p.name for p in out.glob("specforge-run-step*")) == [f"specforge-run-step{s}" for s in (1, 2, 3)]
    # ...a larger training.max_steps cannot resume its schedule: one line saying how to train longer
    capsys.readouterr()
    assert main([*cmd, "training.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "trained with training.max_steps=3" in err, err
    assert f"model.draft_checkpoint_path={out / 'specforge-run-step3'}" in err and "--start-over" in err, err
    assert (out / "metrics.jsonl").read_text().splitlines() == first
    # --start-over discards them and trains from step 0
    started = time.time()
    assert main([*cmd, "--start-over"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["time"] >= started for r in rows)

    # Ctrl-C at step 3 (before its checkpoint): one line naming the newest checkpoint kept
    original = MetricsSink.__call__

    def interrupt_at_3(self, metrics, step):
        original(self, metrics, step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(MetricsSink, "__call__", interrupt_at_3)
    capsys.readouterr()
    assert main([*cmd, "--start-over"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "newest: specforge-run-step2" in err and "rerun the same command" in err, err
    monkeypatch.setattr(MetricsSink, "__call__", original)

    # a feature file that turns out corrupt mid-run: one line naming it (the first file loads, the others do not)
    import shutil

    feats = tmp_path / "features"
    shutil.copytree(os.path.join(_root(workspace), "features"), feats)
    for victim in sorted(feats.glob("rows_*/data_*.ckpt"))[1:]:
        victim.write_bytes(victim.read_bytes()[:200])
    assert main([*cmd, "--start-over", f"data.hidden_states_path={feats}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"feature file \S+data_\d+\.ckpt: does not load", err), err


def test_a_non_finite_loss_stops_training_in_one_line_and_no_checkpoint_holds_nan(workspace, tmp_path, capsys):
    """Features whose values are finite but huge (past what the drafter's arithmetic holds; features holding NaN
    are refused as they are read, `tests/training/test_feature_checks.py`): the first step's loss is NaN; the run
    stops there in one line naming the step and the terms, before that step's checkpoint; a NaN state is never
    saved either."""
    import shutil

    import torch

    from pr_specforge.cli import main
    from pr_specforge.training.backends.checkpoint import recipe_checkpoint_manager
    from pr_specforge.training.errors import NonFiniteTraining

    feats = tmp_path / "features"
    shutil.copytree(os.path.join(_root(workspace), "features"), feats)
    for path in feats.glob("rows_*/data_*.ckpt"):
        sample = torch.load(path, weights_only=True)
        sample["hidden_state"] = torch.full_like(sample["hidden_state"], 3e38)
        torch.save(sample, path)
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["train", "-c", workspace, f"output_dir={out}", "training.save_interval=1", f"data.hidden_states_path={feats}"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert re.search(r"training stopped at step 1: the loss is nan \(non-finite term\(s\): \S*loss", err), err
    assert not list(out.glob("*-step*"))
    manager = recipe_checkpoint_manager()(str(tmp_path / "direct"), "run")
    with pytest.raises(NonFiniteTraining, match="drafter tensor 'w' holds NaN"):
        manager.save({"draft_state_dict": {"w": torch.tensor([1.0, float("inf")])}}, 4, rank_state={})
    assert not list((tmp_path / "direct").glob("run-step*"))
