"""Resumable stages, and the one stage builder `run`, `experiment` and the pilot screening share.

    builder = StageBuilder(Path("work/x"), log_file=Path("work/x/commands.log"))
    run_stages([builder.target_stage(), builder.conversations_stage(256), ...], Path("work/x/stage_times.json"))

A stage is skipped once its output exists (each writes it last), so rerunning a command
resumes where it stopped; `run_stages` keeps each stage's wall time across interruptions. A derived
stage (`StageBuilder.derived_stage`: diagnose, headroom, measures, control) also records what its output was
made from, by content (`inputs_record`: a run's newest checkpoint, features' manifest fingerprint, files'
digests, settings) in `<output>.made_from.json`, and is skipped only while that record is what its inputs are
now: else it runs again, saying in one line what changed (`changed_inputs`).

`StageBuilder` owns the stages' argument lists over one work directory (`target/`,
`conversations.jsonl`, `regenerated.jsonl`, `features/`, run directories): target,
conversations, regenerate, features, train, diagnose, export, eval. Each stage calls its
command's entry function in this process (`pr-specforge data|diagnose|export|eval|plot`'s
`main(argv)`, `train`'s `run_train`, imported when the stage runs), logs the equivalent
`pr-specforge ...` command line and appends it to the builder's `log_file`.

Does not own: which stages a command runs, or any stage's work.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

log = logging.getLogger(__name__)


class StageFailed(RuntimeError):
    """A stage's command returned non-zero; the message names the command."""


#: what a stage-running command reports in one line (`stage_error`): bad settings, no checkpoint, a failed stage
STAGE_ERRORS = (StageFailed, FileNotFoundError, ValueError)


def stage_error(command: str, error: Exception):
    """`(line, exit code)` a stage-running command says one of `STAGE_ERRORS` with: one line (a SpecForge config
    error spans several) as `command: ...`; 1 for a failed stage, 2 for bad input (the code every command gives it)."""
    return f"{command}: {' '.join(str(error).split())}", 1 if isinstance(error, StageFailed) else 2

REPO_ROOT = Path(__file__).resolve().parent.parent
#: evaluation prompt sets whose prompts are held out of the training conversations
HELDOUT_PROMPTS = ("mtbench", "gsm8k", "humaneval")


class Stage:
    """A pipeline stage: skipped once `done()` (by default: `output` exists; a stage writes it last).

    With `made_from` (a derived output: what it is computed from, `inputs_record`), `run` records `made_from()` as
    it was when the stage ran in `made_from_path(output)` after the stage's own work, and `done()` also needs that
    record to equal `made_from()` now; `stale()` says what changed, for the line `run_stages` logs."""

    def __init__(self, name: str, output: Path, run: Callable[[], None], done: Optional[Callable[[], bool]] = None,
                 made_from: Optional[Callable[[], Dict]] = None):
        self.name, self.output, self.made_from = name, output, made_from
        self.finished = done or output.exists
        self.done = self.finished if made_from is None else (lambda: self.finished() and self.stale() is None)
        self.run = run if made_from is None else (lambda: self._run_and_record(run))

    def stale(self) -> Optional[str]:
        """Why a finished output is not reused (`changed_inputs`); None when it records what it is made from now,
        or the stage records nothing."""
        return None if self.made_from is None else changed_inputs(self.output, _plain(self.made_from()))

    def _run_and_record(self, run: Callable[[], None]) -> None:
        from pr_specforge.data.io import atomic_write_json, own_kind

        inputs = _plain(self.made_from())  # what the stage reads, before it reads it
        run()
        atomic_write_json(made_from_path(self.output), {**own_kind(MADE_FROM_KIND), "output": self.output.name,
                                                        "made_from": inputs})


#: the marker of a derived stage's record of its inputs (`Stage(made_from=...)`)
MADE_FROM_KIND = "pr-specforge stage inputs"


def made_from_path(output: Path) -> Path:
    """Where a derived stage records what `output` was made from: `<output>.made_from.json` beside it."""
    return output.with_name(output.name + ".made_from.json")


def _plain(value):
    """`value` as its JSON round trip (tuples as lists, paths as strings): what a record compares equal to."""
    return json.loads(json.dumps(value, default=str))


