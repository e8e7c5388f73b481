"""metrics.jsonl beside the checkpoints, panel-grouped wandb names, and `pr-specforge plot`."""

import glob
import json
import os
import subprocess
import sys

from pr_specforge.training.telemetry import METRICS_FILE, MetricsSink, panel_name, plot_run, read_metrics
from tests.helpers import run_cli, write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")


class _FakeTracker:
    def __init__(self):
        self.logged, self.defined = [], []
        self._run = self

    def define_metric(self, pattern, summary=None):
        self.defined.append((pattern, summary))

    def log(self, values, step=None):
        self.logged.append((step, values))

    def close(self):
        pass


def test_pr_metrics_reach_the_tracker_grouped_into_gate_usage_and_depth_marginal_panels(tmp_path):
    import torch
    from specforge.training.tracking import TrackerLogger

    tracker = _FakeTracker()
    sink = MetricsSink(TrackerLogger(tracker), str(tmp_path))
    sink({"pr/gate_mean_depth_0": torch.tensor(0.5), "pr/depth_marginal_1": 0.25, "pr/depth_marginal_entropy": 1.04,
          "pr/loss_total": 3.0, "acc_0": 0.1, "lr": 1e-4, "grad_norm": 0.4}, 7)
    step, values = tracker.logged[0]
    assert step == 7
    assert values == {"gate_usage/mean_gate_depth_0": 0.5, "depth_marginal/q_bar_1": 0.25, "depth_marginal/entropy": 1.04,
                      "loss_terms/total": 3.0, "accuracy/ttt_step_0": values["accuracy/ttt_step_0"], "train/lr": 1e-4,
                      "train/grad_norm": 0.4}
    assert ("gate_usage/*", "last") in tracker.defined and ("accuracy/*", "max") in tracker.defined
    sink.close()
    rows = [json.loads(x) for x in open(tmp_path / METRICS_FILE)]
    assert rows[0]["step"] == 7 and rows[0]["pr/gate_mean_depth_0"] == 0.5 and rows[0]["lr"] == 1e-4


def test_every_pr_ratio_metric_has_a_panel():
    for key in ("pr/gate_mean_depth_1", "pr/halt_share_depth_2", "pr/halt_past_0", "pr/depth_marginal_2",
                "pr/recovered_share", "pr/recovered_of_all", "pr/acc_depth_1", "pr/loss_depth_0", "pr/loss_balance"):
        assert panel_name(key) is not None and not panel_name(key).startswith("train/"), key
    assert panel_name("grad_norm") is None


