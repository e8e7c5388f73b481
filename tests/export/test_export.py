"""`pr-specforge export`: SGLang's own loader and the PR drafter reload what we write; broken checkpoints are refused."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pr_specforge.export import ExportError, export_checkpoint, main
from tests.export.conftest import ENV
from tests.helpers import current_umask

HERE = os.path.dirname(__file__)


def _ckpt(run):
    return str(run / "out" / "specforge-run-step6")


def _edited_checkpoint(run, tmp_path, edit):
    """A copy of the step-6 checkpoint whose shared state went through `edit(state)`."""
    dst = tmp_path / "specforge-run-step6"
    shutil.copytree(_ckpt(run), dst)
    state = torch.load(dst / "training_state.pt", weights_only=False)
    edit(state)
    torch.save(state, dst / "training_state.pt")
    return str(dst)


def test_sglang_export_loads_into_sglangs_eagle3_class_with_every_parameter_matching(trained_pr_run, tmp_path):
    out = tmp_path / "sglang"
    assert main([_ckpt(trained_pr_run), str(out), "--to", "sglang"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
    assert cfg["target_hidden_size"] == 64 and cfg["fc_norm"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # SpecForge's default for 4 layers
    assert cfg["pr_config"]["max_depth"] == 2
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sglang_load.py"), str(out)], env=dict(ENV, SGLANG_USE_CPU_ENGINE="1"),
                          capture_output=True, text=True, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("SGLANG_REPORT ")]
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(line[0].split(" ", 1)[1])
    assert report["mismatched"] == [] and report["unfilled"] == [], report
    assert "model.fc_norm.2.weight" in report["matched"] and len(report["matched"]) == 13, report["matched"]
    assert report["hot_token_id_ok"] and report["hot_token_ids_are_t2d"]
    assert report["pr_tensors"] == ["pr_halt_gate.linear.bias", "pr_halt_gate.linear.weight", "pr_self_query.norm.weight",
                                    "pr_self_query.w_in.weight", "pr_self_query.w_out.weight"]


def test_hf_export_reloads_into_the_pr_drafter_with_identical_logits(trained_pr_run, tmp_path):
    from pr_specforge.export import build_drafter_skeleton, read_checkpoint
    from pr_specforge.modeling import load_drafter

    out = tmp_path / "hf"
    export_checkpoint(_ckpt(trained_pr_run), str(out), "hf", target=str(trained_pr_run / "target"))
    reloaded = load_drafter(str(out))
    assert type(reloaded).__name__ == "LlamaForCausalLMEagle3PR" and reloaded.max_depth == 2

    state = read_checkpoint(_ckpt(trained_pr_run))
    draft_cfg = json.loads((trained_pr_run / "draft.json").read_text())
    reference = build_drafter_skeleton(draft_cfg, "pr", state["pr_settings"])
    reference.load_state_dict(state["draft_state_dict"], strict=False)
    reference.load_embedding(str(trained_pr_run / "target"))
    reference.eval()
    torch.testing.assert_close(reloaded.embed_tokens.weight, reference.embed_tokens.weight, rtol=0, atol=0)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (1, 12), generator=g)
    hidden = torch.randn(1, 12, 3 * 64, generator=g)
    with torch.no_grad():
        logits = []
        for draft in (reference, reloaded):
            h = draft.project_hidden_states(hidden)
            mask = draft.prepare_decoder_attention_mask(torch.ones(1, 12, dtype=torch.bool), h, 1, 12, 0)
            pos = torch.arange(12)[None]
            f0 = draft.backbone(draft.embed_input_ids(ids), h, [[], []], mask, pos)
            f1 = draft.backbone(draft.self_query(f0), f0, [[], []], mask, pos)
            logits.append((draft.compute_logits(f0), draft.compute_logits(f1), draft.halt_probability(f0)))
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eagle3_checkpoint_exports_without_pr_tensors(trained_pr_run, tmp_path):
    def to_eagle3(state):
        state["strategy"] = "eagle3"
        state["draft_state_dict"] = {k: v for k, v in state["draft_state_dict"].items() if not k.startswith("pr_")}

    ckpt = _edited_checkpoint(trained_pr_run, tmp_path, to_eagle3)
    out = tmp_path / "e3"
    export_checkpoint(ckpt, str(out), "sglang")
    from safetensors.torch import load_file

    assert not [k for k in load_file(out / "model.safetensors") if k.startswith("pr_")]
    assert "pr_config" not in json.loads((out / "config.json").read_text())


def _state_edit(edit):
    """A checkpoint whose shared state went through `edit` (and lost its stored recipe, so the checks must hold)."""
    def make(run, tmp_path):
        def edit_and_forget_recipe(state):
            edit(state)
            state.pop("pr_specforge_recipe", None)

        return _edited_checkpoint(run, tmp_path, edit_and_forget_recipe), {"draft_config": str(run / "draft.json")}
    return make


def _truncated_state(run, tmp_path):
    dst = tmp_path / "specforge-run-step6"
    shutil.copytree(_ckpt(run), dst)
    data = (dst / "training_state.pt").read_bytes()
    (dst / "training_state.pt").write_bytes(data[: len(data) // 2])
    return str(dst), {}


def _mapping_file(mapping):
    def make(run, tmp_path):
        torch.save(mapping(), tmp_path / "vm.pt")
        return _ckpt(run), {"vocab_mapping": str(tmp_path / "vm.pt")}
    return make


def _other_draft_vocab():
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[:48] = True
    return {"t2d": t2d, "d2t": torch.zeros(48, dtype=torch.long)}


#: every class of bad `export` input: (make(run, tmp) -> (checkpoint, export kwargs), what the error says)
BAD_INPUTS = {
    "missing tensor": (_state_edit(lambda s: s["draft_state_dict"].pop("midlayer.self_attn.q_proj.weight")), "missing tensors"),
    "tensor of the wrong shape": (_state_edit(lambda s: s["draft_state_dict"].__setitem__("fc.weight", torch.zeros(64, 128))),
                                  "fc.weight: shape"),
    "no vocab map anywhere": (_state_edit(lambda s: [s["draft_state_dict"].pop(k) for k in ("d2t", "t2d")]), "no t2d/d2t"),
    "lm_head of another draft vocab": (
        _state_edit(lambda s: s["draft_state_dict"].__setitem__("lm_head.weight", torch.zeros(40, 64))), "lm_head.weight: shape"),
    "d2t and t2d that disagree": (
        _state_edit(lambda s: s["draft_state_dict"].__setitem__("d2t", s["draft_state_dict"]["d2t"].flip(0))),
        "d2t and t2d disagree"),
    "pr checkpoint without PR tensors": (_state_edit(lambda s: s["draft_state_dict"].pop("pr_self_query.w_in.weight")),
                                         "missing tensors"),
    "strategy this exporter does not handle": (_state_edit(lambda s: s.__setitem__("strategy", "dflash")), "strategy 'dflash'"),
    "truncated training_state.pt": (_truncated_state, "the training state does not load"),
    "checkpoint that does not exist": (lambda run, tmp: (str(tmp / "nowhere"), {}), "nowhere"),
    "vocab map from another draft vocab": (_mapping_file(_other_draft_vocab), "disagrees with the checkpoint"),
    "vocab map file that is not a map": (_mapping_file(lambda: torch.zeros(3)), "not a vocab map"),
}


# issue 44: a draft config that is not JSON is named
def _draft_config_not_json(run, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    return _ckpt(run), {"draft_config": str(tmp_path / "bad.json")}


BAD_INPUTS["draft config that is not JSON"] = (_draft_config_not_json, "bad.json: not valid JSON")
# issue 58: a --target that is not there was a WARNING and a context of 2048 (SGLang), a HFValidationError (HF)
BAD_INPUTS["--target that does not exist"] = (lambda run, tmp: (_ckpt(run), {"target": str(tmp / "nonexistent")}),
                                              "nonexistent: does not exist; name the target model's directory")
BAD_INPUTS["--target that is no model directory"] = (lambda run, tmp: (_ckpt(run), {"target": str(tmp)}),
                                                     ": no config.json; name the target model's directory")
BAD_INPUTS["a B_w of 0 for PR_EAGLE3"] = (lambda run, tmp: (_ckpt(run), {"bw": "0"}), "--bw must be >= 1 and --m >= 0")
BAD_INPUTS["a negative m for PR_EAGLE3"] = (lambda run, tmp: (_ckpt(run), {"m": "-1"}), "--bw must be >= 1 and --m >= 0")


def test_a_pr_sglang_export_carries_pr_eagle3s_serving_defaults(trained_pr_run, tmp_path):
    """`pr_serving` (what `PR_EAGLE3` serves by default): m 3 and the launch's k without flags, else --bw / --m."""
    from pr_specforge.export import main

    plain = export_checkpoint(_ckpt(trained_pr_run), str(tmp_path / "plain"), "sglang")
    assert json.load(open(os.path.join(plain, "config.json")))["pr_serving"] == {"m": 3}
    assert main([_ckpt(trained_pr_run), str(tmp_path / "set"), "--to", "sglang", "--bw", "4", "--m", "1"]) == 0
    assert json.load(open(tmp_path / "set" / "config.json"))["pr_serving"] == {"bw": 4, "m": 1}
    with pytest.raises(ExportError, match="they go with --to sglang"):
        export_checkpoint(_ckpt(trained_pr_run), str(tmp_path / "hf"), "hf", m=2)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_export_refuses_bad_input_in_one_line(trained_pr_run, tmp_path, capsys, case):
    from pr_specforge.export import main

    make, message = BAD_INPUTS[case]
    ckpt, kwargs = make(trained_pr_run, tmp_path)
    out = tmp_path / "never"
    with pytest.raises(ExportError, match=message):
        export_checkpoint(ckpt, str(out), "sglang", **kwargs)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".never")]
    flags = [a for k, v in kwargs.items() for a in (f"--{k.replace('_', '-')}", v)]
    assert main([ckpt, str(out), "--to", "sglang", *flags]) == 2  # the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def _user_dir(tmp):
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("mine")
    return tmp / "mine", tmp / "mine" / "notes.txt"


