"""Load an `export --to sglang` directory with SGLang 0.5.14's own `LlamaForCausalLMEagle3` on CPU.

Run as a script (its own process: it initialises SGLang's 1-rank gloo model-parallel
groups and global server args). Prints one JSON line: every SGLang parameter
compared with the tensor the export meant for it.
"""

import json
import os
import sys
import tempfile

import torch


def _init_sglang_cpu():
    from sglang.srt import server_args as sa
    from sglang.srt.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"file://{tempfile.mktemp(prefix='sglang-init-')}")
    ps.initialize_model_parallel(1, 1, 1, backend="gloo")
    args = sa.ServerArgs.__new__(sa.ServerArgs)  # only the field the draft model reads
    args.speculative_draft_window_size = None
    sa.set_global_server_args_for_scheduler(args)


def main(export_dir):
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    _init_sglang_cpu()
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    config = LlamaConfig.from_pretrained(export_dir)
    model = LlamaForCausalLMEagle3(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything load_weights does not fill stays NaN
    tensors = load_file(os.path.join(export_dir, "model.safetensors"))
    model.load_weights(iter(tensors.items()))

    t = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    m = "midlayer."
    expected = {
        "model.fc.weight": t["fc.weight"],
        "model.norm.weight": t["norm.weight"],
        "lm_head.weight": t["lm_head.weight"],
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([t[m + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "model.layers.0.self_attn.o_proj.weight": t[m + "self_attn.o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([t[m + "mlp.gate_proj.weight"], t[m + "mlp.up_proj.weight"]]),
        "model.layers.0.mlp.down_proj.weight": t[m + "mlp.down_proj.weight"],
    }
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        expected[f"model.layers.0.{norm}.weight"] = t[m + f"{norm}.weight"]
    for i in range(3):
        if f"fc_norm.{i}.weight" in t:
            expected[f"model.fc_norm.{i}.weight"] = t[f"fc_norm.{i}.weight"]
    params = dict(model.named_parameters())
    report = {"matched": [], "mismatched": [], "unfilled": []}
    for name, param in params.items():
        if name == "model.embed_tokens.weight":
            continue  # shared with the target at serving time
        if name not in expected:
            report["unfilled"].append(name)
            continue
        want = expected[name]
        got = param.detach()[: want.shape[0]]  # ParallelLMHead pads rows to a multiple of 64
        ok = got.shape == want.shape and torch.equal(got, want) and not torch.isnan(got).any()
        report["matched" if ok else "mismatched"].append(name)
    hot = model.get_hot_token_id()
    report["hot_token_id_ok"] = hot is not None and torch.equal(hot, t["d2t"] + torch.arange(t["d2t"].shape[0]))
    report["hot_token_ids_are_t2d"] = hot is not None and torch.equal(hot, torch.nonzero(t["t2d"].bool()).flatten())
    report["pr_tensors"] = sorted(k for k in tensors if k.startswith("pr_"))
    print("SGLANG_REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
