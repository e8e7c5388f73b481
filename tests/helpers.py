"""Test helpers: tiny drafters and synthetic EAGLE-3 batches; the benchmark scripts as modules."""

import importlib.util
import os

import torch

from tests.conftest import tiny_llama_config


def load_benchmark(name: str):
    """`benchmarks/NAME.py` imported as a module (the benchmark scripts are not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_vocab_map(vocab: int, draft_vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab)
    return t2d, d2t


def make_drafters(max_depth=2, seed=0, **cfg_overrides):
    """An EAGLE-3 drafter and a PR drafter with identical EAGLE-3 weights (and SpecForge's loss made CPU-safe)."""
    from pr_specforge._specforge import LlamaForCausalLMEagle3, install_cpu_loss
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, PRDraftSettings, build_pr_config

    install_cpu_loss()
    cfg = tiny_llama_config(**cfg_overrides)
    torch.manual_seed(seed)
    eagle = LlamaForCausalLMEagle3(cfg).float()
    t2d, d2t = make_vocab_map(cfg.vocab_size, cfg.draft_vocab_size, seed)
    eagle.t2d.copy_(t2d)
    eagle.d2t.copy_(d2t)
    pr = LlamaForCausalLMEagle3PR(build_pr_config(cfg, PRDraftSettings(max_depth=max_depth))).float()
    missing, unexpected = pr.load_state_dict(eagle.state_dict(), strict=False)
    assert not unexpected
    return eagle, pr, missing


def make_batch(cfg, batch=2, seq=24, seed=1, pad_last=0):
    """A batch shaped like SpecForge's offline EAGLE-3 batch after TargetHead."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=g)
    hidden = torch.randn(batch, seq, 3 * cfg.hidden_size, generator=g)
    target = torch.randn(batch, seq, cfg.vocab_size, generator=g) * 3
    loss_mask = (torch.rand(batch, seq, generator=g) > 0.2).long()[..., None]
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_last:
        attention_mask[-1, -pad_last:] = 0
        loss_mask[-1, -pad_last:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, target=target, loss_mask=loss_mask, hidden_states=hidden)


def make_tiny_target(path, hidden=64, layers=4, vocab=97, seed=0, tie=False, tokenizer=None, heads=4):
    """A tiny random Llama target saved as safetensors with an index JSON (TargetHead needs it).

    `tie=True` ties the output embedding to the input one, as SmolLM2 does; a `tokenizer` is saved with it. `heads`
    attention heads (half as many KV heads): 2 gives vLLM's CPU attention a head size it supports (32)."""
    import json
    import os

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2),
                      num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=tie,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # a peaked next-token distribution, as a trained model has (random init is ~uniform)
        (model.model.norm.weight if tie else model.lm_head.weight).mul_(30.0)  # tied: leave the input embedding as it is
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}  # tied: lm_head saved too (TargetHead reads it)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "model.safetensors" for k in state}}, f)
    return model


