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

Output rows are written in input order and fsynced one by one; a rerun skips
ids already in the output, so an interruption loses only the rows in flight.

It deliberately does not tokenise for training or capture hidden states.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pr_specforge.data.io import DataFormatError, JsonlAppender, StageStats, iter_jsonl, read_done_ids

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

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pr_specforge.dtypes import resolve_dtype

        dtype = resolve_dtype(dtype, device)
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), device=device, name=os.path.basename(path.rstrip("/")))

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


def _prompt_chars(conversation: list) -> int:
    return sum(len(str(m.get("content", ""))) for m in conversation if isinstance(m, dict) and m.get("role") in ("user", "system"))


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
) -> RegenerateStats:
    """Regenerate every conversation of `input_path` into `output_path` (resumable).

    Server backends (`concurrency` attribute) run one conversation per thread
    with at most `2 * concurrency` in flight; in-process backends run
    `batch_size` conversations per `generate` call. Rows whose reply failed
    are counted (`skipped["failed"]`), not written, and retried by a rerun.
    In-process batches are formed from rows sorted by prompt length (stable), so one
    long prompt does not pad a whole batch; `max_prompt_chars` skips (and counts)
    conversations whose user turns exceed it.

    Under `torchrun` rank r takes input rows r, r + N, ... and appends them to
    its own `<output>.parts/rank{r}.jsonl` (resumed per rank); once every rank
    is done, rank 0 merges the parts into `output_path` in input order.
    """
    from tqdm import tqdm

    from pr_specforge.data.sharding import current_shard

    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    sampling = sampling or SamplingConfig()
    stats = RegenerateStats()
    shard = current_shard()
    final_path, output_path = output_path, _part_path(output_path, shard)
    done = read_done_ids(final_path) | (read_done_ids(output_path) if shard.world > 1 else set())

    def pending():
        return _pending_rows(input_path, shard, done, stats, limit, max_prompt_chars)

    def emit(out, row, conv):
        if any(m["role"] == "assistant" and not m["content"] for m in conv):
            stats.skipped["empty_reply"] += 1
            return
        out.write({"id": row["id"], "conversations": conv, "regenerated_by": backend.name})
        stats.written += 1

    if next(iter_jsonl(input_path), None) is None:  # every rank sees the same file: all refuse together
        raise DataFormatError(f"{input_path}: no rows to regenerate (an empty file)")
    todo = list(pending())
    desc = "regenerate" if shard.world == 1 else f"regenerate (rank {shard.rank}/{shard.world})"
    with JsonlAppender(output_path) as out, tqdm(total=len(todo), desc=desc, unit="conv", disable=not progress,
                                                 position=shard.local_rank) as bar:
        if getattr(backend, "concurrency", None):
            _regenerate_threaded(todo, backend, turns, sampling, lambda r, c: emit(out, r, c), stats, bar)
        else:
            _regenerate_batched(todo, backend, turns, sampling, lambda r, c: emit(out, r, c), batch_size, bar)
    if shard.world > 1:
        stats = _finish_shards(shard, stats, input_path, final_path)
    logger.info("regenerate: %s", stats.as_dict())
    return stats


def _pending_rows(input_path, shard, done: set, stats: RegenerateStats, limit: int | None, max_prompt_chars: int | None):
    """This rank's input rows still to regenerate, as `{"id", "conversations"}`; the others are counted."""
    seen = set()
    for pos, (lineno, row) in enumerate(iter_jsonl(input_path)):
        if limit is not None and pos >= limit:
            return
        if not shard.owns(pos):
            continue
        stats.read += 1
        rid = str(row.get("id", f"line{lineno}"))
        conv = row.get("conversations")
        if not isinstance(conv, list) or not any(isinstance(m, dict) and m.get("role") == "user" for m in conv):
            stats.skipped["no_user_turn"] += 1
            continue
        if rid in done:
            stats.resumed += 1
            continue
        if rid in seen:
            stats.skipped["duplicate_id"] += 1
            continue
        if max_prompt_chars is not None and _prompt_chars(conv) > max_prompt_chars:
            stats.skipped["prompt_too_long"] += 1
            continue
        seen.add(rid)
        yield {"id": rid, "conversations": conv}


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


def _regenerate_batched(rows, backend, turns: str, sampling, emit, batch_size: int, bar) -> None:
    """In-process backends: `batch_size` conversations per `generate` call, sorted by prompt length."""
    batch: list = []
    ordered = sorted(rows, key=lambda r: _prompt_chars(r["conversations"]))
    for row in ordered + [None]:
        if row is not None:
            batch.append(row)
        if batch and (row is None or len(batch) >= batch_size):
            for r, conv in zip(batch, regenerate_batch(backend, batch, turns, sampling)):
                emit(r, conv)
            bar.update(len(batch))
            batch = []


def _part_path(output_path, shard) -> str:
    """Where this rank appends its rows (the output itself for one rank)."""
    if shard.world == 1:
        return str(output_path)
    return os.path.join(f"{output_path}.parts", f"rank{shard.rank}.jsonl")


def _finish_shards(shard, stats: RegenerateStats, input_path, output_path) -> RegenerateStats:
    """Wait for every rank; rank 0 sums the counters and merges the parts in input order."""
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
    import glob
    import json

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
