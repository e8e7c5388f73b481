"""`pr-specforge train`: a recipe run by SpecForge's trainer, in this process or under torchrun.

    pr-specforge train -c recipes/smollm2-135m-cpu.yaml training.max_steps=20 pr.max_depth=2
    torchrun --nproc_per_node 4 -m pr_specforge.cli train -c recipes/llama3.1-8b-pr.yaml

Owns: the process launch (in-process for one rank or under torchrun; self-launch through
torchrun for several ranks, re-entering THIS cli so every rank has the patched registry; a rank's one-line error is said once, by the
launcher: `hand_to_launcher`),
resume-by-default, Ctrl-C, the stop at a non-finite loss (`check_finite_step`), the runtime
patches a run installs (`install_training_runtime`)
and `assembled_run` (SpecForge's assembled trainer in one process, for `diagnose`, tests
and benchmarks).

Does not own: recipe loading (`training.recipe`), the pre-flight checks (`training.preflight`),
the `pr` algorithm (`training.registration`), the trainer loop, checkpoints and tracker
(SpecForge's; the recipe-carrying checkpoint manager and the JSONL metrics sink are hooked
in from `training.backends.checkpoint` and `training.telemetry`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from typing import List, Sequence

import yaml

from pr_specforge.config import ConfigError
from pr_specforge.training.errors import NonFiniteTraining, RankFailed, TrainingInterrupted
from pr_specforge.training.preflight import check_run
from pr_specforge.training.recipe import Recipe, load_recipe, resolved_payload

log = logging.getLogger(__name__)

def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_train(recipe_path: str, overrides: Sequence[str], dry_run: bool = False, start_over: bool = False) -> int:
    recipe = load_recipe(recipe_path, overrides)
    if dry_run or not _takes_the_lock():
        return _run_train(recipe, recipe_path, overrides, dry_run, start_over)
    from pr_specforge.lock import output_lock

    with output_lock(recipe.config.output_dir, "output_dir"):  # one writer per run directory (`pr_specforge.lock`)
        return _run_train(recipe, recipe_path, overrides, dry_run, start_over)


def _takes_the_lock() -> bool:
    """The process that holds a run directory's one-writer lock: the command itself, or rank 0 of a torchrun the
    user started (the ranks `train` launches itself run under its lock)."""
    if os.environ.get(SELF_LAUNCHED_ENV) == "1":
        return False
    return not _in_torchrun() or os.environ.get("RANK") == "0"


def _run_train(recipe: Recipe, recipe_path: str, overrides: Sequence[str], dry_run: bool, start_over: bool) -> int:
    resume = check_run(recipe, start_over=start_over, dry_run=dry_run)  # every pre-flight check, one pass
    if dry_run:
        return 0
    overrides = list(overrides)
    if resume is not None:  # resume-by-default: the run directory's newest checkpoint
        recipe = with_resume_from(recipe, resume)
        overrides.append(f"training.resume_from={resume}")  # for the ranks a self-launch starts
    cfg = recipe.config
    world = cfg.deployment.trainer.nnodes * cfg.deployment.trainer.nproc_per_node
    if not _in_torchrun() and world > 1:
        if cfg.deployment.trainer.nnodes > 1:
            raise ConfigError(
                "multi-node runs: launch every node with `torchrun --nnodes N --nproc_per_node P "
                "--node_rank R --master_addr ... -m pr_specforge.cli train -c RECIPE` (see recipes/launch/torchrun.sh)"
            )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={cfg.deployment.trainer.nproc_per_node}",
               "-m", "pr_specforge.cli", "train", "-c", recipe_path, *overrides]
        log.info("self-launching %d ranks: %s", world, " ".join(cmd))
        return _self_launch(cmd, cfg.output_dir)
    return _run_worker(recipe)


#: set in the ranks `pr-specforge train` launches itself: an interrupted rank exits quietly, the launcher reports.
SELF_LAUNCHED_ENV = "PR_SPECFORGE_SELF_LAUNCHED"


def _loss_terms(metrics) -> List[str]:
    """The loss terms among a step's metrics (`loss`, `ploss_i`, `pr/loss_*`, ...)."""
    return sorted(k for k in metrics if "loss" in k.split("/")[-1] or k.endswith(("balance", "entropy")))