def changed_inputs(output: Path, now: Dict) -> Optional[str]:
    """None when `output`'s record (`made_from_path`) holds `now`; else one line naming what changed, with both
    values (at most two inputs named), or saying there is no readable record (an output written before records)."""
    from pr_specforge.data.io import DataFormatError, file_kind, read_json_object

    path = made_from_path(output)
    if not path.is_file():
        return f"{output.name} has no record of what it was made from (written before such records were kept)"
    try:
        before = read_json_object(path).get("made_from") if file_kind(path) == (MADE_FROM_KIND, 1) else None
    except DataFormatError:
        before = None
    if not isinstance(before, dict):
        return f"{path.name} is not a readable record of what {output.name} was made from"
    if before == now:
        return None
    keys = [k for k in sorted(set(before) | set(now)) if before.get(k, _NONE) != now.get(k, _NONE)]
    parts = [_change(k, before.get(k, _NONE), now.get(k, _NONE)) for k in keys[:2]]
    return "; ".join(parts) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")


_NONE = "<none>"


def _change(key: str, before, now) -> str:
    """`KEY changed (FIELD A -> B, ...)`: a dict input by its fields that differ (a checkpoint's name and sha256)."""
    if isinstance(before, dict) and isinstance(now, dict):
        a, b = _flat(before), _flat(now)
        fields = [k for k in sorted(set(a) | set(b)) if a.get(k, _NONE) != b.get(k, _NONE)]
        detail = ", ".join(f"{k} {_short(a.get(k, _NONE))} -> {_short(b.get(k, _NONE))}" for k in fields[:3])
        return f"{key} changed ({detail}{' and more' if len(fields) > 3 else ''})"
    return f"{key} changed ({_short(before)} -> {_short(now)})"


def _short(value) -> str:
    """A value for a one-line message: a hash by its first 12 digits, anything else by its repr cut at 60 characters."""
    if isinstance(value, str) and len(value) > 12 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + ".."
    text = value if value == _NONE else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_DIGESTS: Dict[tuple, str] = {}


def cached_digest(path: str) -> str:
    """`data.io.file_digest`, computed once per process while the file keeps its inode, size and modification time
    (a run's checkpoint is read by several derived stages' records)."""
    from pr_specforge.data.io import file_digest

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_digest(path)
    return _DIGESTS[key]


def features_record(features: Path) -> Optional[Dict]:
    """A feature directory by what says its content, cheaply (no feature file is read): its manifest's fingerprint
    fields (the target's config fingerprint, the input's digest and the capture settings, the vocab map's
    fingerprint, the counts of samples and tokens); without a manifest, the vocab map's digest and the files' count
    and bytes. None when the directory does not exist."""
    from pr_specforge.data.io import DataFormatError, read_json_object

    features = Path(features)
    if not features.is_dir():
        return None
    manifest_path = features / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = read_json_object(manifest_path)
        except DataFormatError:
            return {"manifest.json (unreadable)": cached_digest(str(manifest_path))}
        counts = manifest.get("counts") or {}
        return {"target": (manifest.get("target") or {}).get("config_fingerprint"), "resume": manifest.get("resume"),
                "status": manifest.get("status"), "vocab": manifest.get("vocab_fingerprint"),
                "draft_vocab_size": manifest.get("draft_vocab_size"), "samples": counts.get("samples"),
                "loss_tokens": counts.get("loss_tokens")}
    files = [os.path.join(d, f) for d, _, names in os.walk(features) for f in names]
    vocab = features / "vocab_mapping" / "vocab_mapping.pt"
    return {"vocab_mapping": cached_digest(str(vocab)) if vocab.is_file() else None, "files": len(files),
            "bytes": sum(os.path.getsize(f) for f in files)}


def inputs_record(base: Path, runs: Sequence[Path] = (), features: Sequence[Path] = (), files: Sequence[Path] = (),
                  settings: Optional[Dict] = None) -> Dict:
    """What a derived output is made from, by content, each input keyed by how a change line names it (paths
    relative to `base`): each run's newest checkpoint (`export_records.checkpoint_record`: its name and
    `training_state.pt`'s sha256), each feature directory (`features_record`), each file's sha256 (None: missing),
    and the `settings` as they are."""
    from pr_specforge.export_records import checkpoint_record

    def named(path: Path) -> str:
        path, under = Path(path).resolve(), Path(base).resolve()
        return str(path.relative_to(under)) if path.is_relative_to(under) else str(path)

    record: Dict = {f"{named(r)}'s newest checkpoint": checkpoint_record(str(r), digest=cached_digest) for r in runs}
    record.update({f"features {named(f)}": features_record(f) for f in features})
    record.update({named(f): {"sha256": cached_digest(str(f))} if Path(f).is_file() else None for f in files})
    record.update(settings or {})
    return record


