"""Step 3: conversations -> SpecForge offline EAGLE-3 feature files.

Layout (what `scripts/prepare_hidden_states.py` writes and what
`specforge.runtime.data_plane.offline_reader.OfflineManifestReader` walks; the
reader needs no manifest, it lists every `*.ckpt` below the directory):

    <out>/rows_0-2000/data_0.ckpt ... data_1999.ckpt
    <out>/rows_2000-4000/data_2000.ckpt ...
    <out>/vocab_mapping/vocab_mapping.pt   {"t2d": bool[V], "d2t": int64[Vd]}
    <out>/manifest.json                    ours: counts, shapes, target fingerprint

Each `.ckpt` is `torch.save({input_ids[L] int64, loss_mask[L] int64,
hidden_state[1,L,H], aux_hidden_state[1,L,3H]})`: `hidden_state` is the
target's final post-norm hidden state, `aux_hidden_state` the OUTPUTS of the
captured layers concatenated (SpecForge/SGLang convention: default layers
`[1, L//2-1, L-4]`, i.e. HF `output_hidden_states[i+1]`). `data_{i}` is the
i-th row of the input JSONL, so a rerun skips exactly the files already
written (each written atomically) and produces the same directory.

Backends: `transformers` (batched forward, CPU or GPU) and `sglang` (GPU only,
a thin driver over `specforge.offline_capture`).

It deliberately does not train, and does not regenerate responses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pr_specforge.data.io import (DataFormatError, ResumeMismatch, atomic_torch_save, atomic_write_json, check_resume,
                                  file_digest, iter_jsonl)
from pr_specforge.data.vocab import build_vocab_mapping, count_loss_tokens, save_vocab_mapping, vocab_fingerprint

logger = logging.getLogger(__name__)

FILE_GROUP_SIZE = 2000
MANIFEST = "manifest.json"
FORMAT = "specforge-offline-eagle3"
#: Test hook: seconds to sleep after each written batch (lets a test kill -9 a rank mid-shard).
BATCH_SLEEP_ENV = "PR_SPECFORGE_PREP_BATCH_SLEEP"


class FeatureDirMismatch(ResumeMismatch):
    """The output directory holds features of another target, input or settings."""


#: the manifest's `target` fields a resumed directory must share with this run's target
TARGET_FIELDS = ("path", "hidden_size", "num_hidden_layers", "vocab_size", "aux_layers")


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's default capture layers of an `num_layers`-layer target (layer outputs)."""
    from pr_specforge._specforge import eagle_capture_layers, target_layer_count

    return eagle_capture_layers({}, target_layer_count(num_layers))


