"""`pr-specforge train` end to end: SpecForge's trainer, gloo/DDP on 2 ranks under torchrun."""

import ast
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
STEP_LINE = re.compile(r"step (\d+): (\{[^{}]*\})")


def _steps(text):
    return {int(m.group(1)): ast.literal_eval(m.group(2)) for m in STEP_LINE.finditer(text)}


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
    steps = _steps(out)
    assert sorted(steps)[-1] == 16, sorted(steps)
    # each rank sees the same 2 samples every 2 steps: compare like with like
    first = sum(steps[s]["pr/loss_total"] for s in (1, 2, 3, 4)) / 4
    last = sum(steps[s]["pr/loss_total"] for s in (13, 14, 15, 16)) / 4
    assert last < first, (first, last)
    for r in range(3):
        assert 0.0 < steps[16][f"pr/depth_marginal_{r}"] < 1.0
    outdir = tmp_path / "out"
    assert (outdir / "specforge-run-step16").is_dir() and (outdir / "specforge-run-step8").is_dir()
    resolved = yaml.safe_load((outdir / "resolved_recipe.yaml").read_text())
    assert resolved["pr"]["max_depth"] == 2 and resolved["training"]["strategy"] == "pr"

    # Resume from the step-8 checkpoint (SpecForge refuses a changed schedule): the log continues at step 9.
    rc, out2 = _run(_torchrun(2, "-c", recipe, "training.save_interval=8",
                              "training.num_epochs=20", f"training.resume_from={outdir / 'specforge-run-step8'}"), tmp_path)
    assert rc == 0, out2[-4000:]
    resumed = _steps(out2)
    assert min(resumed) == 9 and max(resumed) == 16, sorted(resumed)
    # The resumed run reproduces the original run's steps 9..16 (same data order, same weights).
    for s in range(9, 17):
        assert abs(resumed[s]["ploss_0"] - steps[s]["ploss_0"]) < 1e-3 * max(1.0, abs(steps[s]["ploss_0"])), s


def test_single_process_train_runs_in_process(tmp_path):
    recipe = write_workspace(str(tmp_path), steps=3, pr_section={"max_depth": 1})
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "training.save_interval=0"], tmp_path)
    assert rc == 0, out[-4000:]
    assert sorted(_steps(out)) == [1, 2, 3]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("pr.bogus=1", "unknown key"),
        ("pr.max_depth=-1", "pr.max_depth"),
        ("pr.max_depth=9", "pr.max_depth"),
        ("pr.balance_coef=-0.1", "pr.balance_coef"),
        ("training.batch_size=0", "training.batch_size"),
    ],
)
def test_bad_recipe_values_fail_at_load_naming_the_field(tmp_path, override, needle):
    recipe = write_workspace(str(tmp_path), steps=1, pr_section={})
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, override, "--dry-run"], tmp_path)
    assert rc == 2, out[-2000:]
    assert needle in out and "Traceback" not in out, out[-2000:]


def test_feature_width_mismatch_and_non_eagle_draft_are_refused(tmp_path):
    import json

    recipe = write_workspace(str(tmp_path), steps=1, pr_section={})
    draft_path = tmp_path / "draft.json"
    draft = json.loads(draft_path.read_text())
    draft["target_hidden_size"] = 96
    draft_path.write_text(json.dumps(draft))
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "--dry-run"], tmp_path)
    assert rc == 2 and "aux_hidden_state width 192" in out and "Traceback" not in out, out[-2000:]

    draft["target_hidden_size"] = 64
    draft["architectures"] = ["Qwen3ForCausalLM"]
    draft_path.write_text(json.dumps(draft))
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "--dry-run"], tmp_path)
    assert rc == 2 and "not an EAGLE-3 drafter" in out and "Traceback" not in out, out[-2000:]


def test_held_out_eval_features_are_checked_before_training(tmp_path):
    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=1)
    feats = str(tmp_path / "features")
    base = [sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "--dry-run", "training.eval_interval=1"]
    rc, out = _run([*base, f"data.eval_hidden_states_path={tmp_path / 'nowhere'}"], tmp_path)
    assert rc == 2 and "data.eval_hidden_states_path" in out and "not a directory" in out and "Traceback" not in out
    # bf16 features + fp32 weights would fail inside SpecForge's eagle3 eval loop at the first eval step
    rc, out = _run([*base, f"data.eval_hidden_states_path={feats}"], tmp_path)
    assert rc == 2 and "model.torch_dtype=bfloat16" in out and "Traceback" not in out, out[-2000:]
    rc, out = _run([*base, f"data.eval_hidden_states_path={feats}", "model.torch_dtype=bfloat16"], tmp_path)
    assert rc == 0, out[-2000:]


def test_pr_section_with_eagle3_strategy_is_refused(tmp_path):
    recipe = write_workspace(str(tmp_path), strategy="eagle3", steps=1, pr_section={"max_depth": 2})
    rc, out = _run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "--dry-run"], tmp_path)
    assert rc == 2 and "training.strategy=pr" in out, out[-2000:]


def test_pr_strategy_defaults_to_sdpa_and_refuses_an_explicit_other_backend(tmp_path):
    from pr_specforge.config import ConfigError
    from pr_specforge.train import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"target_model_path": "t"}, "data": {"hidden_states_path": "f"},
                                    "training": {"strategy": "pr"}}))
    assert load_recipe(str(path)).config.training.attention_backend == "sdpa"
    with pytest.raises(ConfigError, match="training.attention_backend=sdpa"):
        load_recipe(str(path), ["training.attention_backend=flex_attention"])
