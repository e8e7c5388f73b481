"""Train the control: the PR drafter, the PR objective and SpecForge's TTT loop on `ControlTask`.

`run_control(pr, settings)` builds a tiny `LlamaForCausalLMEagle3PR` (SpecForge's
`LlamaForCausalLMEagle3` plus the PR parts), wraps it in `OnlinePRModel` (SpecForge's
`OnlineEagle3Model` TTT loop with Eq. 6) with the given `pr:` options, trains it with AdamW on
fresh samples of the task, and measures on a held-out set: per query kind (1-hop, 2-hop) the
accuracy of each depth's readout and the gate's mean `q` per depth, at the answer rows of TTT
step 0. `verdict` reads whether the drafter learnt the second pass.

Options that start from a trained EAGLE-3 drafter (`pr.init_from`, `pr.freeze_one_pass`) start
from one trained here on the same task for `warm_steps` steps (R = 0: SpecForge's EAGLE-3 loss);
the recipe's own `init_from` path is not read (it belongs to another model size).

Owns: `ControlSettings`, `run_control`, `verdict`. Does not own the task (`control.task`) or
the command line (`control.cli`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from pr_specforge.config import PRConfig
from pr_specforge.control.task import ControlTask

#: the verdict's margins: depth >= 1 must beat depth 0 on 2-hop queries by this much (absolute)...
MIN_ACCURACY_GAIN = 0.10
#: ... and the gate's mean depth on 2-hop queries must exceed the 1-hop one by this much
MIN_ROUTING_GAP = 0.25
KINDS = {"one_hop": 1, "two_hop": 2}
#: what `init_from` reads in the control: an EAGLE-3 drafter trained here on the task
WARM_START = "control:eagle3"


#: the largest seed the control takes (it seeds torch with seed + 10000, which must fit 64 bits)
MAX_SEED = 2 ** 63 - 1
#: the largest tensor the control may allocate (its teacher logits); a larger size is refused before any work
MAX_TENSOR_BYTES = 2 * 10 ** 9


@dataclass(frozen=True)
class ControlSettings:
    """The control's size and schedule (its `pr:` options come from the recipe)."""

    symbols: int = 6  # N: one pass can hold 2-hop queries to 1/(N-3) = 33% at best (docs/control.md)
    queries: int = 6  # K = N: every symbol is asked once (the answers are hidden, so they cannot help)
    pool: Optional[int] = None  # M: the symbols each sample's N are drawn from (None: 2 N); M = N is the old task
    hidden: int = 64
    heads: int = 1  # one head: with 4 heads and M = N one pass learnt most 2-hop queries (docs/control.md)
    ttt_length: int = 2
    max_depth: int = 1
    steps: int = 400
    warm_steps: Optional[int] = None  # None: `steps`
    batch: int = 32
    lr: float = 5e-3
    eval_samples: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "ttt_length", "steps", "batch", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"control {name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.max_depth < 1:
            raise ValueError(f"control max_depth: the control needs R >= 1, got {self.max_depth}")
        if self.hidden % self.heads:
            raise ValueError(f"control hidden={self.hidden} is not a multiple of heads={self.heads}")
        if not 0 <= self.seed <= MAX_SEED:  # torch seeds the run with seed + 10000 at most: a 64-bit integer
            raise ValueError(f"control seed: expected an integer from 0 to {MAX_SEED}, got {self.seed}")
        task = self.task  # the task checks N and K
        samples = max(self.batch, self.eval_samples)
        largest = samples * task.seq_len * task.vocab_size * 4  # the teacher logits, float32 (`ControlTask.batch`)
        if largest > MAX_TENSOR_BYTES:
            raise ValueError(f"control size: N = {self.symbols} symbols from a pool of M = {task.size} over {samples} "
                             f"samples need a {largest / 1e9:.1f} GB teacher tensor (samples x sequence x vocabulary), "
                             f"above the control's {MAX_TENSOR_BYTES / 1e9:.0f} GB: give a smaller --pool or --symbols "
                             "(the default is N = 6, M = 12)")

    @property
    def task(self) -> ControlTask:
        return ControlTask(symbols=self.symbols, queries=self.queries, pool=2 * self.symbols if self.pool is None else self.pool)


def control_pr(pr: PRConfig, settings: ControlSettings) -> PRConfig:
    """The recipe's `pr:` options at the control's R, with no checkpoint path to read."""
    warm = WARM_START if (pr.init_from or pr.freeze_one_pass) else None
    return dataclasses.replace(pr, max_depth=settings.max_depth, init_from=warm, gradient_checkpointing=False)


def build_drafter(pr: PRConfig, settings: ControlSettings, seed: int):
    """A tiny PR drafter on the task's vocabulary (embeddings frozen, as SpecForge freezes them)."""
    from transformers import LlamaConfig

    from pr_specforge._specforge import install_cpu_loss
    from pr_specforge.modeling import LlamaForCausalLMEagle3PR, build_pr_config

    install_cpu_loss()
    task = settings.task
    cfg = LlamaConfig(hidden_size=settings.hidden, intermediate_size=2 * settings.hidden,
                      num_attention_heads=settings.heads, num_key_value_heads=settings.heads, num_hidden_layers=1,
                      vocab_size=task.vocab_size, draft_vocab_size=task.size, max_position_embeddings=4 * task.seq_len,
                      rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLMEagle3"])
    torch.manual_seed(seed)
    draft = LlamaForCausalLMEagle3PR(build_pr_config(cfg, pr.draft_settings())).float()
    t2d, d2t = task.vocab_map()
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(d2t)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(task.embedding_table(settings.hidden))
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def _train(draft, pr: PRConfig, settings: ControlSettings, steps: int, seed: int, model_cls=None,
           observe: Optional[Callable[[int], None]] = None, every: int = 0) -> float:
    """`steps` AdamW steps of `model_cls` (default `OnlinePRModel`) on fresh samples; returns seconds taken
    (training only). `observe(step)` is called after every `every`-th step (0: never)."""
    from pr_specforge.training.objective.ttt import OnlinePRModel

    cls = model_cls or OnlinePRModel
    model = cls(draft, length=settings.ttt_length, pr=pr, generator=torch.Generator().manual_seed(seed + 1))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)))
    data_gen = torch.Generator().manual_seed(seed + 2)
    table = settings.task.feature_table(settings.hidden)
    draft.train()
    start, observed = time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        b = settings.task.batch(settings.batch, data_gen, settings.hidden, table)
        out = model(**{k: v for k, v in b.items() if k not in ("kind", "answer")})
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        if observe is not None and every and (step % every == 0 or step == steps):
            t = time.perf_counter()
            observe(step)
            observed += time.perf_counter() - t
    return time.perf_counter() - start - observed