def check_finite_step(original):
    """`TrainerCore.train_step` that stops the run at the first optimizer step whose loss is
    non-finite (every rank sees the same reduced metrics, so all stop together), before the
    step can be checkpointed."""
    import math

    def train_step(self, batch, ctx=None):
        result = original(self, batch, ctx)
        if not result.optimizer_stepped:
            return result
        bad = [k for k in _loss_terms(result.metrics)
               if isinstance(result.metrics[k], (int, float)) and not math.isfinite(result.metrics[k])]
        if bad or not math.isfinite(float(result.loss)):
            step = (ctx.global_step + 1) if ctx is not None else "?"
            terms = [k for k in bad if k != "loss"] or ["loss"]
            raise NonFiniteTraining(
                f"training stopped at step {step}: the loss is {float(result.loss)} (non-finite term(s): "
                f"{', '.join(terms[:6])}); nothing of this step was checkpointed. Check the features "
                "(pr-specforge data validate) and lower training.learning_rate, then rerun to resume from the "
                "newest checkpoint (or --start-over)")
        return result

    return train_step


def interrupted_message(output_dir: str) -> str:
    from pr_specforge.training.preflight import run_checkpoints

    latest = run_checkpoints(output_dir)
    if latest is None:
        return (f"interrupted before the first checkpoint; {output_dir} holds none (training.save_interval sets how "
                "often one is written); rerun the same command to train from step 0")
    return (f"interrupted; checkpoints kept in {output_dir} (newest: {os.path.basename(latest)}); "
            "rerun the same command to resume from it")


#: set in the ranks `pr-specforge train` launches itself: the file a rank's one-line error goes to (`hand_to_launcher`)
RANK_ERROR_ENV = "PR_SPECFORGE_RANK_ERROR_FILE"


def hand_to_launcher(message: str, code: int) -> bool:
    """In a rank `pr-specforge train` launched (`RANK_ERROR_ENV` set), hand the run's one-line error (`message`, exit
    `code`) to the launcher, which says it once after torchrun ends (the first rank's wins) instead of each rank's
    line, the peers' broken-connection tracebacks and torchrun's failure report; False elsewhere."""
    path = os.environ.get(RANK_ERROR_ENV)
    if not path:
        return False
    try:
        fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another rank said it first
        return True
    with os.fdopen(fd, "w") as f:
        f.write(f"{code}\n{message}")
    os.replace(path + ".part", path)
    return True


def _self_launch(cmd: List[str], output_dir: str) -> int:
    """torchrun in its own session: Ctrl-C reaches this process only, which interrupts the ranks
    (they stop quietly) and reports in one line, instead of torchrun's and every rank's tracebacks.
    The ranks' stderr passes through until a rank hands over a one-line error (`hand_to_launcher`): from then
    on it is dropped, and that error is raised here (`RankFailed`, with the rank's exit code) for the CLI to say."""
    import signal
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="pr-train-") as scratch:
        said = os.path.join(scratch, "error")
        proc = subprocess.Popen(cmd, env={**os.environ, SELF_LAUNCHED_ENV: "1", RANK_ERROR_ENV: said},
                                start_new_session=True, stderr=subprocess.PIPE)
        forward = threading.Thread(target=_forward_until, args=(proc.stderr, said), daemon=True)
        forward.start()
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            while True:
                try:
                    proc.wait()
                    break
                except KeyboardInterrupt:
                    continue
            raise TrainingInterrupted(interrupted_message(output_dir)) from None
        finally:
            forward.join()
        if os.path.exists(said):
            with open(said) as f:
                code, message = f.read().split("\n", 1)
            raise RankFailed(message, int(code))
        return rc


def _forward_until(stream, said: str) -> None:
    """Copy `stream` (bytes) to stderr as it comes, until a rank hands over its error (`hand_to_launcher` writes
    `said`); then drain it unsaid."""
    import codecs

    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    for chunk in iter(lambda: stream.read1(65536), b""):
        if not (os.path.exists(said) or os.path.exists(said + ".part")):
            sys.stderr.write(decode(chunk))
            sys.stderr.flush()


