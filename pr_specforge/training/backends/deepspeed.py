"""The DeepSpeed ZeRO-1/2 backend selected by `backend: {name: deepspeed, config: ...}`.

Seam: SpecForge's `Trainer` (specforge/training/trainer.py) builds its backend as
`FSDPTrainingBackend(parallel, optimizer_factory=...)` and then calls
`prepare_model(model, optimizer_target=model.draft_model)`.  `install_deepspeed_backend`
rebinds that one module-level name to a `DeepSpeedTrainingBackend` subclass that
carries the recipe; nothing else in SpecForge's trainer/controller changes.

What the backend does, against SpecForge's own BF16Optimizer math:
* `deepspeed.initialize` over the composite training model with a client
  `torch.optim.AdamW` on the draft's trainable params (betas 0.9/0.999, eps 1e-8,
  weight_decay 0 -- BF16Optimizer's AdamW) and SpecForge's own warmup+cosine /
  constant scheduler (`specforge.lr_scheduler`), stepped by the engine once per
  optimizer step, with the horizon SpecForge's assembly resolved
  (`optimizer_factory.total_steps`);
* ZeRO stage from the JSON (1 or 2); the "auto" fields are filled from the recipe:
  micro batch = training.batch_size, accumulation = training.accumulation_steps,
  clipping = training.max_grad_norm;
* precision follows the recipe's model dtype (the one SpecForge computes in):
  bf16 params -> DeepSpeed bf16 (bf16 compute, fp32 master partitions); fp32 params
  -> fp32 throughout. A JSON `bf16.enabled` that disagrees is logged and overridden;
  fp16 is refused;
* accumulation: SpecForge already divides the loss by accumulation_steps and tells
  the backend which micro-step is the boundary, so backward passes
  `scale_wrt_gas=False` and sets the engine's boundary explicitly;
* checkpoints: `state_dict()` = rank-0 full composite-model state (what DDP gives),
  this rank's ZeRO optimizer partition (fp32 masters + Adam moments) + scheduler,
  and RNG; `optimizer_state_is_replicated` is False so SpecForge's controller writes
  the optimizer into `training_state_rank{r}.pt`. Resume restores the masters exactly
  (`load_from_fp32_weights=True`); the world size must match (SpecForge already
  refuses per-rank state from a different world size).
"""

from __future__ import annotations

import copy
import logging
import os
import weakref
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from pr_specforge._specforge import ParallelConfig, TrainingBackend, rng_state, set_rng_state

log = logging.getLogger(__name__)

#: engines this process built, for the teardown (see `release_deepspeed_groups`)
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def _config_error(message: str):
    from pr_specforge.config import ConfigError

    return ConfigError(message)


def resolve_deepspeed_config(raw: Dict[str, Any], training: Any, *, world_size: int,
                             param_dtype: torch.dtype) -> Dict[str, Any]:
    """The DeepSpeed JSON with its "auto" fields filled from the recipe's training section."""
    ds = copy.deepcopy(dict(raw))
    if ds.get("optimizer") or ds.get("scheduler"):
        raise _config_error("deepspeed JSON: drop the 'optimizer'/'scheduler' sections; the recipe's training section "
                            "drives AdamW and SpecForge's warmup+cosine schedule")
    if (ds.get("fp16") or {}).get("enabled"):
        raise _config_error("deepspeed JSON: fp16 is not supported (SpecForge trains in bf16 or fp32); use bf16")
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (1, 2):
        raise _config_error(f"deepspeed JSON: zero_optimization.stage={stage}; supported stages are 1 and 2")
    micro, gas = int(training.batch_size), int(training.accumulation_steps)
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = gas
    ds["train_batch_size"] = micro * gas * world_size
    ds["gradient_clipping"] = float(training.max_grad_norm)
    want_bf16 = param_dtype == torch.bfloat16
    bf16 = dict(ds.get("bf16") or {})
    if bool(bf16.get("enabled", False)) != want_bf16 and bf16.get("enabled") != "auto":
        log.warning("deepspeed JSON bf16.enabled=%s but the recipe's model dtype is %s; following the model dtype "
                    "(SpecForge computes in the model dtype with fp32 master weights)", bf16.get("enabled"), param_dtype)
    bf16["enabled"] = want_bf16
    ds["bf16"] = bf16
    ds.pop("fp16", None)
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("steps_per_print", 1 << 30)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


class _LearningRateView:
    """What SpecForge's controller reads from `backend.optimizer` for logging."""

    def __init__(self, engine):
        self._engine = engine

    def get_learning_rate(self) -> float:
        return float(self._engine.optimizer.param_groups[0]["lr"])


