"""Offline acceptance-length evaluation of EAGLE-3 / PR drafters against a `transformers` target.

Owns:
  * `EvalSettings` — the grid (budgets x temperatures) and tree shape, validated.
  * `Evaluator` — for every drafter x budget x temperature x prompt set x prompt:
    speculative decode (`pr_specforge.serving`), the target's own autoregressive
    decode (speed baseline; at T = 0 also the reference output, checked token for
    token: `lossless`, and a `LosslessnessError` if it differs), results appended
    per prompt to `results.jsonl` / `baseline.jsonl` in `out_dir` (a rerun skips
    what is there: rows are keyed by prompt id and content hash, and a prompt whose
    text changed under its id is refused, `check_prompts`), and `summarize` to aggregate them.
  * Diagnostic buckets: acceptance of the one-pass top-1 token by drafter
    confidence (10 equal-width buckets, Figure 1a) and, for one-pass misses, the
    share recovered by reconsideration by drafter x target confidence
    (`<0.5, 0.5-0.9, >=0.9`, Table 7); definitions in `pr_specforge.serving.decode`.

Does not own: prompt files (`pr_specforge.data.prompts`), tables and plots (`report`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from pr_specforge.data.io import append_jsonl, check_resume, dir_fingerprint, read_json_object, read_jsonl_rows
from pr_specforge.export import export_fingerprints
from pr_specforge.training.objective.metrics import CONFIDENCE_BANDS
from pr_specforge.serving import TREE_BUILDERS, SpeculativeDecoder, TreeConfig, autoregressive_decode

CONF_BUCKETS = 10
BANDS = CONFIDENCE_BANDS  # drafter / target confidence bands of Table 7 (the training telemetry's too)


class LosslessnessError(RuntimeError):
    """The speculative output at T = 0 differs from the target's greedy decode."""


