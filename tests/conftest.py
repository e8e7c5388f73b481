"""Shared fixtures: tiny random drafter configs, seeded, float32, CPU."""

import os
import signal

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, int(os.environ.get("OMP_NUM_THREADS", "2")))))


@pytest.fixture(autouse=True)
def _sigint_reaches_python():
    """A suite started in the background of a non-interactive shell (`make test &`, `nohup`) inherits SIGINT ignored,
    and Python then installs no Ctrl-C handler (nor does the CLI: it leaves an ignored SIGINT ignored). The Ctrl-C
    tests send a real SIGINT, as a terminal would: Python's own handler is put back for every test."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


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


# ---- the live packages' shared session: one trained pair, one server per launch (tests/live_servers.py) ----

_REGISTRY = None


@pytest.fixture(scope="session")
def live_run(tmp_path_factory):
    """The session's tiny trained pair and its exports (tests/live_pair.py), built once for every live package."""
    from tests.live_pair import build

    return build(tmp_path_factory.mktemp("live_run"))


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """The session's server registry (tests/live_servers.py): `shared.get(name, key, start)`; every server it started
    is stopped at the session's end, also on failure."""
    global _REGISTRY
    from tests.live_servers import Registry

    _REGISTRY = Registry(tmp_path_factory.mktemp("servers"))
    try:
        yield _REGISTRY
    finally:
        _REGISTRY.close()
        _REGISTRY = None


def pytest_configure(config):
    """Every server start of the session is recorded (`pr_specforge.local_server.record_start`) for its summary."""
    import tempfile

    from tests.live_servers import STARTS_ENV

    if not os.environ.get(STARTS_ENV):
        fd, path = tempfile.mkstemp(prefix="pr-specforge-server-starts-", suffix=".txt")
        os.close(fd)
        os.environ[STARTS_ENV] = path
        config._pr_server_starts = path


def pytest_runtest_setup(item):
    if _REGISTRY is not None:
        _REGISTRY.mark(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries its own lines of every shared server's log (not the whole session's)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and _REGISTRY is not None:
        if not report.failed:
            _REGISTRY.forget(item.nodeid)
            return
        for name, text in _REGISTRY.grown(item.nodeid):
            report.sections.append((f"server log: {name} (this test's lines)", text))


def pytest_terminal_summary(terminalreporter, config):
    from tests.live_servers import STARTS_ENV, start_counts, starts

    path = getattr(config, "_pr_server_starts", None) or os.environ.get(STARTS_ENV)
    lines = starts(path)
    if lines:
        said = ", ".join(f"{n} {how}" for how, n in sorted(start_counts(lines).items()))
        terminalreporter.write_line(f"server start-ups this session: {len(lines)} ({said}); list: {path}")
