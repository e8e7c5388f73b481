"""The one adapter between pr_specforge and SpecForge 0.2.0 internals.

Every import of a SpecForge symbol goes through this module, and every use of a
private SpecForge member (`_atomic_save`, `_init_rope`, `_rng_state`, the trainer's
module-level factories, and the private methods our subclasses build on: `_prepare_target`,
`_acc_and_loss`, `_prepare_position_ids`, ... each under a name of ours such as
`prepare_teacher`, `step_acc_and_loss`), so a SpecForge upgrade touches one file.

Runtime patches: importing this module changes nothing in SpecForge. The patches
are explicit calls, made by training (`pr_specforge.training.train.install_training_runtime`)
and by the few tools that run SpecForge's loss on CPU:
  * `install_cpu_loss`: SpecForge's soft cross-entropy (`specforge.core.loss.LogSoftmaxLoss`)
    is a Triton kernel, which cannot run on CPU; CPU tensors go to the same math in
    plain PyTorch, CUDA tensors stay on the original kernel;
  * `wrap_evaluate`: SpecForge's eval pass runs through a wrapper of ours (the PR-aware
    acceptance simulator adds its `sim/` metrics to the pass's `eval/` ones);
  * `wrap_train_step`: the trainer's step, checked by training for a non-finite loss;
  * `wrap_trainer_logger`, `use_checkpoint_manager`, `use_training_backend`, `use_feature_store`:
    the factories SpecForge's assembly, trainer and launcher look up by module-level name (the
    metrics sink, the recipe-carrying checkpoint manager, the DeepSpeed backend, online
    training's conversation store); each remembers
    SpecForge's original, so installing twice does not wrap twice and
    `restore_training_backend` undoes the backend.

SpecForge's import-time notice that flash_attn is not installed is silenced here (`FLASH_ATTN_NOTICE`, that one
warning only), so a command's one-line error is one line.

It deliberately does not re-export anything it does not use.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

#: the notice SpecForge's drafter module gives at import where flash_attn is not installed (it then uses another
#: attention backend): two lines before every command's own output, one-line errors included; nothing else is hidden
FLASH_ATTN_NOTICE = "flash_attn is not found"

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=FLASH_ATTN_NOTICE, category=UserWarning)
    import specforge.algorithms.eagle3.model as _eagle3_model_mod
    import specforge.distributed as _distributed_module
    import specforge.launch as _launch_module
    import specforge.training.assembly as _assembly_module
    import specforge.training.trainer as _trainer_module
    from specforge.algorithms.builtin import builtin_algorithm_registry  # noqa: F401
    from specforge.algorithms.common.providers import make_registration  # noqa: F401
    from specforge.algorithms.eagle3 import providers as eagle3_providers  # noqa: F401
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: F401
    from specforge.algorithms.eagle3.model import _compute_target_p_padded
    from specforge.algorithms.model_providers import (  # noqa: F401
        build_eagle3_draft,
        build_eagle3_model,
        resolve_eagle_capture_layers,
    )
    from specforge.algorithms.registry import AlgorithmRegistration, AlgorithmRegistry  # noqa: F401
    from specforge.application import bind_run, resolve_run  # noqa: F401
    from specforge.cli import _train as train_resolved_run  # noqa: F401
    from specforge.config import Config  # noqa: F401
    from specforge.config.schema import apply_overrides, migrate_legacy_config  # noqa: F401
    from specforge.core.loss import LogSoftmaxLoss as _TritonLogSoftmaxLoss
    from specforge.data.preprocessing import preprocess_conversations  # noqa: F401
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate  # noqa: F401
    from specforge.distributed import destroy_distributed, init_distributed  # noqa: F401
    from specforge.export.checkpoint_io import resolve_training_state  # noqa: F401
    from specforge.lr_scheduler import ConstantWarmupLR, CosineAnnealingWarmupLR  # noqa: F401
    from specforge.modeling.target.target_head import TargetHead  # noqa: F401
    from specforge.modeling.draft.llama3_eagle import (  # noqa: F401
        LlamaAttention,
        LlamaForCausalLMEagle3,
        LlamaMLP,
        LlamaMutiRotaryEmbedding,
        LlamaRMSNorm,
        apply_rotary_pos_emb,
        repeat_kv,
    )
    from specforge.modeling.draft.registry import DRAFT_REGISTRY, register_draft  # noqa: F401
    from specforge.runtime.contracts import TrainBatch  # noqa: F401
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore  # noqa: F401
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader  # noqa: F401
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig, TrainingBackend  # noqa: F401
    from specforge.training.checkpoint import STATE_FILE, CheckpointManager  # noqa: F401
    from specforge.training.controller import TrainerController  # noqa: F401  (progress hook)
    from specforge.training.controller import TrainerCore as _TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy, StepOutput  # noqa: F401
    from specforge.training.tracking import TrackerLogger, scalar_metrics, training_metric_names  # noqa: F401
    from specforge.utils import padding  # noqa: F401


def simulated_acc_len(per_position_acc):
    """SpecForge's chain estimate a0 + a0*a1 + ... (its eval loop's `eval/simulated_acc_len`)."""
    from specforge.eval.evaluator import Evaluator

    return Evaluator._simulated_acc_len(list(per_position_acc))


def controller_strategy(controller):
    """The step strategy a SpecForge `TrainerController` runs."""
    return controller.core.strategy


@contextlib.contextmanager
def observe_step_scores(model, observe: Callable[..., None]):
    """While open, every TTT step an `OnlineEagle3Model` (or subclass) scores also calls
    `observe(result, **views)`: SpecForge's per-step scoring (`_acc_and_loss`) with its keyword
    views (`logits`, `target_p`, `target_p_on_draft`, `target_token_ids`, `position_mask`,
    `loss_mask`, `adapter`) and its result `(acc, acceptance rate, loss, correct, denom, ...)`."""
    original = model._acc_and_loss
    shadowed = "_acc_and_loss" in vars(model)  # an observer already open (they nest)

    def scored(**views):
        result = original(**views)
        observe(result, **views)
        return result

    model._acc_and_loss = scored
    try:
        yield
    finally:
        if shadowed:
            model._acc_and_loss = original
        else:
            del model._acc_and_loss


def eagle_capture_layers(draft_config: Any, target_config: Any, override: Optional[List[int]] = None) -> List[int]:
    """SpecForge's EAGLE capture-layer rule, the one owner of it: the run's override, else the draft
    config's `eagle_config.eagle_aux_hidden_state_layer_ids`, else `[1, L//2 - 1, L - 4]` of the target
    (layer outputs). `target_config` is read only in the last case."""
    from types import SimpleNamespace

    run = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=override))
    return resolve_eagle_capture_layers(run, draft_config, target_config)


def target_layer_count(num_layers: int) -> Any:
    """A stand-in target config of `num_layers` layers, for `eagle_capture_layers`."""
    from types import SimpleNamespace

    return SimpleNamespace(num_hidden_layers=int(num_layers))


def bootstrap_single_process_env() -> None:
    """SpecForge's one-process rendezvous variables (RANK/WORLD_SIZE/MASTER_*), as its CLI sets them."""
    from specforge.cli import _bootstrap_single_process_env

    _bootstrap_single_process_env()