def feature_path(out_dir: str | os.PathLike, idx: int, group: int = FILE_GROUP_SIZE) -> Path:
    g = (idx // group) * group
    return Path(out_dir) / f"rows_{g}-{g + group}" / f"data_{idx}.ckpt"


def _text_config(config):
    return getattr(config, "text_config", None) or config


def target_fingerprint(config, aux_layers: list[int], target_path: str) -> dict:
    cfg = _text_config(config)
    fp = {
        "path": str(Path(target_path).resolve()) if os.path.exists(str(target_path)) else str(target_path),
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(cfg.vocab_size),
        "aux_layers": [int(i) for i in aux_layers],
    }
    key = json.dumps({k: v for k, v in fp.items() if k != "path"}, sort_keys=True)
    fp["config_fingerprint"] = hashlib.sha1(key.encode()).hexdigest()[:16]
    return fp


#: the key under which an export's config.json records its target (`target_record`)
TARGET_RECORD_KEY = "pr_specforge_target"
#: bytes of each weight file `target_weights_digest` reads at its start, middle and end
WEIGHT_SAMPLE_BYTES = 1 << 20


def target_weights_digest(target_path: str) -> str:
    """The identity of a target's weights by content, read cheaply: each weight file's name and size and 1 MiB at
    its start, middle and end (the whole file when smaller), so a target of the same shape and other weights
    differs, and an 8B target costs a few MiB, not 16 GB. `train` records it in every checkpoint; `export` compares
    its `--target` with it."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(target_path)):
        full = os.path.join(target_path, name)
        if not (os.path.isfile(full) and name.endswith((".safetensors", ".bin", ".pt", ".pth"))):
            continue
        size = os.path.getsize(full)
        h.update(f"{name}:{size}".encode())
        with open(full, "rb") as f:
            for start in sorted({0, max(0, size // 2 - WEIGHT_SAMPLE_BYTES // 2), max(0, size - WEIGHT_SAMPLE_BYTES)}):
                f.seek(start)
                h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def target_record(target_path: str, aux_layers: list[int] | None = None) -> dict:
    """`target_fingerprint` of a target model directory (`aux_layers` left out when unknown): what a drafter's
    export records about its target and what its features' manifest is compared with."""
    from transformers import AutoConfig

    record = target_fingerprint(AutoConfig.from_pretrained(target_path), list(aux_layers or []), target_path)
    if not aux_layers:
        record.pop("aux_layers")
    return record


def check_output_dir(out_dir: str | os.PathLike, target: dict, resume: dict | None = None) -> None:
    """Refuse to resume features made from another target, input or settings in one directory.

    The fingerprint (`check_resume`) is the manifest's `target` fields and, when given, its
    `resume` record: the input's content hash and the settings that decide a feature file."""
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST
    fix = "rerun with --start-over to discard its features, or write to a new output directory"
    if manifest.exists():
        try:
            old = json.loads(manifest.read_text())
        except json.JSONDecodeError as e:
            raise FeatureDirMismatch(f"{manifest}: unreadable manifest ({e.msg}); move the directory aside") from None
        recorded = {f"target.{k}": v for k, v in old.get("target", {}).items()}
        current = {f"target.{k}": target[k] for k in TARGET_FIELDS}
        if resume is not None:
            recorded.update({f"resume.{k}": v for k, v in (old.get("resume") or {}).items()})
            current.update({f"resume.{k}": v for k, v in resume.items()})
        check_resume(str(manifest), recorded, current, fix, error=FeatureDirMismatch)
        return
    existing = sorted(out_dir.glob("rows_*/data_*.ckpt"))[:1]
    if existing:
        import torch

        sample = torch.load(existing[0], map_location="cpu", weights_only=True, mmap=True)
        h = int(sample["hidden_state"].shape[-1])
        if h != target["hidden_size"]:
            raise FeatureDirMismatch(
                f"{existing[0]}: field 'hidden_state' has hidden size {h} but this run's target has "
                f"hidden_size {target['hidden_size']}; {fix}"
            )
        if resume is not None:  # files without the manifest that says what made them
            raise FeatureDirMismatch(f"{out_dir}: holds feature files but no {MANIFEST} saying what they were made "
                                     f"from; {fix}")


def discard_features(out_dir: str | os.PathLike) -> None:
    """`--start-over`: delete what `prepare_hidden_states` wrote in `out_dir` (nothing else)."""
    import shutil

    out_dir = Path(out_dir)
    for path in out_dir.glob("rows_*/data_*.ckpt"):
        path.unlink()
    for group in out_dir.glob("rows_*"):
        if group.is_dir() and not any(group.iterdir()):
            group.rmdir()
    shutil.rmtree(out_dir / "vocab_mapping", ignore_errors=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)


# ---------------------------------------------------------------- backends


class TransformersCapture:
    """Batched HF forward with `output_hidden_states=True` (CPU or GPU)."""

    def __init__(self, model, aux_layers: list[int], device: str = "cpu"):
        self.model = model.eval()
        self.aux_layers = list(aux_layers)
        self.device = device
        # The decoder stack alone: the final post-norm hidden is its
        # `last_hidden_state`, so the lm_head (V x H per token) is never run.
        self.decoder = getattr(model, model.base_model_prefix, model)
        n = _text_config(model.config).num_hidden_layers
        bad = [i for i in self.aux_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux layers {bad} outside the target's {n} layers")

    @classmethod
    def from_pretrained(cls, path: str, aux_layers: list[int] | None, dtype: str = "bfloat16", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        if aux_layers is None:
            aux_layers = default_aux_layers(_text_config(model.config).num_hidden_layers)
        return cls(model, aux_layers, device)

    def forward(self, input_ids, attention_mask):
        """Batched `(final [B,L,H], aux [B,L,3H])` on the model's device: the one feature path,
        used by `capture` (offline files) and by online training (`pr_specforge.training.online`)."""
        import torch

        with torch.inference_mode():
            out = self.decoder(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                output_hidden_states=True,
                use_cache=False,
            )
        aux = torch.cat([out.hidden_states[i + 1] for i in self.aux_layers], dim=-1)
        return out.last_hidden_state, aux

    def capture(self, batch: list) -> list[tuple]:
        """`batch`: list of 1-D input_ids. Returns `(hidden [1,L,H], aux [1,L,3H])` per row, on CPU."""
        import torch

        lens = [len(x) for x in batch]
        L = max(lens)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for i, x in enumerate(batch):  # right padding: causal attention keeps real positions exact
            ids[i, : lens[i]] = x
            mask[i, : lens[i]] = 1
        final, aux = self.forward(ids, mask)
        final, aux = final.cpu(), aux.cpu()
        return [(final[i : i + 1, : lens[i]].clone(), aux[i : i + 1, : lens[i]].clone()) for i in range(len(batch))]


class SGLangCapture:
    """GPU capture through SpecForge's own SGLang driver (`specforge.offline_capture`).

    SGLang's `set_eagle3_layers_to_capture` adds 1 to each id and captures that
    layer's input, i.e. the output of the layer we name: the same convention
    as `TransformersCapture`. Rows go one at a time because SpecForge's
    `capture` takes every column of a row as a token (no padding support).
    """

    def __init__(self, path: str, aux_layers: list[int] | None, dtype: str = "bfloat16"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "the sglang backend needs a CUDA GPU and none is visible (SpecForge 0.2.0's SGLang capture, "
                "specforge/offline_capture/sglang_backend/capture.py, builds its model runner on "
                "torch.cuda.current_device(), even with device='cpu'); use `--backend transformers` (CPU or GPU) instead"
            )
        import torch.distributed as dist

        from pr_specforge._specforge import init_distributed
        from pr_specforge._specforge import load_offline_capture

        if not dist.is_initialized():
            for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
                os.environ.setdefault(k, v)
            init_distributed(tp_size=1)
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
        self.engine = load_offline_capture(path, torch_dtype=torch_dtype)
        if aux_layers is None:
            from transformers import AutoConfig

            aux_layers = default_aux_layers(_text_config(AutoConfig.from_pretrained(path)).num_hidden_layers)
        self.aux_layers = list(aux_layers)
        self.engine.set_capture_layers(self.aux_layers, capture_method="eagle3")

    def capture(self, batch: list) -> list[tuple]:
        import torch

        out = []
        for ids in batch:
            ids = ids.view(1, -1).cuda()
            res = self.engine.capture(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.zeros_like(ids))
            out.append((res.last_hidden_states.cpu(), res.hidden_states.cpu()))
        return out


# ---------------------------------------------------------------- the step


@dataclass
class HiddenStateStats:
    rows: int = 0
    written: int = 0
    resumed: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    dtype: str | None = None  # of the features this process wrote

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "written": self.written,
            "resumed": self.resumed,
            "samples": self.written + self.resumed,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "skipped": dict(self.skipped),
        }


def _batches(items: list, batch_size: int, max_batch_tokens: int):
    """Length-sorted batches bounded by rows and by padded tokens."""
    items = sorted(items, key=lambda it: len(it[1]))
    batch: list = []
    for it in items:
        if batch and (len(batch) >= batch_size or len(it[1]) * (len(batch) + 1) > max_batch_tokens):
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


def tokenized_rows(input_path, tokenizer, chat_template: str, max_length: int, vocab_size: int,
                   stats: HiddenStateStats, limit: int | None = None):
    """Yield `(row index, TokenizedSample)` for every trainable row of a conversation JSONL.

    The one tokenisation (and skip rule) shared by offline features and online
    training, so both see the same rows with the same ids and loss masks.
    Rows skipped are counted in `stats.skipped` by reason.
    """
    from pr_specforge.data.templates import tokenize_conversation

    for idx, (lineno, row) in enumerate(iter_jsonl(input_path)):
        if limit is not None and idx >= limit:
            break
        stats.rows += 1
        conv = row.get("conversations")
        if not isinstance(conv, list) or not conv:
            stats.skipped["no_conversation"] += 1
            continue
        try:
            sample = tokenize_conversation(tokenizer, conv, chat_template, max_length)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("%s:%d: cannot tokenise (%s); skipped", input_path, lineno, e)
            stats.skipped["bad_conversation"] += 1
            continue
        if int(sample.loss_mask.sum()) == 0:
            stats.skipped["no_loss_tokens"] += 1
            continue
        if int(sample.input_ids.max()) >= vocab_size:
            stats.skipped["token_out_of_vocab"] += 1
            continue
        stats.tokens += len(sample.input_ids)
        stats.loss_tokens += int(sample.loss_mask.sum())
        yield idx, sample


def prepare_hidden_states(
    input_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    target_path: str,
    chat_template: str,
    backend: str = "transformers",
    capture=None,
    tokenizer=None,
    aux_layers: list[int] | None = None,
    max_length: int = 2048,
    draft_vocab_size: int = 32000,
    batch_size: int = 8,
    max_batch_tokens: int = 16384,
    dtype: str = "bfloat16",
    device: str = "cpu",
    limit: int | None = None,
    progress: bool = True,
    start_over: bool = False,
) -> HiddenStateStats:
    """Write SpecForge offline features for the conversations in `input_path`.

    `capture`/`tokenizer` may be passed in (tests, benchmarks); otherwise they
    are loaded from `target_path` with `backend`.

    Under `torchrun` every rank tokenises the whole input (cheap next to the
    forward), forms the same length-sorted batches, and captures batches
    `rank, rank + N, ...`: a row's batch, hence its features, is the same as
    in a one-rank run. Rank 0 writes the vocab map and the final manifest once
    every rank is done (`pr_specforge.data.sharding`).

    An `output_dir` is resumed only when made from the same input, target and settings
    (`check_output_dir`); `start_over` discards its features first.
    """
    from transformers import AutoConfig, AutoTokenizer

    from pr_specforge.data.sharding import barrier, current_shard, gather_to_main
    from pr_specforge.data.templates import check_tokenizer

    shard = current_shard()
    if backend == "sglang" and shard.world > 1 and capture is None:
        raise ValueError("the sglang backend runs one rank; under torchrun use --backend transformers")
    device = shard.device(device)
    out_dir = Path(output_dir)
    config = capture.model.config if capture is not None and hasattr(capture, "model") else AutoConfig.from_pretrained(target_path)
    if aux_layers is None:
        aux_layers = list(getattr(capture, "aux_layers", None) or default_aux_layers(_text_config(config).num_hidden_layers))
    target = target_fingerprint(config, aux_layers, target_path)
    resume = {"input": file_digest(input_path), "chat_template": chat_template, "max_length": max_length,
              "dtype": dtype, "backend": backend}
    _start_or_resume(out_dir, target, resume, start_over, shard)
    _check_draft_vocab_size(draft_vocab_size, target["vocab_size"])

    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(target_path)
    check_tokenizer(tokenizer, chat_template)
    stats = HiddenStateStats()
    items, counts = _tokenized_items(input_path, tokenizer, chat_template, max_length, target["vocab_size"], stats, limit)
    todo = _unfinished_batches(items, shard, out_dir, stats, batch_size, max_batch_tokens)
    if not items:  # every rank reads every row, so all refuse together
        raise DataFormatError(f"{input_path}: no usable conversation (read {stats.rows} rows, "
                              f"skipped {dict(stats.skipped)}); nothing written")
    manifest = {
        "format": FORMAT, "status": "in_progress", "target": target, "chat_template": chat_template,
        "max_length": max_length, "backend": backend, "dtype": dtype, "input": str(Path(input_path).resolve()),
        "file_group_size": FILE_GROUP_SIZE, "shapes": _feature_shapes(target["hidden_size"]),
        "draft_vocab_size": draft_vocab_size, "vocab_mapping": "vocab_mapping/vocab_mapping.pt", "ranks": shard.world,
        "resume": resume,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    if shard.is_main:
        atomic_write_json(out_dir / MANIFEST, {**manifest, "counts": stats.as_dict()})
    barrier(shard)  # no rank writes a feature before the directory says what it holds (a kill then leaves an in_progress manifest)

    if todo and capture is None:
        capture = _load_capture(backend, target_path, aux_layers, dtype, device)
    _capture_batches(capture, todo, out_dir, stats, shard, progress)
    per_rank = gather_to_main(shard, (stats.written, stats.resumed, stats.skipped.get("nan", 0), stats.dtype))
    if shard.is_main:
        _complete(out_dir, manifest, stats, per_rank, counts, draft_vocab_size)
    return stats


def _check_draft_vocab_size(draft_vocab_size: int, vocab_size: int) -> None:
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be at least 1, got {draft_vocab_size}")
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocab size {vocab_size}")


def _start_or_resume(out_dir: Path, target: dict, resume: dict, start_over: bool, shard) -> None:
    """`start_over`: rank 0 discards the directory's features, every rank waits; else refuse features
    made from another target, input or settings (every rank reads the same manifest: all refuse)."""
    from pr_specforge.data.sharding import barrier

    if start_over:
        if shard.is_main:
            discard_features(out_dir)
        barrier(shard)
    else:
        check_output_dir(out_dir, target, resume)


def _capture_batches(capture, todo: list, out_dir: Path, stats: HiddenStateStats, shard, progress: bool) -> None:
    """Capture and write every unfinished batch of this rank, with a progress bar."""
    from tqdm import tqdm

    n_todo = sum(len(b) for b in todo)  # rows of unfinished batches (done rows are recomputed, not rewritten)
    desc = "hidden states" if shard.world == 1 else f"hidden states (rank {shard.rank}/{shard.world})"
    pause = float(os.environ.get(BATCH_SLEEP_ENV, "0") or 0)
    with tqdm(total=n_todo, desc=desc, unit="sample", disable=not progress, position=shard.local_rank) as bar:
        for batch in todo:
            _write_batch(capture, batch, out_dir, stats)
            bar.update(len(batch))
            if pause:
                time.sleep(pause)


def _tokenized_items(input_path, tokenizer, chat_template: str, max_length: int, vocab_size: int,
                     stats: HiddenStateStats, limit: int | None):
    """`(index, input_ids, loss_mask)` of every usable row, and the loss-token counts of the vocab map."""
    counts: Counter = Counter()
    items = []
    for idx, sample in tokenized_rows(input_path, tokenizer, chat_template, max_length, vocab_size, stats, limit):
        count_loss_tokens(counts, sample.input_ids, sample.loss_mask)
        items.append((idx, sample.input_ids, sample.loss_mask))
    return items, counts


def _unfinished_batches(items, shard, out_dir: Path, stats: HiddenStateStats, batch_size: int, max_batch_tokens: int) -> list:
    """This rank's length-sorted batches that still miss a feature file (done rows are counted)."""
    todo = []
    for k, batch in enumerate(_batches(items, batch_size, max_batch_tokens)):
        if not shard.owns(k):
            continue
        done = sum(feature_path(out_dir, it[0]).exists() for it in batch)
        stats.resumed += done
        if done < len(batch):
            todo.append(batch)  # whole: a row's features never depend on how far a killed run got
    return todo


def _feature_shapes(hidden_size: int) -> dict:
    return {
        "input_ids": ["L"],
        "loss_mask": ["L"],
        "hidden_state": [1, "L", hidden_size],
        "aux_hidden_state": [1, "L", 3 * hidden_size],
    }


def _complete(out_dir: Path, manifest: dict, stats: HiddenStateStats, per_rank, counts: Counter, draft_vocab_size: int) -> None:
    """Rank 0, once every rank is done: sum the ranks' counters, write the vocab map and the final manifest."""
    stats.written, stats.resumed, nan = (sum(col) for col in list(zip(*per_rank))[:3])
    if nan:
        stats.skipped["nan"] = nan
    written_dtype = next((d for *_, d in per_rank if d), manifest["dtype"])  # what was stored, e.g. a float32 capture
    mapping = build_vocab_mapping(counts, draft_vocab_size, manifest["target"]["vocab_size"])
    save_vocab_mapping(mapping, out_dir)
    atomic_write_json(out_dir / MANIFEST, {**manifest, "status": "complete", "dtype": written_dtype,
                                           "vocab_fingerprint": vocab_fingerprint(mapping), "counts": stats.as_dict()})
    logger.info("hidden states: %s", stats.as_dict())


def _load_capture(backend: str, target_path: str, aux_layers, dtype: str, device: str):
    if backend == "transformers":
        return TransformersCapture.from_pretrained(target_path, aux_layers, dtype=dtype, device=device)
    if backend == "sglang":
        return SGLangCapture(target_path, aux_layers, dtype=dtype)
    raise ValueError(f"unknown backend {backend!r} (transformers | sglang)")


def _write_batch(capture, batch: list, out_dir: Path, stats: HiddenStateStats) -> None:
    """Capture one batch and write each missing row's feature file atomically (a kill loses only this batch)."""
    import torch

    feats = capture.capture([ids for _, ids, _ in batch])
    for (idx, ids, mask), (hidden, aux) in zip(batch, feats):
        if feature_path(out_dir, idx).exists():
            continue  # written before a kill (counted as resumed)
        if torch.isnan(hidden).any() or torch.isnan(aux).any():
            stats.skipped["nan"] += 1
            logger.warning("NaN in the hidden states of row %d; not written", idx)
            continue
        atomic_torch_save(
            {"input_ids": ids.to(torch.long), "loss_mask": mask.to(torch.long), "hidden_state": hidden, "aux_hidden_state": aux},
            feature_path(out_dir, idx),
        )
        stats.written += 1
        stats.dtype = str(hidden.dtype).replace("torch.", "")
