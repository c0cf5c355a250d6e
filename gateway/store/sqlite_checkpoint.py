"""WAL checkpoints of the state file on a thread of their own, never on the event loop.

Why: in WAL mode SQLite copies the log back into the database file (and fsyncs it) from whichever
connection commits when the log passes 1,000 pages. Our connections commit on the event loop, so
every few thousand steps one request waited for a 4 MB copy and an fsync: the paced p99 of `make
bench` was 18-34 ms with the SQLite store against 5.5-8 ms with the memory store. The loop's
connections turn automatic checkpoints off (`PRAGMA wal_autocheckpoint=0`) and this thread runs a
PASSIVE checkpoint every `interval_s`: it never takes the writers' lock, and SQLite releases the GIL
while it copies and syncs. Under a steady stream of commits a PASSIVE round never catches up with
the last commit, so the log would grow without end (215 MB after 30,000 bench requests); past
`restart_frames` frames a RESTART round follows, which holds the writers' lock while it copies the
frames committed since and syncs, then lets the next writer start the log over.

Contract: `start()` once, `close()` once (joins the thread, then one last checkpoint that also
truncates the log). A failed checkpoint is retried at the next interval; the log only grows meanwhile.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

__all__ = ["Checkpointer", "no_autocheckpoint"]

_log = logging.getLogger("tollgate.store")


def no_autocheckpoint(conn: sqlite3.Connection) -> None:
    """Leave checkpoints of this connection's file to a `Checkpointer`."""
    conn.execute("PRAGMA wal_autocheckpoint=0")


class Checkpointer:
    def __init__(self, path: Path, *, interval_s: float = 0.25, restart_frames: int = 16384) -> None:
        self._path = path
        self._interval = interval_s
        self._restart_frames = restart_frames
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-wal-checkpoint", daemon=True)
        self.checkpoints = 0  # completed rounds, for tests

    def start(self) -> None:
        self._thread.start()

    def _connect(self) -> sqlite3.Connection | None:
        """A connection to the existing file (never creates one); None when it cannot be opened.
        busy_timeout 0: a round that would wait for a lock (a writer, a long reader) gives up at once
        instead of holding the writers' lock while it waits."""
        try:
            conn = sqlite3.connect(f"{self._path.resolve().as_uri()}?mode=rw", uri=True, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as exc:
            _log.warning("cannot open %s to checkpoint it: %s", self._path, exc)
            return None
        conn.execute("PRAGMA busy_timeout=0")
        return conn

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while not self._stop.wait(self._interval):
                conn = conn or self._connect()
                if conn is None:
                    continue  # retried next round
                busy, log, done = self._checkpoint(conn, "PASSIVE")
                # writers kept appending while it copied: SQLite reuses the log from its start only after
                # a checkpoint caught up with no commit in between. A RESTART round takes the writers'
                # lock for the frames committed since the PASSIVE round and one sync; only when that
                # round copied (nearly) everything: a reader pinning the log would make it fail anyway
                if not busy and log > self._restart_frames and log - done < self._restart_frames // 8:
                    self._checkpoint(conn, "RESTART")
        finally:
            if conn is not None:
                conn.close()

    def _checkpoint(self, conn: sqlite3.Connection, mode: str) -> tuple[int, int, int]:
        """(busy, frames in the log, frames checkpointed); (1, 0, 0) when it failed."""
        try:
            busy, log, done = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error as exc:  # I/O: the log waits for the next round
            _log.warning("WAL checkpoint of %s failed: %s", self._path, exc)
            return 1, 0, 0
        self.checkpoints += 1
        return int(busy), int(log), int(done)

    def close(self) -> None:
        """Stop the thread, then checkpoint everything and truncate the log (call after the loop's
        connections wrote their last batch)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        conn = self._connect()
        if conn is None:
            return  # the file is gone: nothing to checkpoint (the next open replays any log)
        try:
            self._checkpoint(conn, "TRUNCATE")
        finally:
            conn.close()
