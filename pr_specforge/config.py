"""The `pr:` section of a recipe: Parallel Reconsideration's own settings, strictly validated.

SpecForge's `Config` forbids extra keys, so PR settings live beside it in the
recipe YAML under `pr:` and are parsed here. Every field where the paper leaves a
choice open is a field, with the default we use and why (see docs/method.md).

Owns: `ConfigError`; `PRDraftSettings`, the architecture-level settings a drafter's
config carries under `pr_config` (`max_depth`, the self-query width, what the gate
reads), declared and validated once; `PRConfig`, the whole `pr:` section (those plus
the objective's settings; parse, validate). Light: imports neither torch nor SpecForge.
Does not own SpecForge's own config (parsed by SpecForge) or recipe loading and
dotted overrides (`pr_specforge.training.recipe`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Mapping, Optional

RECONSIDER_WEIGHTS = ("use", "uniform")
RECON_HEADS = ("shared", "separate")
#: the largest R a drafter may be built with
MAX_SUPPORTED_DEPTH = 8
#: the draft config (config.json) field holding a PR drafter's `PRDraftSettings`
PR_CONFIG_KEY = "pr_config"
PR_SERVING_KEY = "pr_serving"  # an SGLang export's PR_EAGLE3 serving defaults: {"bw": int (optional), "m": int}
PR_SERVING_DEFAULT_M = 3  # the paper's m
RECON_GRADS = ("full", "isolated")
BALANCE_NORMS = ("per_minibatch", "per_position")
#: the one attention layout the pr algorithm trains with: it composes the attention of its co-forwarded rows itself
PR_ATTENTION_BACKEND = "sdpa"


class ConfigError(ValueError):
    """A recipe value is wrong; the message names the field and the fix."""


def check_attention_backend(value: str, where: str = "training.attention_backend") -> None:
    """The pr strategy's attention rule, checked at recipe load and by the training model alike."""
    if value != PR_ATTENTION_BACKEND:
        raise ConfigError(
            f"{where}={value!r} with the pr strategy: PR composes the attention of its co-forwarded rows "
            f"itself and supports only {PR_ATTENTION_BACKEND!r}; set training.attention_backend={PR_ATTENTION_BACKEND} "
            "(or leave it unset)"
        )


def _check_types(settings: Any, types: Mapping[str, Any]) -> None:
    for name, typ in types.items():
        value = getattr(settings, name)
        if isinstance(value, bool) and typ is not bool:
            raise ConfigError(f"pr.{name}: expected a number, got {value!r}")
        if not isinstance(value, typ):
            raise ConfigError(f"pr.{name}: expected {getattr(typ, '__name__', 'a number')}, got {value!r}")