def _user_file(tmp):
    (tmp / "notes.txt").write_text("mine")
    return tmp / "notes.txt", tmp / "notes.txt"


def _under_a_file(tmp):
    (tmp / "notes.txt").write_text("mine")
    return tmp / "notes.txt" / "export", tmp / "notes.txt"


#: issue 43's audit: OUT_DIRs refused before the checkpoint is read: (make(tmp) -> (out_dir, the user's file kept),
#: --overwrite?, what the one line says)
BAD_OUT_DIRS = {
    "--overwrite onto a directory that is not an export": (_user_dir, True, "holds files that are not an earlier export"),
    "--overwrite onto a file": (_user_file, True, "is a file, not an earlier export"),
    "a file as OUT_DIR without --overwrite": (_user_file, False, "exists; pass --overwrite"),
    "OUT_DIR under a file": (_under_a_file, False, "is a file, not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUT_DIRS))
def test_export_refuses_an_out_dir_whose_files_it_would_lose_in_one_line(trained_pr_run, tmp_path, capsys, case):
    from pr_specforge.export import main

    make, overwrite, message = BAD_OUT_DIRS[case]
    out, kept = make(tmp_path)
    assert main([_ckpt(trained_pr_run), str(out), "--to", "hf", *(["--overwrite"] if overwrite else [])]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert kept.read_text() == "mine" and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_overwrite_refuses_an_export_that_holds_a_users_file_and_deletes_nothing(trained_pr_run, tmp_path, capsys):
    """Issue 58: --overwrite onto an earlier export holding the user's NOTES.md deleted it (rc 0)."""
    from pr_specforge.export import main

    for to in ("sglang", "hf"):
        out = tmp_path / to
        args = [_ckpt(trained_pr_run), str(out), "--to", to, "--target", str(trained_pr_run / "target"), "--overwrite"]
        assert main(args) == 0 and main(args) == 0  # an export (every file it writes) is replaced
        capsys.readouterr()
        (out / "NOTES.md").write_text("mine")
        (out / "extra").mkdir()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds files that are not an earlier export's: NOTES.md (and 1 more)" in err[0], err
        assert (out / "NOTES.md").read_text() == "mine" and (out / "extra").is_dir()
    # --to hf with a --target that is not there: one line (was a HFValidationError traceback), nothing written
    assert main([_ckpt(trained_pr_run), str(tmp_path / "never"), "--to", "hf", "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--target /nonexistent: does not exist" in err and "Traceback" not in err and not (tmp_path / "never").exists()


def test_export_is_atomic_and_does_not_clobber_without_overwrite(trained_pr_run, tmp_path):
    out = tmp_path / "sglang"
    export_checkpoint(_ckpt(trained_pr_run), str(out), "sglang")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="--overwrite"):
        export_checkpoint(_ckpt(trained_pr_run), str(out), "sglang")
    os.chmod(out, 0o750)  # issue 65: a replaced export keeps its directory's mode
    export_checkpoint(_ckpt(trained_pr_run), str(out), "sglang", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before and (os.stat(out).st_mode & 0o777) == 0o750
    assert sorted(os.listdir(tmp_path)) == ["sglang"]  # no temp or swapped-out dirs left behind


def test_export_cli_answers_help():
    from tests.helpers import run_cli

    rc, out = run_cli("export", "--help", cwd=os.getcwd())
    assert rc == 0 and "--to" in out


# ---------------------------------------------------------------- issue 44: context length and file modes
def long_context_target(src, dst, context=8192):
    """A copy of the target dir `src` whose config declares SmolLM2's context (8192) instead of the drafter's."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sglang_export_carries_the_targets_context_length_and_is_readable_by_others(trained_pr_run, tmp_path):
    target = long_context_target(trained_pr_run / "target", tmp_path / "target")
    assert json.loads((trained_pr_run / "draft.json").read_text())["max_position_embeddings"] == 512  # as make run's 2048 < 8192
    out = tmp_path / "sglang"
    assert main([_ckpt(trained_pr_run), str(out), "--to", "sglang", "--target", str(target)]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 8192
    plain = tmp_path / "plain"  # a target no longer than the drafter: the draft config's value stays
    assert main([_ckpt(trained_pr_run), str(plain), "--to", "sglang", "--target", str(trained_pr_run / "target")]) == 0
    assert json.loads((plain / "config.json").read_text())["max_position_embeddings"] == 512
    mask = current_umask()
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    for name in os.listdir(out):
        assert (os.stat(out / name).st_mode & 0o777) == 0o666 & ~mask, name


def test_declared_context_follows_sglangs_rule():
    from pr_specforge.export import declared_context, fit_context

    assert declared_context({"max_position_embeddings": 2048}) == 2048
    assert declared_context({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == 8192
    assert declared_context({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 8192
    assert declared_context({"seq_length": 1024, "max_position_embeddings": 4096}) == 1024  # the first key found wins
    cfg = {"seq_length": 1024, "max_position_embeddings": 4096}
    fit_context(cfg, 8192)
    assert cfg == {"max_position_embeddings": 8192} and declared_context(cfg) == 8192
