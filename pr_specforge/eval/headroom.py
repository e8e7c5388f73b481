"""`pr-specforge headroom`: can reconsideration pay for this drafter? The paper's Sec. 2.2 / Figure 1
and App. D.5 / Table 7, measured on held-out features.

    pr-specforge headroom DRAFTER --features HELDOUT_FEATURES --out PREFIX [--k 6] [--pr-tables]

DRAFTER is a training run directory (newest checkpoint), a checkpoint directory, or an export
(`pr-specforge export --to hf`; with --target, or the target the features' manifest names). An
SGLang export (`--to sglang`) is measured as SGLang serves it: the plain EAGLE-3 drafter. The
drafter is rebuilt exactly as `pr-specforge diagnose` rebuilds it and run teacher-forced over the
one-pass TTT chain (every position p, every TTT step j: the drafter drafts token p + j + 1 from the
true tokens). What is compared: the drafter's top-1 (argmax of depth 0's logits over the draft
vocab, mapped to the target vocab) against the target token, the target's own next-token
prediction there (argmax of the target's logits over its full vocabulary: SpecForge's
`target_token_ids`, the frozen target head over the stored final hidden states). Positions are
SpecForge's scored ones (its loss mask). Confidences:
  c_d  depth 0's top-1 probability (softmax over the draft vocab);
  c_t  the target's top-1 probability, `max_t pi_tgt(t)` over its full vocabulary. It is read from
       SpecForge's `target_p_on_draft` (target probabilities of the draft-vocab tokens), so it is
       exact where the target token is in the draft vocab; the rejects whose target token is not
       ("out-of-vocab rejects": no drafter can propose them) are counted apart, outside the grid.
Reported per TTT step and pooled over steps:
  Figure 1(a)  acceptance (top-1 == target token) by c_d, ten buckets [0, 0.1) .. [0.9, 1], with counts;
  Figure 1(b)  the in-vocab rejects by c_d x c_t bands (< 0.5, 0.5-0.9, >= 0.9), as shares of that pool;
  second guess among one-pass misses: the share whose target token is depth 0's rank 2 (what a wider
               tree already has), is outside depth 0's top k (--k, the tree's k); for PR drafters also
               the share some reconsidered depth's top-1 gets right, and the share only a reconsidered
               depth proposes (right at a depth >= 1, outside depth 0's top k);
  Table 7      (PR drafters) per c_d x c_t bucket of the same pool: the share of rejects some depth
               r >= 1 gets right at top-1 (and, in the JSON, the share expected at the halt depth
               d ~ q), and the mean change of top-1 probability against the position's own one-pass
               distribution, p_top1(depth r*) - c_d, with r* the first depth that is right (recovered)
               or the last depth R (not recovered).
The reconsidered depths are the mixed-cache rollout's (training's rollout B; see
`training.simulate`), at the steps it runs (`pr.mixed_rollout_length`). An EAGLE-3 drafter (or R = 0)
has no reconsidered depths: its PR-only tables are omitted with a note, and `--pr-tables` refuses it.

Writes PREFIX.md (the paper's numbers beside ours), PREFIX.json, PREFIX-acceptance.png (the
acceptance-by-confidence curve) and PREFIX-reject-pool.png (the 3x3 heat map), each atomically
(`--out DIR`, a directory: DIR/headroom.md and so on). A PREFIX one of whose files exists is refused in one
line naming it, before any work, unless `--overwrite`. Features made from another target than the
drafter's (their manifest's target fingerprint differs) are refused, as a features resume refuses them.

Owns: the counts (`Headroom`, a chain observer of `training.simulate`), the report, its markdown
and plots, and the paper's quoted figures (`PAPER`). Does not own the drafter's rebuild or the
teacher-forced forward (`training.diagnose`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from pr_specforge.training.simulate import ChainObserver, DepthRows, OnePassRows

BUCKETS = 10
BANDS = (0.5, 0.9)
BAND_NAMES = ("<0.5", "0.5-0.9", ">=0.9")

#: the paper's own figures (Sec. 2.2 text and Figure 1 caption; App. D.5 Table 7), in percent.
PAPER: Dict[str, Any] = {
    "source": "Give the Drafter a Second Chance to Guess: Sec. 2.2 / Figure 1 and App. D.5 / Table 7 "
              "(EAGLE-3.1 and PR drafters of Llama-3.1-8B-Instruct, held-out split, 3.1M scored positions)",
    "reject_share": 30.2,
    "fig1a": {0: 7.3, 5: 52.0, 9: 95.6},  # only these buckets are quoted in the text
    "fig1b": [[18.5, 26.6, 17.0], [6.7, 13.6, 15.1], [0.4, 1.3, 0.8]],
    "table7_recovered": [[17.7, 29.5, 39.7, 28.8], [11.3, 23.4, 42.0, 29.0], [3.7, 6.9, 27.1, 12.9],
                         [16.4, 26.7, 39.9, 28.5]],
    "table7_delta_recovered": [0.008, 0.024, 0.061, 0.039],
    "table7_delta_not_recovered": [0.000, 0.002, 0.004, 0.001],
}


def band(x: torch.Tensor) -> torch.Tensor:
    """0, 1, 2 for `< 0.5`, `0.5 .. 0.9`, `>= 0.9`."""
    return (x >= BANDS[0]).long() + (x >= BANDS[1]).long()


def bucket(x: torch.Tensor) -> torch.Tensor:
    """Ten confidence buckets `[0, 0.1) .. [0.9, 1]`."""
    return (x * BUCKETS).long().clamp(0, BUCKETS - 1)


_COUNTS = ("scored", "accepted", "misses", "oov", "rank2", "outside", "recon_top1", "recon_only")
_GRIDS = ("pool", "t7_n", "t7_rec", "t7_halt", "t7_drec", "t7_dnot")


class Headroom(ChainObserver):
    """Pooled counts of the headroom tables, per TTT step (float64)."""

    def __init__(self, k: int = 6) -> None:
        super().__init__()
        if k < 2:
            from pr_specforge.config import ConfigError

            raise ConfigError(f"--k must be at least 2 (rank 2 is a column), got {k}")
        self.k = k
        self.topk = k
        self.c: Dict[str, torch.Tensor] = {}

    def started(self) -> None:
        if not self.c:
            L = self.length
            self.c = {name: torch.zeros(L, dtype=torch.float64) for name in _COUNTS}
            self.c.update({name: torch.zeros(L, 3, 3, dtype=torch.float64) for name in _GRIDS})
            self.c.update(conf_n=torch.zeros(L, BUCKETS, dtype=torch.float64),
                          conf_acc=torch.zeros(L, BUCKETS, dtype=torch.float64),
                          has_depths=torch.zeros(L, dtype=torch.float64))

    @property
    def reconsiders(self) -> bool:
        return self.max_depth > 0

    def add(self, one_pass: List[OnePassRows], depths: Dict[int, DepthRows]) -> None:
        for j, a in enumerate(one_pass):
            self._add_step(j, a, depths.get(j))

    def _add_step(self, j: int, a: OnePassRows, d: Optional[DepthRows]) -> None:
        c = self.c
        scored = a.mask > 0
        ok = a.correct & scored
        rej = scored & ~a.correct
        c["scored"][j] += scored.sum()
        c["accepted"][j] += ok.sum()
        b = bucket(a.confidence)
        c["conf_n"][j].index_add_(0, b[scored], torch.ones_like(b[scored], dtype=torch.float64))
        c["conf_acc"][j].index_add_(0, b[ok], torch.ones_like(b[ok], dtype=torch.float64))
        pool = rej & a.in_vocab
        cell = band(a.confidence) * 3 + band(a.target_confidence)
        _grid_add(c["pool"][j], cell, pool)
        c["misses"][j] += rej.sum()
        c["oov"][j] += (rej & ~a.in_vocab).sum()
        c["rank2"][j] += (rej & (a.topk[..., 1] == a.target)).sum()
        outside = rej & ~(a.topk[..., : self.k] == a.target[..., None]).any(-1)
        c["outside"][j] += outside.sum()
        if d is None:
            return
        c["has_depths"][j] = 1.0
        rec = d.recovered(a.target)  # [B, T_w, R]
        rec_any = torch.zeros_like(rej)
        d.cut(rec_any).copy_(rec.any(-1))
        halt = torch.zeros_like(a.confidence, dtype=torch.float64)
        d.cut(halt).copy_((rec.double() * d.q[..., 1:].double()).sum(-1))
        first = torch.where(rec.any(-1), rec.double().argmax(-1), torch.full_like(rec[..., 0], rec.shape[-1] - 1, dtype=torch.long))
        delta = torch.zeros_like(a.confidence, dtype=torch.float64)
        d.cut(delta).copy_(d.top1_prob[..., 1:].gather(-1, first[..., None]).squeeze(-1).double() - d.cut(a.confidence).double())
        _grid_add(c["t7_n"][j], cell, pool)
        _grid_add(c["t7_rec"][j], cell, pool & rec_any)
        _grid_add(c["t7_halt"][j], cell, pool, halt)
        _grid_add(c["t7_drec"][j], cell, pool & rec_any, delta)
        _grid_add(c["t7_dnot"][j], cell, pool & ~rec_any, delta)
        c["recon_top1"][j] += (rej & rec_any).sum()
        c["recon_only"][j] += (outside & rec_any).sum()

    # ------------------------------------------------------------------ the report
    def report(self) -> Dict[str, Any]:
        """Pooled over steps and per step (see the module docstring)."""
        if not self.c:
            return {}
        pooled = {name: t.sum(0) for name, t in self.c.items()}
        steps = [{name: t[j] for name, t in self.c.items()} for j in range(self.length)]
        return {"k": self.k, "ttt_length": self.length, "max_depth": self.max_depth,
                "pooled": self._section(pooled), "per_step": [self._section(s) for s in steps]}

    def _section(self, c: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        n = float(c["scored"])
        misses = float(c["misses"])
        pool = c["pool"]
        edges = [i / BUCKETS for i in range(BUCKETS + 1)]
        out: Dict[str, Any] = {
            "scored": n, "accepted": float(c["accepted"]), "acceptance": _ratio(c["accepted"], n),
            "fig1a": [{"bucket": f"{lo:.1f}-{hi:.1f}", "count": float(cn), "accepted": float(ca),
                       "acceptance": _ratio(ca, cn)} for lo, hi, cn, ca in zip(edges, edges[1:], c["conf_n"], c["conf_acc"])],
            "fig1b": {"rejects": misses, "oov_rejects": float(c["oov"]), "pool": float(pool.sum()),
                      "counts": pool.tolist(), "shares": _shares(pool, pool.sum()),
                      "drafter_band_shares": _shares(pool.sum(1), pool.sum()),
                      "target_band_shares": _shares(pool.sum(0), pool.sum())},
            "second_guess": {"misses": misses, "rank2": _ratio(c["rank2"], misses),
                             "outside_topk": _ratio(c["outside"], misses),
                             "recon_top1": _ratio(c["recon_top1"], misses) if self.reconsiders else None,
                             "recon_only": _ratio(c["recon_only"], misses) if self.reconsiders else None},
            "table7": self._table7(c) if self.reconsiders and float(c["has_depths"].sum()) > 0 else None,
        }
        return out

    @staticmethod
    def _table7(c: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        n, rec, halt, drec, dnot = (_with_margins(c[k]) for k in ("t7_n", "t7_rec", "t7_halt", "t7_drec", "t7_dnot"))
        nrec = rec
        nnot = n - rec
        return {
            "pool": n.tolist(), "pool_shares": _shares(n, n[3, 3]),
            "recovered": _shares(rec, n, elementwise=True), "recovered_at_halt": _shares(halt, n, elementwise=True),
            # the bottom of Table 7: by target band (columns), pooled over drafter bands
            "delta_recovered": [_ratio(drec[3, t], nrec[3, t]) for t in range(4)],
            "delta_not_recovered": [_ratio(dnot[3, t], nnot[3, t]) for t in range(4)],
        }


def _grid_add(grid: torch.Tensor, cell: torch.Tensor, where: torch.Tensor, values: Optional[torch.Tensor] = None) -> None:
    v = torch.ones_like(cell[where], dtype=torch.float64) if values is None else values[where].double()
    grid.view(-1).index_add_(0, cell[where], v)


def _with_margins(grid: torch.Tensor) -> torch.Tensor:
    """A 3x3 grid with a 4th row and column of sums ("all")."""
    out = torch.zeros(4, 4, dtype=torch.float64)
    out[:3, :3] = grid
    out[3, :3] = grid.sum(0)
    out[:3, 3] = grid.sum(1)
    out[3, 3] = grid.sum()
    return out


def _ratio(num, den) -> Optional[float]:
    den = float(den)
    return float(num) / den if den > 0 else None


def _shares(x: torch.Tensor, den, elementwise: bool = False):
    if elementwise:
        return [[_ratio(a, b) for a, b in zip(ra, rb)] for ra, rb in zip(x.tolist(), den.tolist())]
    if x.dim() == 1:
        return [_ratio(a, den) for a in x.tolist()]
    return [[_ratio(a, den) for a in row] for row in x.tolist()]


# ------------------------------------------------------------------------- rendering
def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_markdown(report: Dict[str, Any]) -> str:
    from pr_specforge.eval.headroom_report import markdown

    return markdown(report, PAPER)


def check_k(k: int, raw: Dict[str, Any]) -> None:
    """`--k` no larger than the drafter's vocabulary (its draft config's `draft_vocab_size`): a top k of
    more tokens than the drafter has does not exist (torch.topk would fail deep in the forward)."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.io import DataFormatError, read_json_file

    path = (raw.get("model") or {}).get("draft_model_config")
    if not path or not os.path.isfile(path):
        return  # the drafter's own checks name a missing config
    try:
        cfg = read_json_file(path)
        vocab = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    except (DataFormatError, KeyError, TypeError, ValueError, AttributeError):
        return
    if k > vocab:
        raise ConfigError(f"--k {k} is above the drafter's draft vocabulary of {vocab} tokens ({path}); "
                          f"give --k {vocab} or less")


