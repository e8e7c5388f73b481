"""Every shipped recipe loads and carries the paper's settings; bad recipes fail at load time naming field and fix."""

import glob
import json
import os
import subprocess

import pytest
import yaml

from pr_specforge.config import ConfigError
from pr_specforge.training.recipe import load_recipe, read_recipe_mapping

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
PAPER_TARGETS = ("llama3.1-8b", "qwen3-8b", "gemma3-12b")
PAIRS = [(f"{t}-eagle3.yaml", f"{t}-pr.yaml") for t in PAPER_TARGETS] + [("smollm2-135m-cpu-eagle3.yaml", "smollm2-135m-cpu.yaml")]
PAIR_MAY_DIFFER = {"training.strategy", "pr", "backend", "output_dir", "run_id", "tracking.wandb_name"}


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # recipe paths are relative to the repository root


def _recipe(name):
    return load_recipe(os.path.join("recipes", name))


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("pr", "backend"):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def test_the_expected_recipes_are_shipped():
    names = {os.path.basename(p) for p in RECIPES}
    assert {n for pair in PAIRS for n in pair} <= names, names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_shipped_recipe_loads_and_opens_with_its_command(path):
    recipe = load_recipe(os.path.relpath(path, REPO))
    first = open(path).readline()
    assert first.startswith("# "), first
    assert "pr-specforge train -c recipes/" in open(path).read() or "recipes/launch/torchrun.sh recipes/" in open(path).read()
    draft = json.load(open(recipe.config.model.draft_model_config))
    two_layer = path.endswith("-2layer.yaml")  # the paper's depth control (Table 3): strategy eagle3, a second layer
    assert draft["architectures"] == ["LlamaForCausalLMEagle3TwoLayer" if two_layer else "LlamaForCausalLMEagle3"]
    assert draft["fc_norm"] is True and (recipe.config.training.strategy == "eagle3" or not two_layer)
    assert draft["num_hidden_layers"] == 1 and draft["tie_word_embeddings"] is False
    assert len(draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    if recipe.config.training.strategy == "pr":
        assert recipe.pr.max_depth == 2 and recipe.pr.balance_coef == 0.01


@pytest.mark.parametrize("target", PAPER_TARGETS)
@pytest.mark.parametrize("kind", ["eagle3", "pr"])
def test_paper_recipes_carry_appendix_f_settings(target, kind):
    c = _recipe(f"{target}-{kind}.yaml").config
    t = c.training
    assert (t.learning_rate, t.warmup_ratio, t.lr_scheduler, t.max_grad_norm) == (1e-4, 0.015, "cosine", 0.5)
    assert (t.batch_size, t.accumulation_steps, c.deployment.trainer.nproc_per_node, t.ttt_length) == (1, 1, 4, 7)
    assert (c.model.torch_dtype, c.data.max_length) == ("bfloat16", 4096)
    assert t.strategy == kind


@pytest.mark.parametrize("baseline, pr", PAIRS)
def test_pr_recipe_differs_from_its_baseline_only_in_strategy_pr_and_output(baseline, pr):
    a, b = _flat(_recipe(baseline).raw), _flat(_recipe(pr).raw)
    differing = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differing <= PAIR_MAY_DIFFER, differing - PAIR_MAY_DIFFER


def test_smollm2_cpu_recipe_is_the_cpu_default():
    r = _recipe("smollm2-135m-cpu.yaml")
    c = r.config
    assert c.training.strategy == "pr" and c.training.learning_rate == 3e-4 and c.training.log_interval == 1
    assert (c.training.fsdp_sharding, c.training.attention_backend, c.data.dataloader_num_workers) == ("NO_SHARD", "sdpa", 0)
    assert (c.model.target_model_path, c.data.hidden_states_path, c.output_dir) == (
        "work/smollm2/target", "work/smollm2/features", "work/smollm2/runs/pr")
    draft = json.load(open(c.model.draft_model_config))
    assert (draft["hidden_size"], draft["num_attention_heads"], draft["num_key_value_heads"], draft["intermediate_size"]) == (576, 9, 3, 1536)
    assert (draft["vocab_size"], draft["draft_vocab_size"], draft["target_hidden_size"]) == (49152, 8192, 576)
    assert c.deployment.trainer.nproc_per_node == 1 and r.backend.name == "fsdp"


def _write(tmp_path, name, mapping):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


BASE = {"model": {"target_model_path": "t"}, "data": {"hidden_states_path": "f"}, "training": {"strategy": "pr"}, "pr": {"max_depth": 2}}


@pytest.mark.parametrize("edit, overrides, field, fix", [
    ({"training": {"strategy": "pr", "bogus_knob": 1}}, [], "training.bogus_knob", "remove it"),
    ({"pr_typo": {}}, [], "pr_typo", "remove it"),
    ({"pr": {"max_depth": 2, "beta": 0.1}}, [], "unknown key(s) ['beta']", "allowed keys"),
    ({}, ["pr.max_depth=9"], "pr.max_depth", "set pr.max_depth=2"),
    ({}, ["training.batch_size=0"], "training.batch_size", "greater than 0"),
    ({"training": {"strategy": "pr", "attention_backend": "usp", "sp_ulysses_size": 2}, "backend": {"name": "deepspeed", "config": "recipes/deepspeed/zero2.json"}},
     [], "attention_backend=usp", "use attention_backend=sdpa"),
    ({"backend": {"name": "deepspeed"}}, [], "backend.config", "recipes/deepspeed/zero2.json"),
    ({"backend": {"name": "horovod"}}, [], "backend.name", "one of ['fsdp', 'deepspeed']"),
    ({"training": {"strategy": "eagle3"}}, [], "pr:", "set training.strategy=pr"),
    ({"pr": ["max_depth", 2]}, [], "pr: expected a mapping of PR settings", "got list"),  # was a TypeError traceback
    ({"pr": 3}, [], "pr: expected a mapping of PR settings", "got int 3"),
])
def test_bad_recipe_fails_at_load_naming_field_and_fix(tmp_path, edit, overrides, field, fix):
    raw = {**BASE, **edit}
    with pytest.raises(ConfigError) as info:
        load_recipe(_write(tmp_path, "bad.yaml", raw), overrides)
    assert field in str(info.value) and fix in str(info.value), str(info.value)


def test_extends_merges_mappings_and_the_extending_file_wins(tmp_path):
    _write(tmp_path, "base.yaml", {"model": {"target_model_path": "t", "torch_dtype": "float32"}, "data": {"max_length": 64, "hidden_states_path": "f"},
                                   "training": {"learning_rate": 1e-4, "ttt_length": 7}})
    child = _write(tmp_path, "child.yaml", {"extends": "base.yaml", "training": {"learning_rate": 3e-4}})
    r = load_recipe(child)
    assert (r.config.training.learning_rate, r.config.training.ttt_length, r.config.model.torch_dtype) == (3e-4, 7, "float32")
    assert "extends" not in r.raw


def test_extends_cycle_and_missing_base_fail_naming_the_file(tmp_path):
    _write(tmp_path, "a.yaml", {"extends": "b.yaml"})
    _write(tmp_path, "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        read_recipe_mapping(str(tmp_path / "a.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml.*does not exist.*extended by"):
        read_recipe_mapping(_write(tmp_path, "c.yaml", {"extends": "missing.yaml"}))


def test_deepspeed_backend_section_validates_against_the_recipe(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="gradient_clipping=1.0 disagrees"):
        load_recipe(_write(tmp_path, "r.yaml", {**BASE, "backend": {"name": "deepspeed", "config": str(ds)}}))
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="ZeRO stages"):
        load_recipe(_write(tmp_path, "r.yaml", {**BASE, "backend": {"name": "deepspeed", "config": str(ds)}}))
    ok = load_recipe(_write(tmp_path, "r.yaml", BASE), ["backend.name=deepspeed", "backend.config=recipes/deepspeed/zero1.json"])
    assert ok.backend.name == "deepspeed" and ok.raw["backend"]["config"].endswith("zero1.json")


def test_torchrun_launcher_is_valid_bash_and_explains_usage():
    script = os.path.join(REPO, "recipes", "launch", "torchrun.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    proc = subprocess.run(["bash", script], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_auto_dtype_is_bf16_only_on_a_cpu_with_native_bf16(tmp_path):
    from pr_specforge.dtypes import cpu_has_native_bf16, resolve_dtype

    for flags, native in (("fpu avx512f avx512bw", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True)):
        info = tmp_path / f"cpuinfo_{native}_{len(flags)}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert cpu_has_native_bf16(str(info)) is native
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_dtype("auto") == expected and resolve_dtype("float32") == "float32"
    # an offline recipe's `auto` is the same (its teacher head follows the drafter's dtype: training.target_head)
    assert load_recipe(os.path.join("recipes", "smollm2-135m-cpu.yaml")).config.model.torch_dtype == expected
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8")


def test_draft_config_path_resolves_from_any_working_directory(tmp_path, monkeypatch):
    """Shipped recipes name their drafter config relative to themselves: `pr-specforge train -c
    /abs/recipes/x.yaml` works outside the repository; a user's cwd-relative path still works."""
    monkeypatch.chdir(tmp_path)
    for name in ("smollm2-135m-cpu.yaml", "smollm2-135m-cpu-eagle3.yaml", "llama3.1-8b-pr.yaml"):
        draft = load_recipe(os.path.join(REPO, "recipes", name)).config.model.draft_model_config
        assert os.path.isabs(draft) and os.path.isfile(draft), (name, draft)
    (tmp_path / "mine").mkdir()
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "d.json").write_text(open(os.path.join(REPO, "recipes", "drafters", "smollm2-135m-eagle3.json")).read())
    raw = read_recipe_mapping(os.path.join(REPO, "recipes", "smollm2-135m-cpu-eagle3.yaml"))  # extends resolved
    raw["model"]["draft_model_config"] = "cfg/d.json"  # relative to the working directory, not to mine/
    (tmp_path / "mine" / "r.yaml").write_text(yaml.safe_dump(raw))
    assert load_recipe("mine/r.yaml").config.model.draft_model_config == "cfg/d.json"


def test_a_deepspeed_config_resolves_by_the_drafter_configs_rule(tmp_path, monkeypatch):
    """One rule for every file a recipe names: its own directory first, else the working directory;
    a command-line override is cwd-relative."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    zero1 = open(os.path.join(REPO, "recipes", "deepspeed", "zero1.json")).read()
    raw = read_recipe_mapping(os.path.join(REPO, "recipes", "smollm2-135m-cpu-eagle3.yaml"))
    raw["backend"] = {"name": "deepspeed", "config": "ds.json"}
    (tmp_path / "mine" / "r.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "ds.json").write_text(zero1)
    assert load_recipe("mine/r.yaml").backend.config == "ds.json"  # only in the working directory
    (tmp_path / "mine" / "ds.json").write_text(zero1)
    assert load_recipe("mine/r.yaml").backend.config == str(tmp_path / "mine" / "ds.json")  # the recipe's own wins
    assert load_recipe("mine/r.yaml", ["backend.config=ds.json"]).backend.config == "ds.json"


def test_extends_takes_a_list_merged_in_order(tmp_path):
    _write(tmp_path, "a.yaml", {"training": {"learning_rate": 1e-4, "ttt_length": 7}, "pr": {"max_depth": 2}})
    _write(tmp_path, "b.yaml", {"training": {"learning_rate": 2e-4}, "pr": {"recon_head": "separate"}})
    raw = read_recipe_mapping(_write(tmp_path, "c.yaml", {"extends": ["a.yaml", "b.yaml"], "pr": {"max_depth": 1}}))
    assert raw["training"] == {"learning_rate": 2e-4, "ttt_length": 7} and raw["pr"] == {"max_depth": 1, "recon_head": "separate"}
    with pytest.raises(ConfigError, match="a recipe path or a list"):
        read_recipe_mapping(_write(tmp_path, "d.yaml", {"extends": ["a.yaml", 3]}))
    _write(tmp_path, "e.yaml", {"extends": ["a.yaml", "f.yaml"]})
    _write(tmp_path, "f.yaml", {"extends": "e.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        read_recipe_mapping(str(tmp_path / "e.yaml"))


@pytest.mark.parametrize("target", PAPER_TARGETS)
def test_paper_recipes_take_the_papers_pr_options(target):
    pr = _recipe(f"{target}-pr.yaml").pr
    assert (pr.max_depth, pr.balance_coef, pr.recon_head, pr.recon_grad) == (2, 0.01, "separate", "full")
    assert (pr.reconsider_weight, pr.balance_norm, pr.init_from, pr.gradient_checkpointing) == ("use", "per_position", None, True)
