"""Shared fixtures: tiny random drafter configs, seeded, float32, CPU."""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers on two cores, one thread each (and their children)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, int(os.environ.get("OMP_NUM_THREADS", "2")))))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=97,
        draft_vocab_size=48,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        pad_token_id=0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


@pytest.fixture
def tiny_config():
    return tiny_llama_config()


#: modules that take a minute or more, started first so that the two workers of `make test` end together
SLOW_FIRST = ("tests/sglang_live/", "tests/experiment/test_pipeline.py", "tests/training/test_deepspeed.py",
              "tests/training/test_kill_resume.py", "tests/eval/test_headroom.py", "tests/control/test_control.py",
              "tests/training/test_online.py",
              "tests/recipe_options/test_warm_start.py", "tests/integration/test_diagnose.py",
              "tests/data/test_data_smollm2.py", "tests/integration/test_train_cli.py", "tests/data/test_sharded_prep.py",
              "tests/telemetry/test_telemetry.py")


def _unit(nodeid: str) -> str:
    """The unit of work of `make test`'s workers: a module (its fixtures are built once), and the live SGLang
    package as one unit (its package-scoped trained run and plain server are built once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/sglang_live/" if path.startswith("tests/sglang_live/") else path


def pytest_xdist_make_scheduler(config, log):
    """`make test` (`-n 2 --dist loadfile --no-loadscope-reorder`) schedules by `_unit`, in collection order.
    (xdist's own `loadgroup` marks do nothing under pytest 9, whose node ids no longer live in `_nodeid`.)"""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The slow units first (stable: within a rank, collection order), so the two workers end together."""
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, p in enumerate(SLOW_FIRST) if path.startswith(p)), len(SLOW_FIRST))

    items.sort(key=rank)
