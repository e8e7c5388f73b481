"""Serving-time drafting (Sec. 5, Appendix C): the reconsidered draft tree, exact tree
verification by a `transformers` target, and the speculative decode loop — a PyTorch
reference implementation, not a production server."""

from pr_specforge.serving.batched_tree import BatchedTreeBuilder, BatchRequest  # noqa: F401
from pr_specforge.serving.decode import TREE_BUILDERS, DecodeResult, SpeculativeDecoder, autoregressive_decode  # noqa: F401
from pr_specforge.serving.drafter_runtime import DrafterRuntime, aux_layer_ids, check_compatible  # noqa: F401
from pr_specforge.serving.tensor_tree import TensorDraftTree, TensorTreeBuilder  # noqa: F401
from pr_specforge.serving.tree import DraftTree, Node, TreeConfig, build_tree, global_cut, tree_mask  # noqa: F401
from pr_specforge.serving.verify import (  # noqa: F401
    accept_greedy,
    accept_sampling,
    TreeLogits,
    commit_cache,
    output_head,
    sample_token,
    target_forward_tree,
)