def _children(pid: int) -> List[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def with_resume_from(recipe: Recipe, resume: str) -> Recipe:
    """`recipe` with `training.resume_from=resume` (what the same override would load)."""
    import dataclasses

    cfg = recipe.config
    training = cfg.training.model_copy(update={"resume_from": resume})
    return dataclasses.replace(recipe, config=cfg.model_copy(update={"training": training}))


def _run_worker(recipe: Recipe) -> int:
    from pr_specforge.training.registration import ALGORITHM_NAME, build_registry
    from pr_specforge._specforge import bind_run, resolve_run
    from pr_specforge._specforge import train_resolved_run as _train

    cfg = recipe.config
    if cfg.training.strategy != ALGORITHM_NAME:
        # eagle3 baselines run through the same entry point, with the same registry.
        log.info("training.strategy=%s (not pr): running SpecForge's own algorithm", cfg.training.strategy)
    cfg, registry = run_config(recipe)
    resolved = resolve_run(cfg, registry)
    os.makedirs(cfg.output_dir, exist_ok=True)
    payload = resolved_payload(recipe)
    _write_resolved_recipe(recipe, payload)
    install_training_runtime(recipe, payload)
    interrupted: List[bool] = []
    with _watch_sigint(interrupted):
        try:
            _train(bind_run(resolved.config, resolved.algorithm))  # returns the final step count, not a status
        except BaseException:
            # After Ctrl-C a rank may fail with its peer's closed connection rather than KeyboardInterrupt.
            if not interrupted:
                raise
            if os.environ.get(SELF_LAUNCHED_ENV) == "1":
                return 0  # the launcher reports, once
            raise TrainingInterrupted(interrupted_message(cfg.output_dir)) from None
    return 0


def run_config(recipe: Recipe):
    """`(SpecForge config, registry)` a run trains with: `pr` registered, and for `data.online`
    the vocab map, the online step and the conversation reader (`pr_specforge.training.online`)."""
    from pr_specforge.training.registration import build_registry

    registry = build_registry(recipe.pr)
    if recipe.online is None:
        return recipe.config, registry
    from pr_specforge.training.online import prepare_online_run

    return prepare_online_run(recipe.config, recipe.online, registry)


@contextlib.contextmanager
def assembled_run(recipe: Recipe):
    """SpecForge's assembled trainer for `recipe` in this process (one rank), never fitted:
    yields `(strategy, loader)` for tests and benchmarks that drive steps themselves."""
    from pr_specforge import _specforge as sf

    from pr_specforge.training.preflight import recipe_sample_check

    sf.install_cpu_loss()
    sf.install_feature_file_errors(recipe_sample_check(recipe))  # every sample checked as the loader reads it
    cfg, registry = run_config(recipe)
    resolved = sf.resolve_run(cfg, registry)
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding  # as SpecForge's CLI does: the backend reads it
    sf.bootstrap_single_process_env()
    sf.init_distributed(timeout=cfg.training.dist_timeout)
    try:
        trainer = sf.build_training_run(resolved.config, algorithm=resolved.algorithm).trainer
        yield sf.trainer_strategy(trainer), sf.trainer_loader(trainer)
    finally:
        sf.destroy_distributed()


@contextlib.contextmanager
def _watch_sigint(seen: List[bool]):
    """Append to `seen` when SIGINT arrives (which still raises KeyboardInterrupt); restore the handler after."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        seen.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def target_state(target_path: str):
    """What every checkpoint records of its target (`TARGET_STATE_KEY`): its directory's name and its weights by
    content (`target_weights_digest`), which `export` compares its `--target` with; None for a hub id."""
    if not (target_path and os.path.isdir(target_path)):
        return None
    from pr_specforge.data.hidden_states import target_weights_digest

    return {"name": os.path.basename(os.path.abspath(target_path)), "weights": target_weights_digest(target_path)}


def install_training_runtime(recipe: Recipe, payload: dict) -> None:
    """Every runtime patch training needs, in one place (nothing is patched at import time):
    SpecForge's loss on CPU, the stop at a non-finite loss, the check of every feature sample the loader reads
    (training and eval features: `preflight.FeatureSampleCheck`), recipe-carrying atomic checkpoints
    (never of non-finite tensors) carrying `payload` (`resolved_payload`), the metrics JSONL sink,
    the acceptance simulator in the eval pass, and the chosen backend."""
    from pr_specforge._specforge import install_cpu_loss, install_feature_file_errors, wrap_train_step
    from pr_specforge.training.backends.checkpoint import install_checkpoint_manager
    from pr_specforge.training.preflight import recipe_sample_check
    from pr_specforge.training.simulate import install_eval_simulator
    from pr_specforge.training.telemetry import install_metrics_sink

    install_cpu_loss()
    wrap_train_step(check_finite_step)
    install_feature_file_errors(recipe_sample_check(recipe))
    install_checkpoint_manager(payload, target_state(recipe.config.model.target_model_path))
    install_metrics_sink()
    install_eval_simulator()
    if recipe.backend.name == "deepspeed":
        from pr_specforge.training.backends.deepspeed import install_deepspeed_backend

        install_deepspeed_backend(recipe.backend, recipe.config)


def _write_resolved_recipe(recipe: Recipe, payload) -> None:
    """Store the resolved recipe (SpecForge config dump + pr section) in the output dir, atomically."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    from pr_specforge.data.io import atomic_write_text

    atomic_write_text(os.path.join(recipe.config.output_dir, "resolved_recipe.yaml"),
                      yaml.safe_dump(payload, sort_keys=False))
