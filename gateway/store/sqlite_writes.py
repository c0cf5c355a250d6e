"""Side-effecting tool calls of the SQLite run store: the twin of `gateway.store.writes` in a table.

Contracts:
* One row per `(run_id, epoch, key)` in `tool_writes`, apart from the run's state (a recorded result
  never rides along when the run is written). The rowid orders a run's rows by first claim; past `keep`
  rows the oldest are deleted.
* The file belongs to one process (the store's lock) and every method runs its statements on the event
  loop without awaiting, so a claim is atomic. Each change is on file before the method returns (one
  transaction), so recorded results survive a restart, and a claim of a process that crashed holds
  until its lease runs out.
* A reset deletes the run's rows of former epochs (the new epoch names none of them anyway).
* sqlite3 errors become the store's StateUnavailable (`error`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from gateway.errors import StateUnavailable
from gateway.store.base import WriteClaim
from gateway.store.writes import CLAIMED, DONE, MAX_RESULT_BYTES, RUNNING

# the primary key's index also serves the per-run count and age order (an index holds the rowid)
SCHEMA = (
    ("CREATE TABLE IF NOT EXISTS tool_writes (run_id TEXT NOT NULL, epoch INTEGER NOT NULL, key TEXT NOT NULL, "
     "token TEXT NOT NULL, until REAL NOT NULL, done INTEGER NOT NULL DEFAULT 0, result BLOB, "
     "PRIMARY KEY (run_id, epoch, key))"),
)
_FIND = "SELECT token, until, done, result FROM tool_writes WHERE run_id = ? AND epoch = ? AND key = ?"
_INSERT = ("INSERT INTO tool_writes (run_id, epoch, key, token, until, done, result) "
           "VALUES (?, ?, ?, ?, ?, ?, ?)")
_HOLD = "UPDATE tool_writes SET token = ?, until = ? WHERE run_id = ? AND epoch = ? AND key = ?"
_DONE = "UPDATE tool_writes SET token = ?, done = 1, result = ? WHERE run_id = ? AND epoch = ? AND key = ?"
_DROP = "DELETE FROM tool_writes WHERE run_id = ? AND epoch = ? AND key = ?"
_COUNT = "SELECT COUNT(*) FROM tool_writes WHERE run_id = ?"
_OLDEST = ("DELETE FROM tool_writes WHERE rowid IN "
           "(SELECT rowid FROM tool_writes WHERE run_id = ? ORDER BY rowid LIMIT ?)")
_FORMER = "DELETE FROM tool_writes WHERE run_id = ? AND epoch < ?"
_BODIES = "SELECT COALESCE(SUM(LENGTH(result)), 0) FROM tool_writes"
_OLDEST_BODIES = "SELECT rowid, LENGTH(result) FROM tool_writes WHERE result IS NOT NULL ORDER BY rowid"
_NO_BODY = "UPDATE tool_writes SET result = NULL WHERE rowid = ?"


class SqliteWrites:
    def __init__(self, conn: sqlite3.Connection, error: Callable[[sqlite3.Error], StateUnavailable]) -> None:
        """`conn` is the store's autocommit connection; `error` makes its StateUnavailable."""
        self._conn = conn
        self._error = error
        self._bytes: int | None = None  # bodies on file, as counted (None: not counted yet)

    def claim(self, run_id: str, epoch: int, key: str, token: str, until: float, keep: int,
              now: float) -> WriteClaim:
        """`RunStore.claim_write`."""
        try:
            row = self._conn.execute(_FIND, (run_id, epoch, key)).fetchone()
            if row is None:
                self._insert((run_id, epoch, key, token, until, 0, None), keep)
                return WriteClaim(CLAIMED)
            holder, lease_end, done, result = row
            if done:
                return WriteClaim(DONE, None if result is None else bytes(result))
            if holder == token or lease_end <= now:  # its holder's lease ran out: presumed dead
                self._conn.execute(_HOLD, (token, until, run_id, epoch, key))
                return WriteClaim(CLAIMED)
            return WriteClaim(RUNNING)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def renew(self, run_id: str, epoch: int, key: str, token: str, until: float) -> bool:
        """`RunStore.renew_write`."""
        try:
            cursor = self._conn.execute(_HOLD + " AND token = ? AND done = 0",
                                        (token, until, run_id, epoch, key, token))
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        return cursor.rowcount > 0

    def finish(self, run_id: str, epoch: int, key: str, token: str, result: bytes | None, keep: int) -> None:
        """`RunStore.finish_write`."""
        try:
            row = self._conn.execute(_FIND, (run_id, epoch, key)).fetchone()
            if row is None:
                self._insert((run_id, epoch, key, token, 0.0, 1, result), keep)
            elif not row[2]:  # the first result stands
                self._conn.execute(_DONE, (token, result, run_id, epoch, key))
            else:
                return
            if result is not None:
                self._bound(len(result))
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _bound(self, added: int) -> None:
        """Keep the bodies on file within MAX_RESULT_BYTES: past it, the oldest lose theirs (down to three
        quarters of it, so the count is taken again only after that much more). Rows deleted meanwhile
        (evicted, reset) are counted until then: the file holds less, never more."""
        if self._bytes is None:
            self._bytes = int(self._conn.execute(_BODIES).fetchone()[0])
        else:
            self._bytes += added
        if self._bytes <= MAX_RESULT_BYTES:
            return
        held = int(self._conn.execute(_BODIES).fetchone()[0])
        if held > MAX_RESULT_BYTES:
            goal, dropped = held - MAX_RESULT_BYTES * 3 // 4, []
            for rowid, size in self._conn.execute(_OLDEST_BODIES):
                if goal <= 0:
                    break
                dropped.append((rowid,))
                goal -= size
                held -= size
            self._conn.executemany(_NO_BODY, dropped)
        self._bytes = held

    def release(self, run_id: str, epoch: int, key: str, token: str) -> None:
        """`RunStore.release_write`."""
        try:
            self._conn.execute(_DROP + " AND token = ? AND done = 0", (run_id, epoch, key, token))
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def forget_former(self, run_id: str, epoch: int) -> None:
        """Delete the run's rows of epochs before `epoch` (after a reset). Raises sqlite3.Error."""
        self._conn.execute(_FORMER, (run_id, epoch))

    def _insert(self, row: tuple[object, ...], keep: int) -> None:
        """A new row and, past `keep` rows of its run, the oldest dropped: one transaction."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.execute(_INSERT, row)
            over = self._conn.execute(_COUNT, (row[0],)).fetchone()[0] - max(keep, 1)
            if over > 0:
                self._conn.execute(_OLDEST, (row[0], over))
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # some errors (a full disk) have rolled it back already
                self._conn.execute("ROLLBACK")
            raise
