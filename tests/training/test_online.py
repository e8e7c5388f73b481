"""Online training (`data.online: true`): the target runs inside the training rank.

For the same batch, the online step (target forward on the conversation) and the offline
step (features written by `data hidden-states`) give the same loss and gradients, bitwise, for
the `eagle3` and `pr` strategies; a 2-rank online run (torchrun, gloo, DeepSpeed) resumes exactly."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from pr_specforge.data.hidden_states import prepare_hidden_states
from pr_specforge.training.telemetry import read_metrics
from pr_specforge.training.recipe import load_recipe
from pr_specforge.training.train import assembled_run
from tests.data.conftest import CONVERSATIONS, build_tokenizer, write_jsonl
from tests.helpers import make_tiny_target

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
SEQ = 256


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Target (tiny random Llama + BPE tokenizer with SmolLM2's template), conversations, offline features."""
    root = tmp_path_factory.mktemp("online")
    tok = build_tokenizer()
    target = root / "target"
    make_tiny_target(str(target), hidden=64, layers=8, vocab=len(tok))
    tok.save_pretrained(target)
    src = write_jsonl(root / "conv.jsonl", [dict(r, id=f"{r['id']}{k}") for k in range(2) for r in CONVERSATIONS])
    prepare_hidden_states(src, root / "features", str(target), "smollm2", max_length=SEQ, draft_vocab_size=256,
                          batch_size=1, progress=False)
    draft = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
             "vocab_size": len(tok), "draft_vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
             "hidden_act": "silu", "tie_word_embeddings": False, "target_hidden_size": 64, "pad_token_id": 0}
    (root / "draft.json").write_text(json.dumps(draft))
    return root


def write_recipe(root, name, strategy, online, out=None, nproc=1, **training):
    data = {"max_length": SEQ, "chat_template": "smollm2", "dataloader_num_workers": 0}
    model = {"target_model_path": str(root / "target"), "draft_model_config": str(root / "draft.json"),
             "torch_dtype": "bfloat16"}  # as the SmolLM2 recipes: bf16 features, bf16 drafter
    if online:
        data.update(online=True, train_data_path=str(root / "conv.jsonl"))
    else:
        data["hidden_states_path"] = str(root / "features")
        model["vocab_mapping_path"] = str(root / "features" / "vocab_mapping" / "vocab_mapping.pt")
    recipe = {"model": model, "data": data,
              "training": {"strategy": strategy, "max_steps": 4, "batch_size": 1, "learning_rate": 1e-3,
                           "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "ttt_length": 3,
                           "log_interval": 1, "save_interval": 2, "seed": 0, "warmup_ratio": 0.0, **training},
              "deployment": {"trainer": {"nproc_per_node": nproc}},
              "output_dir": str(out or root / f"out-{name}")}
    if strategy == "pr":
        recipe["pr"] = {"max_depth": 2}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def first_steps(recipe_path, n, state=None):
    """Loss, gradients and input ids of the first `n` batches (drafter weights from `state` if given)."""
    from pr_specforge.training.registration import _unwrap

    out = []
    with assembled_run(load_recipe(recipe_path)) as (strategy, loader):
        module = strategy.trainable_module()
        draft = _unwrap(module).draft_model
        if state is not None:
            draft.load_state_dict(state)
        torch.manual_seed(0)  # PR samples halt depths from the global RNG: both runs start from the same state
        for _, batch in zip(range(n), loader):
            ids = batch.tensors["input_ids"].clone()
            module.zero_grad(set_to_none=True)
            result = strategy.forward_loss(batch)
            result.loss.backward()
            grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
            out.append((ids, result.loss.detach(), grads, result))
        state = {k: v.clone() for k, v in draft.state_dict().items()}
    return out, state


@pytest.mark.parametrize("strategy", ["eagle3", "pr"])
def test_online_step_equals_the_offline_step_on_the_same_batch(workspace, strategy):
    offline, state = first_steps(write_recipe(workspace, f"off-{strategy}", strategy, online=False), 3)
    online, _ = first_steps(write_recipe(workspace, f"on-{strategy}", strategy, online=True), 3, state=state)
    for (ids_f, loss_f, grads_f, _), (ids_n, loss_n, grads_n, out_n) in zip(offline, online):
        assert torch.equal(ids_f, ids_n)  # same sampler order over the same rows
        assert torch.equal(loss_f, loss_n), (loss_f, loss_n)
        assert loss_f > 0 and any(g.abs().sum() > 0 for g in grads_f.values())
        assert grads_f.keys() == grads_n.keys() and grads_f
        for name in grads_f:
            assert torch.equal(grads_f[name], grads_n[name]), name
        assert float(out_n.metrics["online/target_s"]) > 0  # the target ran inside this step
    # the vocab map the online run derived from the conversations is the offline one
    ours = torch.load(workspace / f"out-on-{strategy}" / "online_vocab" / "vocab_mapping" / "vocab_mapping.pt")
    theirs = torch.load(workspace / "features" / "vocab_mapping" / "vocab_mapping.pt")
    assert all(torch.equal(ours[k], theirs[k]) for k in ("t2d", "d2t"))


