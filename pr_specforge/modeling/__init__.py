"""The PR drafter (importing this registers `LlamaForCausalLMEagle3PR` with SpecForge)."""

from pr_specforge.modeling.drafter import (  # noqa: F401
    EAGLE3_ARCHITECTURE,
    PR_ARCHITECTURE,
    PR_CONFIG_KEY,
    PR_PARAM_PREFIXES,
    HaltGate,
    LlamaForCausalLMEagle3PR,
    PRDraftSettings,
    SelfQuery,
    build_pr_config,
    halting_distribution,
    load_drafter,
    rebuild_rope,
)