@torch.no_grad()
def evaluate(draft, pr: PRConfig, settings: ControlSettings) -> Dict[str, Any]:
    """Per query kind: accuracy of each depth's readout and mean `q` per depth at TTT step 0's answer rows."""
    from pr_specforge.training.objective.ttt import OnlinePRModel

    model = OnlinePRModel(draft, length=settings.ttt_length, pr=pr, generator=torch.Generator().manual_seed(7))
    draft.eval()
    b = settings.task.batch(settings.eval_samples, torch.Generator().manual_seed(10_000 + settings.seed),
                            settings.hidden, settings.task.feature_table(settings.hidden))
    out = model(**{k: v for k, v in b.items() if k not in ("kind", "answer")}, return_logits=True)
    answer_draft = b["answer"] - settings.task.first_symbol
    result: Dict[str, Any] = {}
    for name, kind in KINDS.items():
        rows = b["kind"] == kind
        acc = [float((lg.argmax(-1) == answer_draft)[rows].float().mean()) for lg in out.depth_logits[0]]
        q = out.q[0][rows].mean(0).tolist()
        result[name] = {"accuracy": acc, "q": q, "mean_depth": float(sum(r * x for r, x in enumerate(q))),
                        "count": int(rows.sum())}
    draft.train()
    return result


def verdict(result: Dict[str, Any]) -> Dict[str, Any]:
    """Did the drafter learn the second pass? Depth >= 1 beats depth 0 on 2-hop queries by
    `MIN_ACCURACY_GAIN`, and the gate sends 2-hop queries deeper than 1-hop ones by `MIN_ROUTING_GAP`."""
    two, one = result["two_hop"], result["one_hop"]
    gain = max(two["accuracy"][1:]) - two["accuracy"][0]
    gap = two["mean_depth"] - one["mean_depth"]
    learns = gain >= MIN_ACCURACY_GAIN and gap >= MIN_ROUTING_GAP
    return {"learns_second_pass": bool(learns), "two_hop_gain": gain, "routing_gap": gap,
            "min_accuracy_gain": MIN_ACCURACY_GAIN, "min_routing_gap": MIN_ROUTING_GAP}


def run_control(pr: PRConfig, settings: ControlSettings = ControlSettings(), model_cls=None,
                warm_cache: Optional[Dict[Any, Dict[str, torch.Tensor]]] = None, curve_every: int = 0) -> Dict[str, Any]:
    """Train the control with `pr`'s options and measure it (see module doc).

    `model_cls`: the training model (default `OnlinePRModel`; a test passes a broken one).
    `warm_cache`: EAGLE-3 warm starts already trained, by settings (the benchmark shares them).
    `curve_every`: also measure every that many steps (`curve`: step, result, verdict)."""
    from pr_specforge.training import warm_start

    cpr = control_pr(pr, settings)
    draft = build_drafter(cpr, settings, settings.seed)
    if cpr.gate_init_bias != 0.0:
        draft.set_gate_bias(cpr.gate_init_bias)
    warm_s = 0.0
    warm = cpr.init_from == WARM_START
    if warm:
        state, warm_s = _warm_state(settings, warm_cache)
        own = draft.state_dict()
        for key, value in state.items():
            own[key].copy_(value)
        draft.copy_one_pass_head()
        if cpr.freeze_one_pass:
            warm_start.freeze_one_pass(draft)
    curve: List[Dict[str, Any]] = []

    def observe(step: int) -> None:
        res = evaluate(draft, cpr, settings)
        curve.append({"step": step, "result": res, "verdict": verdict(res)})

    train_s = _train(draft, cpr, settings, settings.steps, settings.seed, model_cls, observe, curve_every)
    result = curve[-1]["result"] if curve else evaluate(draft, cpr, settings)
    return {"result": result, "verdict": verdict(result), "warm_start": warm, "curve": curve,
            "train_seconds": train_s + warm_s, "pr": cpr.to_dict()}


def _warm_state(settings: ControlSettings, cache) -> tuple:
    """The one-pass tensors of an EAGLE-3 drafter (R = 0) trained on the task, and the seconds it took."""
    key = dataclasses.astuple(settings)
    if cache is not None and key in cache:
        return cache[key], 0.0
    eagle_pr = PRConfig(max_depth=0)
    draft = build_drafter(eagle_pr, settings, settings.seed)
    seconds = _train(draft, eagle_pr, settings, settings.warm_steps or settings.steps, settings.seed + 100)
    state = {k: v.detach().clone() for k, v in draft.state_dict().items() if not k.startswith("pr_")}
    if cache is not None:
        cache[key] = state
    return state, seconds
