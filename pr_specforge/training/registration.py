"""The `pr` algorithm, registered with SpecForge and run by SpecForge's trainer.

Owns: `PRTrainStrategy` (a `DraftTrainStrategy` named `pr`), the algorithm spec
and providers (built from SpecForge's EAGLE-3 ones, so EAGLE-3 offline features
and vocab maps train PR unchanged), and `build_registry`, which returns
SpecForge's built-in registry with `pr` added.

Does not own: the objective math (`pr_specforge.training.objective`), recipe parsing and
process launch (`training.recipe`, `training.train`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch

from pr_specforge import _specforge as sf
from pr_specforge._specforge import Eagle3TrainStrategy, StepOutput
from pr_specforge.config import PR_ATTENTION_BACKEND, PRConfig
from pr_specforge.modeling.drafter import EAGLE3_ARCHITECTURE, PR_ARCHITECTURE, PR_PARAM_PREFIXES, pr_draft_config

ALGORITHM_NAME = "pr"


class PRTrainStrategy(Eagle3TrainStrategy):
    """SpecForge's EAGLE-3 step with the PR objective.

    Target preparation (TargetHead over stored final hidden states) is the
    parent's; the forward is `OnlinePRModel`, whose one-pass metrics keep
    SpecForge's structured names (`plosses`, `acces`, ...) and whose PR
    telemetry goes out as ratio metrics (`pr/...`), reduced across ranks
    as numerator/denominator sums before division.
    """

    name = ALGORITHM_NAME

    def forward_loss(self, batch, ctx=None):
        self.validate_batch(batch)
        t = batch.tensors
        device = sf.strategy_device(self)
        input_ids, target, loss_mask = sf.prepare_teacher(
            self, batch.metadata.get("target_repr"), t["input_ids"], t["target"], t["loss_mask"], device
        )
        hidden = t["hidden_state"].to(device)
        _check_feature_width(self.eagle3_model, hidden)
        position_ids = t.get("position_ids")
        out = self.eagle3_model(
            input_ids=input_ids,
            attention_mask=t["attention_mask"].to(device),
            loss_mask=loss_mask,
            target=target,
            hidden_states=hidden,
            position_ids=position_ids.to(device) if position_ids is not None else None,
        )
        metrics: Dict[str, Any] = {
            "plosses": [p.detach() for p in out.plosses],
            "acces": [a.detach() for a in out.acces],
            "acceptance_rates": [a.detach() for a in out.acceptance_rates],
            "acc_corrects": [c.detach() for c in out.acc_corrects],
            "acc_denoms": [d.detach() for d in out.acc_denoms],
            "metric_losses": [m.detach() for m in out.metric_losses],
            "metric_loss_denoms": [d.detach() for d in out.metric_loss_denoms],
        }
        metrics.update({f"pr/{k}": v for k, v in out.terms.items()})
        # non-padding tokens per sample: the tracker turns samples/s into tokens/s
        metrics["tokens_per_sample"] = t["attention_mask"].sum().float() / max(1, t["attention_mask"].shape[0])
        return StepOutput(loss=out.loss, metrics=metrics, ratio_metrics=dict(out.ratio_metrics))


def make_strategy(wrapped_model, *, target_head=None, ploss_decay: float = 0.8, **options) -> PRTrainStrategy:
    return PRTrainStrategy(wrapped_model, target_head=target_head, ploss_decay=ploss_decay, **options)


def _unwrap(model):
    while not hasattr(model, "draft_model") and hasattr(model, "module"):
        model = model.module
    return model


def _check_feature_width(training_model, hidden: torch.Tensor) -> None:
    draft = _unwrap(training_model).draft_model
    expected = 3 * int(draft.target_hidden_size)
    if hidden.shape[-1] != expected:
        raise ValueError(
            f"offline feature aux_hidden_state has width {hidden.shape[-1]} but the drafter expects "
            f"3 x target_hidden_size = {expected}; the features were captured from a different target "
            "(check data.hidden_states_path and the draft config's target_hidden_size)"
        )


def prepare_draft(draft, pr: PRConfig) -> None:
    """The recipe's start for a freshly built drafter: gate bias, `init_from`, `freeze_one_pass`.

    On resume SpecForge then loads the checkpoint over all of it (frozen tensors stay frozen)."""
    from pr_specforge.training import warm_start

    if pr.max_depth > 0 and pr.gate_init_bias != 0.0:
        draft.set_gate_bias(pr.gate_init_bias)
    if pr.init_from:
        warm_start.init_one_pass_from(draft, pr.init_from)
    if pr.freeze_one_pass:
        warm_start.freeze_one_pass(draft)


def _step_options(config) -> Dict[str, Any]:
    if config.training.compact_teacher:
        raise ValueError("training.compact_teacher is not supported by the pr algorithm; set training.compact_teacher=false")
    if config.training.lk_loss_type is not None:
        raise ValueError("training.lk_loss_type is not supported by the pr algorithm; leave it unset")
    return {}


def _build_offline_reader(hidden_states_path, *, run_id, ttt_length, max_len):
    from pr_specforge._specforge import OfflineManifestReader

    return OfflineManifestReader(
        hidden_states_path, run_id=run_id, strategy=ALGORITHM_NAME, ttt_length=ttt_length,
        max_len=max_len, target_repr="hidden_state",
    )


class _Providers:
    """The provider callbacks SpecForge calls for `pr`, bound to one run's PR settings."""

    def __init__(self, pr: PRConfig) -> None:
        self.pr = pr

    @staticmethod
    def build_step(wrapped_model, *, target_head=None, **options):
        return make_strategy(wrapped_model, target_head=target_head, **options)

    def resume_contract(self, config, draft_model, training_model) -> Dict[str, Any]:
        return {
            "pr_ttt_length": int(training_model.length),
            "pr_attention_backend": str(training_model.attention_backend),
            "pr_settings": self.pr.to_dict(),
        }

    def build_draft(self, config, draft_config):
        from pr_specforge._specforge import build_eagle3_draft
        from pr_specforge.modeling.drafter import rebuild_rope

        draft = build_eagle3_draft(config, pr_draft_config(draft_config, self.pr))
        rebuild_rope(draft)
        prepare_draft(draft, self.pr)
        if self.pr.max_depth == 0:
            # R = 0 is plain EAGLE-3: the PR parts are never used, so keep them out of DDP/optimiser.
            for name, p in draft.named_parameters():
                if name.startswith(PR_PARAM_PREFIXES):
                    p.requires_grad_(False)
        return draft

    def build_training_model(self, config, draft_model, draft_config, target_config, tokenizer):
        from pr_specforge._specforge import build_eagle3_model
        from pr_specforge.training.objective.ttt import OnlinePRModel

        parts = build_eagle3_model(config, draft_model, draft_config, target_config, tokenizer)
        model = OnlinePRModel(
            draft_model,
            length=config.training.ttt_length,
            attention_backend=config.training.attention_backend,
            pr=self.pr,
        )
        from pr_specforge.training.target_head import with_feature_dtype_head

        ref = parts.model
        model = model.to(device=next(ref.parameters()).device, dtype=next(ref.parameters()).dtype)
        return with_feature_dtype_head(dataclasses.replace(parts, model=model), config)


