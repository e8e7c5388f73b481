"""The positive control: the paper recipe's objective learns a second pass; a broken objective does not.

A shrunken control (a cycle of 5 symbols, hidden 32): one attention pass answers a 1-hop query
f(a) and, by elimination of a, f(a) and the symbol before a, half of the 2-hop queries f(f(a));
a second pass answers them all. Fixed seeds; the margins are the verdict's (10 points of 2-hop
accuracy, 0.25 of mean depth), far below what the paper recipe reaches here.
"""

import pytest
import torch

from pr_specforge.control.cli import main, recipe_pr
from pr_specforge.control.run import ControlSettings, run_control
from pr_specforge.training.objective.ttt import OnlinePRModel

PAPER = "recipes/_base/paper-pr.yaml"
SMALL = ControlSettings(symbols=5, queries=4, hidden=32, heads=2, steps=400, batch=16, lr=1e-2, eval_samples=128)


class CutReconsiderationGradients(OnlinePRModel):
    """A deliberately broken objective: the reconsidered depths' losses reach the gate term but send no
    gradient (the kind of bug a misplaced stop-gradient makes)."""

    def _score_depths(self, *args, **kwargs):
        step = super()._score_depths(*args, **kwargs)
        step.losses = torch.cat([step.losses[..., :1], step.losses[..., 1:].detach()], dim=-1)
        return step


@pytest.fixture(scope="module")
def paper_run():
    return run_control(recipe_pr(PAPER), SMALL)


def test_paper_recipe_learns_the_second_pass(paper_run):
    one, two = paper_run["result"]["one_hop"], paper_run["result"]["two_hop"]
    assert one["accuracy"][0] > 0.9  # one pass answers 1-hop queries
    assert two["accuracy"][1] - two["accuracy"][0] >= 0.10  # the second pass answers what the first cannot
    assert two["mean_depth"] - one["mean_depth"] >= 0.25  # and the gate sends 2-hop queries there
    assert paper_run["verdict"]["learns_second_pass"]


def test_a_broken_objective_fails_the_control():
    out = run_control(recipe_pr(PAPER), SMALL, model_cls=CutReconsiderationGradients)
    assert not out["verdict"]["learns_second_pass"]
    two = out["result"]["two_hop"]
    assert two["accuracy"][1] - two["accuracy"][0] < 0.10


def test_cli_prints_the_table_and_exits_nonzero_when_the_pass_is_not_learnt(capsys):
    assert main(["--recipe", PAPER, "--steps", "2", "--symbols", "4"]) == 1
    out = capsys.readouterr().out
    assert "2-hop acc" in out and "verdict: does NOT learn the second pass" in out


@pytest.mark.parametrize("case", ["missing", "yaml", "unknown", "override"])
def test_cli_bad_input_is_one_line(tmp_path, capsys, case):
    recipe = tmp_path / "r.yaml"
    args = ["--recipe", str(recipe)]
    if case == "yaml":
        recipe.write_text("pr: [unclosed\n")
    elif case == "unknown":
        recipe.write_text("pr:\n  max_dept: 2\n")
    elif case == "override":
        recipe.write_text("pr:\n  max_depth: 2\n")
        args.append("pr.recon_grad=sideways")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pr-specforge control: ") and "\n" not in err
    assert {"missing": "does not exist", "yaml": "not valid YAML", "unknown": "max_dept", "override": "recon_grad"}[case] in err


def test_cli_help_says_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "1 = does not" in capsys.readouterr().out
