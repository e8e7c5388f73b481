"""`pr-specforge export ... --to vllm` without vLLM: what the speculators directory holds (ids in vLLM's convention,
the trained fc_norm weights, no pr_* tensor), the same directory from a run and from its `--to sglang` export, and
each drafter vLLM cannot serve refused in one line before anything is written. (Served for real: tests/vllm_live.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pr_specforge.export import export_checkpoint
from pr_specforge.export_vllm import export_vllm, vllm_layer_ids
from tests.export.conftest import ENV, train_workspace


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pr_specforge.cli", "export", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def _refused(capsys, *args) -> str:
    """`export *args` in this process: exit 2 and the one line it printed (no traceback)."""
    from pr_specforge.export_vllm import main

    capsys.readouterr()
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def post_norm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pr_post_norm")
    train_workspace(root, strategy="pr", steps=3, pr_section={"max_depth": 1, "post_norm_feedback": True},
                    target=dict(layers=8))
    return root


def test_a_pr_run_exports_its_one_pass_chain_in_vllms_convention(trained_pr_run, tmp_path):
    root = trained_pr_run
    proc = _cli(str(root / "out"), str(tmp_path / "v"), "--to", "vllm", "--target", str(root / "target"),
                "--num-speculative-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "one-pass chain" in line and "pr_* tensors not written" in line and "no reconsideration" in line
    cfg = json.load(open(tmp_path / "v" / "config.json"))
    state = torch.load(root / "out" / "specforge-run-step6" / "training_state.pt", weights_only=False)
    trained = state["draft_state_dict"]
    specforge_ids = cfg["pr_specforge_vllm_export"]["specforge_capture_layers"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in specforge_ids]
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    method = cfg["speculators_config"]["proposal_methods"][0]
    assert method["speculative_tokens"] == 5 and cfg["speculators_config"]["default_proposal_method"] == "greedy"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == os.path.abspath(root / "target")
    assert cfg["norm_before_residual"] is False and cfg["fc_norm"] is True and cfg["norm_output"] is False
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert not any(k.startswith("pr_") for k in tensors)
    assert not any(k.startswith("midlayer.") for k in tensors) and "layers.0.self_attn.q_proj.weight" in tensors
    for i in range(3):  # the trained fc_norm weights, not the unit weights a lossy converter leaves
        assert torch.equal(tensors[f"fc_norm.{i}.weight"], trained[f"fc_norm.{i}.weight"])
        assert not torch.equal(tensors[f"fc_norm.{i}.weight"], torch.ones_like(tensors[f"fc_norm.{i}.weight"]))
    assert torch.equal(tensors["layers.0.mlp.down_proj.weight"], trained["midlayer.mlp.down_proj.weight"])


def test_an_sglang_export_converts_to_the_same_directory_as_the_run(trained_pr_run, tmp_path):
    root = trained_pr_run
    export_vllm(str(root / "out"), str(tmp_path / "from-run"), target=str(root / "target"))
    export_checkpoint(str(root / "out"), str(tmp_path / "sglang"), "sglang", target=str(root / "target"))
    export_vllm(str(tmp_path / "sglang"), str(tmp_path / "from-sglang"), target=str(root / "target"))
    assert (tmp_path / "from-run" / "config.json").read_text() == (tmp_path / "from-sglang" / "config.json").read_text()
    assert (tmp_path / "from-run" / "model.safetensors").read_bytes() == \
        (tmp_path / "from-sglang" / "model.safetensors").read_bytes()
    # an earlier vLLM export is replaced with --overwrite, and refused without it
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        export_vllm(str(tmp_path / "sglang"), str(tmp_path / "from-sglang"), target=str(root / "target"))
    export_vllm(str(tmp_path / "sglang"), str(tmp_path / "from-sglang"), target=str(root / "target"),
                overwrite=True, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = json.load(open(tmp_path / "from-sglang" / "config.json"))
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_post_norm_feedback_is_written_as_norm_output(post_norm_run, tmp_path):
    export_vllm(str(post_norm_run / "out"), str(tmp_path / "v"), target=str(post_norm_run / "target"))
    cfg = json.load(open(tmp_path / "v" / "config.json"))
    assert cfg["norm_output"] is True and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_ids_map_output_of_layer_to_input_of_layer_within_the_target():
    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27]  # SmolLM2-135M
    assert vllm_layer_ids([0, 29], 30) == [1, 30]  # vLLM collects the last layer's output at index L
    with pytest.raises(ValueError, match="do not fit a target of 30 layers"):
        vllm_layer_ids([1, 14, 30], 30)


def _edited_sglang(trained_pr_run, tmp_path, name, config=None, tensors=None):
    src = tmp_path / "sglang-base"
    if not src.exists():
        export_checkpoint(str(trained_pr_run / "out"), str(src), "sglang", target=str(trained_pr_run / "target"))
    dst = tmp_path / name
    shutil.copytree(src, dst)
    if config:
        cfg = json.load(open(dst / "config.json"))
        config(cfg)
        json.dump(cfg, open(dst / "config.json", "w"))
    if tensors:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


REFUSALS = {
    "two decoder layers": dict(config=lambda c: c.update(num_hidden_layers=2)),
    "a reconsideration adapter": dict(tensors=lambda t: t.__setitem__("pr_recon_adapter.q.down", torch.zeros(2, 2))),
    "renamed tensor": dict(tensors=lambda t: t.__setitem__("fc_proj.weight", t.pop("fc.weight"))),
    "dropped tensor": dict(tensors=lambda t: t.pop("fc_norm.1.weight")),
    "ids past the target": dict(config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 4])),
    # issue 73: shapes against the config and finiteness, checked at the door
    "truncated fc.weight": dict(tensors=lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :-8].contiguous())),
    "a 10-long d2t": dict(tensors=lambda t: t.__setitem__("d2t", t["d2t"][:10].contiguous())),
    "a config vocab the tensors disagree with": dict(config=lambda c: c.update(draft_vocab_size=c["draft_vocab_size"] + 1)),
    "NaN weights": dict(tensors=lambda t: t["midlayer.mlp.up_proj.weight"].view(-1)[:3].fill_(float("nan"))),
}
EXPECTED = {
    "two decoder layers": "two decoder layers",
    "a reconsideration adapter": "reconsideration adapter",
    "renamed tensor": "unknown ['fc_proj.weight']",
    "dropped tensor": "missing ['fc_norm.1.weight']",
    "ids past the target": "do not fit a target of 4 layers",
    "truncated fc.weight": "does not match its config.json: fc.weight: shape",
    "a 10-long d2t": "d2t: shape (10,) in the checkpoint",
    "a config vocab the tensors disagree with": "lm_head.weight: shape",
    "NaN weights": "midlayer.mlp.up_proj.weight holds 3 non-finite value(s)",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_vllm_cannot_serve_is_one_line_before_anything_is_written(trained_pr_run, tmp_path, case, capsys):
    src = _edited_sglang(trained_pr_run, tmp_path, "src", **REFUSALS[case])
    last = _refused(capsys, src, str(tmp_path / "out"), "--to", "vllm", "--target", str(trained_pr_run / "target"))
    assert last.startswith("pr-specforge export: ") and EXPECTED[case] in last, last
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]


def test_a_target_of_another_shape_and_a_missing_verifier_are_refused(trained_pr_run, tmp_path, capsys):
    from tests.helpers import make_tiny_target

    src = _edited_sglang(trained_pr_run, tmp_path, "src")
    make_tiny_target(str(tmp_path / "other"), layers=6)
    out = str(tmp_path / "out")
    assert "--target has num_hidden_layers 6" in _refused(capsys, src, out, "--to", "vllm", "--target", str(tmp_path / "other"))
    assert "no verifier" in _refused(capsys, src, out, "--to", "vllm")
    assert "--bw / --m" in _refused(capsys, src, out, "--to", "vllm", "--target", str(trained_pr_run / "target"), "--m", "2")
    assert "go with --to vllm" in _refused(capsys, src, out, "--to", "sglang", "--num-speculative-tokens", "2")
    assert "must be >= 1" in _refused(capsys, src, out, "--to", "vllm", "--target", str(trained_pr_run / "target"),
                                      "--num-speculative-tokens", "0")
    # its own input: an SGLang export is never replaced by its vLLM export, --overwrite or not
    assert "is an input of this command" in _refused(capsys, src, src, "--to", "vllm", "--target",
                                                     str(trained_pr_run / "target"), "--overwrite")
    assert json.load(open(os.path.join(src, "config.json")))["architectures"] == ["LlamaForCausalLMEagle3"]
    assert not (tmp_path / "out").exists()


def test_an_eagle3_run_exports_the_same_chain_as_its_pr_twin(trained_pr_run, tmp_path):
    """The PR run's checkpoint re-labelled `eagle3` without its pr_* tensors (an EAGLE-3 run of the same weights):
    its vLLM export is the PR export's, tensor for tensor, and says it is an EAGLE-3 drafter."""
    root = trained_pr_run
    eagle3 = tmp_path / "eagle3-ckpt" / "specforge-run-step6"
    shutil.copytree(root / "out" / "specforge-run-step6", eagle3)
    state = torch.load(eagle3 / "training_state.pt", weights_only=False)
    state["strategy"] = "eagle3"
    state["draft_state_dict"] = {k: v for k, v in state["draft_state_dict"].items() if not k.startswith("pr_")}
    torch.save(state, eagle3 / "training_state.pt")
    got = export_vllm(str(eagle3), str(tmp_path / "e"), target=str(root / "target"), draft_config=str(root / "draft.json"))
    export_vllm(str(root / "out" / "specforge-run-step6"), str(tmp_path / "p"), target=str(root / "target"))
    assert got["drafter"] == "eagle3" and got["dropped"] == []
    assert load_file(tmp_path / "e" / "model.safetensors").keys() == load_file(tmp_path / "p" / "model.safetensors").keys()
    for name, value in load_file(tmp_path / "e" / "model.safetensors").items():
        assert torch.equal(value, load_file(tmp_path / "p" / "model.safetensors")[name]), name
    e, p = (json.load(open(tmp_path / d / "config.json")) for d in ("e", "p"))
    assert e["eagle_aux_hidden_state_layer_ids"] == p["eagle_aux_hidden_state_layer_ids"]
    assert e["pr_specforge_vllm_export"]["drafter"] == "eagle3" and p["pr_specforge_vllm_export"]["drafter"] == "pr"


def test_a_target_of_the_same_shape_and_other_weights_is_refused_in_every_format(trained_pr_run, tmp_path, capsys):
    """Issue 73: every checkpoint records its target's weights by content; `export --target` of the same shape and
    other weights is one line in all three formats (the HF export would copy its embedding), and `--to vllm` from an
    SGLang export compares the target that export records."""
    from tests.helpers import make_tiny_target

    other = tmp_path / "other-target"
    make_tiny_target(other, seed=1)  # the workspace's target's shape (make_tiny_target's defaults), other weights
    run = str(trained_pr_run / "out")
    for to in ("sglang", "hf", "vllm"):
        last = _refused(capsys, run, str(tmp_path / to), "--to", to, "--target", str(other))
        assert "not the target this run trained on" in last and "'target'" in last, last
        assert not (tmp_path / to).exists() and not [p for p in os.listdir(tmp_path) if p.startswith(f".{to}")]
    sglang = _edited_sglang(trained_pr_run, tmp_path, "src")
    last = _refused(capsys, sglang, str(tmp_path / "v"), "--to", "vllm", "--target", str(other))
    assert f"not the target {sglang} was exported with" in last, last
