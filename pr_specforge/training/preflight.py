"""Checks a training run makes before its first step, each failing in one line naming the file and the fix.

Owns: the target directory check, the vocab map check (readable, a map, the sizes
the drafter needs, and the map the features were made with: the features'
`manifest.json` records its fingerprint), `latest_checkpoint` (a run directory's newest
complete checkpoint, by SpecForge's rule) and the guard on a run directory that
already holds checkpoints (resume it, or start over only when told to).

Also owns `check_run(recipe)`, every check `pr-specforge train` makes after loading the recipe,
in one pass (the draft config's architecture, the target, `pr.init_from`, an online run's
conversations, the vocab map, the first feature file of each feature directory against the
draft config; then the run directory's resume guard and schedule), `check_feature_dir`
(`diagnose` uses it too), and `FeatureSampleCheck`, the check of every sample a loader reads
(`recipe_sample_check`; installed in SpecForge's loader by `training.train`).

Does not own: recipe parsing (`training.recipe`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from pr_specforge.config import ConfigError


def _looks_local(path: str) -> bool:
    """A path meant on this disk (vs a hub id such as `org/name`)."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return True
    head = path.split("/", 1)[0]
    return "/" not in path or os.path.isdir(head)


def check_target(path: Optional[str]) -> Optional[dict]:
    """`model.target_model_path` is a directory with a readable config.json; returns that config.

    A hub id (`org/name`, nothing of that name on disk) is left to SpecForge."""
    if not path:
        return None
    fix = "give a model directory (pr-specforge data smollm2-target --output DIR makes the default one)"
    if not os.path.exists(path):
        if _looks_local(path):
            raise ConfigError(f"model.target_model_path: {path!r} does not exist; {fix}")
        return None
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"model.target_model_path: {path} has no config.json, so it is not a model directory; {fix}")
    from pr_specforge.data.io import read_json_object

    return read_json_object(config, "model.target_model_path:", error=ConfigError)


def check_vocab_map(path: Optional[str], draft: Optional[dict], features: Optional[str]) -> None:
    """`model.vocab_mapping_path` is a vocab map of the drafter's sizes, and the one `features` were made with."""
    if not path:
        return
    from pr_specforge.data.hidden_states import MANIFEST
    from pr_specforge.data.vocab import VOCAB_MAPPING_RELPATH, read_vocab_mapping, vocab_fingerprint, vocab_mapping_problems

    made_by = "pr-specforge data hidden-states writes FEATURES/" + VOCAB_MAPPING_RELPATH
    if not os.path.isfile(path):
        raise ConfigError(f"model.vocab_mapping_path: {path!r} does not exist ({made_by})")
    try:
        mapping = read_vocab_mapping(path)
    except ValueError as e:
        raise ConfigError(f"model.vocab_mapping_path: {e} ({made_by})") from None
    if draft is not None:
        vocab = int(draft.get("vocab_size") or 0)
        size = draft.get("draft_vocab_size")
        problems = vocab_mapping_problems(path, mapping, vocab, int(size) if size is not None else None)
        if problems:
            raise ConfigError(f"model.vocab_mapping_path: {problems[0]} (the draft config "
                              f"model.draft_model_config has vocab_size {vocab}, draft_vocab_size {size})")
    manifest = os.path.join(features or "", MANIFEST)
    if features and os.path.isfile(manifest):
        with open(manifest) as f:
            recorded = json.load(f).get("vocab_fingerprint")
        if recorded is not None and recorded != vocab_fingerprint(mapping):
            own = os.path.join(features, VOCAB_MAPPING_RELPATH)
            raise ConfigError(
                f"model.vocab_mapping_path: {path} is not the map the features in {features} were made with "
                f"(fingerprint {vocab_fingerprint(mapping)}, {manifest} records {recorded}); use {own}")


def latest_checkpoint(run_dir, required: bool = True) -> Optional[str]:
    """The newest complete `<run_id>-stepN` checkpoint directory of a SpecForge run.

    Completeness is SpecForge's own rule (`CheckpointManager.latest_dir`: its `-latest` pointer, else
    the highest step whose `training_state.pt` exists), so a kill in the middle of a save resumes
    from the checkpoint before it. A directory holding several runs gives the highest step of any.
    """
    from pathlib import Path

    from pr_specforge._specforge import latest_checkpoint_dir

    steps = [p.name.rsplit("-step", 1) for p in Path(run_dir).glob("*-step*")]
    run_ids = sorted({run_id for run_id, step in steps if step.isdigit()})
    ckpts = [d for d in (latest_checkpoint_dir(str(run_dir), run_id) for run_id in run_ids) if d]
    if not ckpts:
        if required:
            raise FileNotFoundError(f"no checkpoint under {run_dir}; did training save one (training.save_interval)?")
        return None
    return max(ckpts, key=lambda d: int(d.rsplit("-step", 1)[-1]))


