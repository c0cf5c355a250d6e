"""The SQLite run store's ownership of its state file: one process, one store, enforced.

The store keeps each run's authoritative state in memory and writes it through, which is only correct
while no other writer changes the runs behind its back. `StateFileLock` is an exclusive advisory
`flock` on `<state file>.runs.lock`, taken when the store opens and released when it closes; the OS
releases it when the process dies, `kill -9` included, so a restart never finds a stale lock.

Why a separate file and not the state file itself: SQLite holds POSIX (fcntl) locks on the state file,
and closing *any* descriptor of a file drops every POSIX lock the process holds on it, so a descriptor
of our own on the state file would break the locking of the other connections (the decision ledger's)
when closed. The lock file is never read by SQLite, and only the run store takes it: the ledger and
plain readers (`sqlite3`, backups) open the state file as before.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from gateway.errors import StateUnavailable

SUFFIX = ".runs.lock"


def lock_path(state_file: Path) -> Path:
    """The lock file of `state_file`, next to the file a symlink points at (one lock per real file)."""
    real = state_file.resolve()
    return real.with_name(real.name + SUFFIX)


class StateFileLock:
    """An exclusive lock on a state file, held until `release()` or the end of the process."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_file: Path) -> StateFileLock:
        """Take the lock without waiting. Raises StateUnavailable naming the file when another store
        (this process or another) holds it, or when the lock file cannot be created."""
        path = lock_path(state_file)
        try:
            # Python opens descriptors non-inheritable: a child process never keeps the lock alive
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateUnavailable(
                f"cannot open state file {state_file}: cannot create its lock file {path}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateUnavailable(
                f"state file {state_file} is already in use by another run store{holder} (lock {path}). "
                "One gateway process per SQLite state file: to run several sidecars on one run state, "
                "share Redis between them (state: {backend: redis, url: redis://...})"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StateUnavailable(f"cannot lock state file {state_file} ({path}): {exc.strerror}") from None
        try:
            os.ftruncate(fd, 0)  # who holds it, for the message a second opener gets
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # informational only: the lock is what matters, and it is held
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock). Idempotent. The file stays: removing
        it would race with a process that opened it and is about to lock it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _holder(fd: int) -> str:
    """` (pid N)` from the lock file's content, or "" when unreadable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""
