"""The serving import path of `PR_EAGLE3` never imports SpecForge: a subprocess with `specforge` (and our modules
that import it) refused at import registers the plugin, imports the worker and loads a PR export.

The serving install on its own (issue 65): the wheel `pip install ./serving` builds from this tree (built here from
a copy, into a temporary target, with SGLang 0.5.23's environment's pip) writes nothing into the tree, declares numpy,
ships the CPU bridge and its preflight, which run from it in that environment with SpecForge refused; and where
SGLang is absent, `register()` is one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pr_specforge.export import sglang_config
from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config
from tests.conftest import tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_pr_export(path, context=None) -> str:
    """A tiny PR drafter written as `--to sglang` writes one (config.json + model.safetensors), its vocab map the
    first `draft_vocab_size` target ids; `context`: the target's context length, as `--target` gives it."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = LlamaForCausalLMEagle3PR(build_pr_config(tiny_llama_config(), PRDraftSettings(max_depth=2))).float()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "embed" not in k}
    state["t2d"] = torch.arange(state["t2d"].numel()) < state["d2t"].numel()
    state["d2t"] = torch.zeros_like(state["d2t"])
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(sglang_config(model.config.to_dict(), model, None, torch.float32, context=context), f)
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


def _tree_files(root) -> set:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


@pytest.fixture(scope="module")
def serving_install(tmp_path_factory):
    """`pip install ./serving` of this tree, built by SGLang 0.5.23's environment's pip (no network: its own
    setuptools) from a copy of the tree into a temporary target directory (the shared environment is left as it is):
    `{"site": target, "before": / "after": the copy's files around the build, "python": the interpreter}`."""
    from tests.serve_contract import serve_python

    python = serve_python()
    root = tmp_path_factory.mktemp("serving_install")
    copy = root / "tree"
    for part in ("serving", "pr_specforge"):
        shutil.copytree(os.path.join(ROOT, part), copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = _tree_files(copy)
    built = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                            "--target", str(root / "site"), str(copy / "serving")], cwd=root, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    return {"site": str(root / "site"), "before": before, "after": _tree_files(copy), "python": python}


def test_building_the_serving_install_leaves_the_source_tree_as_it_was(serving_install):
    assert serving_install["after"] == serving_install["before"], \
        f"the build wrote into the tree: {sorted(serving_install['after'] - serving_install['before'])}"


def test_the_serving_wheel_declares_numpy_and_ships_the_cpu_bridge_and_no_training_module(serving_install):
    from email.parser import Parser

    site = serving_install["site"]
    meta = Parser().parse(open(os.path.join(site, "pr_specforge_serve-0.1.0.dist-info", "METADATA")))
    assert sorted(meta.get_all("Requires-Dist")) == ["numpy", "safetensors", "torch"]
    shipped = _tree_files(os.path.join(site, "pr_specforge"))
    for name in ("bridge.py", "preflight.py", "kernels.py", "attention.py", "tree.py", "server.py",
                 os.path.join("site", "sitecustomize.py")):
        assert os.path.join("sglang_cpu", name) in shipped, name
    assert os.path.join("core", "export_format.py") in shipped
    assert not [f for f in shipped if f.startswith(("export.py", "modeling", "training", "_specforge", "eval"))]


def test_in_sglang_0_5_23s_own_environment_the_serving_install_adds_pr_eagle3_and_serves_the_cpu_scripts(serving_install,
                                                                                                        tmp_path):
    """`.venv-serve`: SGLang 0.5.23 with its own pins - no SpecForge there at all - and SGLang's entry-point group
    holds our plugin. The wheel built from this tree (run outside the repository, so nothing of the source tree is on
    the path) serves the export's load path, the CPU bridge installs, and the preflight of
    `scripts/sglang_cpu_serve_pr.sh` passes a good export against its target, SpecForge refused at import throughout."""
    from tests.helpers import make_tiny_target

    python = serving_install["python"]
    target = tmp_path / "target"
    make_tiny_target(target)
    export = write_pr_export(tmp_path / "pr", context=512)  # make_tiny_target's context, as `--target` writes it
    probe = tmp_path / "probe.py"
    shutil.copy(os.path.join(ROOT, "tests", "serve_contract", "import_probe.py"), probe)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = ("from importlib.metadata import version, entry_points; import importlib.util as u; "
             "print(version('sglang'), version('torch'), version('transformers'), u.find_spec('specforge'), "
             "[e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'pr_eagle3'])")
    pins = subprocess.run([python, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert pins.stdout.split("\n")[-2] == "0.5.23 2.14.1 5.19.0 None ['pr_specforge.sglang_plugin:register']", pins.stdout + pins.stderr
    env["PYTHONPATH"] = serving_install["site"]
    where = "import pr_specforge.sglang_cpu.preflight as p, pr_specforge.core.export_format as f; print(p.__file__, f.__file__)"
    files = subprocess.run([python, "-c", where], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert all(f.startswith(serving_install["site"]) for f in files.stdout.split()), files.stdout + files.stderr
    done = subprocess.run([python, str(probe), export, str(target)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "serving path ok: 0.5.23" in done.stdout, done.stdout + done.stderr

def _without_sglang(python: str, site: str, farm) -> dict:
    """An environment of `python` with only the serving install (`site`) and what SGLang's environment holds besides
    SGLang (each of its site-packages entries linked into `farm`, except SGLang's, its kernels and the installed
    serving wheel); run with `python -S`, so its own site-packages stay off the path."""
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    farm.mkdir()
    for name in os.listdir(purelib):
        if not name.lower().startswith(("sgl", "pr_specforge")):
            os.symlink(os.path.join(purelib, name), farm / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": os.pathsep.join([site, str(farm)])}


def test_register_without_sglang_is_one_line(serving_install, tmp_path):
    env = _without_sglang(serving_install["python"], serving_install["site"], tmp_path / "farm")
    code = "import importlib.util; print(importlib.util.find_spec('sglang'), importlib.util.find_spec('torch') is not None)"
    seen = subprocess.run([serving_install["python"], "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert seen.stdout.strip() == "None True", seen.stdout + seen.stderr  # no SGLang; torch as the install needs
    done = subprocess.run([serving_install["python"], "-S", "-c",
                           "from pr_specforge.sglang_plugin import register; register()"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.startswith("PRServeError: PR_EAGLE3 is a plugin of SGLang (SGLang 0.5.14, 0.5.15.post1 and "
                                  "0.5.16-0.5.23), and ") and done.stderr.count("\n") == 1, done.stderr


def test_setup_serve_reinstalls_the_serving_install_when_any_file_it_ships_changes():
    """scripts/setup_serve.sh's change list covers every package of serving/pyproject.toml (for the two shared
    packages, the modules serving/setup.py keeps), so an edit to a shipped file reinstalls it."""
    import ast
    import re
    import tomllib

    with open(os.path.join(ROOT, "serving", "pyproject.toml"), "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    setup_py = open(os.path.join(ROOT, "serving", "setup.py")).read()
    shipped = ast.literal_eval(re.search(r"^SHIPPED = (\{.*\})$", setup_py, re.M).group(1))
    script = open(os.path.join(ROOT, "scripts", "setup_serve.sh")).read()
    watched = re.search(r'find (serving .*?) -newer', script, re.S).group(1).replace("\\\n", " ").split()
    assert "serving" in watched
    for package in packages:
        path = package.replace(".", "/")
        if package in shipped:
            for module in shipped[package]:
                assert f"{path}/{module}.py" in watched, f"{path}/{module}.py"
        else:
            assert any(path == w or path.startswith(w + "/") for w in watched), path
