"""`pr-specforge control --recipe RECIPE.yaml`: does this recipe's PR objective learn a second pass?

Trains a tiny PR drafter on the control task (`pr_specforge.control.task`) with the recipe's
`pr:` options, prints per depth the accuracy on 1-hop and 2-hop queries and the gate's mean `q`,
then a one-line verdict. Exit code 0: the drafter learns the second pass; 1: it does not;
2: bad input (a missing recipe, a recipe that is not a PR recipe, bad YAML, an unknown or wrong `pr:` option,
a size where one pass answers the 2-hop queries by elimination, a `--json` file that exists without `--overwrite`),
said in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from pr_specforge.config import ConfigError, PRConfig


def shown_path(path) -> str:
    """`path` as a user passes it from the current directory: relative when it lies under it, else absolute."""
    full = os.path.abspath(path)
    rel = os.path.relpath(full)
    return full if rel.startswith(os.pardir) else rel


def pr_twin(path: str) -> str:
    """The PR recipe beside an EAGLE-3 one (`X-eagle3.yaml` -> `X-pr.yaml` or `X.yaml`), else the paper's PR base;
    a path that names it from the current directory."""
    from pr_specforge.stages import REPO_ROOT

    head, name = os.path.split(path)
    for twin in (name.replace("-eagle3", "-pr", 1), name.replace("-eagle3", "", 1)):
        if twin != name and os.path.isfile(os.path.join(head, twin)):
            return shown_path(os.path.join(head, twin))
    return shown_path(REPO_ROOT / "recipes" / "_base" / "paper-pr.yaml")


def recipe_pr(path: str, overrides: Sequence[str] = ()) -> PRConfig:
    """The `pr:` options of a recipe (its `extends:` chain resolved) with dotted `pr.` overrides. A recipe that is
    not a PR recipe (`training.strategy` other than `pr`, or neither that nor a `pr:` section) is refused: the
    control would test PRConfig's defaults under its name. The recipe is read by `train`'s strict loader
    (`load_recipe`, as a recipe part: it need not name a target or data), so whatever `train` refuses in it
    (an unknown key, a `pr:` without `training.strategy: pr`, a section that is no mapping) is refused here too."""
    from pr_specforge.training.recipe import PR_SECTION, load_recipe, read_recipe_mapping, split_overrides

    raw = read_recipe_mapping(path)
    spec_over, _ = split_overrides(overrides)
    if spec_over:
        raise ConfigError(f"control: only pr.FIELD=VALUE overrides apply to the control, got {list(spec_over)}")
    training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
    strategy = training.get("strategy")
    if strategy != "pr" and (strategy is not None or PR_SECTION not in raw):
        said = f"training.strategy is {strategy!r}" if strategy is not None else "it sets no training.strategy and has no pr: section"
        raise ConfigError(f"{path}: not a PR recipe ({said}): the control tests a recipe's PR options and this one has "
                          f"none; run it on a PR recipe, e.g. --recipe {pr_twin(path)}")
    return load_recipe(path, overrides, part=True).pr


def table_lines(result: Dict[str, Any]) -> List[str]:
    """Per depth: accuracy on 1-hop and 2-hop queries, the gate's mean q on each."""
    one, two = result["one_hop"], result["two_hop"]
    lines = ["depth | 1-hop acc | 2-hop acc | q on 1-hop | q on 2-hop", "----- | --------- | --------- | ---------- | ----------"]
    for r in range(len(one["accuracy"])):
        lines.append(f"{r:5d} | {one['accuracy'][r]:9.1%} | {two['accuracy'][r]:9.1%} | {one['q'][r]:10.2f} | {two['q'][r]:10.2f}")
    return lines


def verdict_line(verdict: Dict[str, Any]) -> str:
    head = "learns the second pass" if verdict["learns_second_pass"] else "does NOT learn the second pass"
    return (f"verdict: {head} (2-hop depth>=1 minus depth 0: {verdict['two_hop_gain']:+.1%}, needs "
            f">= {verdict['min_accuracy_gain']:.0%}; 2-hop minus 1-hop mean depth: {verdict['routing_gap']:+.2f}, "
            f"needs >= {verdict['min_routing_gap']:.2f})")


