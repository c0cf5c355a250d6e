"""The SQLite run store's ownership of its state file: one process, one store, enforced.

The store keeps each run's authoritative state in memory and writes it through, which is only correct
while no other writer changes the runs behind its back. `StateFileLock` is an exclusive advisory
`flock` on `<state file>.runs.lock`, taken when the store opens and released when it closes; the OS
releases it when the process dies, `kill -9` included, so a restart never finds a stale lock.

A second `flock` is held on the state file itself, because the lock file is named after one path: a
hard link (a second name for the same file, in another directory) has a lock file of its own, and
a second store on it would write the same runs (and SQLite would keep a second WAL beside it). flock
locks belong to the open file, not the path, and never interact with the POSIX (fcntl) locks SQLite
takes on Linux. Closing *any* descriptor of a file drops every POSIX lock the process holds on it, so
that descriptor is closed only by `release()`, after the store's own connections are closed; the
gateway closes the decision ledger (which may share the file) before the store. The lock file stays
for the holder's pid and for paths whose state file does not exist yet. Plain readers (`sqlite3`,
backups) open the state file as before: flock does not stop them.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from gateway.errors import StateUnavailable

SUFFIX = ".runs.lock"
_SHARE_REDIS = ("One gateway process per SQLite state file: to run several sidecars on one run state, share "
                "Redis between them (state: {backend: redis, url: redis://...})")


def lock_path(state_file: Path) -> Path:
    """The lock file of `state_file`, next to the file a symlink points at (one lock per real file)."""
    real = state_file.resolve()
    return real.with_name(real.name + SUFFIX)


class StateFileLock:
    """An exclusive lock on a state file, held until `release()` or the end of the process."""

    def __init__(self, fd: int, path: Path, file_fd: int | None = None) -> None:
        self._fd: int | None = fd
        self._file_fd = file_fd
        self.path = path

    @classmethod
    def acquire(cls, state_file: Path) -> StateFileLock:
        """Take the lock without waiting. Raises StateUnavailable naming the file when another store
        (this process or another) holds it, or when the lock file cannot be created."""
        path = lock_path(state_file)
        # Python opens descriptors non-inheritable: a child process never keeps the lock alive
        fd = _open_locked(
            path,
            cannot_open=f"cannot open state file {state_file}: cannot create its lock file {path}",
            busy=lambda held: (f"state file {state_file} is already in use by another run store{_holder(held)} "
                               f"(lock {path}). {_SHARE_REDIS}"),
            cannot_lock=f"cannot lock state file {state_file} ({path})",
        )
        try:
            # the file itself too: a hard link of it has a lock file of its own
            file_fd = _open_locked(
                state_file,  # created empty when missing: SQLite takes an empty file as a new database
                cannot_open=f"cannot open state file {state_file}",
                busy=lambda _: (f"state file {state_file} is already in use by another run store, under "
                                f"another name of the same file (a hard link). {_SHARE_REDIS}"),
                cannot_lock=f"cannot lock state file {state_file}",
            )
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)  # who holds it, for the message a second opener gets
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # informational only: the lock is what matters, and it is held
        return cls(fd, path, file_fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock). Idempotent. The file stays: removing
        it would race with a process that opened it and is about to lock it."""
        file_fd, self._file_fd = self._file_fd, None
        if file_fd is not None:
            os.close(file_fd)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _open_locked(path: Path, *, cannot_open: str, busy: Callable[[int], str], cannot_lock: str) -> int:
    """A descriptor of `path` (created when missing) holding an exclusive flock, taken without waiting.
    Raises StateUnavailable: `cannot_open` or `cannot_lock` with the OS's reason, or `busy(fd)` when
    another holds the lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StateUnavailable(f"{cannot_open}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        message = busy(fd)
        os.close(fd)
        raise StateUnavailable(message) from None
    except OSError as exc:
        os.close(fd)
        raise StateUnavailable(f"{cannot_lock}: {exc.strerror}") from None
    return fd


def _holder(fd: int) -> str:
    """` (pid N)` from the lock file's content, or "" when unreadable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""
