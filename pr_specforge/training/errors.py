"""The training run's own failures, in a module of their own: the run (`training.train`) raises them, the
checkpoint manager (`training.backends.checkpoint`) raises `NonFiniteTraining` before a tensor is written, and
the CLI reports them; none of them imports the others for an exception class."""


class TrainingInterrupted(Exception):
    """Ctrl-C: the message says what was kept and how to resume."""


class NonFiniteTraining(RuntimeError):
    """The loss (or a tensor about to be checkpointed) went non-finite; the message names the step and the term."""


class RankFailed(Exception):
    """A rank of a self-launched run ended with a one-line error (the message; `code` is its exit code)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