def write_features(model, out_dir, n=8, seq=32, seed=0, draft_vocab=48, generated=False, dtype=torch.bfloat16):
    """SpecForge offline EAGLE-3 feature files from a real forward of `model` + vocab mapping.

    `generated=True`: the last 3/4 of each row (the supervised part) is `model`'s own greedy
    continuation of a random prompt, as regenerated data is; else random tokens throughout. `dtype`: the stored
    hidden states' (bf16, as `data hidden-states` writes them on a CPU with native bf16)."""
    import os

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    layers = [1, cfg.num_hidden_layers // 2 - 1, cfg.num_hidden_layers - 4]
    layers = [max(0, x) for x in layers]
    counts = torch.zeros(cfg.vocab_size)
    os.makedirs(os.path.join(out_dir, "rows_0-2000"), exist_ok=True)
    for i in range(n):
        ids = torch.randint(1, cfg.vocab_size, (seq,), generator=g)
        if generated:
            with torch.no_grad():
                ids = model.generate(ids[None, : seq // 4], max_new_tokens=seq - seq // 4, min_new_tokens=seq - seq // 4,
                                     do_sample=False, pad_token_id=0)[0]
        mask = torch.zeros(seq, dtype=torch.long)
        mask[seq // 4:] = 1
        with torch.no_grad():
            out = model(input_ids=ids[None], output_hidden_states=True)
        hs = out.hidden_states
        aux = torch.cat([hs[j + 1] for j in layers], dim=-1)
        torch.save({"input_ids": ids, "loss_mask": mask, "hidden_state": hs[-1].to(dtype), "aux_hidden_state": aux.to(dtype)},
                   os.path.join(out_dir, "rows_0-2000", f"data_{i}.ckpt"))
        counts.index_add_(0, ids[mask.bool()], torch.ones(int(mask.sum())))
    top = counts.argsort(descending=True)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[top] = True
    d2t = top - torch.arange(draft_vocab)
    os.makedirs(os.path.join(out_dir, "vocab_mapping"), exist_ok=True)
    torch.save({"t2d": t2d, "d2t": d2t}, os.path.join(out_dir, "vocab_mapping", "vocab_mapping.pt"))
    return os.path.join(out_dir, "vocab_mapping", "vocab_mapping.pt")


def write_workspace(root, strategy="pr", steps=6, nproc=1, pr_section=None, n=8, seq=32, extra=None, target=None,
                    generated=False, draft=None, feature_dtype=torch.bfloat16):
    """Target + features (`feature_dtype`) + draft config + recipe under `root`; returns the recipe path.

    `target`: `make_tiny_target` keyword arguments (default: 4 layers, vocab 97, untied); `draft`: draft config keys
    that replace the defaults."""
    import json
    import os

    import yaml

    target_dir = os.path.join(root, "target")
    model = make_tiny_target(target_dir, **(target or {}))
    vocab = model.config.vocab_size
    feats = os.path.join(root, "features")
    vm = write_features(model, feats, n=n, seq=seq, generated=generated, dtype=feature_dtype)
    draft_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": 48, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "target_hidden_size": 64, "pad_token_id": 0,
        "torch_dtype": "float32", **(draft or {}),
    }
    with open(os.path.join(root, "draft.json"), "w") as f:
        json.dump(draft_cfg, f)
    recipe = {
        "model": {"target_model_path": target_dir, "draft_model_config": os.path.join(root, "draft.json"),
                  "vocab_mapping_path": vm, "torch_dtype": "float32"},
        "data": {"hidden_states_path": feats, "max_length": seq, "dataloader_num_workers": 0},
        "training": {"strategy": strategy, "max_steps": steps, "batch_size": 1, "learning_rate": 1e-3,
                     "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "ttt_length": 3,
                     "log_interval": 1, "save_interval": 3, "seed": 0, "warmup_ratio": 0.0},
        "deployment": {"trainer": {"nproc_per_node": nproc}},
        "output_dir": os.path.join(root, "out"),
    }
    if pr_section is not None:
        recipe["pr"] = pr_section
    for k, v in (extra or {}).items():
        recipe.setdefault(k, {}).update(v) if isinstance(v, dict) else recipe.__setitem__(k, v)
    path = os.path.join(root, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def current_umask() -> int:
    """The process's umask (read by setting and restoring it): what a file written with `open` loses."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- issue 43's audit: drafters of a SmolLM2-layout target and the bad inputs `headroom` / `diagnose` share
def smollm2_layout_run(root, cli):
    """A 2-step PR run on a tied target whose weight index has no `lm_head.weight` (the layout `data
    smollm2-target` writes for SmolLM2), its held-out features, and its two exports (HF, SGLang; each
    records its target). `cli(*args, cwd=...)` runs `pr-specforge`; returns the paths by name."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    root = Path(root)
    recipe = write_workspace(str(root), strategy="pr", steps=2, pr_section={"max_depth": 2}, target={"tie": True},
                             extra={"model": {"lm_head_key": "model.embed_tokens.weight"}})
    target = root / "target"
    state = load_file(str(target / "model.safetensors"))
    state.pop("lm_head.weight")
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in state}}))
    held = root / "heldout"
    write_features(AutoModelForCausalLM.from_pretrained(str(target)), str(held), n=3, seed=11)
    paths = {"root": root, "run": root / "out", "held": held, "target": target}
    for argv in (["train", "-c", recipe, "training.save_interval=2"],
                 ["export", str(root / "out"), str(root / "hf"), "--to", "hf", "--target", str(target)],
                 ["export", str(root / "out"), str(root / "sglang"), "--to", "sglang"]):
        rc, out = cli(*argv, cwd=root)
        assert rc == 0, out[-3000:]
    paths.update(hf=root / "hf", sglang=root / "sglang")
    return paths


def write_manifest_of(features, target_dir, aux_layers=(1, 1, 0)):
    """A features manifest.json recording `target_dir` as `data hidden-states` records its target."""
    import json
    import os

    from pr_specforge.data.hidden_states import target_record

    with open(os.path.join(features, "manifest.json"), "w") as f:
        json.dump({"status": "complete", "target": target_record(str(target_dir), list(aux_layers))}, f)