class DeepSpeedTrainingBackend(TrainingBackend):
    """ZeRO-1/2 data parallel in place of SpecForge's FSDP/DDP backend (see module doc)."""

    name = "deepspeed"
    optimizer_state_is_replicated = False  # ZeRO partitions: one optimizer shard per rank file

    # Set by install_deepspeed_backend on the bound subclass.
    ds_json: Dict[str, Any] = {}
    training_config: Any = None

    def __init__(self, parallel_config: ParallelConfig, *, optimizer_factory=None) -> None:
        self.parallel_config = parallel_config
        self._optimizer_factory = optimizer_factory
        self.module: Optional[nn.Module] = None
        self.engine = None
        self.optimizer = None
        self.resolved_config: Optional[Dict[str, Any]] = None
        self._scale_pending = False

    # ------------------------------------------------------------------ setup
    def _training(self):
        cfg = getattr(self._optimizer_factory, "cfg", None)
        return cfg.training if cfg is not None else self.training_config.training

    def _total_steps(self) -> int:
        total = getattr(self._optimizer_factory, "total_steps", None)
        if total is None:
            t = self._training()
            total = t.total_steps or t.max_steps
        if not total:
            raise RuntimeError("deepspeed backend: the optimizer horizon (total_steps) was not resolved before assembly")
        return int(total)

    def prepare_model(self, model: nn.Module, *, wrap: bool = True,
                      optimizer_target: Optional[nn.Module] = None) -> nn.Module:
        import deepspeed
        import torch.distributed as dist

        from pr_specforge._specforge import ConstantWarmupLR, CosineAnnealingWarmupLR

        t = self._training()
        target = optimizer_target if optimizer_target is not None else model
        params = [p for p in target.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("deepspeed backend: the optimizer target has no trainable parameters")
        param_dtype = params[0].dtype
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.resolved_config = resolve_deepspeed_config(self.ds_json, t, world_size=world, param_dtype=param_dtype)
        schedulers = {"constant": ConstantWarmupLR, "cosine": CosineAnnealingWarmupLR}
        if t.lr_scheduler not in schedulers:
            raise ValueError(f"unsupported lr_scheduler={t.lr_scheduler!r}; expected one of {sorted(schedulers)}")
        total = self._total_steps()
        warmup = int(t.warmup_ratio * total)
        scheduler_cls = schedulers[t.lr_scheduler]
        self.lr_scheduler_type = t.lr_scheduler
        self.max_grad_norm = float(t.max_grad_norm)

        # The same AdamW BF16Optimizer builds (torch defaults betas=(0.9, 0.999), eps=1e-8).
        base_optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

        def make_scheduler(optimizer):
            return scheduler_cls(optimizer, total_steps=total, warmup_steps=warmup)

        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=base_optimizer, lr_scheduler=make_scheduler,
            config=self.resolved_config, dist_init_required=False,
        )
        self.engine = engine
        _ENGINES.add(engine)
        self.module = engine
        self.zero_optimizer = optimizer
        self.scheduler = scheduler
        self.optimizer = _LearningRateView(engine)
        if dist.is_initialized() and dist.get_rank() == 0:
            log.info("deepspeed backend: ZeRO-%d, bf16=%s, micro=%d, gas=%d, clip=%s, %s schedule over %d steps (warmup %d)",
                     self.resolved_config["zero_optimization"]["stage"], self.resolved_config["bf16"]["enabled"],
                     t.batch_size, t.accumulation_steps, t.max_grad_norm, t.lr_scheduler, total, warmup)
        return engine

    # ------------------------------------------------------------------ step
    def backward(self, loss: torch.Tensor, *, is_boundary: bool = True) -> None:
        # SpecForge already divided the loss by accumulation_steps and owns the boundary.
        self.engine.set_gradient_accumulation_boundary(bool(is_boundary))
        self.engine.backward(loss, scale_wrt_gas=False)

    def scale_gradients(self, factor: torch.Tensor) -> None:
        """Multiply the reduced gradients by `factor` before clipping (SpecForge's token-count normalisation).

        After the boundary backward ZeRO holds the gradients in its partitions; its step
        divides them (and the norm used for clipping) by the optimizer's loss scale, so an
        external loss scale of 1/factor is exactly a gradient scale by `factor`.
        """
        scale = float(torch.as_tensor(factor).reshape(()).item())
        if scale <= 0:
            raise ValueError(f"gradient scale must be positive, got {scale}")
        self.zero_optimizer.custom_loss_scaler = True  # override_loss_scale without its per-step info log
        self.zero_optimizer.external_loss_scale = 1.0 / scale
        self._scale_pending = True

    def step(self) -> Optional[torch.Tensor]:
        if self.engine is None:
            raise RuntimeError("DeepSpeedTrainingBackend.step called before prepare_model")
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.step()
        finally:
            if self._scale_pending:
                self.zero_optimizer.custom_loss_scaler = False
                self.zero_optimizer.external_loss_scale = None
                self._scale_pending = False
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(norm, dtype=torch.float32).detach().reshape(())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        import torch.distributed as dist

        if self.engine is None:
            raise RuntimeError("state_dict called before prepare_model")
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        model_state = {k: v.detach().cpu() for k, v in self.engine.module.state_dict().items()} if rank0 else {}
        return {
            "model": model_state,
            "optimizer": {
                "backend": self.name,
                "zero_stage": self.resolved_config["zero_optimization"]["stage"],
                "zero_optimizer": self.zero_optimizer.state_dict(),
                "scheduler_state_dict": self.scheduler.state_dict(),
                "lr_scheduler_type": self.lr_scheduler_type,
                "max_grad_norm": self.max_grad_norm,
                "global_steps": int(self.engine.global_steps),
            },
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        import torch.distributed as dist

        if state.get("model"):
            self.engine.module.load_state_dict(state["model"])
        opt = state.get("optimizer")
        if opt is not None:
            if opt.get("backend") != self.name:
                raise ValueError("checkpoint optimizer state was not written by the deepspeed backend "
                                 f"(backend={opt.get('backend', 'fsdp')!r}); resume with the backend it was written with")
            stage = self.resolved_config["zero_optimization"]["stage"]
            if opt.get("zero_stage") != stage:
                raise ValueError(f"checkpoint was written with ZeRO-{opt.get('zero_stage')}, this run is ZeRO-{stage}")
            if opt.get("lr_scheduler_type") != self.lr_scheduler_type:
                raise ValueError(f"checkpoint used lr_scheduler={opt.get('lr_scheduler_type')!r}, "
                                 f"this run has {self.lr_scheduler_type!r}")
            if float(opt.get("max_grad_norm", self.max_grad_norm)) != self.max_grad_norm:
                raise ValueError(f"checkpoint used max_grad_norm={opt.get('max_grad_norm')}, this run has {self.max_grad_norm}")
            world = dist.get_world_size(group=self.zero_optimizer.dp_process_group) if dist.is_initialized() else 1
            # Rigid (same world size) ZeRO load: index dp_rank of the list is this rank's own partition.
            self.zero_optimizer.load_state_dict([opt["zero_optimizer"]] * world, load_optimizer_states=True,
                                                load_from_fp32_weights=True)
            self.scheduler.load_state_dict(opt["scheduler_state_dict"])
            self.engine.global_steps = int(opt.get("global_steps", 0))
            self.engine.global_samples = self.engine.global_steps * self.engine.train_batch_size()
        if state.get("rng") is not None:
            set_rng_state(state["rng"])


def release_deepspeed_groups() -> int:
    """Destroy this process's engines and drop DeepSpeed's process-group handles; returns how many handles.

    ZeRO communicates over DeepSpeed's own clone of the world group (`groups._WORLD_GROUP`,
    made by `dist.new_group`), a gloo group with its own TCP connections, event-loop thread
    and two worker threads. Two references kept it alive after SpecForge's
    `destroy_distributed`: that module global, and the ZeRO optimizer itself, which its
    gradient hooks (closures held by autograd's C++ nodes, invisible to `gc`) never let
    go. So the group's native threads were still running while the interpreter shut down,
    and a rank whose peer had already exited could abort ("terminate called without an
    active exception", tests/training/test_deepspeed.py on a busy machine). With the hooks
    removed (`engine.destroy()`) and the global dropped, the group is destroyed, its
    threads joined, inside `destroy_process_group`, while every rank is still alive.
    """
    import gc

    import torch.distributed as dist
    from deepspeed.utils import groups

    for engine in list(_ENGINES):
        engine.destroy()
    _ENGINES.clear()
    released = 0
    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(groups, name, None)
            released += 1
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()
            released += 1
    gc.collect()  # the engine and its ZeRO optimizer (which hold the group too) sit in reference cycles
    return released


def _ordered_teardown(destroy):
    """SpecForge's `destroy_distributed`, preceded by a barrier (on success) and the release of DeepSpeed's groups."""
    import sys

    def destroy_distributed():
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1 and sys.exc_info()[0] is None:
            dist.barrier()  # no rank closes its connections while a peer still has a collective in flight
        if dist.is_initialized():
            release_deepspeed_groups()
        destroy()
        import gc

        gc.collect()  # DeviceMesh objects hold their groups in reference cycles
        left = _gloo_threads()
        if left is not None:
            log.info("distributed teardown: %d gloo threads left", left)

    destroy_distributed.__wrapped__ = destroy
    return destroy_distributed


def _gloo_threads() -> Optional[int]:
    """Live gloo worker threads of this process (Linux: thread names in /proc), or None elsewhere."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return count


def install_deepspeed_backend(backend: Any, config: Any) -> None:
    """Make SpecForge's trainer build a DeepSpeedTrainingBackend (idempotent, per process)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:  # pragma: no cover - deepspeed is a declared dependency here
        raise _config_error(f"backend.name=deepspeed needs the deepspeed package ({exc}); pip install deepspeed") from exc
    from pr_specforge._specforge import use_training_backend, wrap_destroy_distributed

    backend.validate_against(config)
    bound = type("BoundDeepSpeedTrainingBackend", (DeepSpeedTrainingBackend,),
                 {"ds_json": backend.deepspeed_json(), "training_config": config})
    use_training_backend(bound)
    wrap_destroy_distributed(_ordered_teardown)


def uninstall_deepspeed_backend() -> None:
    """Restore SpecForge's own backend factory (tests; in-process reuse)."""
    from pr_specforge._specforge import restore_destroy_distributed, restore_training_backend

    restore_training_backend()
    restore_destroy_distributed()