def _algorithm_spec(eagle3):
    """SpecForge's EAGLE-3 spec, renamed `pr`, accepting both drafter architectures, sdpa only."""
    base_spec = eagle3.algorithm_spec()
    return dataclasses.replace(
        base_spec,
        name=ALGORITHM_NAME,
        draft=dataclasses.replace(
            base_spec.draft,
            compatible_architectures={EAGLE3_ARCHITECTURE, PR_ARCHITECTURE},
            default_architecture=PR_ARCHITECTURE,
        ),
        capabilities=dataclasses.replace(
            base_spec.capabilities, attention_backends={PR_ATTENTION_BACKEND}, supports_compact_teacher=False
        ),
    )


def build_registration(pr: PRConfig):
    """An `AlgorithmRegistration` for `pr`, bound to these PR settings (SpecForge's EAGLE-3
    providers, with PR's step, drafter, training model and offline reader)."""
    import pr_specforge.modeling  # noqa: F401  (registers the draft architecture)
    from pr_specforge._specforge import make_registration
    from pr_specforge._specforge import eagle3_providers as eagle3

    bound = _Providers(pr)
    base = eagle3.algorithm_providers()
    providers = dataclasses.replace(
        base,
        algorithm_name=ALGORITHM_NAME,
        step=dataclasses.replace(
            base.step, build=bound.build_step, options=_step_options, resume_contract=bound.resume_contract,
        ),
        model=dataclasses.replace(
            base.model,
            draft_config=dataclasses.replace(
                base.model.draft_config, architecture=PR_ARCHITECTURE,
                compatible_architectures=frozenset({EAGLE3_ARCHITECTURE, PR_ARCHITECTURE}),
            ),
            build_draft=bound.build_draft,
            build_training_model=bound.build_training_model,
        ),
        offline=tuple(dataclasses.replace(o, build_reader=_build_offline_reader) for o in base.offline),
    )
    return make_registration(_algorithm_spec(eagle3), providers)


def _eagle3_training_model(build):
    """SpecForge's EAGLE-3 training-model provider, with the offline head scoring features in their own dtype
    (`training.target_head`: float32 offline training)."""
    def build_training_model(config, *args, **kwargs):
        from pr_specforge.training.target_head import with_feature_dtype_head

        return with_feature_dtype_head(build(config, *args, **kwargs), config)
    return build_training_model


def widen_eagle3(registration):
    """SpecForge's `eagle3` registration, also accepting the two-layer EAGLE-3 control's architecture
    (`modeling.two_layer`: its TTT loop calls the drafter's `backbone`, which runs both layers), its offline
    head scoring features in their own dtype (`training.target_head`)."""
    import pr_specforge.modeling  # noqa: F401  (registers the draft architectures)
    from pr_specforge._specforge import AlgorithmRegistration
    from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE

    spec, providers = registration.spec, registration.providers
    archs = frozenset({*spec.draft.compatible_architectures, TWO_LAYER_ARCHITECTURE})
    model = providers.model
    draft_config = dataclasses.replace(model.draft_config, compatible_architectures=frozenset(
        {*(model.draft_config.compatible_architectures or {model.draft_config.architecture}), TWO_LAYER_ARCHITECTURE}))
    return AlgorithmRegistration(
        spec=dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, compatible_architectures=archs)),
        providers=dataclasses.replace(providers, model=dataclasses.replace(
            model, draft_config=draft_config, build_training_model=_eagle3_training_model(model.build_training_model))))


def build_registry(pr: Optional[PRConfig] = None):
    """SpecForge's built-in algorithm registry with `pr` added and `eagle3` widened (`widen_eagle3`)."""
    from pr_specforge._specforge import AlgorithmRegistry, builtin_algorithm_registry

    builtin = [widen_eagle3(r) if r.name == "eagle3" else r for r in builtin_algorithm_registry()]
    return AlgorithmRegistry([*builtin, build_registration(pr or PRConfig())])
