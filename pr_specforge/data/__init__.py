"""Data preparation for PR/EAGLE-3 drafters: chat datasets -> target hidden states.

The pipeline is three resumable steps, each a library function with a thin CLI
(`pr_specforge.data.cli`, mounted as `pr-specforge data ...`):

1. `conversations.prepare_conversations`  dataset -> normalised JSONL
2. `regenerate.regenerate_conversations`   assistant turns -> the target's own replies
3. `hidden_states.prepare_hidden_states`   JSONL -> SpecForge offline `.ckpt` features

plus `smollm2.convert_smollm2_gguf` (a real local target), `prompts.load_prompts`
(evaluation prompt sets) and `validate.validate_features`.

This package deliberately owns no training or evaluation logic. Importing it is
cheap: torch, transformers and SpecForge are imported by the modules that use them.
"""
