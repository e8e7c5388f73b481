"""Shared fixtures: tiny random drafter configs, seeded, float32, CPU."""

import os
import signal

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, int(os.environ.get("OMP_NUM_THREADS", "2")))))


@pytest.fixture(autouse=True)
def _sigint_reaches_python():
    """A suite started in the background of a non-interactive shell (`make test &`, `nohup`) inherits SIGINT ignored,
    and Python then installs no Ctrl-C handler (nor does the CLI: it leaves an ignored SIGINT ignored). The Ctrl-C
    tests send a real SIGINT, as a terminal would: Python's own handler is put back for every test."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


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
