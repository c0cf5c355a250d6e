"""Step history of the SQLite run store, written behind in small batches.

A step record is history, not accounting: nothing decides on it. Writing each in its own commit was
the largest single cost of a step (an autocommit INSERT into `steps` ~40 us; in a batch ~5 us a row), so
`StepLog.add` only buffers the row and marks the run's new activity time, and one transaction writes
the batch `flush_after_s` later (one timer per batch), or at once when `batch` rows wait.

Contracts:
* The runs a batch touched are written with it (`dirty`): their memory is ahead of the file by step
  records, or by the changes the store writes behind (`mark`: settlements, guard counters and
  histories). They stay here, even when the store's cache dropped them, until written, so the store
  never reloads an older version. Dirty runs are also written without their step rows: on the loop's
  next turn after `mark(soon=True)` (`write_runs`), and when the file refuses the step rows.
* A crash loses the rows and run changes of at most the last `flush_after_s`; what that means for
  spend is the store's contract (gateway/store/sqlite.py). `flush()` is also called before steps are
  read and on close.
* When the file refuses a batch, what it refused stays buffered and is retried by the timer (logged
  once per outage, run state and step history each); past `limit` rows, `add` raises
  StateUnavailable instead of growing.
* `mark(soon=True)` then `wait` is for a change that must be on file before its caller goes on (the
  store's reservations): the dirty runs are written on the loop's next turn, and the future resolves
  when a write has the change: that one, a batch, or the store's own write of the run before it
  (`written`). So the reservations made during one turn of the loop share one write (one write each
  was the largest cost of a step). If the file refuses the run, the future fails with
  StateUnavailable (never waits for the retry) and the run stays dirty: its memory, not the refused
  write, is what a later one writes. A run the file refuses fails only its own waiters. Whatever else
  goes wrong while writing, waiters are answered, never left waiting.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import Any

import orjson

from gateway.errors import StateUnavailable
from gateway.store import logic
from gateway.store.base import RunState

_log = logging.getLogger(__name__)

SCHEMA = (
    # Steps live in their own append-only table: recording one never rewrites the run's state
    ("CREATE TABLE IF NOT EXISTS steps (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, "
     "epoch INTEGER NOT NULL, data BLOB NOT NULL)"),
    "CREATE INDEX IF NOT EXISTS steps_run ON steps (run_id, seq)",
)
_INSERT = "INSERT INTO steps (run_id, epoch, data) VALUES (?, ?, ?)"
_PRUNE = (
    "DELETE FROM steps WHERE run_id = ? AND seq <= "
    "(SELECT seq FROM steps WHERE run_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)"
)
_PRUNE_EVERY = 64  # every 64th row recorded, its run's rows beyond the last MAX_STEPS are deleted

RunWriter = Callable[[RunState], tuple[Any, ...]]


class StepLog:
    def __init__(
        self,
        conn: sqlite3.Connection,
        write_run: str,
        run_row: RunWriter,
        error: Callable[[sqlite3.Error], StateUnavailable],
        *,
        flush_after_s: float,
        batch: int,
        limit: int,
    ) -> None:
        """`write_run` is the statement that writes a run from `run_row(state)`; `error` makes the store's
        StateUnavailable from an sqlite3 error."""
        self._conn = conn
        self._write_run = write_run
        self._run_row = run_row
        self._error = error
        self._flush_after = flush_after_s
        self._batch = batch
        self._limit = limit
        self.dirty: dict[str, RunState] = {}
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}  # `wait` callers, by run
        self._soon: asyncio.Handle | None = None
        self._pending: list[tuple[str, int, bytes]] = []
        self._recorded = 0
        self._timer: asyncio.TimerHandle | None = None
        self._failing: set[str] = set()  # what is refused now: "run state", "step history"
        self._closed = False

    def make_room(self) -> None:
        """Call before `add`: raises StateUnavailable when `limit` rows wait and the file still
        refuses them."""
        if len(self._pending) >= self._limit:
            self.flush()

    def add(self, state: RunState, epoch: int, data: bytes, now: float) -> None:
        """Buffer one row of `state`'s run and set its activity time. Call within a running event loop."""
        self._pending.append((state.run_id, epoch, data))
        state.updated_at = now  # what logic.record_step does besides keeping the step
        self.dirty[state.run_id] = state
        if len(self._pending) >= self._batch:
            self._flush_quietly()
        else:
            self._arm()

    def mark(self, state: RunState, *, soon: bool = False) -> None:
        """`state` changed in memory only (a deferred write of the store): write it with the next batch,
        which with `soon` is written on the loop's next turn instead of `flush_after_s` later."""
        self.dirty[state.run_id] = state
        if not soon:
            self._arm()
        elif self._soon is None and not self._closed:
            self._soon = asyncio.get_running_loop().call_soon(self._write_runs_quietly)

    def wait(self, run_id: str) -> asyncio.Future[None]:
        """A future resolved once a write has the run as it is now (module docstring). Call within a
        running event loop."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._closed:  # nothing will write it any more
            written.set_exception(StateUnavailable("the state store is closed"))
        elif run_id in self.dirty:
            self._waiting.setdefault(run_id, []).append(written)
        else:
            written.set_result(None)
        return written

    def written(self, run_id: str) -> None:
        """The store wrote the run's whole state itself: it is no longer dirty, and what waited is on file."""
        self.dirty.pop(run_id, None)
        self._answer(run_id, None)

    def _arm(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(self._flush_after, self._flush_quietly)

    def read(self, run_id: str, epoch: int) -> list[dict[str, Any]]:
        """The run's last MAX_STEPS steps of `epoch`, oldest first, as written. Raises sqlite3.Error."""
        rows = self._conn.execute(
            "SELECT data FROM steps WHERE run_id = ? AND epoch = ? ORDER BY seq DESC LIMIT ?",
            (run_id, epoch, logic.MAX_STEPS),
        ).fetchall()
        return [orjson.loads(r[0]) for r in reversed(rows)]

    def flush(self) -> None:
        """Write the dirty runs and the buffered rows in one transaction. Raises StateUnavailable when the
        file refuses; what it refused stays buffered and the timer tries again (runs are written even
        when step rows are refused)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if not self._pending and not self.dirty:
            self._release_waiters(None)  # nothing is ahead of the file
            return
        pending = self._pending
        conn = self._conn
        refused: sqlite3.Error | None = None
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if self.dirty:
                    conn.executemany(self._write_run, [self._run_row(s) for s in self.dirty.values()])
                if pending:
                    refused = self._insert(pending)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self._arm()
            error = self._error(exc)
            self._release_waiters(error)
            raise error from None
        except BaseException as exc:  # not the file refusing: a bug; answer the waiters, then raise
            self._release_waiters(_broken(exc))
            raise
        self.dirty = {}
        self._release_waiters(None)
        if refused is not None:
            self._arm()
            raise self._error(refused)
        self._recorded += len(pending)
        self._pending = []

    def _insert(self, pending: list[tuple[str, int, bytes]]) -> sqlite3.Error | None:
        """Write step rows within the batch's transaction, in a savepoint: rows the file refuses stay
        buffered and never hold back the runs (spend does not depend on step history)."""
        prune = {r for n, (r, _, _) in enumerate(pending, self._recorded + 1) if n % _PRUNE_EVERY == 0}
        conn = self._conn
        conn.execute("SAVEPOINT steps")
        try:
            conn.executemany(_INSERT, pending)
            if prune:
                conn.executemany(_PRUNE, [(r, r, logic.MAX_STEPS) for r in prune])
        except sqlite3.Error as exc:
            conn.execute("ROLLBACK TO steps")
            return exc
        finally:
            conn.execute("RELEASE steps")
        return None

    def write_runs(self) -> None:
        """Write the dirty runs now; their step rows wait for the batch. One autocommit statement when
        one run is dirty (the common case: an agent's steps share a run), else one transaction; when
        the file refuses that, each run alone, so a run it refuses fails only its own waiters. Raises
        StateUnavailable when a run is refused: it stays dirty and the timer tries again."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if not self.dirty:
            self._release_waiters(None)
            return
        try:
            if len(self.dirty) > 1 and self._write_together():
                return
            refused: sqlite3.Error | None = None
            for run_id, state in list(self.dirty.items()):
                try:
                    self._conn.execute(self._write_run, self._run_row(state))
                except sqlite3.Error as exc:
                    refused = exc
                    self._answer(run_id, self._error(exc))
                else:
                    self.written(run_id)
        except BaseException as exc:  # not the file refusing: a bug; answer the waiters, then raise
            self._release_waiters(_broken(exc))
            raise
        if refused is not None:
            self._arm()
            raise self._error(refused)

    def _write_together(self) -> bool:
        """The dirty runs in one transaction; False (nothing written) when the file refuses it."""
        conn = self._conn
        rows = [self._run_row(s) for s in self.dirty.values()]
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(self._write_run, rows)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                return False
            raise
        self.dirty = {}
        self._release_waiters(None)
        return True

    def _answer(self, run_id: str, error: StateUnavailable | None) -> None:
        """Resolve the run's waiters: written (`error` None) or refused."""
        for waiter in self._waiting.pop(run_id, ()):
            if waiter.done():
                continue  # its caller was cancelled
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(StateUnavailable(error.message))  # one per task

    def _release_waiters(self, error: StateUnavailable | None) -> None:
        for run_id in list(self._waiting):
            self._answer(run_id, error)

    def _flush_quietly(self) -> None:
        """Flush from the timer or at the batch size: a failure is logged (once per outage) and retried."""
        self._quietly(self.flush, "step history")

    def _write_runs_quietly(self) -> None:
        self._quietly(self.write_runs, "run state")

    def _quietly(self, write: Callable[[], None], what: str) -> None:
        try:
            write()
        except StateUnavailable as exc:
            if what not in self._failing:
                _log.warning("%s not written yet, retrying: %s", what, exc.message)
            self._failing.add(what)
            return
        if what in self._failing:
            _log.info("%s written again", what)
            self._failing.discard(what)

    def close(self) -> None:
        """Write what is buffered and stop the timer; raises StateUnavailable when the file refuses
        (what it refused is then lost, and the store says so to its closer). Waiters still waiting
        fail with StateUnavailable."""
        self._closed = True
        try:
            self.flush()
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._pending = []
            self.dirty = {}
            self._release_waiters(StateUnavailable("the state store is closed"))


def _broken(exc: BaseException) -> StateUnavailable:
    return StateUnavailable(f"state store error: {type(exc).__name__}: {exc}")
