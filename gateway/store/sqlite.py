"""SQLite run store: the embedded default. Durable across restarts and `kill -9`.

Contracts:
* One process owns a state file: `open()` takes an exclusive lock (`gateway.store.sqlite_lock`) and a
  second store on the same file, in this process or another, fails with `StateUnavailable` naming the
  file. Several sidecars on one run state share Redis instead. Other connections to the file keep
  working (the decision ledger's table, `sqlite3` readers, backups); they must not write `runs`/`steps`.
* Because nothing else writes the runs, the authoritative `RunState` of a run lives in memory (loaded
  from the file on first use, at most `cache_size` runs, least recently used dropped first). An
  operation applies the pure transition of `gateway.store.logic` to it on the event loop without
  awaiting, so each transition is atomic. No read, no JSON parse on the hot path.
* Written through before the call returns, with one autocommit statement: what must survive a crash
  because it stops work: stops (including an `apply`/`add` that stopped the run), resets, takes, crash
  recovery, and a reservation of a new run or of a run with no open reservation (no other step in
  flight). A write-through writes the run's whole state, so it also carries every change written
  behind before it.
* A reservation of a run that has others open is on file before `reserve` returns too, but the ones
  made during one turn of the event loop share one write of their run, on the next turn
  (`StepLog.mark(soon=True)`, `write_runs`, `wait`). Between its transition and that write it already
  counts (it limits other reservations, guard snapshots see it). If the write fails, `reserve` raises
  StateUnavailable; if its caller is cancelled while it waits, nobody will use it: either way it is
  released like a settlement, in memory and written behind, so a crash before that write charges it
  in full (as for any open reservation, below).
* Written behind (`gateway.store.sqlite_steps`, within `flush_after_s`, 10 ms, in one transaction with
  the step history; runs are written even when their step rows are refused): settlements within their
  reservation, the release of a reservation whose `reserve` failed or was cancelled, and guard
  counters / histories that did not stop the run. A settlement above its reservation (an upstream that
  ignored `max_tokens`) is written through. A crash in that window loses them, safely for spend: a lost
  settlement leaves its reservation open in the file, and on open, reservations a crashed process left
  open are settled at their reserved amount (the spend of a call is never counted below what was
  reserved for it). What else can be lost is the last 10 ms of counters that did not stop anything
  (tool calls counted, loop histories) and of step history.
* Side-effecting tool calls (`claim_write` and the rest) live in their own table
  (`gateway.store.sqlite_writes`), each change on file before the call returns.
* A write-through that fails puts memory back as it was before the call (the file may be behind it by
  writes still to come) and raises `StateUnavailable`; a batch that fails stays buffered and is
  retried by the timer. A failed transition or write never leaves memory half changed.
"""

from __future__ import annotations

import contextlib
import copy
import sqlite3
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.errors import StateUnavailable
from gateway.store import logic
from gateway.store.base import (
    Add,
    Denial,
    Push,
    Reservation,
    ReserveRequest,
    RootClaim,
    RunsCursor,
    RunsPage,
    RunState,
    WriteClaim,
)
from gateway.store.sqlite_checkpoint import Checkpointer, no_autocheckpoint
from gateway.store.sqlite_lock import StateFileLock
from gateway.store.sqlite_runs import (
    MARK_SWEPT,
    META_SCHEMA,
    PAGE_FIRST,
    PAGE_NEXT,
    RUNS_SCHEMA,
    WINDOW_FIRST,
    WINDOW_NEXT,
    WRITE_RUN,
    copy_run,
    run_row,
)
from gateway.store.sqlite_steps import SCHEMA as STEPS_SCHEMA
from gateway.store.sqlite_steps import StepLog
from gateway.store.sqlite_writes import SCHEMA as WRITES_SCHEMA
from gateway.store.sqlite_writes import SqliteWrites

T = TypeVar("T")

CACHE_SIZE = 4096  # runs kept in memory; a run costs a few KB
STEP_FLUSH_S = 0.01
STEP_BATCH = 256
MAX_PENDING_STEPS = 8192


