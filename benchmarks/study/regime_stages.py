"""The stages of a regime over one workdir (`benchmarks/regimes.py gsm8k|sharegpt`): the data stages of each
regime, then per seed and drafter train, export (checked against the fingerprint that served the drafter's kept rows,
`regime_keep`), diagnose and headroom on the regime's held-out features and the held-out measures (`regime_measures`:
the held-out curve, and what a PR drafter's depths compute), then the screening
and report serves (`regime_serves`). Each stage is skipped once its output exists; trainings resume
from their newest checkpoint; an export, diagnose, headroom and the measures are made again when the checkpoint,
features or files they were made from changed (`StageBuilder.derived_stage`).

Owns: the stages' order and settings. Does not own any stage's work (the `data`, `train`, `diagnose`, `export` and
`eval` entry points).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

from pr_specforge.stages import Stage, StageBuilder, check_settings, run_stages
from pr_specforge.training.preflight import latest_checkpoint

from .common import RECIPES, SETS, continue_from
from .regime_keep import fingerprint_checked, kept_fingerprint_check
from .regime_measures import write_measures
from .regime_serves import ReportServes
from .regime_settings import DRAFTERS, SPLITS, STAGE_GROUPS, keep_shortest, write_splits


class Regime(ReportServes):
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
               f"training.learning_rate={args.lr}", f"training.seed={seed}", f"training.save_interval={args.save_interval}",
               f"data.eval_hidden_states_path={self.heldout}", f"training.eval_interval={args.eval_interval}",
               *DRAFTERS[name][1]]
        if warm:  # on top of this seed's EAGLE-3 drafter (fresh optimiser, both the PR drafter and its baseline)
            ckpt = latest_checkpoint(self.seed_dir(seed) / "runs" / "eagle3", required=not args.dry_run) or "<eagle3 checkpoint>"
            out.append(continue_from(ckpt, pr=warm == "pr"))
        return out

    def drafter_stages(self, seed: int) -> List[Stage]:
        build, sd = self.build, self.seed_dir(seed)
        order = sorted(self.args.drafters, key=lambda n: DRAFTERS[n][2] is not None)  # warm starts after eagle3
        stages = []
        for name in order:
            run, export, diag = sd / "runs" / name, sd / "export" / name, sd / "diagnose" / f"{name}.json"
            head = sd / "headroom" / f"{name}.json"
            stages += [
                build.train_stage(f"seed{seed} {name}: train", str(RECIPES / DRAFTERS[name][0]), run,
                                  lambda name=name: self.train_overrides(seed, name)),
                # exported and checked against the kept rows' fingerprint first: a rebuild that differs stops here
                Stage(f"seed{seed} {name}: export", export / "config.json", lambda run=run, export=export: build.export(run, export, "hf"),
                      done=lambda run=run, export=export: build.export_done(run, export)),
                Stage(f"seed{seed} {name}: kept fingerprint", sd / "fingerprints" / f"{name}.json",
                      lambda export=export, name=name: kept_fingerprint_check(sd, name, export, sd / "fingerprints" / f"{name}.json"),
                      done=lambda export=export, name=name: fingerprint_checked(sd / "fingerprints" / f"{name}.json", export)),
                # diagnose, headroom and the measures are made again when what they were made from changed
                build.diagnose_stage(f"seed{seed} {name}: diagnose", run, self.heldout, diag, seed),
                build.derived_stage(f"seed{seed} {name}: headroom", head,
                                    lambda run=run, name=name: self.headroom(run, sd / "headroom" / name, seed),
                                    runs=[run], features=[self.heldout], seed=seed),
                build.derived_stage(f"seed{seed} {name}: held-out measures", sd / "measures" / f"{name}.json",
                                    lambda run=run, diag=diag, head=head, name=name: write_measures(
                                        run, diag, head, sd / "measures" / f"{name}.json"),
                                    runs=[run], files=[diag, head]),
            ]
        return stages

    def headroom(self, run: Path, prefix: Path, seed: int) -> None:
        """`pr-specforge headroom` of the run's newest checkpoint on the held-out features."""
        from pr_specforge.eval.headroom import main

        prefix.parent.mkdir(parents=True, exist_ok=True)
        # --overwrite: the stage runs when PREFIX.json is missing or was made from another checkpoint or features
        # (`derived_stage`), so PREFIX.json and any .md or PNG beside it are this stage's own earlier output in the
        # regime's workdir
        self.build.call("headroom", main, [run, "--features", self.heldout, "--out", prefix, "--seed", seed, "--no-progress",
                                           "--overwrite"])

    def run(self) -> int:
        args, work, write = self.args, self.work, not self.args.dry_run  # a dry run writes nothing, not even settings
        if bad := [s for s in args.seeds if s < 0]:
            raise ValueError(f"--seeds: {bad[0]} is not a seed (a non-negative integer: training.seed and seedN/)")
        if write:
            work.mkdir(parents=True, exist_ok=True)
        check_settings(work / "data_settings.json", self.data_settings(), write=write)
        upto = STAGE_GROUPS.index(args.until)
        stages = self.data_stages()
        for seed in args.seeds:
            if write:
                self.seed_dir(seed).mkdir(exist_ok=True)
            check_settings(self.seed_dir(seed) / "settings.json", {k: getattr(args, k) for k in self.SEED_KEYS}, write=write)
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
        return [self.serve_stage(f"seed{seed} screen-serve", sd / "screen-b48", self.serve_settings(
            seed, [self.splits / "screen.jsonl"], self.args.screen_limit, [48], [0]))]


class ShareGPTRegime(Regime):
    """The ShareGPT chat regime at the pilots' scale (docs/results/pilots.md, "Pilots at reduced scale"): the `--keep`
    shortest of `--conversations` ShareGPT first turns (prompts of at most `--max-prompt-chars` characters), their
    greedy replies (`--max-new-tokens`); `--heldout` more first turns for the held-out features; from-scratch drafters
    train `--steps`, warm starts `--warm-steps` more; the report serves the first `--report-limit` prompts of MT-Bench,
    GSM8K and HumanEval (the final evaluation's; the pilots chose the variant on prompts 40-49). No screening serve."""

    DATA_KEYS = ("conversations", "keep", "max_new_tokens", "max_prompt_chars", "heldout_conversations", "max_length",
                 "draft_vocab_size")
    SEED_KEYS = ("steps", "warm_steps", "lr", "eval_interval", "serve_max_new_tokens")
    SETS = SETS

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
