import json

import pytest
import torch

from pr_specforge.data.smollm2 import SMOLLM2_CHAT_TEMPLATE, write_index_json


def test_index_json_lets_specforge_target_head_load_tied_embeddings(tiny_target, tmp_path):
    from specforge.modeling.target.target_head import TargetHead
    from transformers import AutoModelForCausalLM

    index = write_index_json(tiny_target)
    weight_map = json.loads(index.read_text())["weight_map"]
    assert "model.embed_tokens.weight" in weight_map and "lm_head.weight" not in weight_map  # tied
    head = TargetHead.from_pretrained(str(tiny_target), lm_head_key="model.embed_tokens.weight")
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    torch.testing.assert_close(head.fc.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())


def test_smollm2_template_renders_chatml_with_the_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.chat_template == SMOLLM2_CHAT_TEMPLATE


@pytest.mark.slow
def test_real_smollm2_conversion_reloads_and_answers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pr_specforge.data.smollm2 import convert_smollm2_gguf

    out = convert_smollm2_gguf(tmp_path / "smollm2")
    assert (out / "model.safetensors.index.json").exists()
    with pytest.raises(FileExistsError, match="holds a bfloat16 target, not the float32 one"):
        convert_smollm2_gguf(out, dtype="float32")  # never a silent bf16 for a float32 request
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert model.config.hidden_size == 576 and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids.shape[1]:])