def drafter_bad_inputs(p):
    """Every audited bad input of a DRAFTER + --features command: name -> (argv, needles of its one line)."""
    import shutil

    root, run, held = p["root"], p["run"], p["held"]
    bad = root / "bad"
    bad.mkdir(exist_ok=True)
    truncated = bad / "truncated-ckpt"
    shutil.copytree(next(run.glob("*-step2")), truncated)
    state = truncated / "training_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    broken_run = bad / "broken-run"
    broken_run.mkdir()
    (broken_run / "resolved_recipe.yaml").write_text("model: [\n  a: b\n")
    listed = bad / "listed-features"
    shutil.copytree(held, listed)
    (listed / "manifest.json").write_text("[1, 2]")
    # another target of the same hidden width (and vocab): only its identity differs
    same_width = bad / "same-width-features"
    shutil.copytree(held, same_width)
    make_tiny_target(str(bad / "same-width-target"), seed=5)
    write_manifest_of(same_width, bad / "same-width-target")
    other_vocab = bad / "other-vocab-features"
    shutil.copytree(held, other_vocab)
    make_tiny_target(str(bad / "other-vocab-target"), vocab=101, seed=6)
    write_manifest_of(other_vocab, bad / "other-vocab-target")
    f = "--features"
    later = {name: (str(path), needles) for name, (path, needles) in later_feature_file_cases(held, bad).items()}
    return {
        **{name: ([str(run), f, path], needles) for name, (path, needles) in later.items()},
        "the target model directory as the drafter": ([str(p["target"]), f, str(held)], ("not an EAGLE-3 drafter", "not the target")),
        "a truncated training_state.pt": ([str(truncated), f, str(held)], ("does not load", "damaged")),
        "a run whose resolved_recipe.yaml is malformed": ([str(broken_run), f, str(held)], ("resolved_recipe.yaml", "not valid YAML", "line 3")),
        "a features manifest.json that is a JSON list": ([str(run), f, str(listed)], ("manifest.json", "expected a JSON object, got a list")),
        "features of another target of the same width": ([str(run), f, str(same_width)], ("another target", "target.path")),
        "an export on features of another target": ([str(p["hf"]), f, str(same_width)], ("another target", "fingerprint")),
        "an SGLang export on features of another target": ([str(p["sglang"]), f, str(same_width)], ("another target",)),
        "features of another vocabulary": ([str(run), f, str(other_vocab)], ("another target", "vocab_size")),
        "--limit 0": ([str(run), f, str(held), "--limit", "0"], ("--limit", "at least 1")),
        "a negative --limit": ([str(run), f, str(held), "--limit", "-2"], ("--limit", "at least 1")),
        "a --checkpoint that does not exist": ([str(run), f, str(held), "--checkpoint", str(bad / "nope")],
                                              ("--checkpoint", "no such checkpoint")),
        "a drafter path that is a file": ([str(root / "draft.json"), f, str(held)], ("draft.json", "not a training run")),
    }


def later_feature_file_cases(held, bad):
    """Copies of the features `held` whose LAST feature file (not the first, which was the only one checked) is
    damaged: name -> (features dir, needles of its one line; each names the file). A loader checks each sample as
    it reads it (`training.preflight.FeatureSampleCheck`), so each ends the command in one line."""
    import shutil

    import torch

    def damaged(name, edit):
        out = bad / f"later-{name}"
        shutil.copytree(held, out)
        last = sorted(out.rglob("*.ckpt"))[-1]
        edit(last)
        return out, last.name

    def rewrite(change):
        def edit(path):
            sample = torch.load(path, weights_only=True)
            change(sample)
            torch.save(sample, path)
        return edit

    cases = {
        "a later features file truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), ("does not load",)),
        "a later features file of garbage": (lambda p: p.write_bytes(b"not a torch file"), ("does not load",)),
        "a later features file of another width": (rewrite(lambda s: s.update(hidden_state=s["hidden_state"][..., :-1])),
                                                   ("hidden_state shape",)),
        "a later features file without loss_mask": (rewrite(lambda s: s.pop("loss_mask")), ("missing key(s) ['loss_mask']",)),
        "a later features file of another dtype": (rewrite(lambda s: s.update(hidden_state=s["hidden_state"].half(),
                                                                              aux_hidden_state=s["aux_hidden_state"].half())),
                                                   ("hidden_state is torch.float16", "first feature file torch.bfloat16")),
        # issue 65: each of these gave rc 0 with wrong numbers (silent zero padding, NaN) or a 45-74 line traceback
        "a later features file whose hidden states are shorter than input_ids": (
            rewrite(lambda s: s.update(hidden_state=s["hidden_state"][:, :-2], aux_hidden_state=s["aux_hidden_state"][:, :-2])),
            ("hidden_state shape", "input_ids tokens")),
        "a later features file whose input_ids are shorter than the states": (
            rewrite(lambda s: s.update(input_ids=s["input_ids"][:-2], loss_mask=s["loss_mask"][:-2])), ("hidden_state shape",)),
        "a later features file holding NaN": (rewrite(lambda s: s["aux_hidden_state"][0, 3, 5].fill_(float("nan"))),
                                              ("non-finite values", "aux_hidden_state")),
        "a later features file holding a token id >= the vocab": (rewrite(lambda s: s["input_ids"][-1].fill_(10_000)),
                                                                  ("input_ids outside [0, ",)),
        "a later features file with a 2-D loss_mask": (rewrite(lambda s: s.update(loss_mask=s["loss_mask"][None])),
                                                       ("loss_mask shape (1, ",)),
    }
    out = {}
    for name, (edit, needles) in cases.items():
        path, file_name = damaged(name.replace(" ", "-"), edit)
        out[name] = (path, (file_name, *needles))
    return out