@dataclass
class EvalSettings:
    budgets: Sequence[int] = (24, 48)
    temperatures: Sequence[float] = (0.0,)
    max_new_tokens: int = 128
    shape: TreeConfig = TreeConfig()  # k, bw, gamma, m of every round (its budget is replaced per budget)
    seed: int = 0
    turns: str = "first"
    tree_builder: str = "tensor"  # "object": the reference builder (same trees, slower)
    decompose: bool = False  # diagnostic: per-round counters against the m = 0 tree (`serving.decompose`)
    batch_prompts: int = 1  # > 1: decode that many prompts together, their trees drafted as one batch per round

    def __post_init__(self) -> None:
        if not self.budgets:
            raise ValueError("budgets must list at least one budget B")
        for b in self.budgets:
            self.tree(b)
        check_beam_width(self.shape.bw, self.budgets)
        if not self.temperatures or not all(t >= 0 and t != float("inf") for t in self.temperatures):  # nan >= 0 is False
            raise ValueError(f"temperatures must be >= 0 and finite, got {list(self.temperatures)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.turns not in ("first", "all"):
            raise ValueError(f"turns must be 'first' or 'all', got {self.turns!r}")
        if self.tree_builder not in TREE_BUILDERS:
            raise ValueError(f"tree_builder must be one of {TREE_BUILDERS}, got {self.tree_builder!r}")
        if not isinstance(self.batch_prompts, int) or self.batch_prompts < 1:
            raise ValueError(f"batch_prompts must be an integer >= 1, got {self.batch_prompts!r}")
        if self.batch_prompts > 1 and (self.tree_builder != "tensor" or self.decompose):
            raise ValueError("batch_prompts > 1 drafts with the batched tensor builder: it needs tree_builder "
                             "'tensor' and no decompose")

    def tree(self, budget: int, m: Optional[int] = None) -> TreeConfig:
        """The round's shape at `budget` (and `m` reconsideration rows per step, if given)."""
        return dataclasses.replace(self.shape, budget=budget, m=self.shape.m if m is None else m)


def check_beam_width(bw: int, budgets: Sequence[int]) -> None:
    """B_w <= B: the cut keeps the B highest-scoring nodes, and a step's (B + 1)-th best node is beaten by B nodes
    of that step alone, so no cut of B keeps more than B of one step's frontier: forwarding more only costs rows."""
    if bw > min(budgets):
        raise ValueError(f"--bw {bw} exceeds the budget --budget {min(budgets)}: the cut keeps B nodes, so at most B "
                         f"of one step's nodes can be verified; use --bw <= {min(budgets)}")


@dataclass
class DraftEntry:
    """A drafter under evaluation; `m = 0` serves a PR drafter as plain EAGLE (None: the settings' m)."""

    name: str
    model: torch.nn.Module
    m: Optional[int] = None


def band(x: float) -> int:
    return sum(x >= b for b in BANDS)


def _encoder(tokenizer) -> Callable[[List[dict]], List[int]]:
    """Messages -> prompt ids: the chat template when the tokenizer has one, else the raw turns."""

    def encode(messages: List[dict]) -> List[int]:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "\n".join(m["content"] for m in messages)
        return list(tokenizer(text)["input_ids"])

    return encode


class Evaluator:
    def __init__(
        self,
        target,
        tokenizer,
        drafters: Sequence[DraftEntry],
        settings: EvalSettings,
        out_dir: str,
        progress: bool = True,
    ) -> None:
        if not drafters:
            raise ValueError("drafts: give at least one NAME=DIR drafter")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafts: duplicate drafter names {names}")
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.encode = _encoder(tokenizer)
        self.settings = settings
        self.out_dir = out_dir
        self.progress = progress
        self.eos = getattr(tokenizer, "eos_token_id", None)
        os.makedirs(out_dir, exist_ok=True)
        self.results_path = os.path.join(out_dir, "results.jsonl")
        self.baseline_path = os.path.join(out_dir, "baseline.jsonl")
        # decoders are built once per drafter x budget (this checks drafter/target compatibility early)
        self.decoders: Dict[Tuple[str, int], SpeculativeDecoder] = {}
        for d in drafters:
            for b in settings.budgets:
                self.decoders[(d.name, b)] = SpeculativeDecoder(
                    target, d.model, settings.tree(b, d.m), tree_builder=settings.tree_builder,
                    decompose=settings.decompose,
                )
        self.drafters = list(drafters)
        #: the target's own decodes lent by other out-dirs (`borrowed_baselines`), used before decoding anew
        self.borrowed: Dict[Tuple, dict] = {}

    # ------------------------------------------------------------------ runs
    def _conversation(self, turns: List[str], generate: Callable[[List[int]], Tuple[List[int], object]]):
        """Run each user turn in order; the model's own reply joins the history."""
        return self._conversations([turns], lambda ids_list, _: [generate(ids_list[0])])[0]

    def _conversations(self, conversations: List[List[str]],
                       generate: Callable[[List[List[int]], List[int]], List[Tuple[List[int], object]]]):
        """Several conversations, turn j of each together (`generate(ids of each, which conversations)`); each
        reply joins its own conversation's history."""
        messages: List[List[dict]] = [[] for _ in conversations]
        outs: List[list] = [[] for _ in conversations]
        for j in range(max(len(turns) for turns in conversations)):
            which = [i for i, turns in enumerate(conversations) if j < len(turns)]
            ids_list = []
            for i in which:
                messages[i].append({"role": "user", "content": conversations[i][j]})
                ids = self.encode(messages[i])
                if not ids:
                    raise ValueError(f"prompt turn {conversations[i][j][:40]!r} encodes to no tokens")
                ids_list.append(ids)
            for i, (tokens, extra) in zip(which, generate(ids_list, which)):
                outs[i].append((tokens, extra))
                messages[i].append({"role": "assistant", "content": self.tokenizer.decode(tokens, skip_special_tokens=True)})
        return outs

    def _baseline(self, set_name: str, prompt, temperature: float, seed: int, done: Dict) -> dict:
        key = (set_name, prompt.id, float(temperature))
        if key in done:
            return done[key]
        lent = self.borrowed.get(key)
        if lent is not None and lent.get("prompt_sha") == prompt.digest and (temperature == 0 or lent.get("seed") == seed):
            row = dict(lent)  # copied here, so this out-dir stands on its own
            append_jsonl(self.baseline_path, row)
            done[key] = row
            return row
        s = self.settings

        def gen(ids):
            return autoregressive_decode(self.target, ids, s.max_new_tokens, temperature, seed, self.eos)

        outs = self._conversation(prompt.turns, gen)
        row = {
            "set": set_name,
            "prompt": prompt.id,
            "prompt_sha": prompt.digest,
            "temperature": float(temperature),
            "seed": seed,
            "outputs": [o[0] for o in outs],
            "tokens": sum(len(o[0]) for o in outs),
            "seconds": sum(o[1] for o in outs),
        }
        append_jsonl(self.baseline_path, row)
        done[key] = row
        return row

    def _speculative(self, entry: DraftEntry, budget: int, set_name: str, prompt, temperature, seed, base) -> dict:
        s = self.settings
        dec = self.decoders[(entry.name, budget)]

        def gen(ids):
            r = dec.generate(ids, s.max_new_tokens, temperature, seed, self.eos)
            return r.tokens, r

        return self._row(entry, budget, set_name, prompt, temperature, seed, base, self._conversation(prompt.turns, gen))

    def _speculative_batch(self, chunk: list, base_done: Dict) -> List[dict]:
        """Jobs of one (set, T, drafter, B) decoded together (`SpeculativeDecoder.generate_many`): their rows."""
        s = self.settings
        set_name, _, _, temperature, entry, budget = chunk[0]
        dec = self.decoders[(entry.name, budget)]
        seeds = [s.seed + job[1] for job in chunk]
        bases = [self._baseline(set_name, job[2], temperature, seed, base_done) for job, seed in zip(chunk, seeds)]

        def gen(ids_list, which):
            rs = dec.generate_many(ids_list, s.max_new_tokens, temperature, [seeds[i] for i in which], self.eos)
            return [(r.tokens, r) for r in rs]

        outs = self._conversations([job[2].turns for job in chunk], gen)
        return [self._row(entry, budget, set_name, job[2], temperature, seed, base, o)
                for job, seed, base, o in zip(chunk, seeds, bases, outs)]

    def _row(self, entry: DraftEntry, budget: int, set_name: str, prompt, temperature, seed, base, outs) -> dict:
        """One prompt's row from its turns' `(tokens, DecodeResult)`."""
        s = self.settings
        results = [o[1] for o in outs]
        lossless = None
        if temperature == 0:
            lossless = all(o[0] == ref for o, ref in zip(outs, base["outputs"]))
        hist = [[0, 0] for _ in range(CONF_BUCKETS)]  # [verified nodes, top-1 accepted]
        recover = [[[0, 0] for _ in range(3)] for _ in range(3)]  # [cd][ct] -> [one-pass misses, recovered]
        for r in results:
            for c_d, c_t, top1_hit, onepass_hit, recovered in r.diagnostics:
                b = min(CONF_BUCKETS - 1, int(c_d * CONF_BUCKETS))
                hist[b][0] += 1
                hist[b][1] += int(top1_hit)
                if not onepass_hit:
                    cell = recover[band(c_d)][band(c_t)]
                    cell[0] += 1
                    cell[1] += int(recovered)
        accepted = sum(sum(r.accept_lengths) for r in results)
        rounds = sum(r.rounds for r in results)
        return {
            "draft": entry.name,
            "reconsider": self.decoders[(entry.name, budget)].cfg.m > 0,  # this entry's tree reconsiders (m > 0)
            "budget": budget,
            "temperature": float(temperature),
            "set": set_name,
            "prompt": prompt.id,
            "prompt_sha": prompt.digest,
            "seed": seed,
            "tau": accepted / max(1, rounds),
            "accepted": accepted,
            "rounds": rounds,
            "tokens": sum(len(r.tokens) for r in results),
            "draft_s": sum(r.draft_s for r in results),
            "verify_s": sum(r.verify_s for r in results),
            "total_s": sum(r.total_s for r in results),
            "recon_rows": sum(r.recon_rows for r in results),
            "recon_kept": sum(r.recon_kept for r in results),
            "repriced_kept": sum(r.repriced_kept for r in results),
            "ar_tokens": base["tokens"],
            "ar_s": base["seconds"],
            "lossless": lossless,
            "conf_hist": hist,
            "recover": recover,
            **({"decomposition": _sum_counts([r.decomposition for r in results])} if s.decompose else {}),
        }

    def run(self, prompt_sets: Dict[str, list]) -> dict:
        """Evaluate every combination (resuming from `out_dir`); returns `summarize(...)`."""
        from tqdm.auto import tqdm

        for name, prompts in prompt_sets.items():
            if not prompts:
                raise ValueError(f"prompts {name!r}: no usable prompt")
        s = self.settings
        rows, base_rows = read_jsonl_rows(self.results_path), read_jsonl_rows(self.baseline_path)
        base_done = {baseline_key(r, f"{self.baseline_path}, row {i}"): r for i, r in enumerate(base_rows, 1)}
        check_prompts(self.out_dir, prompt_sets, rows + base_rows)
        done = {(r["draft"], r["budget"], r["temperature"], r["set"], r["prompt"]) for r in rows}
        jobs = [
            (set_name, idx, prompt, float(t), entry, b)
            for set_name, prompts in prompt_sets.items()
            for idx, prompt in enumerate(prompts)
            for t in s.temperatures
            for entry in self.drafters
            for b in s.budgets
        ]
        pending = [job for job in jobs if (job[4].name, job[5], job[3], job[0], job[2].id) not in done]
        bar = tqdm(self._chunks(pending), desc="eval", disable=not self.progress)
        for chunk in bar:
            set_name, idx, prompt, t, entry, b = chunk[0]
            more = f" (+{len(chunk) - 1} prompts)" if len(chunk) > 1 else ""
            bar.set_postfix_str(f"{entry.name} B={b} T={t} {set_name}/{prompt.id}{more}")
            if len(chunk) > 1:
                rows = self._speculative_batch(chunk, base_done)
            else:
                seed = s.seed + idx
                base = self._baseline(set_name, prompt, t, seed, base_done)
                rows = [self._speculative(entry, b, set_name, prompt, t, seed, base)]
            for row in rows:
                append_jsonl(self.results_path, row)
                if row["lossless"] is False:
                    raise LosslessnessError(
                        f"{row['draft']} B={row['budget']} on {row['set']}/{row['prompt']}: speculative output differs "
                        "from the target's greedy decode at temperature 0"
                    )
        return summarize(read_jsonl_rows(self.results_path), s)

    def _chunks(self, jobs: list) -> List[list]:
        """The jobs in order, one at a time; with `batch_prompts` n > 1, up to n prompts of one
        (set, T, drafter, B) together."""
        n = self.settings.batch_prompts
        if n == 1:
            return [[job] for job in jobs]
        groups: Dict[Tuple, list] = {}
        for job in jobs:
            groups.setdefault((job[0], job[3], job[4].name, job[5]), []).append(job)
        return [group[i : i + n] for group in groups.values() for i in range(0, len(group), n)]


def check_prompts(out_dir: str, prompt_sets: Dict[str, list], rows: Iterable[dict]) -> None:
    """Rows of `out_dir` are reused for a prompt only when made from the same text: a prompt edited
    under its id (or a prompts file whose lines moved: ids default to line numbers) is refused."""
    current = {f"prompt {name}/{p.id}": p.digest for name, prompts in prompt_sets.items() for p in prompts}
    recorded = {}
    for r in rows:
        key = f"prompt {r['set']}/{r['prompt']}"
        if key in current:
            recorded.setdefault(key, r.get("prompt_sha"))  # None: a row of an older version
    check_resume(f"--out-dir {out_dir}", recorded, {k: v for k, v in current.items() if k in recorded},
                 "its rows of that prompt were made from another text: rerun with --start-over to discard them, "
                 "or use a new --out-dir")


def _sum_counts(counts: Iterable[Optional[Dict[str, int]]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for c in counts:
        for key, value in (c or {}).items():
            out[key] = out.get(key, 0) + value
    return out


def decomposition_per_round(rows: Sequence[dict], rounds: int) -> Optional[Dict[str, float]]:
    """`serving.decompose`'s counters per round over rows that carry them (None when none does)."""
    counted = [r["decomposition"] for r in rows if r.get("decomposition")]
    if not counted:
        return None
    total = _sum_counts(counted)
    return {f"{key}_per_round": value / max(1, rounds) for key, value in sorted(total.items())}


def summarize(rows: Iterable[dict], settings: Optional[EvalSettings] = None) -> dict:
    """Aggregate per-prompt rows into one entry per drafter x budget x temperature x set."""
    groups: Dict[Tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["draft"], r["budget"], r["temperature"], r["set"]), []).append(r)
    entries = []
    for (draft, budget, temp, set_name), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        rounds = sum(r["rounds"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        total_s = sum(r["total_s"] for r in rs)
        ar_s = sum(r["ar_s"] for r in rs)
        ar_tokens = sum(r["ar_tokens"] for r in rs)
        tps = tokens / total_s if total_s > 0 else 0.0
        ar_tps = ar_tokens / ar_s if ar_s > 0 else 0.0
        hist = [[sum(r["conf_hist"][b][i] for r in rs) for i in range(2)] for b in range(CONF_BUCKETS)]
        recover = [[[sum(r["recover"][i][j][c] for r in rs) for c in range(2)] for j in range(3)] for i in range(3)]
        flags = [r["lossless"] for r in rs if r["lossless"] is not None]
        entries.append(
            {
                "draft": draft,
                "budget": budget,
                "temperature": temp,
                "set": set_name,
                "prompts": len(rs),
                "tau": sum(r["accepted"] for r in rs) / max(1, rounds),
                "rounds": rounds,
                "tokens": tokens,
                "draft_s_per_round": sum(r["draft_s"] for r in rs) / max(1, rounds),
                "verify_s_per_round": sum(r["verify_s"] for r in rs) / max(1, rounds),
                "tokens_per_s": tps,
                "ar_tokens_per_s": ar_tps,
                "speedup": tps / ar_tps if ar_tps > 0 else 0.0,
                "recon_rows_per_round": sum(r["recon_rows"] for r in rs) / max(1, rounds),
                # room under the cut: reconsidered candidates (and repriced ones) among the B kept per round
                "recon_kept_per_round": sum(r.get("recon_kept", 0) for r in rs) / max(1, rounds),
                "repriced_kept_per_round": sum(r.get("repriced_kept", 0) for r in rs) / max(1, rounds),
                "lossless": all(flags) if flags else None,
                "per_prompt_tau": {r["prompt"]: r["tau"] for r in rs},
                "conf_hist": hist,
                "recover": recover,
            }
        )
        decomposition = decomposition_per_round(rs, rounds)
        if decomposition is not None:
            entries[-1]["decomposition"] = decomposition
    out = {"results": entries}
    if settings is not None:
        out["settings"] = {
            "budgets": list(settings.budgets),
            "temperatures": list(settings.temperatures),
            "max_new_tokens": settings.max_new_tokens,
            "k": settings.shape.k,
            "bw": settings.shape.bw,
            "gamma": settings.shape.gamma,
            "m": settings.shape.m,
            "seed": settings.seed,
            "turns": settings.turns,
            "tree_builder": settings.tree_builder,
            "decompose": settings.decompose,
            **({"batch_prompts": settings.batch_prompts} if settings.batch_prompts > 1 else {}),
        }
    return out


# ---------------------------------------------------------------- provenance
PROVENANCE_FILE = "eval_config.json"


def provenance(settings: EvalSettings, target: str, drafts: Dict[str, str], dtype: str) -> dict:
    """Everything that decides a row besides its (drafter, B, T, set, prompt) key."""
    shared = {"target": dir_fingerprint(target, hash_weights=False), "dtype": dtype,
              "max_new_tokens": settings.max_new_tokens, "k": settings.shape.k, "bw": settings.shape.bw,
              "gamma": settings.shape.gamma, "m": settings.shape.m, "seed": settings.seed, "turns": settings.turns,
              "tree_builder": settings.tree_builder, "decompose": settings.decompose}  # both change the timings
    if settings.batch_prompts > 1:  # so does batching (absent at 1: out-dirs of earlier versions stay resumable)
        shared["batch_prompts"] = settings.batch_prompts
    prints = {name: export_fingerprints(path) for name, path in drafts.items()}
    return {"shared": shared, "drafters": {name: fp[0] for name, fp in prints.items()},
            TARGET_CONTENT: dir_fingerprint(target), LEGACY_DRAFTERS: {name: fp[1] for name, fp in prints.items()}}


#: each drafter's fingerprint as its files are (`export.export_fingerprints`' legacy one, what out-dirs written before
#: exports recorded their target by name hold): accepted on resume and replaced there by the current one; not written
LEGACY_DRAFTERS = "drafters_as_files"


#: the content hash of the target's weights (`dir_fingerprint`), kept beside `shared` (whose `target` hashes names
#: and sizes only) so that out-dirs written before it was recorded still resume; `--baseline-from` requires it
TARGET_CONTENT = "target_weights"


def _check_target_content(where: str, recorded: Optional[str], current: str, fix: str) -> None:
    if recorded is not None and recorded != current:
        raise ValueError(f"{where}: made with a target of other weights (content {recorded}, this run's {current}; "
                         f"the same file names and sizes); {fix}")


def check_out_dir(out_dir: str, current: dict) -> None:
    """Rows in `out_dir` are reused only when made the same way: refuse other settings, another target,
    or changed files under a drafter name (`check_resume`); record the drafters this run adds."""
    import logging

    from pr_specforge.data.io import atomic_write_json

    path = os.path.join(out_dir, PROVENANCE_FILE)
    rows_exist = any(os.path.exists(os.path.join(out_dir, f)) for f in ROW_FILES)
    legacy = current.get(LEGACY_DRAFTERS) or {}
    current = {k: v for k, v in current.items() if k != LEGACY_DRAFTERS}
    if not os.path.exists(path):
        if rows_exist:
            logging.getLogger(__name__).warning(
                "%s: rows without %s (an older version wrote them); taking them as made with this run's settings",
                out_dir, PROVENANCE_FILE)
        atomic_write_json(path, current)
        return
    before = read_json_object(path, "--out-dir", error=ValueError)
    fix = "its rows were made another way: rerun with --start-over to discard them, or use a new --out-dir"
    check_resume(f"--out-dir {out_dir}", before.get("shared", {}), current["shared"], fix)
    _check_target_content(f"--out-dir {out_dir}", before.get(TARGET_CONTENT), current[TARGET_CONTENT], fix)
    drafters = dict(before.get("drafters", {}))
    for name, fp in current["drafters"].items():
        if drafters.get(name) is not None and drafters[name] == legacy.get(name):
            drafters[name] = fp  # recorded as the files were (its target's path inside): the same export, migrated
        if drafters.get(name, fp) != fp:
            raise ValueError(f"--out-dir {out_dir}: drafter {name!r} there was made from other files; "
                             f"give this drafter another NAME, or rerun with --start-over to discard its rows")
        drafters[name] = fp
    if drafters != before.get("drafters") or before.get(TARGET_CONTENT) != current[TARGET_CONTENT]:
        atomic_write_json(path, {**before, "drafters": drafters, TARGET_CONTENT: current[TARGET_CONTENT]})


#: the provenance fields the target's own decode depends on besides its row's seed (what `--baseline-from` must share)
BASELINE_FIELDS = ("target", "dtype", "max_new_tokens", "turns")


def borrowed_baselines(dirs: Sequence[str], current: dict) -> Dict[Tuple, dict]:
    """The target's own decodes (`baseline.jsonl`) of other eval out-dirs, (set, prompt, temperature) -> row.

    `current` is this run's `provenance`. Refused in one line unless each dir was made with this run's
    target (by the content of its weights: `TARGET_CONTENT`), dtype, max_new_tokens and turns.
    A row is then used only for the same prompt text and, at T > 0, the same sampling seed (`Evaluator._baseline`).
    """
    lent: Dict[Tuple, dict] = {}
    for d in dirs:
        path = os.path.join(d, PROVENANCE_FILE)
        if not os.path.exists(path):
            raise ValueError(f"--baseline-from {d}: no {PROVENANCE_FILE} there (not a `pr-specforge eval` --out-dir)")
        record = read_json_object(path, "--baseline-from", error=ValueError)
        theirs, shared = record.get("shared", {}), current["shared"]
        fix = "its target decodes were made another way: drop that --baseline-from"
        check_resume(f"--baseline-from {d}", {k: theirs[k] for k in BASELINE_FIELDS if k in theirs},
                     {k: shared[k] for k in BASELINE_FIELDS}, fix)
        if record.get(TARGET_CONTENT) is None:
            raise ValueError(f"--baseline-from {d}: its {PROVENANCE_FILE} records no content hash of its target "
                             f"(written by an older version); rerun its eval command once to record it, or {fix[fix.index('drop'):]}")
        _check_target_content(f"--baseline-from {d}", record[TARGET_CONTENT], current[TARGET_CONTENT], fix)
        rows = os.path.join(d, "baseline.jsonl")
        for lineno, r in enumerate(read_jsonl_rows(rows, repair=False), 1):
            lent.setdefault(baseline_key(r, f"--baseline-from {rows}, row {lineno}"), r)
    return lent


#: what identifies a target decode in baseline.jsonl (the row's set, prompt text and temperature)
BASELINE_KEY = ("set", "prompt", "temperature")


def baseline_key(row: dict, where: str) -> Tuple:
    """`(set, prompt, temperature)` of a baseline row, or one line naming the row and the missing field."""
    missing = [k for k in BASELINE_KEY if k not in row]
    if missing:
        raise ValueError(f"{where}: no field {missing[0]!r}; not a `pr-specforge eval` baseline row (the file is damaged)")
    try:
        return row["set"], row["prompt"], float(row["temperature"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field 'temperature' is {row['temperature']!r}, not a number") from None


#: what `eval` writes per prompt in its --out-dir, and the provenance of those rows (`--start-over` deletes them)
ROW_FILES = ("results.jsonl", "baseline.jsonl")


def discard_rows(out_dir: str) -> None:
    """`eval --start-over`: delete the per-prompt rows and their provenance (reports are rewritten)."""
    for name in (*ROW_FILES, PROVENANCE_FILE):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------- loading
def load_target(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A `transformers` causal LM and its tokenizer from a directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"target {path}: no config.json")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_draft_entries(specs: Sequence[str], device: str, dtype: torch.dtype, also_one_pass: bool = False) -> List[DraftEntry]:
    """`NAME=DIR` specs -> drafters (a PR drafter also as `NAME/one-pass` with `also_one_pass`)."""
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, load_drafter

    out: List[DraftEntry] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--draft must be NAME=DIR, got {spec!r}")
        model = load_drafter(path, device, dtype)
        out.append(DraftEntry(name, model))
        if also_one_pass and isinstance(model, LlamaForCausalLMEagle3PR):
            out.append(DraftEntry(f"{name}/one-pass", model, m=0))
    return out