def run_checkpoints(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint directory under a run directory, or None."""
    if not os.path.isdir(output_dir):
        return None
    return latest_checkpoint(output_dir, required=False)


def resume_or_start_over(output_dir: str, resume_from: Optional[str], start_over: bool) -> Optional[str]:
    """What a run in `output_dir` resumes from: the given `resume_from`, else the directory's own
    newest checkpoint (a rerun continues, it never restarts over finished work). With `start_over`
    the directory's checkpoints and metrics are deleted first and nothing is resumed."""
    from pr_specforge.training.telemetry import METRICS_FILE

    latest = run_checkpoints(output_dir)
    if start_over:
        if resume_from:
            raise ConfigError("--start-over with training.resume_from: choose one")
        if latest is not None:
            for name in os.listdir(output_dir):
                full = os.path.join(output_dir, name)
                if "-step" in name and os.path.isdir(full):
                    shutil.rmtree(full)
                elif name == METRICS_FILE or (name.endswith("-latest") and os.path.islink(full)):
                    os.unlink(full)
        return None
    if resume_from or latest is None:
        return resume_from
    return output_dir


#: what a run directory's schedule is made of: SpecForge resumes a checkpoint only under the same horizon
SCHEDULE_FIELDS = ("max_steps", "num_epochs")


def check_same_schedule(output_dir: str, training) -> None:
    """A rerun resuming `output_dir` keeps the schedule it was trained with (SpecForge compares the
    learning-rate horizon); a changed `training.max_steps` / `num_epochs` is refused in one line
    that says how to train longer. The run's schedule is read from its `resolved_recipe.yaml`."""
    import yaml

    path = os.path.join(output_dir, "resolved_recipe.yaml")
    try:
        with open(path) as f:
            before = (yaml.safe_load(f) or {}).get("training") or {}
    except (OSError, yaml.YAMLError):
        return  # nothing recorded: SpecForge's own resume check decides
    changed = [(k, before[k], getattr(training, k)) for k in SCHEDULE_FIELDS
               if k in before and before[k] != getattr(training, k)]
    if not changed:
        return
    key, old, new = changed[0]
    latest = run_checkpoints(output_dir)
    raise ConfigError(
        f"training.{key}={new}, but {output_dir} was trained with training.{key}={old} and a resumed run keeps "
        f"its learning-rate schedule. To train longer, start a new run from its weights: output_dir=NEW_DIR "
        f"model.draft_checkpoint_path={latest} training.{key}={new} (a fresh optimiser and schedule); or rerun "
        f"with --start-over to retrain {output_dir} from step 0; or keep training.{key}={old} to resume it")


#: training settings a resumed run may change: they shape no step's arithmetic (when to log, save and evaluate, how
#: many checkpoints to keep, where to resume from, how long to wait for a peer); the schedule has its own check
RESUMABLE_TRAINING = ("save_interval", "eval_interval", "log_interval", "max_checkpoints", "resume_from",
                      "dist_timeout", *SCHEDULE_FIELDS)
#: the fields of a resolved recipe that shape a checkpoint's weights besides `training` and `pr` (paths are not
#: compared: the same files may be named from another working directory; the features resume check owns their content)
SHAPING_FIELDS = (("model", "torch_dtype"), ("data", "max_length"))


def recorded_recipe(checkpoint: str) -> Optional[dict]:
    """The resolved recipe the run that wrote `checkpoint` recorded (`resolved_recipe.yaml` beside it or in its run
    directory), or None when there is none to read."""
    import yaml

    ckpt = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    for cand in (os.path.join(ckpt, "resolved_recipe.yaml"), os.path.join(os.path.dirname(os.path.abspath(ckpt)), "resolved_recipe.yaml")):
        try:
            with open(cand) as f:
                raw = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(raw, dict):
            return raw
    return None


def shaping_settings(payload: dict, schedule: bool = False) -> dict:
    """The settings of a resolved recipe that shape its checkpoints (`RESUMABLE_TRAINING` left out; with `schedule`,
    the schedule's fields kept: what a finished run's weights depend on), dotted."""
    skip = [k for k in RESUMABLE_TRAINING if not (schedule and k in SCHEDULE_FIELDS)]
    out = {f"training.{k}": v for k, v in (payload.get("training") or {}).items() if k not in skip}
    out.update({f"pr.{k}": v for k, v in (payload.get("pr") or {}).items()})
    for section, key in SHAPING_FIELDS:
        if key in (payload.get(section) or {}):
            out[f"{section}.{key}"] = payload[section][key]
    return out


def check_same_settings(resume: str, recipe, output_dir: str) -> None:
    """A resumed run restores its optimiser, schedule and RNG from the checkpoint, so it continues the run that wrote
    it only under the same settings: a changed setting (`shaping_settings`: the learning rate, a `pr.*` field, the dtype,
    ...) would be recorded but not used. Refused in one line naming the setting and both values; settings the
    checkpoint's run did not record (an older version) are not compared."""
    from pr_specforge.data.io import check_resume
    from pr_specforge.training.recipe import resolved_payload

    recorded = recorded_recipe(resume)
    if recorded is None:
        return
    before, now = shaping_settings(recorded), shaping_settings(resolved_payload(recipe))
    now = {k: v for k, v in now.items() if k in before}
    check_resume(f"resuming {resume}", before, now,
                 f"a resumed run keeps the settings it was trained with: keep that value to resume it, rerun with "
                 f"--start-over to retrain {output_dir} from step 0, or start a new run from its weights "
                 f"(output_dir=NEW_DIR model.draft_checkpoint_path={resume})", error=ConfigError)


def _feature_files(root: str):
    """The feature files under `root`, in a fixed order (directories and names sorted)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".ckpt", ".ckpt.gz")):
                yield os.path.join(dirpath, name)


def _first_feature_file(root: str) -> Optional[str]:
    return next(_feature_files(root), None)


def check_run(recipe, start_over: bool = False, dry_run: bool = False) -> Optional[str]:
    """Every check `train` makes before its first step, in one pass, each turning a deep trainer failure
    into an error naming the file and field; then (not for `dry_run`) the run directory's guard.
    Returns the checkpoint the run resumes by default (its output_dir's newest), or None."""
    check_inputs(recipe)
    if dry_run:
        return None
    return _resume_source(recipe, start_over)


def _resume_source(recipe, start_over: bool) -> Optional[str]:
    """A run directory holding checkpoints is resumed (under the same schedule and settings) unless `start_over`,
    which discards them (rank 0; no rank resumes). A given `training.resume_from` is checked the same way."""
    import logging

    log = logging.getLogger(__name__)
    cfg = recipe.config
    if start_over and int(os.environ.get("RANK", "0")) != 0:
        return None
    resume = resume_or_start_over(cfg.output_dir, cfg.training.resume_from, start_over)
    if start_over:
        log.info("--start-over: discarded the checkpoints and metrics in %s; training from step 0", cfg.output_dir)
    if resume is None:
        return None
    if resume == cfg.training.resume_from:
        check_same_settings(resume, recipe, cfg.output_dir)
        return None
    check_same_schedule(cfg.output_dir, cfg.training)
    check_same_settings(resume, recipe, cfg.output_dir)
    log.info("%s holds checkpoints: resuming from the newest (pass --start-over to discard them and train from step 0)",
             cfg.output_dir)
    return resume


def check_inputs(recipe) -> None:
    """The checks of the files a recipe names (draft config, target, init_from, data, vocab map)."""
    import json

    from pr_specforge.modeling.drafter import EAGLE3_ARCHITECTURE, PR_ARCHITECTURE
    from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE

    cfg = recipe.config
    draft_path = cfg.model.draft_model_config
    draft = None
    if draft_path:
        if not os.path.isfile(draft_path):
            raise ConfigError(f"model.draft_model_config: {draft_path!r} does not exist")
        with open(draft_path) as f:
            try:
                draft = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"model.draft_model_config: {draft_path} is not valid JSON ({e})") from None
        arch = (draft.get("architectures") or [None])[0]
        accepted = {"pr": (EAGLE3_ARCHITECTURE, PR_ARCHITECTURE),
                    "eagle3": (EAGLE3_ARCHITECTURE, PR_ARCHITECTURE, TWO_LAYER_ARCHITECTURE)}.get(cfg.training.strategy)
        if accepted and arch not in accepted:
            raise ConfigError(
                f"model.draft_model_config: {draft_path} has architectures[0]={arch!r}, which the "
                f"{cfg.training.strategy} strategy does not train; it needs one of {', '.join(accepted)}"
                + (" (the two-layer control trains with strategy eagle3)" if arch == TWO_LAYER_ARCHITECTURE else "")
            )
    check_target(cfg.model.target_model_path)
    if cfg.training.strategy == "pr" and recipe.pr.init_from and draft_path:
        from pr_specforge.training.warm_start import check_init_from

        check_init_from(recipe.pr, draft_path)
    if recipe.online is not None:
        check_online_inputs(recipe.online)
        check_vocab_map(cfg.model.vocab_mapping_path, draft, None)  # when given; else the run builds its own
    else:
        check_vocab_map(cfg.model.vocab_mapping_path, draft, cfg.data.hidden_states_path)
    for field in ("hidden_states_path", "eval_hidden_states_path"):
        if field == "hidden_states_path" and recipe.online is not None:
            continue
        sample = check_feature_dir(f"data.{field}", getattr(cfg.data, field), draft, draft_path)
        if (sample is not None and cfg.training.strategy == "eagle3"
                and str(cfg.model.torch_dtype) == "float32" and str(sample["hidden_state"].dtype) != "torch.float32"):
            # SpecForge 0.2.0's eagle3 training step and eval loop feed stored features to the drafter uncast; the
            # failure would come as a dtype error deep in torch at the first step (or eval step, hours into training).
            loop = "training step" if field == "hidden_states_path" else "eval loop"
            fix = "" if field == "hidden_states_path" else " or train without held-out eval"
            raise ConfigError(
                f"data.{field}: features are {sample['hidden_state'].dtype} but model.torch_dtype is "
                f"float32, and SpecForge's eagle3 {loop} does not cast them; set model.torch_dtype=bfloat16{fix}"
            )


def check_online_inputs(settings) -> None:
    """An online run reads conversations and runs the target (instead of a features directory): the
    conversations file exists and every line is a JSON object (rows are tokenised only when the run
    starts), and the target is a model directory."""
    from pr_specforge.data.io import DataFormatError, iter_jsonl

    if not os.path.isfile(settings.conversations):
        raise ConfigError(f"data.train_data_path: {settings.conversations!r} does not exist (a conversation JSONL)")
    try:
        for _ in iter_jsonl(settings.conversations):
            pass
    except DataFormatError as e:
        raise ConfigError(f"data.train_data_path: {e}") from None
    target = settings.target_path
    hub_id = not os.path.exists(target) and target.count("/") == 1 and not target.startswith((".", "/"))
    if not hub_id and not os.path.isfile(os.path.join(target, "config.json")):
        raise ConfigError(f"model.target_model_path: {target!r} has no config.json; online training runs the target "
                          "(build it first, e.g. `pr-specforge data smollm2-target`)")


def _check_manifest_status(field: str, feats: str) -> None:
    from pr_specforge.data.io import read_json_object

    path = os.path.join(feats, "manifest.json")
    if not os.path.isfile(path):
        return
    status = read_json_object(path, field, error=ConfigError).get("status", "complete")
    if status != "complete":
        raise ConfigError(f"{field}: {path} has status {status!r}: the `pr-specforge data hidden-states` run writing "
                          f"{feats} did not finish; rerun the same command to complete it")


def _load_feature_file(path: str, feats: str, mmap: bool = False) -> dict:
    """One feature file, loaded (memory-mapped where it can be: only its header is read) and checked to be a
    SpecForge EAGLE-3 feature dict; one line naming the file otherwise."""
    import torch

    from pr_specforge.data.io import brief
    from pr_specforge.data.validate import FEATURE_KEYS

    try:
        sample = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and not path.endswith(".gz"))
    except Exception as e:  # truncated, not a torch file, pickled objects
        raise ConfigError(f"feature file {path}: does not load ({brief(e)}); "
                          f"delete it and rerun the `pr-specforge data hidden-states` command that wrote {feats}") from None
    if not isinstance(sample, dict):
        raise ConfigError(f"feature file {path}: holds a {type(sample).__name__}, not a SpecForge EAGLE-3 feature dict")
    missing = [k for k in FEATURE_KEYS if k not in sample]
    if missing:
        raise ConfigError(f"feature file {path}: missing key(s) {missing}; not a SpecForge EAGLE-3 feature file")
    return sample


