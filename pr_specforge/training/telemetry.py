"""Training telemetry: a `metrics.jsonl` beside the checkpoints, wandb panels, and `pr-specforge plot`.

    pr-specforge plot work/smollm2/runs/pr            # -> work/smollm2/runs/pr/metrics.png
    WANDB_MODE=offline pr-specforge train -c RECIPE tracking.report_to=wandb

Owns: `MetricsSink`, which wraps the logger SpecForge's trainer calls
(`logger(metrics, step)`, built by SpecForge's assembly; `install_metrics_sink` wraps it):
every logged step is appended (and flushed) to `<output_dir>/metrics.jsonl`
under the names the strategy reports (`pr/loss_total`, `acc_0`, `lr`, ...); when a
tracker is configured (wandb, tensorboard, ...), the PR metrics go to it under
panel-grouping names (`gate_usage/...`, `depth_marginal/...`; see
`PANEL_ALIASES` and docs/telemetry.md) and the rest under SpecForge's `train/`.
Also owns the plot.

Does not own: the tracker backends (SpecForge's `specforge/tracker.py`) or the
metric values (`pr_specforge.training.registration`, SpecForge's trainer).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pr_specforge.data.io import atomic_save_figure

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"

#: strategy metric name (regex) -> tracker name; wandb groups panels by the text before the first `/`.
PANEL_ALIASES: Tuple[Tuple[str, str], ...] = (
    (r"pr/acc_depth_(\d+)_(conf_\w+)", r"by_confidence/acc_depth_\1_\2"),
    (r"pr/halt_past_0_(conf_\w+)", r"by_confidence/halt_past_0_\1"),
    (r"pr/recovered_share_(conf_\w+)", r"by_confidence/recovered_share_\1"),
    (r"pr/conf_share_(conf_\w+)", r"by_confidence/share_\1"),
    (r"pr/gate_mean_depth_(\d+)", r"gate_usage/mean_gate_depth_\1"),
    (r"pr/halt_share_depth_(\d+)", r"gate_usage/halt_share_depth_\1"),
    (r"pr/halt_past_0", r"gate_usage/halt_past_0"),
    (r"pr/depth_marginal_(\d+)", r"depth_marginal/q_bar_\1"),
    (r"pr/depth_marginal_entropy", r"depth_marginal/entropy"),
    (r"pr/recovered_share", r"reconsideration/recovered_share"),
    (r"pr/recovered_of_all", r"reconsideration/recovered_of_all"),
    (r"pr/recovered_outside_topk", r"reconsideration/recovered_outside_topk"),
    (r"pr/acc_depth_(\d+)", r"reconsideration/acc_depth_\1"),
    (r"pr/feature_change_depth_(\d+)", r"reconsideration/feature_change_depth_\1"),
    (r"pr/argmax_agree_depth_(\d+)", r"reconsideration/argmax_agree_depth_\1"),
    (r"pr/loss_depth_(\d+)", r"reconsideration/loss_depth_\1"),
    (r"pr/loss_(one_pass|reconsider|gate|balance|total)", r"loss_terms/\1"),
    (r"acc_(\d+)", r"accuracy/ttt_step_\1"),
    (r"sim/(\w+)", r"sim/\1"),  # the acceptance simulator (`training.simulate`), logged with each eval
    (r"ploss_(\d+)", r"loss_terms/ttt_step_\1"),
)
#: wandb summaries (the run table shows these).
WANDB_SUMMARIES = (("loss_terms/*", "min"), ("accuracy/*", "max"), ("gate_usage/*", "last"),
                   ("depth_marginal/*", "last"), ("reconsideration/*", "last"), ("by_confidence/*", "last"),
                   ("sim/*", "max"))
_COMPILED = [(re.compile(f"^{pattern}$"), repl) for pattern, repl in PANEL_ALIASES]


def panel_name(key: str) -> Optional[str]:
    """The panel-grouped tracker name of a strategy metric, or None if it keeps `train/<key>`."""
    for pattern, repl in _COMPILED:
        if pattern.match(key):
            return pattern.sub(repl, key)
    return None


def tracker_values(scalars: Mapping[str, float]) -> Dict[str, float]:
    """Strategy scalars -> tracker keys: panel names where defined, else SpecForge's `train/` namespace."""
    from pr_specforge._specforge import training_metric_names

    aliased = {}
    rest = {}
    for key, value in scalars.items():
        name = panel_name(key)
        if name is None:
            rest[key] = value
        else:
            aliased[name] = value
    return {**training_metric_names(rest), **aliased}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class MetricsSink:
    """Wraps the trainer's logger: JSONL row per logged step (rank 0), panel names for the tracker."""

    def __init__(self, inner: Callable[[Dict[str, Any], int], None], output_dir: str) -> None:
        self.inner = inner  # SpecForge's console printer (the whole dict) or a TrackerLogger: its tracker only
        self.console = ConsoleLine()
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._defined = False
        self._file = None

    def __call__(self, metrics: Mapping[str, Any], step: int) -> None:
        from pr_specforge._specforge import TrackerLogger, scalar_metrics

        scalars = scalar_metrics(metrics)
        if "tokens_per_sample" in scalars and "perf/global_samples_per_second" in scalars:
            scalars["perf/global_tokens_per_second"] = (
                scalars["tokens_per_sample"] * scalars["perf/global_samples_per_second"])
        if _rank() == 0:
            self._append({"step": int(step), "time": time.time(), **scalars})
            self.console.line(scalars, int(step))
        if isinstance(self.inner, TrackerLogger):
            self._define_wandb_metrics()
            self.inner.tracker.log(tracker_values(scalars), step=step)

    def _append(self, row: Dict[str, Any]) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _define_wandb_metrics(self) -> None:
        if self._defined:
            return
        self._defined = True
        run = getattr(self.inner.tracker, "_run", None)
        define = getattr(run, "define_metric", None)
        if define is None:
            return
        for pattern, summary in WANDB_SUMMARIES:
            define(pattern, summary=summary)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class ConsoleLine:
    """One short line per logged step (the full dict goes to metrics.jsonl and the tracker):

        step 120/300  loss 3.412  acc0 0.352  q 0.81/0.12/0.07  halt>0 0.19  1.52 s/step  ETA 4m33s

    `q` is PR's depth marginal (share of rows halting at depth 0, 1, ...), `halt>0` the share
    that reconsiders past depth 0; s/step and ETA average over this run since its first step.
    Printed through tqdm (below SpecForge's progress bar when it draws one)."""

    def __init__(self) -> None:
        self.total: Optional[int] = None
        self.bar = None
        self._start: Optional[Tuple[int, float]] = None

    def started(self, step: int, total: Optional[int], bar: Any) -> None:
        self.total, self.bar, self._start = total, bar, (step, time.perf_counter())

    def format(self, scalars: Mapping[str, float], step: int) -> str:
        if not any(k == "loss" or k.startswith(("ploss_", "pr/loss")) for k in scalars):
            return self.format_eval(scalars, step)
        parts = [f"step {step}/{self.total}" if self.total else f"step {step}"]
        loss = scalars.get("pr/loss_total", scalars.get("loss"))
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if "acc_0" in scalars:
            parts.append(f"acc0 {scalars['acc_0']:.3f}")
        q = [scalars[k] for k in sorted((k for k in scalars if re.fullmatch(r"pr/depth_marginal_\d+", k)),
                                        key=lambda k: int(k.rsplit("_", 1)[1]))]
        if q:
            parts.append("q " + "/".join(f"{x:.2f}" for x in q))
        if "pr/halt_past_0" in scalars:
            parts.append(f"halt>0 {scalars['pr/halt_past_0']:.2f}")
        if self._start is not None and step > self._start[0]:
            per_step = (time.perf_counter() - self._start[1]) / (step - self._start[0])
            parts.append(f"{per_step:.2f} s/step")
            if self.total:
                parts.append(f"ETA {_duration(per_step * max(0, self.total - step))}")
        return "  ".join(parts)

    @staticmethod
    def format_eval(scalars: Mapping[str, float], step: int) -> str:
        """`eval at step 40: avg_loss 3.1  avg_acc 0.41  simulated_acc_len 0.93  sim len one_pass/width2/pr 0.93/1.21/0.97`"""
        from pr_specforge.training.simulate import RULES, sim_key

        parts = [f"{k} {scalars[f'eval/{k}']:.4g}" for k in ("avg_loss", "avg_acc", "simulated_acc_len")
                 if f"eval/{k}" in scalars]
        sims = [(rule, scalars[sim_key(rule)]) for rule in RULES if sim_key(rule) in scalars]
        if sims:
            parts.append("sim len " + "/".join(r for r, _ in sims) + " " + "/".join(f"{v:.3f}" for _, v in sims))
        if not parts:
            shown = {k: v for k, v in scalars.items() if k.startswith("eval/")}
            parts = [f"{k[5:]} {v:.4g}" for k, v in sorted(shown.items())[:6]]
        return f"eval at step {step}: " + "  ".join(parts)

    def line(self, scalars: Mapping[str, float], step: int) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(scalars, step), file=sys.stdout)  # above the bar when there is one
        sys.stdout.flush()


