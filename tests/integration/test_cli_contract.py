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


def test_ctrl_c_that_a_library_turns_into_another_error_is_one_interrupted_line(monkeypatch, capsys):
    """issue 43's audit: Ctrl-C while `export` imported transformers/accelerate ended in a half-imported
    module's ImportError traceback (exit 1). A real SIGINT here, turned into an ImportError the same way."""
    import os
    import signal

    import pr_specforge.cli as cli

    def command(argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            import time

            time.sleep(5)  # the signal lands here
        except KeyboardInterrupt:
            raise ImportError("cannot import name 'dispatch_model' from partially initialized module") from None
        return 0

    monkeypatch.setattr(cli, "_entry", lambda name: command)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main(["export", "x", "y"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert err.strip() == "pr-specforge export: interrupted", err
    with pytest.raises(ImportError):  # without an interrupt, the same error is not hidden
        monkeypatch.setattr(cli, "_entry", lambda name: lambda argv: (_ for _ in ()).throw(ImportError("real")))
        main(["export", "x", "y"])
    signal.signal(signal.SIGINT, previous)
