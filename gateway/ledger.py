"""The decision ledger: an append-only, hash-chained SQLite table `ledger`, one row per step decision.

Columns: id (1, 2, 3, ...), ts, agent, run_id, operation, model, input_hash (never the content),
decision (allow, stop, reask, drop, approve, deny, ...), reason (stop code or null), detail (cut to
DETAIL_MAX chars), prev_hash, entry_hash. The chain format and `verify` live in gateway/ledger_chain.py
(re-exported here); this module is the writer.

Contracts:
* Append-only: no code path updates or deletes a row (corrections are new rows), and triggers make
  SQLite refuse UPDATE/DELETE on `ledger` (raw file access can drop them; the chain detects that).
  Only `ledger`, its index and triggers are created: the file may be the run store's.
* Many processes may append to one file: a batch reads the last row inside `BEGIN IMMEDIATE`, so all
  writers extend one chain (WAL + busy_timeout: writers queue). Next id = max(last id, sqlite_sequence)
  + 1, so rows cut from the end leave a visible gap.
* The request path never touches SQLite: `append_nowait`/`append` enqueue; the writer task (`start()`)
  writes batches, one transaction each, on a worker thread, or with `on_loop` on the event loop
  itself: for a file only this process writes (the SQLite run store's, which it locks), where a
  worker thread would only contend with the store's own writes for the file's write lock (the loser
  sleeps in SQLite's busy handler, milliseconds at a time) and cost a thread hop per batch.
* `append` waits while `max_pending` entries are queued; `append_nowait` never waits: past `max_pending`
  the queue grows (counted in `overflowed`), past `hard_limit` the entry is refused, counted in
  `dropped` and logged. A failed write keeps its batch queued and is retried with backoff
  (`write_errors`); `close()` tries 3 times, then counts the rest in `lost` and raises StateUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sqlite3
import time
from collections import deque
from dataclasses import dataclass
from functools import cache
from hashlib import sha256
from pathlib import Path
from typing import Any

from gateway.errors import StateUnavailable
from gateway.frozen_init import fast_init
from gateway.ledger_chain import (
    COLUMNS,
    GENESIS,
    SCHEMA,
    SELECT,
    VerifyResult,
    canonical_row,
    connect,
    enable_wal,
    entry_hash,
    input_hash,
    verify,
)
from gateway.store.sqlite_checkpoint import no_autocheckpoint

__all__ = ["Ledger", "LedgerEntry", "VerifyResult", "entry_hash", "input_hash", "verify"]

DETAIL_MAX = 500
LOOP_BATCH = 128  # rows per transaction when writing on the event loop (~1 ms)
_TEXT = ("agent", "run_id", "operation", "model", "input_hash", "decision", "detail")
_WIDTH = len(COLUMNS)
# Rows per INSERT statement at most: 64 x 12 parameters stays under SQLite's historic 999-variable
# limit (builds before 3.32), and longer statements measured no faster.
_MAX_ROWS = 64
_LAST = ("SELECT id, entry_hash, (SELECT seq FROM sqlite_sequence WHERE name = 'ledger')"
         " FROM ledger ORDER BY id DESC LIMIT 1")
_log = logging.getLogger(__name__)


@fast_init
@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One step decision as the pipeline reports it. `ts` 0 means "now, at append"."""

    agent: str
    run_id: str
    operation: str
    model: str
    input_hash: str
    decision: str
    reason: str | None = None
    detail: str = ""
    ts: float = 0.0


