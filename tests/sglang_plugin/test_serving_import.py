"""The serving import path of `PR_EAGLE3` never imports SpecForge: a subprocess with `specforge` (and our modules
that import it) refused at import registers the plugin, imports the worker and loads a PR export."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from pr_specforge.export import sglang_config
from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
from tests.conftest import tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_pr_export(path) -> str:
    """A tiny PR drafter written as `--to sglang` writes one (config.json + model.safetensors)."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = LlamaForCausalLMEagle3PR(build_pr_config(tiny_llama_config(), PRDraftSettings(max_depth=2))).float()
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "embed" not in k},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(sglang_config(model.config.to_dict(), model, None, torch.float32), f)
    return str(path)


def run_probe(python: str, export_dir: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([python, "-m", "tests.serve_contract.import_probe", export_dir], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_serving_path_imports_no_specforge(tmp_path):
    done = run_probe(sys.executable, write_pr_export(tmp_path / "pr"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serving path ok" in done.stdout


def test_the_probe_fails_when_the_serving_path_imports_specforge(tmp_path):
    """The hook bites: a planted import of the training drafter on the path fails the probe."""
    export = write_pr_export(tmp_path / "pr")
    code = ("import sys; from tests.serve_contract import import_probe as p; "
            "import pr_specforge.sglang_plugin.checks as c; "
            "orig = c.read_export_config\n"
            "def planted(d):\n    import pr_specforge.modeling\n    return orig(d)\n"
            "c.read_export_config = planted; sys.exit(p.main(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, export], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "the serving path imported pr_specforge.modeling" in done.stderr, done.stdout + done.stderr


def test_in_sglang_0_5_23s_own_environment_the_serving_install_adds_pr_eagle3_without_specforge(tmp_path):
    """`.venv-serve`: SGLang 0.5.23 with its own pins, plus `pip install ./serving` - no SpecForge there at all; the
    installed wheel (run outside the repository, so nothing of the source tree is on the path) serves the export's
    load path, and SGLang's entry-point group holds our plugin."""
    from tests.serve_contract import serve_python

    python = serve_python()
    export = write_pr_export(tmp_path / "pr")
    probe = tmp_path / "probe.py"
    probe.write_text(open(os.path.join(ROOT, "tests", "serve_contract", "import_probe.py")).read())
    check = ("from importlib.metadata import version, entry_points; import importlib.util as u; "
             "print(version('sglang'), version('torch'), version('transformers'), u.find_spec('specforge'), "
             "[e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'pr_eagle3'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pins = subprocess.run([python, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert pins.stdout.split("\n")[-2] == "0.5.23 2.14.1 5.19.0 None ['pr_specforge.sglang_plugin:register']", pins.stdout + pins.stderr
    done = subprocess.run([python, str(probe), export], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "serving path ok: 0.5.23" in done.stdout, done.stdout + done.stderr
