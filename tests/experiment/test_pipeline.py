"""`pr-specforge experiment` end to end at toy scale on the real SmolLM2 target (about 80 s on a CPU with native bf16;
15 min on an AVX2-only AMD EPYC beside a second job, where torch emulates bf16)."""

import json
import os
import re
import subprocess
import sys

import pytest

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
TOY = ["--conversations", "10", "--max-new-tokens", "10", "--epochs", "1", "--eval-limit", "2",
       "--eval-max-new-tokens", "10", "--heldout", "3", "--eval-interval", "5", "--save-interval", "5",
       "--benchmarks", "gsm8k", "--bootstrap", "200"]


#: a guard against a hang, not a speed check: on a CPU without native bf16 (no avx512_bf16 / amx_bf16, an AVX2-only
#: AMD EPYC) torch emulates the drafters' bf16 arithmetic and each toy training takes minutes, not seconds
HANG = 2400


def _experiment(work, report):
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "experiment", "--workdir", str(work),
                           "--report", str(report), *TOY], env=ENV, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_experiment_runs_every_stage_reports_both_drafters_and_resumes(tmp_path):
    work, report = tmp_path / "work", tmp_path / "results" / "smollm2-toy"
    _experiment(work, report)
    data = json.loads(report.with_suffix(".json").read_text())
    # held-out conversations are disjoint from the training conversations
    ids = lambda p: {json.loads(line)["id"] for line in open(p)}  # noqa: E731
    train_ids, held_ids = ids(work / "conversations.jsonl"), ids(work / "heldout" / "conversations.jsonl")
    assert len(held_ids) == 3 and not train_ids & held_ids
    # every drafter x budget x temperature has the required numbers, and T = 0 decoding is lossless
    cells = {(r["draft"], r["budget"], r["temperature"]) for r in data["results"]}
    assert cells == {(d, b, t) for d in ("eagle3", "pr") for b, t in ((48, 0.0), (48, 1.0), (24, 0.0))}
    for r in data["results"]:
        assert r["tau"] >= 1.0 and r["rounds"] > 0 and r["tokens"] > 0 and r["speedup_vs_ar"] > 0
        if r["temperature"] == 0.0:
            assert r["lossless"] is True
    for c in data["comparisons"]:
        lo, hi = c["gain_rel_ci95"]
        assert lo <= c["gain_rel"] <= hi
    # both trainings logged SpecForge's held-out eval; diagnose ran on both final checkpoints
    for name in ("eagle3", "pr"):
        assert data["training"][name]["heldout_eval"]["step"] == 10
        assert data["heldout"][name]["simulated_acc_len"] == pytest.approx(
            data["training"][name]["heldout_eval"]["eval/simulated_acc_len"], abs=1e-9)
    assert sum(data["heldout"]["pr"]["pr"][f"pr/depth_marginal_{r}"] for r in range(3)) == pytest.approx(1.0)
    assert "pr/depth_marginal_0" in data["training"]["pr"] and data["training"]["eagle3"]["median_step_time_s"] > 0
    stages = ["target", "conversations", "regenerate", "features", "heldout-conversations", "heldout-regenerate",
              "heldout-features", "train-eagle3", "train-pr", "diagnose", "export", "eval-b48", "eval-b24"]
    assert set(data["stage_wall_s"]) == set(stages)
    md = report.with_suffix(".md").read_text()
    assert "95% CI" in md and "Held-out features" in md and "recovered share" in md
    assert data["command"].startswith("pr-specforge experiment --workdir")
    assert any(c.startswith("pr-specforge data regenerate --target") for c in data["stage_commands"])
    assert any(c.startswith("pr-specforge diagnose") for c in data["stage_commands"]) and "pr-specforge eval" in md
    # the trainings are recorded too: logged as run, and restated in the report for this seed
    for name, recipe in (("eagle3", "smollm2-135m-cpu-eagle3.yaml"), ("pr", "smollm2-135m-cpu.yaml")):
        # logged with the thread count it trained with (the experiment's process's own)
        logged = [c for c in data["stage_commands"] if re.match(r"OMP_NUM_THREADS=[1-9][0-9]* pr-specforge train -c ", c)
                  and c.split()[4].endswith(recipe)]
        assert len(logged) == 1 and f"output_dir={work / 'runs' / (name + '-seed0')}" in logged[0]
        assert data["train_commands"][name] == logged[0] and logged[0] in md
    assert len(set(data["stage_commands"])) == len(data["stage_commands"])
    assert report.parent.joinpath("smollm2-toy-tau.png").exists()
    # a rerun skips every finished stage and rebuilds the same report
    out = _experiment(work, report)
    assert all(f"stage {s:<13s} skipped" in out for s in stages), out[-3000:]
    assert json.loads(report.with_suffix(".json").read_text())["results"] == data["results"]
