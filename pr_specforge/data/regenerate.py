"""Step 2: replace assistant turns with the target model's own responses.

A drafter learns the distribution it is trained on; training on the target's
own replies (rather than ShareGPT's ChatGPT replies) matches what it will see
at serving time.

Backends:
- `OpenAIChatBackend`: any OpenAI-compatible server (`POST /v1/chat/completions`),
  standard library only, threads for concurrency, retries with exponential
  backoff on connection errors, timeouts, 429 and 5xx.
- `TransformersBackend`: in-process batched `generate` (left padding; bf16
  where supported).

Modes: `first` keeps [system?, first user] and generates one reply; `all`
walks every user turn in order, feeding the regenerated history back.

Output rows are fsynced one by one; a rerun skips ids already in the output
(when made with the same input and settings: `regenerate_fingerprint`), so an
interruption loses only the rows in flight. A finished output is in input order.

It deliberately does not tokenise for training or capture hidden states.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pr_specforge.data.io import (DataFormatError, JsonlAppender, StageStats, dir_fingerprint, file_digest, iter_jsonl,
                                  read_done_ids, resume_jsonl_output)

logger = logging.getLogger(__name__)


class RegenerationError(RuntimeError):
    """A reply could not be obtained (after retries, or a non-retryable error)."""


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512


class OpenAIChatBackend:
    """Client of an OpenAI-compatible `/v1/chat/completions` endpoint."""

    RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 120.0,
        max_retries: int = 5,
        backoff: float = 1.0,
        concurrency: int = 8,
    ):
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.concurrency = concurrency
        self.name = model
        self.fingerprint = {"server": self.url, "model": model}  # what decides its replies (`regenerate_fingerprint`)

    def _post(self, payload: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode())

    def complete(self, messages: list[dict], sampling: SamplingConfig) -> str:
        payload = {
            "model": self.model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
        }
        last = None
        for attempt in range(self.max_retries + 1):
            try:
                body = self._post(payload)
                return body["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as e:
                if e.code not in self.RETRYABLE_STATUS:
                    detail = e.read()[:300].decode(errors="replace")
                    raise RegenerationError(f"{self.url} answered HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
                raise RegenerationError(f"{self.url} sent a malformed completion ({e!r})") from None
            if attempt < self.max_retries:
                delay = self.backoff * (2**attempt)
                logger.warning("%s failed (%s); retry %d/%d in %.2fs", self.url, last, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise RegenerationError(f"{self.url} failed after {self.max_retries + 1} attempts (last: {last})")

    def generate(self, batch: list[list[dict]], sampling: SamplingConfig) -> list[str]:
        return [self.complete(m, sampling) for m in batch]


class TransformersBackend:
    """In-process batched generation with a `transformers` causal LM."""

    def __init__(self, model, tokenizer, device: str = "cpu", name: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = device
        self.name = name or getattr(model.config, "_name_or_path", "transformers")
        self.last_new_tokens = 0
        # what decides its replies (`regenerate_fingerprint`); `from_pretrained` adds the target's files
        self.fingerprint = {"name": self.name, "dtype": str(model.dtype).replace("torch.", "")}

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pr_specforge.dtypes import resolve_dtype

        dtype = resolve_dtype(dtype, device)
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        backend = cls(model, AutoTokenizer.from_pretrained(path), device=device, name=os.path.basename(path.rstrip("/")))
        backend.fingerprint.update(target=os.path.abspath(path), target_files=dir_fingerprint(path, hash_weights=False),
                                   device=str(device).split(":")[0])
        return backend

    def generate(self, batch: list[list[dict]], sampling: SamplingConfig) -> list[str]:
        import torch

        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        kwargs = {"max_new_tokens": sampling.max_new_tokens, "pad_token_id": self.tokenizer.pad_token_id}
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            kwargs["eos_token_id"] = eos
        with torch.inference_mode():
            out = self.model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        self.last_new_tokens = int((new != self.tokenizer.pad_token_id).sum())  # for throughput reports
        # Kept verbatim (no strip): the drafter should see the target's exact tokens.
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in new]


# ---------------------------------------------------------------- conversations


def prompt_turns(conversation: list[dict]) -> tuple[list[dict], list[str]]:
    """Split into (leading system messages, user turns)."""
    system = [m for m in conversation[:1] if m.get("role") == "system"]
    users = [m["content"] for m in conversation if m.get("role") == "user"]
    return system, users


def regenerate_batch(backend, rows: list[dict], turns: str, sampling: SamplingConfig) -> list[list[dict]]:
    """New conversations for `rows`, turns advanced in lockstep across the batch."""
    convs, users = [], []
    for row in rows:
        system, u = prompt_turns(row["conversations"])
        convs.append(list(system))
        users.append(u if turns == "all" else u[:1])
    for k in range(max(len(u) for u in users)):
        active = [i for i, u in enumerate(users) if k < len(u)]
        for i in active:
            convs[i].append({"role": "user", "content": users[i][k]})
        replies = backend.generate([convs[i] for i in active], sampling)
        for i, reply in zip(active, replies):
            convs[i].append({"role": "assistant", "content": reply})
    return convs


RegenerateStats = StageStats


def prompt_chars(conversation: list) -> int:
    """A conversation's prompt length in characters (its user and system turns): what `max_prompt_chars` bounds and
    the in-process batches are sorted by."""
    return sum(len(str(m.get("content", ""))) for m in conversation if isinstance(m, dict) and m.get("role") in ("user", "system"))


def regenerate_fingerprint(input_path, backend, turns: str, sampling: SamplingConfig, batch_size: int | None,
                           limit: int | None, max_prompt_chars: int | None) -> dict:
    """What decides the replies `regenerate_conversations` writes: the input's content, the backend
    (`backend.fingerprint`: the target or the server and model), the sampling, and for in-process
    backends the batches (`batch_size`, and `limit`, which decides the rows they are formed from)."""
    return {"input": file_digest(input_path), "backend": getattr(backend, "fingerprint", {"name": backend.name}),
            "turns": turns, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens, "max_prompt_chars": max_prompt_chars,
            "batch_size": batch_size, "limit": limit}


def regenerate_conversations(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    backend,
    turns: str = "first",
    sampling: SamplingConfig | None = None,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = True,
    max_prompt_chars: int | None = None,
    start_over: bool = False,
) -> RegenerateStats:
    """Regenerate every conversation of `input_path` into `output_path` (resumable).

    Server backends (`concurrency` attribute) run one conversation per thread
    with at most `2 * concurrency` in flight; in-process backends run
    `batch_size` conversations per `generate` call. Rows whose reply failed
    are counted (`skipped["failed"]`), not written, and retried by a rerun.
    In-process batches are formed from every usable row sorted by prompt length
    (stable), so one long prompt does not pad a whole batch; a batch holding a
    row still to write is regenerated whole (a row's reply depends on its
    batch-mates' padding), so a resumed run writes what an uninterrupted one
    does. `max_prompt_chars` skips (and counts) conversations whose user turns
    exceed it. The output ends in input order.

    An existing output is resumed only when made with the same fingerprint
    (`regenerate_fingerprint`; `ResumeMismatch` otherwise); `start_over`
    discards it first.

    Under `torchrun` every rank forms the same batches and takes batches
    r, r + N, ... (server backends: rows r, r + N, ...), as one rank would
    form them; it appends its rows to its own `<output>.parts/rank{r}.jsonl`
    (resumed per rank); once every rank is done, rank 0 merges the parts into
    `output_path` in input order: the same file a one-rank run writes.
    """
    from tqdm import tqdm

    from pr_specforge.data.sharding import barrier, current_shard

    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    sampling = sampling or SamplingConfig()
    stats = RegenerateStats()
    shard = current_shard()
    if next(iter_jsonl(input_path), None) is None:  # every rank sees the same file: all refuse together
        raise DataFormatError(f"{input_path}: no rows to regenerate (an empty file)")
    batched = not getattr(backend, "concurrency", None)
    fingerprint = regenerate_fingerprint(input_path, backend, turns, sampling, batch_size if batched else None,
                                         limit if batched else None, max_prompt_chars)
    parts_dir = f"{output_path}.parts"
    resume_jsonl_output(output_path, fingerprint, start_over, extra=(parts_dir,), write=shard.is_main)
    barrier(shard)  # no rank reads what it has done before rank 0 has discarded (--start-over) or recorded
    final_path, output_path = output_path, _part_path(output_path, shard)
    done = _done_ids(final_path, output_path, shard)
    rows = list(_usable_rows(input_path, shard, stats, limit, max_prompt_chars))
    todo = _unfinished(_batches(rows, batch_size) if batched else [[row] for row in rows], shard, done, stats)

    def emit(out, row, conv):
        if row["id"] in done:
            return  # a batch-mate regenerated for its padding; written before
        if any(m["role"] == "assistant" and not m["content"] for m in conv):
            stats.skipped["empty_reply"] += 1
            return
        out.write({"id": row["id"], "conversations": conv, "regenerated_by": backend.name})
        stats.written += 1

    desc = "regenerate" if shard.world == 1 else f"regenerate (rank {shard.rank}/{shard.world})"
    total = sum(len(u) for u in todo)
    with JsonlAppender(output_path) as out, tqdm(total=total, desc=desc, unit="conv", disable=not progress,
                                                 position=shard.local_rank) as bar:
        if batched:
            for batch in todo:
                for r, conv in zip(batch, regenerate_batch(backend, batch, turns, sampling)):
                    emit(out, r, conv)
                bar.update(len(batch))
        else:
            _regenerate_threaded([u[0] for u in todo], backend, turns, sampling, lambda r, c: emit(out, r, c), stats, bar)
    stats = _finish_shards(shard, stats, input_path, final_path)
    logger.info("regenerate: %s", stats.as_dict())
    return stats


def _done_ids(final_path, part_path, shard) -> set:
    """Ids this rank need not regenerate: in the output, in its own part, and for one rank in any
    part a sharded run left (killed before its merge)."""
    done = read_done_ids(final_path) | read_done_ids(part_path)
    if shard.world == 1:
        done |= {i for p in sorted(glob.glob(os.path.join(f"{final_path}.parts", "rank*.jsonl"))) for i in read_done_ids(p)}
    return done


def _unfinished(units: list, shard, done: set, stats: RegenerateStats) -> list:
    """This rank's units (batches, or single rows for a server) holding a row still to write; the rows are counted."""
    todo = []
    for k, unit in enumerate(units):
        if not shard.owns(k):
            continue
        stats.read += len(unit)
        kept = sum(row["id"] in done for row in unit)
        stats.resumed += kept
        if kept < len(unit):
            todo.append(unit)
    return todo


def usable_rows(input_path, max_prompt_chars: int | None = None) -> list:
    """The rows a one-process `regenerate_conversations` would regenerate (`{"id", "conversations"}`, input order)."""
    from pr_specforge.data.sharding import Shard

    return list(_usable_rows(input_path, Shard(), RegenerateStats(), None, max_prompt_chars))


def _usable_rows(input_path, shard, stats: RegenerateStats, limit: int | None, max_prompt_chars: int | None):
    """Every usable input row as `{"id", "conversations"}`, in input order (every rank reads them all);
    rank 0 counts the rows it skips, by reason, and they count as read there."""
    seen = set()
    for pos, (lineno, row) in enumerate(iter_jsonl(input_path)):
        if limit is not None and pos >= limit:
            return
        rid = str(row.get("id", f"line{lineno}"))
        conv = row.get("conversations")
        reason = None
        if not isinstance(conv, list) or not any(isinstance(m, dict) and m.get("role") == "user" for m in conv):
            reason = "no_user_turn"
        elif rid in seen:
            reason = "duplicate_id"
        elif max_prompt_chars is not None and prompt_chars(conv) > max_prompt_chars:
            reason = "prompt_too_long"
        if reason is not None:
            if shard.is_main:
                stats.read += 1
                stats.skipped[reason] += 1
            continue
        seen.add(rid)
        yield {"id": rid, "conversations": conv}


def _batches(rows: list, batch_size: int) -> list:
    """In-process batches: `batch_size` rows at a time, sorted by prompt length (stable)."""
    ordered = sorted(rows, key=lambda r: prompt_chars(r["conversations"]))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def _regenerate_threaded(rows, backend, turns: str, sampling, emit, stats: RegenerateStats, bar) -> None:
    """Server backends: one conversation per thread, at most `2 * concurrency` in flight, in input order."""
    concurrency = backend.concurrency
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        window: deque = deque()

        def drain(n_keep: int):
            while len(window) > n_keep:
                row, fut = window.popleft()
                try:
                    emit(row, fut.result()[0])
                except RegenerationError as e:
                    logger.error("row %s: %s", row["id"], e)
                    stats.skipped["failed"] += 1
                bar.update(1)

        for row in rows:
            window.append((row, pool.submit(regenerate_batch, backend, [row], turns, sampling)))
            drain(2 * concurrency)
        drain(0)


def _part_path(output_path, shard) -> str:
    """Where this rank appends its rows (the output itself for one rank)."""
    if shard.world == 1:
        return str(output_path)
    return os.path.join(f"{output_path}.parts", f"rank{shard.rank}.jsonl")


def _finish_shards(shard, stats: RegenerateStats, input_path, output_path) -> RegenerateStats:
    """Wait for every rank; rank 0 sums the counters and merges the parts (and its own rows) in input order."""
    from collections import Counter

    from pr_specforge.data.sharding import gather_to_main

    per_rank = gather_to_main(shard, stats.as_dict())
    if not shard.is_main:
        return stats
    total = RegenerateStats(skipped=Counter())
    for d in per_rank:
        total.read += d["read"]
        total.written += d["written"]
        total.resumed += d["resumed"]
        total.skipped.update(d["skipped"])
    merge_parts(input_path, output_path)
    return total


def merge_parts(input_path, output_path) -> int:
    """Fold `<output>.parts/rank*.jsonl` into `output_path`, rows in input order, atomically.

    Rows already in the output are kept; the parts are deleted once the merged
    file is in place (a kill before that leaves them for the next merge).
    Returns the number of rows in the merged output.
    """
    from pr_specforge.data.io import atomic_write_text, read_jsonl_rows

    parts = sorted(glob.glob(os.path.join(f"{output_path}.parts", "rank*.jsonl")))
    order = {str(row.get("id", f"line{lineno}")): k for k, (lineno, row) in enumerate(iter_jsonl(input_path))}
    rows, seen = [], set()
    for path in [str(output_path), *parts]:
        for row in read_jsonl_rows(path):
            if row["id"] not in seen:
                seen.add(row["id"])
                rows.append(row)
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    atomic_write_text(output_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    for path in parts:
        os.unlink(path)
    if parts:
        try:
            os.rmdir(os.path.dirname(parts[0]))
        except OSError:  # a stray temp file: harmless, the next merge reads only rank*.jsonl
            pass
    return len(rows)