def features_done(feats: Path) -> bool:
    """A features stage finished: its `manifest.json` says complete (`data hidden-states` writes it
    `in_progress` at the start, so its mere existence is no sign of a finished stage)."""
    manifest = feats / "manifest.json"
    if not manifest.exists():
        return False
    try:
        return json.loads(manifest.read_text()).get("status") == "complete"
    except json.JSONDecodeError:
        return False


def log_command(line: str, log_file: Optional[Path] = None) -> None:
    """Log a stage's equivalent command line; append it to `log_file` when given."""
    log.info("stage command: %s", line)
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(line + "\n")


def command_line(subcommand: str, argv: Sequence[str]) -> str:
    """The `pr-specforge SUBCOMMAND ARGV...` line a stage is equivalent to."""
    import shlex

    return "pr-specforge " + shlex.join([subcommand, *argv])


def train_command(recipe: str, overrides: Sequence[str]) -> str:
    """The command line equivalent to `run_train(recipe, overrides)` in this process, torch's thread count included
    (`OMP_NUM_THREADS=N pr-specforge train ...`): training is bitwise reproducible at the same count only (float sums
    split over threads round differently)."""
    import torch

    return f"OMP_NUM_THREADS={torch.get_num_threads()} " + command_line("train", ["-c", str(recipe), *overrides])


def recipe_content(recipe: str) -> Dict:
    """A recipe as what it says, not where it is: its mapping with its `extends:` chain merged
    (`training.recipe.read_recipe_mapping`) and the files it names beside it (the draft config) by name and content
    hash, so the same recipe named by another path, or in another checkout, is the same setting, and an edited one
    (or one naming an edited draft config) is another."""
    import os

    from pr_specforge.data.io import file_digest
    from pr_specforge.training.recipe import RECIPE_RELATIVE_PATHS, read_recipe_mapping

    raw = read_recipe_mapping(str(recipe))
    for section, key in RECIPE_RELATIVE_PATHS:  # a file the recipe names (the draft config): by its content too
        value = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str) and os.path.isfile(value):
            raw[section][key] = f"{os.path.basename(value)} (sha256 {file_digest(value)})"
    return raw


def _flat(settings: Dict, prefix: str = "") -> Dict:
    """`{"recipe": {"pr": {"max_depth": 2}}}` -> `{"recipe.pr.max_depth": 2}`: a changed setting is named in full."""
    out: Dict = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_settings(path: Path, settings: Dict, write: bool = True) -> None:
    """Stages skip when their output exists, so a workdir must not be reused with other settings. A workdir's first
    settings are written to `path` (unless not `write`: a dry run compares and writes nothing)."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.io import atomic_write_json

    settings = json.loads(json.dumps(settings))
    if path.exists():
        before, now = _flat(json.loads(path.read_text())), _flat(settings)
        keys = sorted(set(before) | set(now), key=lambda k: (k not in before or k not in now, k))  # values both hold first
        changed = {k: (before.get(k), now.get(k)) for k in keys if before.get(k) != now.get(k)}
        if changed:
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:3])
            detail += f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise ConfigError(
                f"{path.parent} was made with other settings ({detail}); its finished stages would be reused "
                "as they are. Use a new --workdir, or delete this one to start over."
            )
        return
    if write:
        atomic_write_json(path, settings)


def migrate_recipe_record(path: Path, recipe: str, content: Dict) -> None:
    """A workdir's settings written before recipes were recorded by content name the recipe by path: when that path is
    this run's recipe file, its content is recorded in its place (the record is otherwise left for `check_settings`)."""
    import os

    from pr_specforge.data.io import atomic_write_json

    if not path.exists():
        return
    before = json.loads(path.read_text())
    old = before.get("recipe")
    if isinstance(old, str) and os.path.isfile(old) and os.path.samefile(old, recipe):
        log.warning("%s: the recipe was recorded by path (%s); recording its content now", path, old)
        atomic_write_json(path, {**before, "recipe": json.loads(json.dumps(content))})