@dataclass(frozen=True)
class PRDraftSettings:
    """Architecture-level PR settings, stored in the draft config under `pr_config`.

    max_depth: R, reconsideration passes per position (paper: 2). R = 0 is
        plain EAGLE-3 (no gate, no second rollout).
    self_query_hidden_size: width of the self-query MLP's hidden layer
        (default: the drafter's hidden size).
    gate_reads_normed: the gate reads `norm(f)` (the feature the head reads)
        rather than the raw pre-norm feature; the raw feature's scale grows
        with depth, the normed one does not. [choice; paper: `gate(f)`]
    recon_head: [choice] the readout of depths >= 1. "shared" (default, the
        equations' `head(f^r)`): the one-pass `norm` + `lm_head`, so the
        reconsideration terms also train the one-pass readout. "separate" (the
        prose's "second head and gate", App. I): their own final norm and lm_head
        (`pr_recon_head.*`), copied from the one-pass head at init and when
        warm-starting; the serving tree reads pi_{d_v} through it.
    recon_adapter_rank: rank of a low-rank adapter on every linear map of M that
        is active only on reconsideration rows (depth >= 1; `pr_recon_adapter.*`),
        so depth >= 1 has capacity of its own when the one-pass path is isolated or
        frozen; 0 = off (default). Every row of a step still runs in one batched call of M.
    post_norm_feedback: [choice] EAGLE-3.1's post-norm feedback: the next TTT (draft) step
        and the next reconsideration depth read `norm(f)`, the final-normed feature the
        one-pass head reads, instead of the pre-norm residual `f`. Training, the serving
        runtime and the SGLang export (`norm_output: true`) agree. Default False (EAGLE-3:
        the next step reads the pre-norm feature).
    """

    max_depth: int = 2
    self_query_hidden_size: Optional[int] = None
    gate_reads_normed: bool = True
    recon_head: str = "shared"
    recon_adapter_rank: int = 0
    post_norm_feedback: bool = False

    def __post_init__(self) -> None:
        _check_types(self, {"max_depth": int, "gate_reads_normed": bool, "recon_adapter_rank": int,
                            "post_norm_feedback": bool})
        if self.recon_head not in RECON_HEADS:
            raise ConfigError(f"pr.recon_head: expected one of {list(RECON_HEADS)}, got {self.recon_head!r}")
        if self.recon_adapter_rank < 0:
            raise ConfigError(f"pr.recon_adapter_rank: expected an integer >= 0 (0 = no adapter), got {self.recon_adapter_rank}")
        if not 0 <= self.max_depth <= MAX_SUPPORTED_DEPTH:
            raise ConfigError(
                f"pr.max_depth: R must be in [0, {MAX_SUPPORTED_DEPTH}] (paper: 2), got {self.max_depth}; "
                "set pr.max_depth=2"
            )
        if self.self_query_hidden_size is not None and (
            isinstance(self.self_query_hidden_size, bool) or not isinstance(self.self_query_hidden_size, int)
            or self.self_query_hidden_size < 1
        ):
            raise ConfigError(f"pr.self_query_hidden_size: expected null or an integer >= 1, got {self.self_query_hidden_size!r}")

    @classmethod
    def from_config(cls, config: Any) -> "PRDraftSettings":
        """The settings a draft config (a transformers config) carries under `pr_config`."""
        raw = getattr(config, PR_CONFIG_KEY, None) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"draft config field {PR_CONFIG_KEY!r} must be a mapping, got {type(raw).__name__}")
        allowed = {f.name for f in fields(PRDraftSettings)}
        unknown = set(raw) - allowed
        if unknown:
            raise ConfigError(f"draft config {PR_CONFIG_KEY}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        try:
            return PRDraftSettings(**raw)
        except ConfigError as e:
            raise ConfigError(f"draft config {PR_CONFIG_KEY}: {e}") from None

    def draft_settings(self) -> "PRDraftSettings":
        """The architecture-level part (itself for a `PRDraftSettings`)."""
        return PRDraftSettings(**{f.name: getattr(self, f.name) for f in fields(PRDraftSettings)})

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PRConfig(PRDraftSettings):
    """Parallel Reconsideration settings (`pr:` in a recipe): the drafter's `PRDraftSettings`
    (`max_depth`, `self_query_hidden_size`, `gate_reads_normed`) plus the objective's.

    balance_coef: beta of the balance term `-beta H(mean_p q)` (paper: 0.01).
    gate_detach_input: [choice] the gate reads a detached feature, so the gate
        term of Eq. 6 trains the gate alone; with False it also sends gradient
        into M, Q and fc through the features the gate reads. Default True:
        routing is learnt by the gate, and the features are shaped only by the
        head terms (what they are for).
    mix_context: [choice] whether the mixed cache (Eq. 7) also replaces the
        context rows (step-0 keys of earlier sequence positions) by their
        halt-depth keys. Default False: at serving the context is rebuilt from
        the target after every verification and is never reconsidered, so only
        the draft chain is mixed (train as you serve).
    one_pass_loss_on_mixed: [choice] also apply the unconditional one-pass term
        `l^0` to the depth-0 features of the mixed-cache rollout (steps >= 1).
        Default False: `l^0` lives on the one-pass rollout (Appendix B.2 scores
        each chain by its own terms); the mixed rollout's depth-0 features are
        trained through the continuation they seed and the gate term reads
        their detached loss.
    mixed_rollout_length: [choice] how many TTT steps the mixed-cache rollout
        runs (default None = the TTT length, so both rollouts cover the same
        positions). Smaller values trade fidelity for speed.
    reconsider_weight: [choice] the weight of the reconsidered heads' losses
        `l^r` (r >= 1) in Eq. 6. "use" (default, the paper): `sg[q(r)]`, each
        depth's head is trained where the gate routes to it. "uniform": weight 1,
        every depth's head is trained on every position (deep supervision); an
        ablation for the case where the gate settles on depth 0 before the deeper
        heads have learnt anything (they are then trained at a weight ~q(r) ~ 0).
    gradient_checkpointing: recompute each batched call of M in the backward pass
        instead of keeping its attention scores (the paper trains with gradient
        checkpointing). A PR step keeps ~4x the activations of an EAGLE-3 step,
        and the [rows x context] scores dominate at 4096 tokens. Same gradients;
        costs one extra forward of M per call.

    Recipe options of issue 16 (defaults reproduce the earlier numerics bitwise):
    recon_grad: [choice] "full" (default, the paper's design): the reconsideration
        and gate terms reach every shared parameter through rollout B. "isolated":
        they update only the reconsideration-only parameters (Q, the gate, the
        second head, the adapter); rollout B runs M, fc and the one-pass head with
        detached weights on detached one-pass inputs, so the one-pass drafter gets
        only `l^0`'s gradient and trains exactly as EAGLE-3.
    gate_init_bias: the gate's initial bias b (weight zero): lambda = sigmoid(b)
        everywhere at the start. 0.0 (default) gives q = (1/2, 1/4, 1/4) at R = 2;
        a negative bias starts with more weight on the deeper depths.
    balance_norm: [choice] the balance term's normalisation. "per_minibatch"
        (default, as before): `-beta H(q_bar)` once per minibatch, against head and
        gate terms summed over the TTT steps and averaged over all B*T rows (issue
        16 estimates an effective beta of ~0.004 at beta 0.01, TTT 7). "per_position" (Eq. 6 read
        per position): the term gets the head terms' normalisation, i.e. it is
        multiplied by `sum_j w_j * (scored rows at step j) / (B*T)`.
    init_from: start the one-pass drafter from a trained EAGLE-3 drafter: a
        SpecForge checkpoint dir (or its training_state.pt, or a run dir: latest)
        or an HF drafter directory (`config.json` + safetensors). Its EAGLE-3
        tensors are loaded; the `pr_` tensors start fresh. Default None.
    freeze_one_pass: keep every EAGLE-3 tensor of the drafter fixed (no gradient,
        not in the optimiser): only the reconsideration-only parameters train.
        Needs `init_from` (it adds reconsideration to an existing EAGLE-3
        drafter; without it a random one-pass drafter would be frozen: refused). Default False.
    """

    balance_coef: float = 0.01
    gate_detach_input: bool = True
    mix_context: bool = False
    one_pass_loss_on_mixed: bool = False
    mixed_rollout_length: Optional[int] = None
    gradient_checkpointing: bool = False
    reconsider_weight: str = "use"
    recon_grad: str = "full"
    gate_init_bias: float = 0.0
    balance_norm: str = "per_minibatch"
    init_from: Optional[str] = None
    freeze_one_pass: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_types(self, {
            "balance_coef": (int, float),
            "gate_detach_input": bool,
            "mix_context": bool,
            "one_pass_loss_on_mixed": bool,
            "gradient_checkpointing": bool,
            "gate_init_bias": (int, float),
            "freeze_one_pass": bool,
        })
        for name in ("balance_coef", "gate_init_bias"):  # a NaN passes every comparison and trains to NaN
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"pr.{name}: expected a finite number, got {getattr(self, name)!r}")
        if self.balance_coef < 0:
            raise ConfigError(
                f"pr.balance_coef: beta must be >= 0 (paper: 0.01), got {self.balance_coef}; a negative "
                "beta would reward collapsing onto one depth"
            )
        if self.reconsider_weight not in RECONSIDER_WEIGHTS:
            raise ConfigError(f"pr.reconsider_weight: expected one of {list(RECONSIDER_WEIGHTS)} (paper: 'use'), "
                              f"got {self.reconsider_weight!r}")
        for name, allowed in (("recon_grad", RECON_GRADS), ("balance_norm", BALANCE_NORMS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"pr.{name}: expected one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ConfigError(f"pr.init_from: expected null or a path to an EAGLE-3 drafter, got {self.init_from!r}")
        if self.freeze_one_pass and self.max_depth == 0:
            raise ConfigError("pr.freeze_one_pass: with pr.max_depth=0 nothing would train; set pr.max_depth >= 1")
        if self.freeze_one_pass and not self.init_from:
            raise ConfigError("pr.freeze_one_pass=true without pr.init_from would freeze a randomly initialised "
                              "one-pass drafter; set pr.init_from to a trained EAGLE-3 drafter, or drop freeze_one_pass")
        if self.mixed_rollout_length is not None and (
            isinstance(self.mixed_rollout_length, bool) or not isinstance(self.mixed_rollout_length, int) or self.mixed_rollout_length < 1
        ):
            raise ConfigError(f"pr.mixed_rollout_length: expected null or an integer >= 1, got {self.mixed_rollout_length!r}")

    @classmethod
    def from_mapping(cls, raw: Optional[Mapping[str, Any]], where: str = "pr") -> "PRConfig":
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping of PR settings, got {type(raw).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys: {sorted(allowed)}")
        return cls(**dict(raw))