def test_online_recipe_errors_name_the_field(workspace, tmp_path):
    from pr_specforge.config import ConfigError

    path = write_recipe(workspace, "bad", "pr", online=True)
    with pytest.raises(ConfigError, match="data.online_dtype"):
        load_recipe(path, ["data.online_dtype=int8"])
    with pytest.raises(ConfigError, match="data.train_data_path"):
        load_recipe(path, ["data.train_data_path=", f"data.hidden_states_path={workspace / 'features'}"])
    recipe = load_recipe(path)
    assert recipe.config.data.hidden_states_path == str(workspace / "conv.jsonl")  # SpecForge runs its local runtime
    from pr_specforge.training.recipe import resolved_payload

    data = resolved_payload(recipe)["data"]  # ... but the stored recipe keeps the user's form
    assert data["online"] is True and data["train_data_path"] == str(workspace / "conv.jsonl")


def _train(recipe, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "pr_specforge.cli", "train", "-c", recipe, *extra]
    proc = subprocess.run(cmd, env=dict(ENV, DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.slow
def test_two_rank_deepspeed_online_run_resumes_exactly(workspace):
    """2 ranks (torchrun, gloo) under DeepSpeed ZeRO-2; a kill after the step-2 save, then resume:
    the final weights equal the uninterrupted run's. (The same run under DDP passed too; the
    DDP step itself is the one checked against offline above.)"""
    out = workspace / "ds"
    recipe = write_recipe(workspace, "ds", "pr", online=True, out=out, nproc=2)
    raw = yaml.safe_load(open(recipe))
    raw["backend"] = {"name": "deepspeed", "config": os.path.join(REPO, "recipes", "deepspeed", "zero2.json")}
    with open(recipe, "w") as f:
        yaml.safe_dump(raw, f)
    _train(recipe)
    final = out / "specforge-run-step4" / "training_state.pt"
    reference = torch.load(final, weights_only=False)
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["online/target_share"] < 1 and r["online/target_s"] > 0 for r in rows[1:])
    shutil.rmtree(out / "specforge-run-step4")  # as if killed after the step-2 save
    _train(recipe, f"training.resume_from={out}")
    resumed = torch.load(final, weights_only=False)
    for key, value in reference["draft_state_dict"].items():
        assert torch.equal(value, resumed["draft_state_dict"][key]), key


def test_a_float32_target_trains_a_bf16_drafter(workspace):
    """`data.online_dtype=float32` (the target in fp32) with the bf16 drafter of the SmolLM2 recipes: the
    target's states reach the drafter in its dtype, as bf16 features would offline."""
    path = write_recipe(workspace, "fp32-target", "pr", online=True)
    raw = yaml.safe_load(open(path))
    raw["data"]["online_dtype"] = "float32"
    open(path, "w").write(yaml.safe_dump(raw))
    steps, _ = first_steps(path, 1)
    assert torch.isfinite(steps[0][1]) and steps[0][1] > 0 and steps[0][2]


def _malformed_line(root, tmp):
    (tmp / "bad.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n" + '{"id": "x", "conversations": [\n')
    return [f"data.train_data_path={tmp / 'bad.jsonl'}"]


def _non_object_row(root, tmp):
    (tmp / "list.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n" + json.dumps(["not", "a", "row"]) + "\n")
    return [f"data.train_data_path={tmp / 'list.jsonl'}"]


#: bad inputs of an online run, refused by `train --dry-run` in one line naming the file and row or field
ONLINE_BAD_INPUTS = {
    "conversations with a malformed JSON line": (_malformed_line, "bad.jsonl:2: malformed JSON"),
    "conversations with a row that is not an object": (_non_object_row, "list.jsonl:2: expected a JSON object"),
    "model.vocab_mapping_path that does not exist": (lambda r, t: [f"model.vocab_mapping_path={t / 'none.pt'}"],
                                                     "model.vocab_mapping_path"),
}


@pytest.mark.parametrize("case", sorted(ONLINE_BAD_INPUTS))
def test_online_bad_input_is_one_line(workspace, tmp_path, capsys, case):
    from pr_specforge.cli import main

    edit, needle = ONLINE_BAD_INPUTS[case]
    path = write_recipe(workspace, "bad-input", "pr", online=True)
    assert main(["train", "-c", path, *edit(workspace, tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