def curve_line(point: Dict[str, Any]) -> str:
    one, two, v = point["result"]["one_hop"], point["result"]["two_hop"], point["verdict"]
    return (f"step {point['step']}: 1-hop d0 {one['accuracy'][0]:.1%} d1 {max(one['accuracy'][1:]):.1%}, 2-hop d0 "
            f"{two['accuracy'][0]:.1%} d1 {max(two['accuracy'][1:]):.1%}, routing gap {v['routing_gap']:+.2f}")


def _parser() -> argparse.ArgumentParser:
    from pr_specforge.control.run import ControlSettings

    d = ControlSettings()
    p = argparse.ArgumentParser(
        prog="pr-specforge control",
        description="A positive control for a recipe's PR options, to run before spending GPU hours: train a tiny "
                    "PR drafter where 1-hop queries (f(a)) need one attention pass and 2-hop queries (f(f(a))) two, "
                    "and report whether depth >= 1 answers the 2-hop queries that depth 0 cannot, and whether the "
                    "gate routes them deeper. About a minute on one CPU core at the default size.",
        epilog="Exit code: 0 = learns the second pass; 1 = does not; 2 = bad input (one-line error).")
    p.add_argument("--recipe", required=True, help="recipe YAML whose pr: options are tested (extends: resolved)")
    p.add_argument("overrides", nargs="*", help="pr.FIELD=VALUE overrides, e.g. pr.recon_grad=isolated")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--symbols", type=int, default=d.symbols, help=f"cycle length N (default {d.symbols})")
    p.add_argument("--pool", type=int, default=d.pool, help="symbol pool M >= N that each sample's N symbols are drawn from (default 2 N; M = N is the old task)")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads of the control drafter (default {d.heads})")
    p.add_argument("--queries", type=int, default=None, help="queries per sample K, 1 to N (default N: every symbol asked once)")
    p.add_argument("--max-depth", type=int, default=d.max_depth, help=f"the control drafter's R (default {d.max_depth})")
    p.add_argument("--ttt-length", type=int, default=d.ttt_length, help=f"TTT steps (default {d.ttt_length})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed (default {d.seed})")
    p.add_argument("--curve-every", type=int, default=0, help="also measure every that many steps and print the curve (default 0: only at the end)")
    p.add_argument("--json", default=None, help="also write the result as JSON to this path (a new file, or --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="let --json replace an existing file (never the recipe)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from pr_specforge.data.io import DataFormatError, atomic_write_json, check_writable_file

    try:
        from pr_specforge.control.run import ControlSettings, run_control

        if args.json:  # before minutes of training, not after (data.io's one rule: never the recipe it reads)
            check_writable_file("--json", args.json, overwrite=args.overwrite, inputs=[args.recipe], fmt="JSON")
        pr = recipe_pr(args.recipe, args.overrides)
        queries = args.symbols if args.queries is None else args.queries
        settings = ControlSettings(steps=args.steps, symbols=args.symbols, queries=queries, pool=args.pool, heads=args.heads,
                                   max_depth=args.max_depth,
                                   ttt_length=args.ttt_length, seed=args.seed)
    except (ConfigError, DataFormatError, ValueError) as e:
        print(f"pr-specforge control: {' '.join(str(e).split())}", file=sys.stderr)  # one line (YAML errors span several)
        return 2
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    out = run_control(pr, settings, curve_every=max(0, args.curve_every))
    for point in out["curve"]:
        print(curve_line(point))
    print(f"control: {args.recipe}, {settings.steps} steps, N = {settings.symbols}, M = {settings.task.size}, K = {settings.queries}, heads = {settings.heads}, R = {settings.max_depth}")
    print("\n".join(table_lines(out["result"])))
    print(verdict_line(out["verdict"]))
    if args.json:  # atomically: an interrupt leaves no partial file (nor a temp one)
        atomic_write_json(args.json, {"recipe": args.recipe, "settings": vars(args), **out})
    return 0 if out["verdict"]["learns_second_pass"] else 1
