"""Every `pr-specforge` sub-command answers `--help` (exit 0, a usage line naming it)."""

import pytest

from pr_specforge.cli import _DELEGATED, main


@pytest.mark.parametrize("command", [None, "train", *sorted(_DELEGATED)])
def test_every_subcommand_answers_help(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if command is not None:
        assert command in out.splitlines()[0] or command in out


def test_unknown_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
