"""`scripts/sglang_cpu_serve.sh` refuses, in one line and before SGLang starts, what SGLang fails on late or
never (issue 44): checked through the script itself, which exits before any server would start."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.export.conftest import ENV
from tests.export.test_export import long_context_target

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve.sh")
PR_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sglang_cpu_serve_pr.sh")


@pytest.fixture(scope="module")
def exports(trained_pr_run, tmp_path_factory):
    from pr_specforge.export import export_checkpoint

    root = tmp_path_factory.mktemp("serve_preflight")
    ckpt = str(trained_pr_run / "out" / "specforge-run-step6")
    target = str(trained_pr_run / "target")
    export_checkpoint(ckpt, str(root / "sglang"), "sglang", target=target)
    export_checkpoint(ckpt, str(root / "hf"), "hf", target=target)
    long_target = long_context_target(trained_pr_run / "target", root / "long-target")
    return {"root": root, "target": target, "sglang": str(root / "sglang"), "hf": str(root / "hf"),
            "long_target": str(long_target)}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rename_tensor(exports, tmp):
    from safetensors.torch import load_file, save_file

    dst = tmp / "renamed"
    shutil.copytree(exports["sglang"], dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["midlayer.mlp.down_proj.w"] = tensors.pop("midlayer.mlp.down_proj.weight")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return {"draft": str(dst)}


def _draft_config_not_json(exports, tmp):
    dst = tmp / "broken"
    shutil.copytree(exports["sglang"], dst)
    (dst / "config.json").write_text("{not json")
    return {"draft": str(dst)}


#: every class of bad serve input: (make(exports, tmp) -> argument overrides, what the one line says)
BAD_SERVE = {
    "an export --to hf as the draft": (lambda e, t: {"draft": e["hf"]}, "is an `export --to hf` directory"),
    "the target as the draft": (lambda e, t: {"draft": e["target"]}, "is not an EAGLE-3 drafter"),
    "the drafter as the target": (lambda e, t: {"target": e["sglang"]}, "is a drafter (LlamaForCausalLMEagle3)"),
    "a draft directory without config.json": (lambda e, t: {"draft": str(t)}, "no config.json"),
    "a draft config that is not JSON": (_draft_config_not_json, "config.json: not valid JSON"),
    "a renamed tensor": (_rename_tensor, "midlayer.mlp.down_proj.weight"),
    "a draft context shorter than the target's": (lambda e, t: {"target": e["long_target"]},
                                                  "context length 512 is below the target's 8192"),
    "a port in use": ("in use", "is in use"),
    "a port that is no number": (lambda e, t: {"port": "http"}, "PORT 'http': not a port number"),
}


def _eagle3_export(exports, tmp):
    """The PR export without its PR config: what `export --to sglang` writes for an EAGLE-3 checkpoint."""
    from pr_specforge.config import PR_CONFIG_KEY

    dst = tmp / "eagle3"
    shutil.copytree(exports["sglang"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop(PR_CONFIG_KEY)
    (dst / "config.json").write_text(json.dumps(cfg))
    return {"draft": str(dst), "script": PR_SCRIPT}


def _a_file(tmp):
    (tmp / "notes.txt").write_text("mine")
    return str(tmp / "notes.txt")


def _python_without_sglang(exports, tmp):
    """PYTHON an interpreter whose environment has no SGLang (this one without its site-packages)."""
    wrapper = tmp / "python-without-sglang"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    return {"python": str(wrapper)}


#: issue 43's audit rows: missing and wrong paths, and the PR script's own drafter check, all before SGLang starts
BAD_SERVE.update({
    "a draft path that does not exist": (lambda e, t: {"draft": str(t / "nowhere")}, "DRAFT " + "{tmp}/nowhere: does not exist"),
    "a draft path that is a file": (lambda e, t: {"draft": _a_file(t)}, "notes.txt: is a file, not a model directory"),
    "a target path that is a file": (lambda e, t: {"target": _a_file(t)}, "TARGET {tmp}/notes.txt: is a file"),
    "a target path that does not exist": (lambda e, t: {"target": str(t / "nowhere")}, "TARGET {tmp}/nowhere: does not exist"),
    "a training run as the draft": (lambda e, t: {"draft": os.path.join(os.path.dirname(e["target"]), "out")},
                                    "(a training run or checkpoint: serve `pr-specforge export"),
    "an EAGLE-3 export to the PR script": (_eagle3_export, "not a PR drafter export (serve it with --speculative-algorithm EAGLE3)"),
    "a port in use, PR script": ("in use PR", "is in use"),
    "a PYTHON without SGLang (issue 65)": (_python_without_sglang, "has no SGLang: serve with the interpreter of "
                                           "SGLang's own environment"),
})


@pytest.mark.parametrize("case", sorted(BAD_SERVE))
def test_the_serve_script_refuses_bad_input_in_one_line_before_sglang_starts(exports, tmp_path, case):
    make, needle = BAD_SERVE[case]
    args = {"target": exports["target"], "draft": exports["sglang"], "port": str(_free_port())}
    holder, script = None, SCRIPT
    needle = needle.replace("{tmp}", str(tmp_path))
    if make in ("in use", "in use PR"):
        script = PR_SCRIPT if make == "in use PR" else SCRIPT
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        args["port"] = str(holder.getsockname()[1])
    else:
        args.update(make(exports, tmp_path))
        script = args.pop("script", SCRIPT)
    try:
        proc = subprocess.run(["bash", script, args["target"], args["draft"], args["port"]], capture_output=True,
                              text=True, timeout=120, env=dict(ENV, PYTHON=args.pop("python", sys.executable)))
    finally:
        if holder is not None:
            holder.close()
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and needle in err[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "sglang.launch_server" not in proc.stdout


def test_the_preflight_passes_an_export_made_with_the_long_target(exports, tmp_path):
    from pr_specforge.export import main as export_main
    from pr_specforge.sglang_cpu.preflight import main

    out = tmp_path / "long"
    ckpt = os.path.join(os.path.dirname(exports["target"]), "out", "specforge-run-step6")
    assert export_main([ckpt, str(out), "--to", "sglang", "--target", exports["long_target"]]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 8192
    assert main([exports["long_target"], str(out), str(_free_port())]) == 0
    assert main([exports["target"], exports["sglang"], str(_free_port())]) == 0


def test_the_preflights_architecture_names_are_the_models():
    from pr_specforge.modeling.drafter import EAGLE3_ARCHITECTURE, PR_ARCHITECTURE
    from pr_specforge.modeling.two_layer import TWO_LAYER_ARCHITECTURE
    from pr_specforge.sglang_cpu import preflight

    assert preflight.EAGLE3_ARCHITECTURE == EAGLE3_ARCHITECTURE
    assert set(preflight.HF_EXPORT_ARCHITECTURES) == {PR_ARCHITECTURE, TWO_LAYER_ARCHITECTURE}
