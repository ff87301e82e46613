"""One writer per run folder, per store and per regeneration output: a second training on the same
`train.out_dir`, a second precompute (or capturing regeneration) on the same store, or a second
regeneration into the same output file, is refused in one line naming the process that holds it,
before it reads or writes anything.

The lock is an advisory `flock` on a `.lock` file in the directory (`.lock.rank<r>` for launched
rank r > 0: every rank of a second job meets the same rank of the first). The kernel drops it
when its process ends, however it ends, so a lock left by a killed run is simply taken over; the
file's text (pid and host) is only there for the message."""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Busy(FileExistsError):
    """The directory is held by another running process."""


def launched_rank() -> int:
    """This process's rank among those `torchrun` / `accelerate launch` started (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def lock_path(directory: Path, rank: int, lock_name: str = ".lock") -> Path:
    return directory / (lock_name if rank == 0 else f"{lock_name}.rank{rank}")


@contextmanager
def exclusive(
    directory: str | Path, setting: str, rank: int | None = None, lock_name: str = ".lock"
) -> Iterator[None]:
    """Hold `directory` (created if absent) for this process while the block runs. `setting`:
    the config field that names it, for the message. `lock_name`: the lock file's name, where one
    file in the directory is held rather than the whole directory (a regeneration's output)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = lock_path(directory, launched_rank() if rank is None else rank, lock_name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise Busy(
            f"{directory} is in use by {holder} (lock {path.name}): wait for that run to end, or "
            f"choose another {setting}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