class FeatureSampleCheck:
    """`data validate`'s checks of one sample (`data.validate.sample_problem`: keys, shapes, widths, dtype, token
    ids in the vocab, a 1-D loss mask as long as input_ids, finite hidden states), made on every sample as a loader
    reads it, so a bad file anywhere in a features directory of any size ends the command in one line naming it
    and the field (`ConfigError`), at the cost of a few reductions per sample (no pass over the files at start).

    The hidden size and vocab are the draft config's (`target_hidden_size`, `vocab_size`); the dtype every sample
    must share is the one of the first file of its directory (`roots`: the features directories a run reads)."""

    def __init__(self, draft: Optional[dict], roots=()) -> None:
        draft = draft or {}
        hidden = draft.get("target_hidden_size") or draft.get("hidden_size")
        self.hidden = int(hidden) if hidden else None
        self.vocab = int(draft["vocab_size"]) if draft.get("vocab_size") else None
        self.roots = sorted({os.path.abspath(r) for r in roots if r}, key=len, reverse=True)
        self._first: dict = {}  # root -> (hidden width, dtype) of its first feature file

    def _reference(self, path: str):
        """`(hidden size, dtype)` a sample at `path` must have: the draft config's size, else (and for the dtype)
        its directory's first file's (read once per directory; loader threads may both read it, to the same
        value); None for a file under none of `roots` (another run's, in a process that ran this one: unchecked)."""
        full = os.path.abspath(path)
        root = next((r for r in self.roots if full.startswith(r.rstrip(os.sep) + os.sep)), None)
        if root is None:
            return None
        if root not in self._first:
            first = _first_feature_file(root)
            sample = _load_feature_file(first, root, mmap=True) if first else None
            hs = sample.get("hidden_state") if sample is not None else None
            self._first[root] = (int(hs.shape[-1]), hs.dtype) if hasattr(hs, "shape") else (None, None)
        width, dtype = self._first[root]
        return self.hidden or width, dtype

    def __call__(self, path: str, sample) -> None:
        reference = self._reference(path)
        if reference is None:
            return
        hidden, dtype = reference
        if hidden is None and isinstance(sample, dict) and hasattr(sample.get("hidden_state"), "shape"):
            hidden = int(sample["hidden_state"].shape[-1])
        from pr_specforge.data.validate import sample_problem

        problem = sample_problem(sample, hidden or 0, self.vocab, dtype)
        if problem:
            raise ConfigError(f"feature file {path}: {problem}; delete it or prepare the features again "
                              "(`pr-specforge data validate DIR` lists every bad file)")