# ---- kill -9 / Ctrl-C audit helpers (issue 43): shared by the train, headroom and diagnose kill tests
def sigkill_when(cmd, ready, env=None, timeout=120):
    """Start `cmd`, SIGKILL it as soon as `ready()` holds (it must not end before)."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while not ready():
            assert proc.poll() is None, "the command ended before the kill point"
            assert time.time() < deadline, "kill point never reached"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def kill_a_writer_mid_write(path, env=None):
    """kill -9 a process inside `data.io`'s atomic write of `path` (its temp file written, not yet renamed):
    what a kill of any command mid-write leaves. Returns the temp files it left."""
    import sys
    from pathlib import Path

    path = Path(path)
    code = ("import sys, time; from pr_specforge.data.io import _atomic_write; "
            "_atomic_write(sys.argv[1], lambda f: (f.write('half a file'), f.flush(), time.sleep(600)), 'w')")

    def temps():
        return [p for p in path.parent.glob(f".{path.name}.*.tmp")] if path.parent.is_dir() else []

    sigkill_when([sys.executable, "-c", code, str(path)], lambda: bool(temps()), env=env, timeout=60)
    return temps()


def sigint_at_first_batch(monkeypatch):
    """Ctrl-C (a real SIGINT to this process) once the acceptance simulator takes its first batch: mid-run of
    `diagnose` and `headroom`, both of which feed it."""
    import os
    import signal

    from pr_specforge.training.simulate import Simulator

    original = Simulator.add

    def add_then_interrupt(self, *args, **kwargs):
        original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Simulator, "add", add_then_interrupt)
    return lambda: monkeypatch.setattr(Simulator, "add", original)


def interrupted_run(main, argv, capsys, monkeypatch, command):
    """`main(argv)` Ctrl-C'd at its first batch (`sigint_at_first_batch`): asserts exit 130, no traceback and one
    line of `pr-specforge COMMAND:` saying it was interrupted (SpecForge's import may warn too); returns that line."""
    restore = sigint_at_first_batch(monkeypatch)
    capsys.readouterr()
    try:
        assert main(argv) == 130
    finally:
        restore()
    full = capsys.readouterr().err
    lines = [x for x in full.splitlines() if x.startswith(f"pr-specforge {command}:")]
    assert "Traceback" not in full and len(lines) == 1 and "interrupted" in lines[0], full[-2000:]
    return lines[0]


def run_cli(*args, cwd, env=None):
    """`pr-specforge ARGS` from `cwd`: (exit code, stdout + stderr). Every command but `train` runs in this process
    (a fresh interpreter costs ~8 s of imports on this CPU, most of a tiny command's time); `train` starts SpecForge's
    process-group and trainer state, so it runs as `python -m pr_specforge.cli train ...` under `env`. In process,
    the CLI's SIGINT handler and the working directory are restored after; an uncaught exception propagates (the
    test fails, as a traceback in a subprocess's output would fail it)."""
    import contextlib
    import io
    import signal
    import subprocess
    import sys

    argv = [str(a) for a in args]
    if argv[:1] == ["train"]:
        proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
        return proc.returncode, proc.stdout + proc.stderr
    from pr_specforge.cli import main

    buf, handler = io.StringIO(), signal.getsignal(signal.SIGINT)
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors and --help
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        signal.signal(signal.SIGINT, handler)
    return rc, buf.getvalue()
