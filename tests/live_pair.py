"""The session's one tiny trained pair, read by every live package (SGLang 0.5.14, 0.5.23, vLLM) and the seams.

A SmolLM2-shaped tiny target (Llama, tied embeddings, 8 layers so the three captured layers 1, 3, 4 are distinct, a
byte-level BPE tokenizer with SmolLM2's chat template, 2 attention heads: vLLM's CPU attention needs a head size of
at least 32) and a PR drafter (2 heads, 1 KV head) trained on the target's own greedy continuations (48 steps: it
accepts most of what the target says on prompts of that distribution). Built once per session (`live_run` in
tests/conftest.py); no live package retrains its own. Its exports:

* `pr`: `--to sglang` (PR, what `PR_EAGLE3` serves; stock EAGLE3 serves it too, skipping the `pr_*` tensors);
* `eagle3`: the same run as an `eagle3` checkpoint (the PR tensors dropped), `--to sglang`;
* `hf`: `--to hf` (our evaluator's drafter);
* `vllm`: `export --to vllm` (a chain of `VLLM_GAMMA`, vLLM's capture ids), `summary`: what that export said.

`prompts`: three prompts of the training distribution and one off it (random ids).
"""

from __future__ import annotations

import json
import shutil

import torch

STEPS = 48
VLLM_GAMMA = 3
#: the training seed: a drafter some of whose reconsidered nodes survive the cut at k 2 and B 6 (the live PR modules
#: assert that some do, to show the served cut keeps them). With this target (2 heads) seeds 0, 1 and 3 give drafters
#: whose reconsidered nodes all lose the cut at that shape on these prompts; seed 2's keep 2 (our evaluator, float32,
#: the same on a CPU with AVX-512 and one limited to AVX2).
SEED = 2


def build(root) -> dict:
    from pr_specforge.export import export_checkpoint
    from pr_specforge.export_vllm import export_vllm
    from tests.data.conftest import build_tokenizer
    from tests.export.conftest import train_workspace

    tok = build_tokenizer()
    train_workspace(root, strategy="pr", steps=STEPS, n=8, seq=48, generated=True, pr_section={"max_depth": 2},
                    extra={"training": {"num_epochs": 6, "seed": SEED}},
                    target=dict(layers=8, vocab=len(tok), tie=True, tokenizer=tok, heads=2),
                    draft={"num_attention_heads": 2, "num_key_value_heads": 1})
    (root / "target" / "pr_specforge_target.json").write_text(json.dumps({"chat_template_name": "smollm2"}))
    ckpt = str(root / "out" / f"specforge-run-step{STEPS}")
    export_checkpoint(ckpt, str(root / "pr-sglang"), "sglang")
    export_checkpoint(ckpt, str(root / "hf"), "hf", target=str(root / "target"))
    summary = export_vllm(str(root / "out"), str(root / "pr-vllm"), target=str(root / "target"), tokens=VLLM_GAMMA)
    eagle3 = root / "eagle3-ckpt" / f"specforge-run-step{STEPS}"  # the same run as an eagle3 checkpoint
    shutil.copytree(ckpt, eagle3)
    state = torch.load(eagle3 / "training_state.pt", weights_only=False)
    state["strategy"] = "eagle3"
    state["draft_state_dict"] = {k: v for k, v in state["draft_state_dict"].items() if not k.startswith("pr_")}
    torch.save(state, eagle3 / "training_state.pt")
    export_checkpoint(str(eagle3), str(root / "eagle3-sglang"), "sglang", draft_config=str(root / "draft.json"))
    prompts = [torch.load(root / "features" / "rows_0-2000" / f"data_{i}.ckpt")["input_ids"][:12].tolist()
               for i in range(3)]
    g = torch.Generator().manual_seed(7)
    prompts.append(torch.randint(3, len(tok), (10,), generator=g).tolist())  # off the training distribution
    return {"root": root, "target": str(root / "target"), "pr": str(root / "pr-sglang"),
            "eagle3": str(root / "eagle3-sglang"), "hf": str(root / "hf"), "vllm": str(root / "pr-vllm"),
            "summary": summary, "prompts": prompts}