def recipe_sample_check(recipe) -> FeatureSampleCheck:
    """The `FeatureSampleCheck` of a recipe's feature directories against its draft config."""
    from pr_specforge.data.io import read_json_object

    cfg = recipe.config
    path = cfg.model.draft_model_config
    draft = read_json_object(path, "model.draft_model_config:", error=ConfigError) if path and os.path.isfile(path) else None
    return FeatureSampleCheck(draft, (cfg.data.hidden_states_path, cfg.data.eval_hidden_states_path))


def check_feature_dir(field: str, feats: Optional[str], draft: Optional[dict], draft_path: Optional[str]):
    """The first feature file under `feats`, checked against the draft config (its width first, naming the draft
    config; then every check a loader makes of each sample, `FeatureSampleCheck`); None when unset. Later files
    are checked as they are read."""
    if not feats:
        return None
    if not os.path.isdir(feats):
        raise ConfigError(f"{field}: {feats!r} is not a directory (prepare features first)")
    first = _first_feature_file(feats)
    if first is None:
        raise ConfigError(f"{field}: no .ckpt feature files under {feats}")
    _check_manifest_status(field, feats)
    sample = _load_feature_file(first, feats)
    if draft is not None:
        target_hidden = int(draft.get("target_hidden_size") or draft.get("hidden_size"))
        width = int(sample["aux_hidden_state"].shape[-1])
        if width != 3 * target_hidden:
            raise ConfigError(
                f"feature file {first}: aux_hidden_state width {width} != 3 x target_hidden_size "
                f"({target_hidden}) of {draft_path}; the features come from a different target"
            )
    FeatureSampleCheck(draft, (feats,))(first, sample)
    return sample