def run_stages(stages: List[Stage], times_path: Optional[Path] = None, heartbeat_s: float = 60.0) -> Dict[str, float]:
    """Run the stages in order, skipping finished ones; return each stage's wall time.

    Wall time accumulates across interrupted runs: while a stage runs, its running total is
    saved every `heartbeat_s` seconds (so a kill loses at most that much of the account), and
    once more when the stage ends, whether it finished or failed. A save changes only its own
    stage's entry in the file (read, set, written under a lock on `times_path`.lock), so two
    runners over one work directory (e.g. two seeds side by side) keep each other's times.
    """
    import threading

    timings: Dict[str, float] = {}
    if times_path is not None and times_path.exists():
        timings.update(json.loads(times_path.read_text()))
    lock = threading.Lock()

    def save(name: str, total: float) -> None:
        with lock:
            timings[name] = total
            if times_path is not None:
                _set_stage_time(times_path, name, total)

    for stage in stages:
        if stage.done():
            log.info("stage %-13s skipped (%s exists)", stage.name, stage.output)
            timings.setdefault(stage.name, 0.0)
            continue
        if stage.made_from is not None and stage.finished() and (why := stage.stale()):
            log.warning("%s: %s: recomputing %s", stage.name, why, stage.output.name)
        log.info("stage %-13s running", stage.name)
        base, t0 = timings.get(stage.name, 0.0), time.perf_counter()
        done = threading.Event()

        def beat(name=stage.name, base=base, t0=t0, done=done) -> None:
            while not done.wait(heartbeat_s):
                save(name, base + time.perf_counter() - t0)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            stage.run()
        finally:
            done.set()
            thread.join()
            save(stage.name, base + time.perf_counter() - t0)
        log.info("stage %-13s done in %.1f s", stage.name, time.perf_counter() - t0)
    return {stage.name: timings[stage.name] for stage in stages}