def install_metrics_sink() -> None:
    """Route every logger SpecForge's assembly builds through `MetricsSink` (idempotent)."""
    from pr_specforge._specforge import wrap_progress_bar, wrap_trainer_logger

    wrap_trainer_logger(lambda logger, cfg: MetricsSink(logger, cfg.output_dir))
    wrap_progress_bar(_progress_started)


def _progress_started(controller, bar):
    """When SpecForge's controller starts fitting: tell the sink the run's first step and horizon.

    SpecForge draws its own step/total bar (with s/step and ETA) on a terminal; the sink's one
    line per logged step carries the same numbers into a log file."""
    sink = controller.logger
    if isinstance(sink, MetricsSink):
        total = controller.max_steps if controller.max_steps is not None else controller.total_steps
        sink.console.started(controller.global_step, total, bar)
    return bar


# ------------------------------------------------------------------------------ reading
def metrics_path(run_dir: str) -> str:
    """The metrics file of a run directory (`RUN_DIR/metrics.jsonl`), or the JSONL named itself."""
    return run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, METRICS_FILE)


def read_metrics(run_dir: str) -> List[Dict[str, Any]]:
    """Rows of `<run_dir>/metrics.jsonl` by step, merged: a step's training and eval rows are two lines,
    and a step logged again (a resumed run) overrides what it logs again. A line that is not a JSON
    object with a step (one cut by a kill mid-write) is skipped with a warning naming file and line."""
    path = metrics_path(run_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics file; train with pr-specforge train (it writes {METRICS_FILE} in output_dir)")
    rows: Dict[int, Dict[str, Any]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a metrics file (not UTF-8 text: binary content, e.g. an image written over it)") from None
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("%s:%d: not a metrics row (a line cut by a kill mid-write?), skipped", path, lineno)
            continue
        rows.setdefault(step, {}).update(row)
    return [rows[s] for s in sorted(rows)]


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def _matching(rows: Sequence[Mapping[str, Any]], pattern: str) -> List[str]:
    rx = re.compile(f"^{pattern}$")
    keys = sorted({k for row in rows for k in row if rx.match(k)}, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])
    return keys


#: (title, [metric-name patterns], y label)
PANELS = (
    ("loss terms", [r"pr/loss_(one_pass|reconsider|gate|balance|total)", r"loss"], "loss"),
    ("accuracy per TTT step (one-pass chain)", [r"acc_\d+"], "top-1 acc"),
    ("accuracy per reconsideration depth", [r"pr/acc_depth_\d+"], "top-1 acc"),
    ("gate usage", [r"pr/gate_mean_depth_\d+", r"pr/halt_share_depth_\d+", r"pr/halt_past_0"], "share"),
    ("depth marginal q_bar and its entropy", [r"pr/depth_marginal_\d+", r"pr/depth_marginal_entropy"], "q_bar / nats"),
    ("recovered share", [r"pr/recovered_share", r"pr/recovered_of_all", r"pr/recovered_outside_topk"], "share"),
    ("by depth-0 confidence: gate opens, recovered", [r"pr/halt_past_0_conf_\w+", r"pr/recovered_share_conf_\w+"], "share"),
    ("simulated acceptance length (eval)", [r"eval/simulated_acc_len", r"sim/acc_len_\w+"], "tokens"),
    ("learning rate", [r"lr"], "lr"),
    ("grad norm (pre-clip)", [r"grad_norm"], "norm"),
    ("throughput: tokens", [r"perf/global_tokens_per_second"], "tokens/s"),
    ("throughput: samples", [r"perf/global_samples_per_second"], "samples/s"),
)


def plotted_panels(rows: Sequence[Mapping[str, Any]]) -> List[Tuple[str, List[str], str, Dict[str, Tuple[List[int], List[float]]]]]:
    """Each of `PANELS` with the series it draws (key -> steps, values); a panel without any is not drawn."""
    out = []
    for title, patterns, ylabel in PANELS:
        series = {key: _series(rows, key) for pattern in patterns for key in _matching(rows, pattern)}
        out.append((title, patterns, ylabel, {k: xy for k, xy in series.items() if xy[0]}))
    return out


def default_plot_path(run_dir: str) -> str:
    """Where `plot` writes without -o: the run's own `PLOT_FILE` (beside the JSONL named itself)."""
    return os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), PLOT_FILE)