def test_training_writes_metrics_jsonl_and_wandb_offline_run_and_plot_renders(tmp_path):
    recipe = write_workspace(str(tmp_path), steps=6, pr_section={"max_depth": 2})
    out = tmp_path / "out"
    wandb_dir = tmp_path / "wandb"
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe, "tracking.report_to=wandb",
                           "tracking.wandb_offline=true", f"tracking.wandb_dir={wandb_dir}", "tracking.wandb_project=pr-test"],
                          env=dict(ENV, WANDB_MODE="offline", WANDB_SILENT="true"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("pr/loss_total", "pr/depth_marginal_entropy", "pr/gate_mean_depth_0", "acc_0", "lr", "grad_norm",
                "perf/global_tokens_per_second"):
        assert all(key in r for r in rows), key
    for r in rows:  # 32-token samples, batch 1: tokens/s is 32 x samples/s
        assert r["tokens_per_sample"] == 32.0
        assert abs(r["perf/global_tokens_per_second"] - 32.0 * r["perf/global_samples_per_second"]) < 1e-6 * r["perf/global_tokens_per_second"]
    runs = glob.glob(str(wandb_dir / "**" / "offline-run-*" / "run-*.wandb"), recursive=True)
    assert len(runs) == 1, os.listdir(wandb_dir)
    record = open(runs[0], "rb").read()  # the offline run's protobuf log holds every key as UTF-8
    for key in (b"gate_usage/mean_gate_depth_0", b"gate_usage/halt_share_depth_2", b"depth_marginal/q_bar_2",
                b"depth_marginal/entropy", b"loss_terms/total", b"train/lr", b"train/grad_norm"):
        assert key in record, key

    png = plot_run(str(out))
    assert png.endswith(".png") and os.path.getsize(png) > 20_000
    rc, log = run_cli("plot", out, "-o", tmp_path / "p.png", cwd=tmp_path)
    assert rc == 0 and (tmp_path / "p.png").is_file(), log[-2000:]


def test_plot_refuses_a_dir_without_metrics(tmp_path):
    rc, log = run_cli("plot", tmp_path, cwd=tmp_path)
    assert rc == 2 and "no metrics file" in log


def test_plot_o_refuses_an_existing_file_unless_overwrite(tmp_path):
    """issue 58 item 6: -o naming a file that exists (a user's image) is one line naming it, the file left as it was;
    --overwrite replaces it; the run's own metrics.png (no -o) is rewritten as before. Issue 65: its own metrics
    are never replaced, --overwrite or not, and a name that is not .png (a user's notes) is no PNG to write."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n" + json.dumps({"step": 2, "loss": 2.5}) + "\n")
    notes, image = tmp_path / "notes.md", tmp_path / "mine.png"
    notes.write_text("a user's notes\n")
    image.write_text("a user's image\n")
    kept = {p: p.read_bytes() for p in (notes, image, tmp_path / "metrics.jsonl")}
    cases = [(image, f"-o {image}: exists; pass --overwrite"), (notes, f"-o {notes}: this command writes PNG only"),
             (tmp_path / "metrics.jsonl", "is an input of this command"), (tmp_path, "is a directory; name a file")]
    for target, needle in cases:
        for overwrite in ([], ["--overwrite"]) if target != image else ([],):
            rc, log = run_cli("plot", tmp_path, "-o", target, *overwrite, cwd=tmp_path)
            lines = [x for x in log.splitlines() if x.startswith("pr-specforge plot:")]
            assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in log, log[-2000:]
    assert {p: p.read_bytes() for p in kept} == kept and not (tmp_path / "metrics.png").exists()
    rc, log = run_cli("plot", tmp_path, "-o", image, "--overwrite", cwd=tmp_path)
    assert rc == 0 and image.read_bytes().startswith(b"\x89PNG"), log[-2000:]
    for _ in range(2):
        rc, log = run_cli("plot", tmp_path, cwd=tmp_path)
        assert rc == 0 and (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG"), log[-2000:]


# ---------------------------------------------------------------- issue 44: plot's input and panels
def test_plot_merges_a_steps_rows_warns_on_a_bad_line_and_keeps_samples_off_the_tokens_axis(tmp_path):
    from pr_specforge.training.telemetry import plotted_panels

    lines = [json.dumps({"step": 1, "loss": 3.0, "perf/global_tokens_per_second": 320.0, "perf/global_samples_per_second": 10.0}),
             json.dumps({"step": 2, "loss": 2.5, "perf/global_tokens_per_second": 330.0, "perf/global_samples_per_second": 11.0}),
             json.dumps({"step": 2, "eval/simulated_acc_len": 0.9, "sim/acc_len_one_pass": 0.9}),  # the eval row of step 2
             '{"step": 3, "loss": 2.',  # cut by a kill
             json.dumps({"loss": 2.0})]  # no step
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "plot", str(tmp_path)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "metrics.png").is_file(), proc.stderr[-2000:]
    for lineno in (4, 5):
        assert f"metrics.jsonl:{lineno}: not a metrics row" in proc.stderr, proc.stderr[-2000:]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 2.5 and rows[1]["sim/acc_len_one_pass"] == 0.9
    panels = {title: series for title, _, _, series in plotted_panels(rows)}
    assert set(panels["throughput: tokens"]) == {"perf/global_tokens_per_second"}
    assert set(panels["throughput: samples"]) == {"perf/global_samples_per_second"}
    assert panels["simulated acceptance length (eval)"]["sim/acc_len_one_pass"] == ([2], [0.9])
    assert panels["loss terms"]["loss"] == ([1, 2], [3.0, 2.5])  # step 2's training row survives its eval row
    assert panels["grad norm (pre-clip)"] == {}  # not drawn (named under the title instead)