class SqliteRunStore:
    def __init__(
        self,
        conn: sqlite3.Connection,
        lock: StateFileLock,
        path: Path,
        *,
        cache_size: int,
        flush_after_s: float,
    ) -> None:
        self._conn = conn
        self._lock = lock
        self._path = path
        self._cache_size = cache_size
        self._runs: OrderedDict[str, RunState] = OrderedDict()  # least recently used first
        self._steps = StepLog(
            conn, WRITE_RUN, run_row, self._error,
            flush_after_s=flush_after_s, batch=STEP_BATCH, limit=MAX_PENDING_STEPS,
        )
        self._writes = SqliteWrites(conn, self._error)
        self._prefix = uuid.uuid4().hex[:8]  # reservation ids never collide with a dead process's
        self._seq = 0
        self._closed = False
        self._checkpointer = Checkpointer(path)  # started by `open`, once the file is set up

    @classmethod
    def open(
        cls, path: str | Path, *, cache_size: int = CACHE_SIZE, flush_after_s: float = STEP_FLUSH_S
    ) -> SqliteRunStore:
        """Lock the file, open it, settle what a crashed owner left reserved. Raises StateUnavailable."""
        path = Path(path)
        lock = StateFileLock.acquire(path)
        try:
            conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=5000")  # the ledger's connections write the same file
                no_autocheckpoint(conn)  # commits run on the event loop; checkpoints on their own thread
                for statement in (RUNS_SCHEMA, META_SCHEMA, *STEPS_SCHEMA, *WRITES_SCHEMA):
                    conn.execute(statement)
                store = cls(conn, lock, path, cache_size=max(cache_size, 1), flush_after_s=flush_after_s)
                store._recover()
                store._checkpointer.start()
            except BaseException:
                conn.close()
                raise
        except sqlite3.Error as exc:
            lock.release()
            raise StateUnavailable(f"cannot open state file {path}: {exc}") from None
        except BaseException:
            lock.release()
            raise
        return store

    def _recover(self) -> None:
        now = time.time()
        # `state` is a BLOB, and LIKE never matches a BLOB: compare its text.
        rows = self._conn.execute("SELECT run_id FROM runs WHERE CAST(state AS TEXT) LIKE '%\"open\":{\"%'")
        for (run_id,) in rows.fetchall():
            state = self._load(run_id)
            if state is not None and state.open:
                self._change(state, lambda s: logic.recover(s, now))

    # -- memory and file -----------------------------------------------------------------------------

    def _load(self, run_id: str) -> RunState | None:
        """The run's authoritative state, read from the file only when not in memory. Raises
        sqlite3.Error."""
        state = self._runs.get(run_id)
        if state is not None:
            self._runs.move_to_end(run_id)
            return state
        state = self._steps.dirty.get(run_id)  # ahead of the file by step records: newer than its row
        if state is None:
            row = self._conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            state = logic.from_dict(orjson.loads(row[0]))
            state.steps = []  # kept in the steps table
        self._keep(state)
        return state

    def _keep(self, state: RunState) -> None:
        self._runs[state.run_id] = state
        while len(self._runs) > self._cache_size:
            self._runs.popitem(last=False)  # written through, or held by the step log until flushed

    def _state(self, run_id: str, agent: str) -> RunState:
        """The run, created in memory when new (written by the caller's `_change`)."""
        try:
            state = self._load(run_id)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        if state is None:
            state = RunState(run_id=run_id, agent=agent)
            self._keep(state)
        return state

    def _judged(self, run_id: str, agent: str, epoch: int | None) -> RunState:
        """The run a stop or effects judged on `epoch` change: RunReset before anything is written or kept
        when a reset has ended that epoch (`logic.same_epoch`)."""
        state = self._existing(run_id)
        logic.same_epoch(state or RunState(run_id=run_id, agent=agent), epoch)
        return state if state is not None else self._state(run_id, agent)

    def _existing(self, run_id: str) -> RunState | None:
        try:
            return self._load(run_id)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _change(
        self,
        state: RunState,
        transition: Callable[[RunState], T],
        *,
        behind: bool = False,
        soon: bool = False,
    ) -> T:
        """Apply `transition` to the run in memory, then write it through, or with `behind` mark it for
        the next batch (`soon`: the loop's next turn) unless the result stops the run (module
        docstring). If the transition or the write fails, memory goes back to what it was before."""
        run_id = state.run_id
        ahead = run_id in self._steps.dirty
        saved = copy_run(state, shared_open=True) if ahead else None  # memory holds changes the file lacks
        try:
            result = transition(state)
            if isinstance(result, Denial) and result.held:
                return result  # refused while steps in flight hold the budget: nothing changed
            if behind and not isinstance(result, Denial):
                self._steps.mark(state, soon=soon)
                return result
            self._conn.execute(WRITE_RUN, run_row(state))
        except BaseException as exc:
            if saved is None:
                self._forget(run_id)  # the file holds the state before the call
            else:
                self._runs[run_id] = self._steps.dirty[run_id] = saved
            if isinstance(exc, sqlite3.Error):
                raise self._error(exc) from None
            raise
        self._steps.written(run_id)  # everything it had in memory is in the file now
        return result

    def _forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._steps.dirty.pop(run_id, None)  # the failed transition changed that object too

    def _error(self, exc: sqlite3.Error) -> StateUnavailable:
        return StateUnavailable(f"state store error ({self._path}): {exc}")

    def _next_id(self) -> str:
        self._seq += 1
        return f"{self._prefix}-{self._seq}"

    # -- RunStore ------------------------------------------------------------------------------------

    async def get(self, run_id: str, *, steps: bool = True, reservations: bool = True) -> RunState | None:
        """A copy of the run: changing it never changes the store. Without `reservations`, `open` is
        empty: copying every open reservation was the largest part of a guard's snapshot."""
        state = self._existing(run_id)
        if state is None:
            return None
        snapshot = copy_run(state, reservations=reservations)
        if steps:
            self._steps.flush()
            try:
                snapshot.steps = self._steps.read(run_id, snapshot.epoch)
            except sqlite3.Error as exc:
                raise self._error(exc) from None
        return snapshot

    async def reserve(
        self, run_id: str, agent: str, request: ReserveRequest, now: float
    ) -> Reservation | Denial:
        rid = self._next_id()
        state = self._existing(run_id)
        # Written through at once when no other step of the run is in flight (nothing to share a write
        # with, and no loop turn to wait), and for a new run (one whose creation the file refused must
        # not exist): batching only pays, like a database's commit_siblings, when steps run concurrently.
        if state is None or not state.open:
            state = self._state(run_id, agent) if state is None else state
            return self._change(state, lambda s: logic.reserve(s, request, now, rid))
        result = self._change(state, lambda s: logic.reserve(s, request, now, rid), behind=True, soon=True)
        if isinstance(result, Denial):
            return result  # stopped the run (written through), or refused with nothing to write
        try:
            await self._steps.wait(run_id)
        except BaseException:  # refused, or the caller is gone: nobody will settle it
            # the store itself failing here (closed) must not hide why: a next start charges it
            with contextlib.suppress(StateUnavailable):
                self._settle(result, {}, now)
            raise
        return result

    async def settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
        self._settle(reservation, actual, now)

    def _settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
        state = self._existing(reservation.run_id)
        if state is None or reservation.epoch != state.epoch or reservation.id not in state.open:
            return  # settled already, or reset since: nothing changes, nothing to write
        held = state.open[reservation.id]["amounts"]
        # a crash before the batch charges the reservation: enough unless the call cost more than it
        # held (output beyond max_tokens): then the settlement is written through
        within = all(actual.get(counter, 0.0) <= amount + logic.EPS for counter, amount in held.items())
        self._change(state, lambda s: logic.settle(s, reservation, actual, now), behind=within)

    async def add(
        self,
        run_id: str,
        agent: str,
        counter: str,
        amount: float,
        *,
        limit: float | None,
        code: str,
        now: float,
    ) -> Denial | None:
        state = self._state(run_id, agent)
        return self._change(state, lambda s: logic.add(s, counter, amount, limit, code, now), behind=True)

    async def push(self, run_id: str, agent: str, key: str, values: Sequence[str], keep: int) -> list[str]:
        return self._change(self._state(run_id, agent), lambda s: logic.push(s, key, values, keep), behind=True)

    async def apply(
        self, run_id: str, agent: str, adds: Sequence[Add], pushes: Sequence[Push], now: float,
        *, in_flight: bool = False, epoch: int | None = None,
    ) -> Denial | None:
        if not adds and not pushes:
            return None
        state = self._judged(run_id, agent, epoch)
        return self._change(state, lambda s: logic.apply(s, adds, pushes, now, in_flight=in_flight), behind=True)

    async def take(self, run_id: str, key: str, value: str) -> bool:
        state = self._existing(run_id)
        if state is None or value not in state.lists.get(key, ()):
            return False  # nothing taken, nothing to write
        return self._change(state, lambda s: logic.take(s, key, value))

    async def stop(
        self, run_id: str, agent: str, reason: str, detail: str, now: float, *, epoch: int | None = None
    ) -> Denial:
        return self._change(self._judged(run_id, agent, epoch), lambda s: logic.stop(s, reason, detail, now))

    async def record_step(self, run_id: str, agent: str, step: Mapping[str, Any], now: float) -> int:
        """Buffer the step row and the run's activity time; written within `flush_after_s` (module
        docstring). `step["epoch"]`, when given, is the epoch the step ran under (a reset may have come
        since); otherwise the run's current one."""
        given = step.get("epoch")
        epoch = None if given is None else int(given)
        data = orjson.dumps(dict(step))
        self._steps.make_room()  # before a new run exists in memory: raises while the file refuses rows
        state = self._state(run_id, agent)
        filed = state.epoch if epoch is None else epoch
        self._steps.add(state, filed, data, now)
        return filed

    async def reset(self, run_id: str, now: float) -> RunState | None:
        state = self._existing(run_id)
        if state is None:
            return None
        before = copy_run(state)
        self._steps.flush()
        try:
            before.steps = self._steps.read(run_id, state.epoch)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        ended = self._change(state, lambda s: logic.reset(s, now))
        # the new epoch names none of the former epochs' tool calls: deleting them only frees the space,
        # so a refusal leaves them for the next reset rather than failing a reset that happened
        with contextlib.suppress(sqlite3.Error):
            self._writes.forget_former(run_id, state.epoch)
        fresh = copy_run(state)
        if ended is not None:
            fresh.ended = before, ended
        return fresh

    async def claim_root(
        self, run_id: str, epoch: int, *, final: bool, stopped: bool = False, upto: float | None = None,
        now: float,
    ) -> RootClaim | None:
        """Written through: the file holds every claim, so a restarted process never exports a root twice
        (one process holds the file: `StateFileLock`)."""
        state = self._existing(run_id)
        if state is None:
            return None

        def claim(s: RunState) -> RootClaim | None:
            return logic.claim_root(s, epoch, final=final, stopped=stopped, upto=upto, now=now)

        probe = copy.copy(state)  # the claim changes only plain fields: a shallow copy tries it
        if claim(probe) is None and (probe.roots, probe.roots_final) == (state.roots, state.roots_final):
            return None  # nothing to claim, nothing to write (a sweep judging a run with no news)
        return self._change(state, claim)

    async def list_runs(self, limit: int = 100) -> list[RunState]:
        """Most recently updated first, with their steps (buffered steps are written first)."""
        return self._read_runs("SELECT run_id, state, updated_at FROM runs ORDER BY updated_at DESC LIMIT ?",
                               (limit,))

    async def runs_page(self, after: RunsCursor | None, limit: int) -> RunsPage:
        """`RunStore.runs_page`: one statement, so a page is one snapshot of the file. Like `runs_updated`,
        a scan of `runs` (no index on `updated_at`) with a bounded sort, parsing only the page's runs."""
        args = (limit + 1,) if after is None else (after[0], after[0], after[1], limit + 1)
        runs = self._read_runs(PAGE_FIRST if after is None else PAGE_NEXT, args)
        if len(runs) <= limit:
            return RunsPage(runs, None)
        last = runs[limit - 1]
        return RunsPage(runs[:limit], (last.updated_at or 0.0, last.run_id))

    async def runs_updated(
        self, after: float, before: float, page: int = 1000
    ) -> AsyncIterator[list[RunState]]:
        """`RunStore.runs_updated`. `runs` has no index on `updated_at`: every run write would update it
        (an upsert took about twice as long with one, measured on 100,000 runs). So each page is one scan
        of the table that parses only the page's runs; a sweep's window is mostly one page."""
        cursor: tuple[str, float] | None = None
        while True:
            if cursor is None:
                runs = self._read_runs(WINDOW_FIRST, (after, before, page))
            else:
                runs = self._read_runs(WINDOW_NEXT, (cursor[1], cursor[1], cursor[0], before, page))
            if runs:
                yield runs
            if len(runs) < page:
                return
            cursor = (runs[-1].run_id, runs[-1].updated_at or 0.0)

    def _read_runs(self, sql: str, args: tuple[Any, ...]) -> list[RunState]:
        """The runs of `sql` (selecting run_id, state, updated_at), each with its steps, read after the
        buffered writes (the file is then what memory holds, steps included)."""
        self._steps.flush()
        try:
            runs = []
            for run_id, blob, updated in self._conn.execute(sql, args).fetchall():
                state = logic.from_dict(orjson.loads(blob))
                state.updated_at = updated
                state.steps = self._steps.read(run_id, state.epoch)
                runs.append(state)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        return runs

    async def claim_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, *, lease_s: float, keep: int, now: float
    ) -> WriteClaim:
        return self._writes.claim(run_id, epoch, key, token, now + lease_s, keep, now)

    async def renew_write(self, run_id: str, epoch: int, key: str, token: str, *, until: float) -> bool:
        return self._writes.renew(run_id, epoch, key, token, until)

    async def finish_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, result: bytes | None, *, keep: int,
        now: float,
    ) -> None:
        self._writes.finish(run_id, epoch, key, token, result, keep)

    async def release_write(self, run_id: str, epoch: int, key: str, token: str) -> None:
        self._writes.release(run_id, epoch, key, token)

    async def idle_swept(self) -> float | None:
        try:
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'idle_swept'").fetchone()
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        return None if row is None else float(row[0])

    async def set_idle_swept(self, upto: float) -> None:
        try:
            self._conn.execute(MARK_SWEPT, (upto,))
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    async def close(self) -> None:
        """Write buffered steps, close the file, release the lock. Idempotent. Raises StateUnavailable
        when the steps could not be written (the file is closed and the lock released all the same)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._steps.close()
        finally:
            self._runs.clear()
            try:
                self._conn.close()
                self._checkpointer.close()
            finally:
                self._lock.release()