class Ledger:
    """Append-only decision log over one SQLite file; the module docstring states the contracts."""

    def __init__(self, writer: sqlite3.Connection, reader: sqlite3.Connection, *, max_pending: int,
                 hard_limit: int, batch_size: int, retry_delay_s: float, linger_s: float = 0.0,
                 on_loop: bool = False) -> None:
        self._writer = writer  # used by one worker thread at a time: the writer task serializes
        self._on_loop = on_loop
        self._reader = reader  # used by rows() on the caller's thread, never by the worker
        self._pending: deque[tuple[LedgerEntry, float]] = deque()
        self._max_pending, self._hard_limit = max_pending, hard_limit
        self._batch_size, self._retry_delay_s = batch_size, retry_delay_s
        self._linger_s = linger_s
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._progress: asyncio.Condition | None = None
        self._closing = False
        self._hurry: asyncio.Event | None = None  # set by a waiting `flush`: write without lingering
        self.accepted = self.written = self.overflowed = self.dropped = self.lost = self.write_errors = 0

    @classmethod
    def open(cls, path: str | Path, *, max_pending: int = 10_000, hard_limit: int = 1_000_000,
             batch_size: int = 512, retry_delay_s: float = 0.05, linger_s: float = 0.0,
             on_loop: bool = False) -> Ledger:
        """Open `path`, creating the ledger table if needed. Sync: call at startup, not per request.
        `on_loop`: write on the event loop (module docstring); batches are then at most LOOP_BATCH rows,
        so one never holds the loop for long. Raises StateUnavailable naming the file."""
        writer: sqlite3.Connection | None = None
        try:
            writer = connect(path)
            enable_wal(writer)
            writer.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: no fsync per commit
            writer.execute("BEGIN IMMEDIATE")  # processes creating the table at once must not race
            for statement in SCHEMA:
                writer.execute(statement)
            _check_head(_head(writer))  # a damaged head would hold every row queued: refuse to start
            writer.execute("COMMIT")
            if on_loop:
                # never wait for the file's lock on the loop: if some other process writes this ledger
                # after all (it should not: it is the run store's file), the batch fails and is retried
                writer.execute("PRAGMA busy_timeout = 0")
                no_autocheckpoint(writer)  # nor copy the log back on the loop: the store's checkpointer does
            reader = connect(path)
        except sqlite3.Error as exc:
            if writer is not None:
                writer.close()
            raise StateUnavailable(f"cannot open the ledger {path}: {exc}") from None
        return cls(writer, reader, max_pending=max_pending, hard_limit=hard_limit,
                   batch_size=min(batch_size, LOOP_BATCH) if on_loop else batch_size,
                   retry_delay_s=retry_delay_s, linger_s=linger_s, on_loop=on_loop)

    async def start(self) -> None:
        """Start the background writer on the running loop. Idempotent."""
        if self._task is None:
            self._wake, self._progress, self._hurry = asyncio.Event(), asyncio.Condition(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="tollgate-ledger")
            self._wake.set()

    def append_nowait(self, entry: LedgerEntry) -> None:
        """Enqueue without waiting (hot path). A malformed entry raises TypeError here, at the caller."""
        _check(entry)
        if len(self._pending) >= self._hard_limit:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                _log.error("ledger queue full (%d): %d entries dropped", self._hard_limit, self.dropped)
            return
        if len(self._pending) >= self._max_pending:
            self.overflowed += 1
        # ts is stored as REAL: hash the float SQLite will give back, not an int.
        self._pending.append((entry, float(entry.ts) if entry.ts else time.time()))
        self.accepted += 1
        if self._wake is not None:
            self._wake.set()

    async def append(self, entry: LedgerEntry) -> None:
        """Enqueue, waiting (without blocking the loop) while `max_pending` entries are queued."""
        if self._progress is not None and len(self._pending) >= self._max_pending:
            async with self._progress:
                await self._progress.wait_for(
                    lambda: len(self._pending) < self._max_pending or not self._writer_alive())
        self.append_nowait(entry)

    async def flush(self) -> None:
        """Return once every entry accepted before the call is written (or lost at close)."""
        target = self.accepted
        if not self._writer_alive():
            while self._pending:  # no writer task: write here
                await self._write_batch()
            return
        assert self._progress is not None and self._wake is not None and self._hurry is not None
        self._hurry.set()
        self._wake.set()
        async with self._progress:
            await self._progress.wait_for(
                lambda: self.written + self.lost >= target or not self._writer_alive())

    async def close(self) -> None:
        """Write everything, stop the writer, close the connections. Raises StateUnavailable when
        entries could still not be written after the final retries (they are counted in `lost`)."""
        await self.start()
        self._closing, lost_before = True, self.lost
        try:
            if self._writer_alive():
                assert self._wake is not None and self._task is not None
                self._wake.set()
                await self._task
        finally:
            self._discard_pending()
            self._writer.close()
            self._reader.close()
        if self.lost > lost_before:
            raise StateUnavailable(f"ledger: {self.lost - lost_before} entries could not be written")

    def close_sync(self) -> None:
        """Write what is pending on this thread, then close. For code without a running writer (CLI,
        after the loop ended); raises RuntimeError while the writer task runs."""
        if self._writer_alive():
            raise RuntimeError("the ledger writer is running: use `await close()`")
        while self._pending:
            self._write_some()
        self._writer.close()
        self._reader.close()

    def rows(self, run_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The last `limit` (1..10000) written rows, of one run or of all, oldest first, as dicts."""
        limit = max(1, min(int(limit), 10_000))
        where, args = ("WHERE run_id = ?", (run_id, limit)) if run_id is not None else ("", (limit,))
        cursor = self._reader.execute(
            f"SELECT * FROM ({SELECT} {where} ORDER BY id DESC LIMIT ?) ORDER BY id", args)
        return [dict(zip(COLUMNS, row, strict=True)) for row in cursor]

    def _writer_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        assert self._wake is not None and self._progress is not None and self._hurry is not None
        failures = 0
        try:
            while self._pending or not self._closing:
                if not self._pending:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                if self._linger_s and not self._closing and len(self._pending) < self._batch_size:
                    # batch rows of the next few ms into one transaction: each write is a thread hop
                    # (~100 us CPU) plus a few GIL hand-offs with the request path's thread; a flush
                    # (a stop's row) ends the wait
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._linger_s):
                            await self._hurry.wait()
                self._hurry.clear()  # a flush called from here on waits for a batch after this one
                try:
                    await self._write_batch()
                    failures = 0
                except sqlite3.Error as exc:
                    self.write_errors += 1
                    failures += 1
                    _log.warning("ledger write failed (%d pending, try %d): %s", len(self._pending),
                                 failures, exc)
                    if self._closing and failures >= 3:
                        self._discard_pending()
                        break
                    # Why wait: a locked or full database does not heal within microseconds.
                    await asyncio.sleep(min(self._retry_delay_s * 2 ** min(failures, 5), 2.0))
                async with self._progress:
                    self._progress.notify_all()
        finally:
            async with self._progress:  # wake waiters even when this task dies or is cancelled
                self._progress.notify_all()

    async def _write_batch(self) -> None:
        if self._on_loop:
            self._write_some()
            await asyncio.sleep(0)  # a backlog is many batches: let requests run between them
        else:
            await asyncio.to_thread(self._write_some)

    def _write_some(self) -> None:
        """Write up to batch_size queued entries in one transaction, extending the chain. On failure
        they stay at the head of the queue, in order. Runs on one thread at a time."""
        count = min(self._batch_size, len(self._pending))
        # By index, not by iterating: the loop thread appends meanwhile, and a deque iterator raises
        # if the deque changes under it (GC can switch threads in the middle of a C-level iteration).
        batch = [self._pending[i] for i in range(count)]
        conn = self._writer
        conn.execute("BEGIN IMMEDIATE")  # the write lock: nobody appends between our read and insert
        try:
            # One statement, not two: every statement releases and retakes the GIL, and a busy event
            # loop thread makes each retake a forced thread switch.
            last = _head(conn)
            _check_head(last)
            next_id = max(last[0], last[2] or 0) + 1
            values = _chained(batch, next_id, last[1])
            # Multi-row INSERTs, not executemany: one GIL release per statement instead of per row,
            # and AUTOINCREMENT updates sqlite_sequence once per statement.
            done = 0
            for rows in _chunks(count):
                conn.execute(_insert_sql(rows), values[done * _WIDTH:(done + rows) * _WIDTH])
                done += rows
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        for _ in range(count):
            self._pending.popleft()
        self.written += count

    def _discard_pending(self) -> None:
        if self._pending:
            self.lost += len(self._pending)
            _log.error("ledger closed with %d unwritten entries", len(self._pending))
            self._pending.clear()


def _chained(batch: list[tuple[LedgerEntry, float]], next_id: int, prev: str) -> list[Any]:
    """The column values (COLUMNS order) of `batch`'s rows, flat, as rows next_id, next_id + 1, ...
    extending the chain from `prev`. Hashes via canonical_row: no dict, no json.dumps per row."""
    values: list[Any] = []
    for entry, ts in batch:
        row = (next_id, ts, _text(entry.agent), _text(entry.run_id), _text(entry.operation),
               _text(entry.model), _text(entry.input_hash), _text(entry.decision),
               None if entry.reason is None else _text(entry.reason), _text(entry.detail)[:DETAIL_MAX],
               prev)
        prev = sha256(canonical_row(*row).encode("utf-8")).hexdigest()
        values += row
        values.append(prev)
        next_id += 1
    return values


def _head(conn: sqlite3.Connection) -> tuple[Any, Any, Any]:
    """The chain's head: the last row's id and entry_hash and the id sequence (no rows, or all cut: id 0
    and the genesis hash, the sequence alone tells the next id)."""
    last = conn.execute(_LAST).fetchone()
    if last is None:
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'ledger'").fetchone()
        last = (0, GENESIS, seq[0] if seq else 0)
    return last  # type: ignore[no-any-return]


class UnreadableHead(sqlite3.DatabaseError):
    """The chain's head (the last row's id and hash, the id sequence) holds a value no writer stores (the
    file was edited or damaged): nothing is appended after it; the batch stays queued and is retried, as
    for any failed write, until the file is repaired (`tollgate ledger verify` names the problem)."""


def _check_head(last: tuple[Any, Any, Any]) -> None:
    row_id, entry_hash_, seq = last
    if type(row_id) is not int or type(entry_hash_) is not str or len(entry_hash_) != 64 or not (
            seq is None or type(seq) is int):
        raise UnreadableHead(f"the ledger's last row or id sequence is damaged (id {row_id!r}, sequence "
                             f"{seq!r}; `tollgate ledger verify` names it): no row is appended after it")


def _chunks(rows: int) -> list[int]:
    """Rows per INSERT for a batch of `rows`: full chunks of _MAX_ROWS, then the rest in one. A
    connection thus compiles at most _MAX_ROWS distinct INSERTs, once each: its statement cache (128)
    keeps them, and a typical batch is one statement."""
    return [_MAX_ROWS] * (rows // _MAX_ROWS) + ([rows % _MAX_ROWS] if rows % _MAX_ROWS else [])


@cache  # at most _MAX_ROWS entries
def _insert_sql(rows: int) -> str:
    one = f"({', '.join('?' * _WIDTH)})"
    return f"INSERT INTO ledger ({', '.join(COLUMNS)}) VALUES {', '.join([one] * rows)}"


def _text(value: str) -> str:
    # A lone surrogate cannot be stored or hashed as UTF-8: replace it rather than poison a batch.
    # str.isascii() is O(1) in CPython, so the common case costs nothing.
    return value if value.isascii() else value.encode("utf-8", "replace").decode("utf-8")


def _check(entry: LedgerEntry) -> None:
    # One flat expression: this runs per step on the request path (a loop of getattr costs ~4x more).
    e, str_ = entry, str
    if (type(e.agent) is str_ and type(e.run_id) is str_ and type(e.operation) is str_
            and type(e.model) is str_ and type(e.input_hash) is str_ and type(e.decision) is str_
            and type(e.detail) is str_ and (e.reason is None or type(e.reason) is str_)
            and (type(e.ts) is float or type(e.ts) is int) and math.isfinite(e.ts)):
        return
    bad = [n for n in (*_TEXT, "reason") if type(getattr(e, n)) is not str and (n != "reason" or e.reason)]
    raise TypeError(f"LedgerEntry: text fields must be str, reason str or None, ts finite: {bad or 'ts'}")