def _set_stage_time(times_path: Path, name: str, total: float) -> None:
    """Set one stage's wall time in `times_path`, keeping what other processes wrote there."""
    import fcntl

    from pr_specforge.data.io import atomic_write_json

    with open(times_path.with_name(times_path.name + ".lock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            on_disk = json.loads(times_path.read_text()) if times_path.exists() else {}
            on_disk[name] = total
            atomic_write_json(times_path, on_disk)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def check_finished_run(run_dir: Path, recipe: str, overrides: Sequence[str]) -> None:
    """A finished training is reused only when every setting that shaped its weights (`preflight.shaping_settings`,
    its schedule included) is this command's: else one line naming the setting and both values."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.io import check_resume
    from pr_specforge.training.preflight import recorded_recipe, shaping_settings
    from pr_specforge.training.recipe import load_recipe, resolved_payload

    before = recorded_recipe(str(run_dir))
    if before is None:
        return
    recorded = shaping_settings(before, schedule=True)
    now = shaping_settings(resolved_payload(load_recipe(str(recipe), list(overrides))), schedule=True)
    check_resume(f"{run_dir} (a finished training)", recorded, {k: v for k, v in now.items() if k in recorded},
                 f"its weights were trained otherwise: delete {run_dir} to train it again with these settings, or use a "
                 "new work directory", error=ConfigError)


class StageBuilder:
    """The stages over one work directory; see the module docstring."""

    def __init__(self, work: Path, log_file: Optional[Path] = None) -> None:
        self.work, self.log_file = work, log_file
        self.target, self.convs = work / "target", work / "conversations.jsonl"
        self.regen, self.feats = work / "regenerated.jsonl", work / "features"

    def call(self, command: str, main: Callable[[List[str]], int], argv: Sequence) -> None:
        """Run `pr-specforge COMMAND ARGV` as `main(argv)` in this process; non-zero stops the stages."""
        argv = [str(a) for a in argv]
        log_command(command_line(command, argv), self.log_file)
        rc = main(argv)
        if rc:
            raise StageFailed(f"stage command failed (pr-specforge {command} {' '.join(argv)}): exit {rc}")

    def data(self, *argv) -> None:
        from pr_specforge.data.cli import main

        self.call("data", main, argv)

    def target_stage(self) -> Stage:
        """The SmolLM2-135M-Instruct target (`data smollm2-target`)."""
        return Stage("target", self.target / "config.json", lambda: self.data("smollm2-target", "--output", self.target))

    def conversations_stage(self, limit: int, out: Optional[Path] = None, name: str = "conversations",
                            extra: Sequence[str] = ()) -> Stage:
        """ShareGPT first turns, the evaluation prompts held out (`data conversations`)."""
        out = out or self.convs
        holdout = [a for p in HELDOUT_PROMPTS for a in ("--holdout-prompts", p)]
        return Stage(name, out, lambda: self.data("conversations", "--source", "sharegpt-package", "--output", out,
                                                  "--limit", limit, "--max-turns", "1", *extra, *holdout))

    def regenerate_stage(self, max_new_tokens: int, max_prompt_chars: int, batch_size: int, conversations: Optional[Path] = None,
                         out: Optional[Path] = None, name: str = "regenerate", limit: Optional[int] = None) -> Stage:
        """Greedy replies by the target (`data regenerate`, the first `limit` conversations when given); done once
        `<out stem>.done` exists."""
        conversations, out = conversations or self.convs, out or self.regen
        done = out.with_suffix(".done")

        def run() -> None:
            self.data("regenerate", "--target", self.target, "--input", conversations, "--output", out,
                      "--max-new-tokens", max_new_tokens, "--batch-size", batch_size, "--temperature", "0",
                      "--max-prompt-chars", max_prompt_chars, *(["--limit", limit] if limit else []))
            done.write_text("ok\n")
        return Stage(name, done, run)

    def features_stage(self, max_length: int, draft_vocab_size: int, regenerated: Optional[Path] = None,
                       out: Optional[Path] = None, name: str = "features", validate: bool = True) -> Stage:
        """Target hidden states + vocab map (`data hidden-states`), then `data validate` when asked."""
        regenerated, out = regenerated or self.regen, out or self.feats

        def run() -> None:
            self.data("hidden-states", "--target", self.target, "--input", regenerated, "--output", out,
                      "--max-length", max_length, "--draft-vocab-size", draft_vocab_size)
            if validate:
                self.data("validate", out, "--target", self.target)
        return Stage(name, out / "manifest.json", run, done=lambda: features_done(out))

    def feature_overrides(self, run_dir: Path, max_length: int) -> List[str]:
        """The recipe overrides that train on this work directory's target and features into `run_dir`."""
        return [f"model.target_model_path={self.target}",
                f"model.vocab_mapping_path={self.feats / 'vocab_mapping' / 'vocab_mapping.pt'}",
                f"data.hidden_states_path={self.feats}", f"data.max_length={max_length}", f"output_dir={run_dir}"]

    def train_stage(self, name: str, recipe: str, run_dir: Path, overrides: Callable[[], List[str]]) -> Stage:
        """`pr-specforge train -c RECIPE OVERRIDES` (made when the stage runs), resumed from the run's
        newest checkpoint; done once `RUN_DIR/train.done` exists, and refused then when a setting that shaped the
        weights differs (`check_finished_run`). The logged command names torch's thread count: training is bitwise
        reproducible at the same count only."""
        def run() -> None:
            from pr_specforge.training.preflight import latest_checkpoint
            from pr_specforge.training.train import run_train

            argv = list(overrides())
            ckpt = latest_checkpoint(run_dir, required=False)
            if ckpt:
                log.info("resuming %s from %s", name, ckpt)
                argv.append(f"training.resume_from={ckpt}")
            log_command(train_command(recipe, argv), self.log_file)
            rc = run_train(str(recipe), argv)
            if rc:
                raise StageFailed(f"{name}: training failed with exit {rc}")
            (run_dir / "train.done").write_text("ok\n")

        def done() -> bool:
            if not (run_dir / "train.done").exists():
                return False
            check_finished_run(run_dir, recipe, overrides())
            return True
        return Stage(name, run_dir / "train.done", run, done=done)

    def derived_stage(self, name: str, output: Path, run: Callable[[], None], runs: Sequence[Path] = (),
                      features: Sequence[Path] = (), files: Sequence[Path] = (), **settings) -> Stage:
        """A stage whose output is computed from `runs` (their newest checkpoints), `features`, `files` and
        `settings`: done while its output exists and records those inputs as they are now (`inputs_record`, paths
        named relative to the work directory); else it runs again (`run` must replace its earlier output)."""
        return Stage(name, output, run, made_from=lambda: inputs_record(self.work, runs, features, files, settings))

    def diagnose(self, run_dir: Path, features: Path, out_json: Path, seed: int) -> None:
        """`pr-specforge diagnose` of the run's newest checkpoint on held-out features. `--overwrite`: the file is
        the stage's own, in its work directory, made again when what it was made from changed (`derived_stage`)."""
        from pr_specforge.training.diagnose import main

        self.call("diagnose", main, [run_dir, "--features", features, "--json", out_json, "--seed", seed, "--no-progress",
                                     "--overwrite"])

    def diagnose_stage(self, name: str, run_dir: Path, features: Path, out_json: Path, seed: int) -> Stage:
        """`diagnose` as a derived stage of the run's newest checkpoint, the features and the seed."""
        def run() -> None:
            out_json.parent.mkdir(parents=True, exist_ok=True)
            self.diagnose(run_dir, features, out_json, seed)
        return self.derived_stage(name, out_json, run, runs=[run_dir], features=[features], seed=seed)

    def export_done(self, run_dir: Path, *outs: Path) -> bool:
        """An export stage is done when each of `outs` is an export of the run's newest checkpoint
        (`export.export_is_of`): an export of earlier weights (the training was run again) is made again."""
        from pr_specforge.export import export_is_of
        from pr_specforge.training.preflight import latest_checkpoint

        ckpt = latest_checkpoint(run_dir, required=False)
        return all(export_is_of(str(out), ckpt) for out in outs)

    def export(self, run_dir: Path, out: Path, to: str) -> None:
        """`pr-specforge export` of the run's newest checkpoint (`--to sglang|hf`)."""
        from pr_specforge.export import main
        from pr_specforge.training.preflight import latest_checkpoint

        self.call("export", main, [latest_checkpoint(run_dir), out, "--to", to, "--target", self.target, "--overwrite"])

    def eval_argv(self, out_dir: Path, drafts: Dict[str, Path], prompts: Sequence[str], limit: int, budgets: Sequence[int],
                  temperatures: Sequence[float], max_new_tokens: int, extra: Sequence = ()) -> List[str]:
        """`pr-specforge eval` arguments: `drafts` (name -> HF export) against the target, into `out_dir`."""
        return [str(a) for a in (
            "--target", self.target, *(a for n, d in drafts.items() for a in ("--draft", f"{n}={d}")),
            "--prompts", *prompts, "--limit", limit, "--budget", *budgets, "--temperature", *temperatures,
            "--max-new-tokens", max_new_tokens, *extra, "--out-dir", out_dir, "--json", out_dir / "summary.json")]

    def eval_stage(self, name: str, out_dir: Path, **settings) -> Stage:
        """`pr-specforge eval` (`eval_argv(out_dir, **settings)`); done once `OUT_DIR/summary.json` exists and its
        rows were served by these drafters (`served_by`): after a re-export of other weights the serve runs again,
        where `eval` refuses the folder's rows in one line (made from other files) instead of a stale summary."""
        def run() -> None:
            from pr_specforge.eval.cli import main

            self.call("eval", main, self.eval_argv(out_dir, **settings))
        drafts = settings.get("drafts") or {}
        return Stage(name, out_dir / "summary.json", run,
                     done=lambda: (out_dir / "summary.json").exists() and self.served_by(out_dir, drafts))

    def served_by(self, out_dir: Path, drafts: Dict[str, Path]) -> bool:
        """Every drafter of `drafts` (name -> export) is the one `out_dir`'s `eval_config.json` records under its
        name (`export.export_fingerprints`, hashed once per process while the export's files keep their times and sizes)."""
        from pr_specforge.data.io import read_json_object
        from pr_specforge.export import export_fingerprints, matches_export

        path = out_dir / "eval_config.json"
        if not path.is_file():
            return not drafts
        recorded = read_json_object(path, error=ValueError).get("drafters") or {}
        cache = self.__dict__.setdefault("_fingerprints", {})
        for name, export in drafts.items():
            if not Path(export).is_dir():
                return False
            key = (str(export), *((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(export).iterdir())))
            if key not in cache:
                cache[key] = export_fingerprints(str(export))
            if not matches_export(recorded.get(name), cache[key]):
                return False
        return True

    def plot(self, run_dir: Path) -> None:
        """`pr-specforge plot RUN_DIR` (metrics.png)."""
        from pr_specforge.training.telemetry import main

        self.call("plot", main, [run_dir])
