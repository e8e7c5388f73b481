"""Fixtures for the data-prep tests: a tiny random Llama target with a real
byte-level BPE tokenizer and SmolLM2's ChatML template, built locally (no hub)."""

from __future__ import annotations

import json

import pytest

CORPUS = [
    "Hello there, how are you today? I am fine, thank you very much.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea and the sky and the wind.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols !?.,;:'\"()[]{}",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pr_specforge.data.smollm2 import SMOLLM2_CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
    )


def build_model(vocab_size: int, hidden_size: int = 32, num_layers: int = 8, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, tokenizer):
    """Directory with a tiny random Llama (8 layers, hidden 32) + tokenizer."""
    path = tmp_path_factory.mktemp("tiny_target")
    model = build_model(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "pr_specforge_target.json").write_text(json.dumps({"chat_template_name": "smollm2"}))
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_target):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


CONVERSATIONS = [
    {"id": "a", "conversations": [{"role": "user", "content": "Hello there, how are you?"},
                                  {"role": "assistant", "content": "I am fine, thank you."}]},
    {"id": "b", "conversations": [{"role": "system", "content": "You write poems."},
                                  {"role": "user", "content": "Write a poem about the sea."},
                                  {"role": "assistant", "content": "The sea and the sky."},
                                  {"role": "user", "content": "And the wind?"},
                                  {"role": "assistant", "content": "The wind, the wind."}]},
    {"id": "c", "conversations": [{"role": "user", "content": "What is the capital of France?"},
                                  {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"id": "d", "conversations": [{"role": "user", "content": "def add(a, b):"},
                                  {"role": "assistant", "content": "    return a + b"}]},
    {"id": "e", "conversations": [{"role": "user", "content": "Numbers 0 1 2 3?"},
                                  {"role": "assistant", "content": "4 5 6 7 8 9!"}]},
]