def build_training_run(cfg, *, algorithm):
    """SpecForge's run assembly (model bundle, offline loader, trainer), without fitting."""
    from specforge.training.assembly import build_training_run as _build

    return _build(cfg, algorithm=algorithm)


def trainer_strategy(trainer):
    """The step strategy an assembled SpecForge `Trainer` runs (its controller's core)."""
    return trainer._controller.core.strategy


def trainer_loader(trainer):
    """The feature loader of an assembled SpecForge `Trainer`."""
    return trainer._loader


def load_offline_capture(*args, **kwargs):
    """SpecForge's SGLang capture entry point (imports SGLang's GPU stack: only called on GPU)."""
    from specforge.offline_capture import load_offline_capture as _load

    return _load(*args, **kwargs)


def soft_cross_entropy_rows(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy `-(p * log_softmax(logits)).sum(-1)` in fp32.

    This is the per-position loss `l_p^r` of Eq. 6 (the same one SpecForge's
    EAGLE-3 uses), before masking and averaging.
    """
    return -(target_p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


class CpuSafeLogSoftmaxLoss:
    """Drop-in for `LogSoftmaxLoss.apply`: Triton on CUDA, plain torch elsewhere.

    The torch path computes `(-(p * log_softmax(logits)).sum(-1) * mask).mean()`
    over all B*T rows: exactly the reduction of SpecForge's kernel.
    """

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor):
        if logits.is_cuda:
            return _TritonLogSoftmaxLoss.apply(logits, target_p, position_mask)
        rows = soft_cross_entropy_rows(logits, target_p)
        return (rows * position_mask.squeeze(-1).to(rows.dtype)).mean()


# ------------------------------------------------------------------ runtime patches
_ORIGINALS: Dict[Tuple[str, str], Any] = {}


def _original(module, name: str):
    """SpecForge's own value of `module.name`, before any patch of ours."""
    return _ORIGINALS.get((module.__name__, name), getattr(module, name))


def _patch(module, name: str, value) -> None:
    _ORIGINALS.setdefault((module.__name__, name), getattr(module, name))
    setattr(module, name, value)


def _restore(module, name: str) -> None:
    original = _ORIGINALS.pop((module.__name__, name), None)
    if original is not None:
        setattr(module, name, original)


def install_cpu_loss() -> None:
    """Route SpecForge's EAGLE-3 loss through `CpuSafeLogSoftmaxLoss` (idempotent)."""
    _patch(_eagle3_model_mod, "LogSoftmaxLoss", CpuSafeLogSoftmaxLoss)


def wrap_trainer_logger(wrap: Callable[[Any, Any], Any]) -> None:
    """Every logger SpecForge's assembly builds becomes `wrap(logger, config)` (idempotent)."""
    original = _original(_assembly_module, "_configured_logger")
    _patch(_assembly_module, "_configured_logger", lambda cfg: wrap(original(cfg), cfg))


def wrap_train_step(wrap: Callable[[Any], Any]) -> None:
    """SpecForge's one training step (`TrainerCore.train_step(self, batch, ctx)`, returning a
    `StepResult` whose boundary metrics are reduced over ranks) becomes `wrap(original)` (idempotent)."""
    _patch(_TrainerCore, "train_step", wrap(_original(_TrainerCore, "train_step")))


def use_checkpoint_manager(cls) -> None:
    """SpecForge's trainer builds its checkpoint manager from `cls` (a `checkpoint_manager_base()` subclass)."""
    _patch(_trainer_module, "CheckpointManager", cls)


def use_feature_store(cls) -> None:
    """SpecForge's launcher builds its local feature store from `cls` (online training's conversation store)."""
    _patch(_launch_module, "LocalFeatureStore", cls)


def use_training_backend(cls) -> None:
    """SpecForge's trainer builds its training backend from `cls` instead of `FSDPTrainingBackend`."""
    _patch(_trainer_module, "FSDPTrainingBackend", cls)


def restore_training_backend() -> None:
    """Undo `use_training_backend` (tests; in-process reuse)."""
    _restore(_trainer_module, "FSDPTrainingBackend")


def wrap_destroy_distributed(wrap: Callable[[Any], Any]) -> None:
    """SpecForge's CLI tears its process groups down with `wrap(original destroy_distributed)`."""
    _patch(_distributed_module, "destroy_distributed", wrap(_original(_distributed_module, "destroy_distributed")))


def restore_destroy_distributed() -> None:
    """Undo `wrap_destroy_distributed`."""
    _restore(_distributed_module, "destroy_distributed")


def checkpoint_manager_base():
    """SpecForge's `CheckpointManager` with its per-file atomic write exposed as `write_file(obj, path)`.

    SpecForge writes every checkpoint file through the private `_atomic_save`; a subclass of the
    returned class overrides the public `write_file` instead (default: SpecForge's own write)."""

    class CheckpointManagerBase(CheckpointManager):
        def write_file(self, obj: Any, path: str) -> None:
            CheckpointManager._atomic_save(obj, path)

        def _atomic_save(self, obj: Any, path: str) -> None:
            self.write_file(obj, path)

    return CheckpointManagerBase


def latest_checkpoint_dir(run_dir: str, run_id: str):
    """SpecForge's newest complete checkpoint of run `run_id` under `run_dir`, or None."""
    return CheckpointManager(run_dir, run_id).latest_dir()


def rng_state() -> Dict[str, Any]:
    """The RNG state SpecForge's backends checkpoint (python, numpy, torch, cuda)."""
    return FSDPTrainingBackend._rng_state()


def set_rng_state(state: Dict[str, Any]) -> None:
    FSDPTrainingBackend._set_rng_state(state)


def init_rope(attention) -> None:
    """Rebuild a SpecForge drafter attention's rotary embedding from its config."""
    attention._init_rope()


# ---------------------------------------------------------------------------------------------
# SpecForge's private methods that our subclasses build on, each under a name of ours. Nothing
# outside this module calls a SpecForge-private member (tests/test_architecture.py checks it).


def strategy_device(strategy) -> torch.device:
    """The device an `Eagle3TrainStrategy` (or a subclass) steps on."""
    return strategy._device()


def prepare_teacher(strategy, target_repr, input_ids, target, loss_mask, device):
    """`(input_ids, target, loss_mask)` as SpecForge's EAGLE-3 step prepares them from a batch
    (the frozen `TargetHead` over stored final hidden states, or a compact teacher)."""
    return strategy._prepare_target(target_repr, input_ids, target, loss_mask, device)


def teacher_distributions(*, target, t2d, loss_mask, length: int):
    """SpecForge's padded teacher: `(target_p, target_p on the draft vocab, target ids, position mask)`
    for `length` TTT steps."""
    return _compute_target_p_padded(target=target, t2d=t2d, loss_mask=loss_mask, length=length)


def draft_position_ids(model, position_ids, seq_length: int, device):
    """The position ids an `OnlineEagle3Model` gives its drafter (`arange` when none are given)."""
    return model._prepare_position_ids(position_ids, seq_length=seq_length, past_key_values_length=0, device=device)


def loss_adapter(model):
    """The loss adapter an `OnlineEagle3Model` scores each TTT step with."""
    return model._make_adapter()


def step_acc_and_loss(model, **views):
    """SpecForge's per-TTT-step `(acc, acceptance rate, loss, correct, denom, metric loss, loss denom)`."""
    return model._acc_and_loss(**views)


def reader_sample_ref(reader, index: int, uri: str):
    """The `SampleRef` an `OfflineManifestReader` makes for its `index`-th sample at `uri`."""
    return reader._ref_for(index, uri)


def lease_sample(store, sample_ref):
    """A `LocalFeatureStore` lease for `sample_ref` (what its `get` returns beside the tensors)."""
    return store._register_file_lease(sample_ref)


def install_feature_file_errors(check: Optional[Callable[[str, Any], None]] = None) -> None:
    """A feature file that fails to load mid-run raises one error naming it and the fix; with `check`, every
    sample SpecForge's loader reads is passed to `check(path, sample)` first, which raises on a bad one (a loader
    thread's error reaches the trainer as it is). Installing again replaces the check.

    SpecForge's loader reads files lazily (`feature_store.load_feature_file`); torch's own error
    ("failed finding central directory") does not say which file."""
    import specforge.runtime.data_plane.feature_store as feature_store
    import specforge.runtime.data_plane.offline_reader as offline_reader

    original = _original(feature_store, "load_feature_file")

    def load_feature_file(path: str):
        try:
            sample = original(path)
        except Exception as e:
            from pr_specforge.config import ConfigError
            from pr_specforge.data.io import brief

            raise ConfigError(
                f"feature file {path}: does not load ({brief(e)}); delete it and rerun the "
                "`pr-specforge data hidden-states` command that wrote it (`pr-specforge data validate DIR` lists every bad file)"
            ) from None
        if check is not None:
            check(path, sample)
        return sample

    _patch(feature_store, "load_feature_file", load_feature_file)
    _patch(offline_reader, "load_feature_file", load_feature_file)


def wrap_evaluate(wrap: Callable[[Any, Any, Callable], Any]) -> None:
    """SpecForge's controller runs each eval pass as `wrap(controller, data, original evaluate)` (idempotent)."""
    original = _original(TrainerController, "evaluate")
    _patch(TrainerController, "evaluate", lambda controller, data: wrap(controller, data, original))


def wrap_progress_bar(wrap: Callable[[Any, Any], Any]) -> None:
    """SpecForge's controller starts fitting with `wrap(controller, its own step bar or None)` (idempotent)."""
    original = _original(TrainerController, "_make_progress_bar")
    _patch(TrainerController, "_make_progress_bar", lambda controller: wrap(controller, original(controller)))
