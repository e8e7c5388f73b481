"""The PR drafter and the two-layer EAGLE-3 control (importing this registers both architectures with SpecForge)."""

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
from pr_specforge.modeling.two_layer import (  # noqa: F401
    TWO_LAYER_ARCHITECTURE,
    LlamaForCausalLMEagle3TwoLayer,
)
