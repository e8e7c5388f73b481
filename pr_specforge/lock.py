"""One writer per output: an advisory lock every writing command holds on its output while it works.

`train` (its `output_dir`), `run` and `experiment` (their workdir), `export` (its OUT) and the data commands (their
`--output`) take `output_lock(output)` after their checks and before any work. A second writer of the same output
is refused in one `OutputBusy` line naming the holder's PID (exit 2); a reader is never blocked.

The lock is `fcntl.flock` on a lock file beside the output, `<parent>/.<name>.lock` (beside, not inside: an export
replaces its whole directory by a rename, a features directory is checked for foreign files, and a lock there
would go with them). The file records the holder's PID, for the refusal's line only: whether the lock is held is
the kernel's flock, never that text, so a lock file a killed writer left (kill -9, power loss: the kernel
released its flock) is simply taken by the next writer, whatever PID it still names. A writer removes the file
when it is done; a taker that finds the file it locked no longer at that path (removed by a finishing holder
between its open and its flock) locks the new one instead.

Advisory and local: it stops this package's commands on one host (flock over NFS may not lock across hosts).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

#: the environment variable that holds a taken lock this long (seconds) before the command's work: the tests' window
HOLD_ENV = "PR_SPECFORGE_LOCK_HOLD_S"


class OutputBusy(ValueError):
    """Another live process is writing the same output; the message names its PID."""


def lock_path(output: str | os.PathLike) -> Path:
    """Where the lock of `output` (a file or a directory) lives: `<parent>/.<name>.lock`."""
    output = Path(os.path.abspath(output))
    return output.parent / f".{output.name}.lock"


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return "another process"
    if not text.isdigit():
        return "another process"
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:  # the PID a killed writer left, read before the live holder wrote its own
        return "another process"
    except (PermissionError, OverflowError):
        pass
    return f"PID {text}"


def _acquire(path: Path, flag: str, output) -> int:
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputBusy(f"{flag} {output}: is being written by {_holder(path)} (its lock {path}); one writer "
                             "per output: wait for it to finish, or name another output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # a finishing holder removed the file between our open and flock: lock the one there now


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, flag: str = "--output") -> Iterator[Path | None]:
    """Hold the one-writer lock of `output` for the `with` block; `OutputBusy` (one line naming the holder's PID)
    when a live process holds it. The output's parent directory is made when missing; where no lock file can be
    made (a read-only directory) the block runs unlocked, for the command's own checks to refuse the output."""
    path = lock_path(output)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, flag, output)
    except OutputBusy:
        raise
    except OSError:  # no lock file can be made there (a read-only directory, a path under a file): nor can a second
        yield None   # writer write there; the command's own checks refuse the output in their own line
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        hold = float(os.environ.get(HOLD_ENV, "0") or 0)
        if hold:
            import time

            time.sleep(hold)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before the unlock: a waiter that locked this inode sees it gone and retries
        os.close(fd)