def plot_run(run_dir: str, out_path: Optional[str] = None) -> str:
    """Render the run's metrics to one PNG (a grid of the `PANELS`); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: {METRICS_FILE} holds no rows yet")
    out_path = out_path or default_plot_path(run_dir)
    panels = plotted_panels(rows)
    drawn = [p for p in panels if p[3]]
    cols = 3
    nrows = max(1, math.ceil(len(drawn) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (title, _, ylabel, series) in zip(axes.flat, drawn):
        for key, (xs, ys) in series.items():
            ax.plot(xs, ys, label=key, linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
    missing = [p[0] for p in panels if not p[3]]
    note = f"\nnot logged by this run: {'; '.join(missing)}" if missing else ""
    fig.suptitle(f"{os.path.abspath(run_dir)} — steps {rows[0]['step']}..{rows[-1]['step']}{note}", fontsize=10)
    fig.tight_layout()
    atomic_save_figure(fig, out_path, dpi=90)  # whole or not at all; a replaced file keeps its mode
    plt.close(fig)
    return out_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pr-specforge plot", description="render a run's metrics.jsonl to PNG")
    parser.add_argument("run_dir", help="the run's output_dir (holding metrics.jsonl), or the JSONL itself")
    parser.add_argument("-o", "--output", default=None, help=f"PNG path (.png): a new file, or --overwrite (default: "
                        f"RUN_DIR/{PLOT_FILE}, the run's own plot, rewritten); never the metrics file it reads")
    parser.add_argument("--overwrite", action="store_true", help="let -o replace an existing file")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from pr_specforge.data.io import check_writable_file

        # before any work (data.io's one rule): a PNG, never the metrics it reads, in a directory it can write
        check_writable_file("-o", args.output or default_plot_path(args.run_dir), args.overwrite if args.output else None,
                            inputs=[metrics_path(args.run_dir)], fmt="PNG")
        out = plot_run(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"pr-specforge plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
