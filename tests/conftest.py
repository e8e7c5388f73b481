"""Shared fixtures: tiny random drafter configs, seeded, float32, CPU."""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, int(os.environ.get("OMP_NUM_THREADS", "2")))))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=97,
        draft_vocab_size=48,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        pad_token_id=0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


@pytest.fixture
def tiny_config():
    return tiny_llama_config()