#: the file name `--out DIR` (an existing directory, or a path ending in a separator) writes under DIR
DIR_PREFIX = "headroom"
#: what `--out PREFIX` writes: PREFIX + each suffix (in this order; PREFIX.json first)
OUTPUTS = (".json", ".md", "-acceptance.png", "-reject-pool.png")


def output_prefix(out: str) -> str:
    """`--out` as the prefix written: a directory gets `DIR/headroom` (never hidden `DIR/.md` files)."""
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        return os.path.join(out, DIR_PREFIX)
    return out


def written(out: str) -> List[str]:
    """The files of `--out` that exist (a refused run, an interrupted or killed one left them)."""
    prefix = output_prefix(out)
    return [prefix + suffix for suffix in OUTPUTS if os.path.lexists(prefix + suffix)]


def run_headroom(drafter: str, features: str, out: str, *, checkpoint: Optional[str] = None, target: Optional[str] = None,
                 k: int = 6, pr_tables: bool = False, limit: Optional[int] = None, seed: int = 0,
                 ttt_length: Optional[int] = None, progress: bool = True, overwrite: bool = False) -> Dict[str, Any]:
    """Measure, then write PREFIX.{json,md} and the two PNGs; returns the report. Refuses, before any work, a
    PREFIX whose files exist unless `overwrite`."""
    from pr_specforge.config import ConfigError
    from pr_specforge.data.io import atomic_write_json, atomic_write_text, check_writable_file
    from pr_specforge.eval.headroom_report import plot
    from pr_specforge.training.diagnose import diagnose, drafter_inputs, drafter_source, source_kind

    out = output_prefix(out)
    inputs = drafter_inputs(drafter, checkpoint, features, target)
    for suffix in OUTPUTS:  # data.io's one rule: a new file or --overwrite, never an input
        check_writable_file("--out", out + suffix, overwrite=overwrite, inputs=inputs)
    source_kind(drafter)
    source = drafter_source(drafter, checkpoint, features, target, ttt_length)
    strategy = (source.raw.get("training") or {}).get("strategy")
    depth = int((source.raw.get("pr") or {}).get("max_depth", 0)) if strategy == "pr" else 0
    if pr_tables and depth == 0:
        raise ConfigError(f"{drafter}: --pr-tables needs a PR drafter with reconsidered depths; this one is "
                          f"{'an EAGLE-3 drafter' if strategy != 'pr' else 'a PR drafter with pr.max_depth=0'} "
                          "(Table 7 and the reconsidered rows of the second-guess split do not exist for it)")
    check_k(k, source.raw)
    counts = Headroom(k)
    diag = diagnose(source, features, limit=limit, seed=seed, progress=progress, observers=[counts])
    report = {"drafter": source.label, "checkpoint": diag["checkpoint"], "features": str(features),
              "strategy": diag["strategy"], "batches": diag["batches"], "sim": diag["sim"],
              "simulated_acc_len": diag["simulated_acc_len"], **counts.report(), "paper": PAPER}
    if depth == 0:
        report["note"] = ("no reconsidered depths (an EAGLE-3 drafter or pr.max_depth=0): Table 7 and the "
                          "reconsidered columns of the second-guess split are omitted")
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    atomic_write_json(out + ".json", report)
    atomic_write_text(out + ".md", render_markdown(report))
    plot(report, PAPER, out)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    from pr_specforge.config import ConfigError
    from pr_specforge.data.cli import positive_int
    from pr_specforge.data.io import DataFormatError
    from pr_specforge.export import ExportError

    p = argparse.ArgumentParser(prog="pr-specforge headroom", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", help="a training run directory, a checkpoint directory, or an export (--to hf or --to sglang)")
    p.add_argument("--features", required=True, help="held-out feature directory (`pr-specforge data hidden-states`)")
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.md, PREFIX.json, PREFIX-*.png "
                   f"(a directory: DIR/{DIR_PREFIX}.md, ...)")
    p.add_argument("--checkpoint", default=None, help="with a run directory: this checkpoint instead of the newest")
    p.add_argument("--target", default=None, help="with an HF export: the target model directory (default: the features' manifest)")
    p.add_argument("--k", type=int, default=6, help="the tree's k: a miss outside depth 0's top k is one a served tree lacks")
    p.add_argument("--pr-tables", action="store_true", help="require Table 7 and the reconsidered rows (refuses an EAGLE-3 drafter)")
    p.add_argument("--ttt-length", type=positive_int, default=None, help="with an export: TTT steps of the chain (default: the run's, which the export records; else SpecForge's)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out sample order and the mixed rollout's "
                   "halt-depth sampling (a run and its export read the same samples at the same seed)")
    p.add_argument("--overwrite", action="store_true", help="let --out replace the files an earlier run wrote there")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        report = run_headroom(args.drafter, args.features, args.out, checkpoint=args.checkpoint, target=args.target,
                              k=args.k, pr_tables=args.pr_tables, limit=args.limit, seed=args.seed,
                              ttt_length=args.ttt_length, progress=not args.no_progress, overwrite=args.overwrite)
    except (ConfigError, FileNotFoundError, ExportError, DataFormatError) as e:
        print(f"pr-specforge headroom: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        left = written(args.out)
        rerun = (f"rerun the same command with --overwrite ({', '.join(left)} written)" if left and not args.overwrite
                 else "rerun the same command")
        print(f"pr-specforge headroom: interrupted; no output file was left half-written (each is written whole or not at all; {rerun})", file=sys.stderr)
        return 130
    pooled = report["pooled"]
    sg = pooled["second_guess"]
    print(f"{output_prefix(args.out)}.md: {pooled['scored']:.0f} positions, acceptance {_pct(pooled['acceptance'])}; misses: "
          f"rank 2 {_pct(sg['rank2'])}, reconsidered top-1 {_pct(sg['recon_top1'])}, only reconsidered {_pct(sg['recon_only'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
