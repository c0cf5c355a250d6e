"""SQLite run store: the embedded default. Durable across restarts and `kill -9`.

Each operation is one `BEGIN IMMEDIATE` transaction (read the run, apply the pure transition, write it
back), so it is atomic even when several processes share the file. WAL with `synchronous=NORMAL`
survives a process crash; an operation costs tens of microseconds, so it runs on the event loop
instead of paying a thread hop. On open, reservations left by a crashed process are settled at their
reserved amount: the spend of a call whose answer was never seen is never counted as zero.
One gateway process per state file is the supported setup; several sidecars share Redis instead.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gateway.errors import StateUnavailable
from gateway.store import logic
from gateway.store.base import Add, Denial, Push, Reservation, ReserveRequest, RunState

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    updated_at REAL,
    state BLOB NOT NULL
)
"""
# Steps live in their own append-only table, so recording one is an INSERT instead of a rewrite of
# the run's state (which the hot path reads and writes several times per step).
_STEPS = (
    "CREATE TABLE IF NOT EXISTS steps (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, "
    "epoch INTEGER NOT NULL, data BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS steps_run ON steps (run_id, seq)",
)
_PRUNE_EVERY = 64


class SqliteRunStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._prefix = uuid.uuid4().hex[:8]
        self._seq = 0
        self._recorded = 0

    @classmethod
    def open(cls, path: str | Path) -> SqliteRunStore:
        try:
            conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.execute(_SCHEMA)
            for statement in _STEPS:
                conn.execute(statement)
        except sqlite3.Error as exc:
            raise StateUnavailable(f"cannot open state file {path}: {exc}") from None
        store = cls(conn)
        store._recover()
        return store

    def _recover(self) -> None:
        now = time.time()
        # `state` is a BLOB, and LIKE never matches a BLOB: compare its text.
        rows = self._conn.execute(
            "SELECT state FROM runs WHERE CAST(state AS TEXT) LIKE '%\"open\":{\"%'"
        ).fetchall()
        for (blob,) in rows:
            run_id = orjson.loads(blob)["run_id"]
            self._tx(run_id, "", lambda s: logic.recover(s, now), create=False)

    def _tx(self, run_id: str, agent: str, fn: Callable[[RunState], T], *, create: bool = True) -> T:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                if row is None:
                    state = RunState(run_id=run_id, agent=agent)
                else:
                    state = logic.from_dict(orjson.loads(row[0]))
                result = fn(state)
                state.steps = []  # kept in the steps table
                if row is not None or create:
                    conn.execute(
                        "INSERT OR REPLACE INTO runs (run_id, agent, updated_at, state) VALUES (?, ?, ?, ?)",
                        (run_id, state.agent, state.updated_at, orjson.dumps(logic.to_dict(state))),
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StateUnavailable(f"state store error: {exc}") from None
        return result

    def _next_id(self) -> str:
        self._seq += 1
        return f"{self._prefix}-{self._seq}"

    async def get(self, run_id: str, *, steps: bool = True) -> RunState | None:
        try:
            row = self._conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            state = logic.from_dict(orjson.loads(row[0]))
            if steps:
                state.steps = self._steps(run_id, state.epoch)
        except sqlite3.Error as exc:
            raise StateUnavailable(f"state store error: {exc}") from None
        return state

    def _steps(self, run_id: str, epoch: int) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT data FROM steps WHERE run_id = ? AND epoch = ? ORDER BY seq DESC LIMIT ?",
            (run_id, epoch, logic.MAX_STEPS),
        ).fetchall()
        return [orjson.loads(r[0]) for r in reversed(rows)]

    async def reserve(self, run_id: str, agent: str, request: ReserveRequest, now: float) -> Reservation | Denial:
        rid = self._next_id()
        return self._tx(run_id, agent, lambda s: logic.reserve(s, request, now, rid))

    async def settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
        self._tx(reservation.run_id, "", lambda s: logic.settle(s, reservation, actual, now), create=False)

    async def add(
        self, run_id: str, agent: str, counter: str, amount: float, *, limit: float | None, code: str, now: float
    ) -> Denial | None:
        return self._tx(run_id, agent, lambda s: logic.add(s, counter, amount, limit, code, now))

    async def push(self, run_id: str, agent: str, key: str, values: Sequence[str], keep: int) -> list[str]:
        return self._tx(run_id, agent, lambda s: logic.push(s, key, values, keep))

    async def apply(
        self, run_id: str, agent: str, adds: Sequence[Add], pushes: Sequence[Push], now: float
    ) -> Denial | None:
        if not adds and not pushes:
            return None
        return self._tx(run_id, agent, lambda s: logic.apply(s, adds, pushes, now))

    async def take(self, run_id: str, key: str, value: str) -> bool:
        return self._tx(run_id, "", lambda s: logic.take(s, key, value), create=False)

    async def stop(self, run_id: str, agent: str, reason: str, detail: str, now: float) -> None:
        self._tx(run_id, agent, lambda s: logic.stop(s, reason, detail, now))

    async def record_step(self, run_id: str, agent: str, step: Mapping[str, Any], now: float) -> None:
        """An INSERT and the run's activity time, without rewriting its state. `step["epoch"]`, when given,
        saves reading the run."""
        conn = self._conn
        try:
            epoch = step.get("epoch")
            if epoch is None:
                row = conn.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                if row is None:
                    self._tx(run_id, agent, lambda s: None)
                epoch = 1 if row is None else int(orjson.loads(row[0]).get("epoch", 1))
            conn.execute("BEGIN")  # one commit for the row and the run's activity time
            try:
                conn.execute("INSERT INTO steps (run_id, epoch, data) VALUES (?, ?, ?)",
                             (run_id, int(epoch), orjson.dumps(dict(step))))
                conn.execute("UPDATE runs SET updated_at = ? WHERE run_id = ?", (now, run_id))
                self._recorded += 1
                if self._recorded % _PRUNE_EVERY == 0:
                    conn.execute(
                        "DELETE FROM steps WHERE run_id = ? AND seq <= (SELECT seq FROM steps WHERE run_id = ? "
                        "ORDER BY seq DESC LIMIT 1 OFFSET ?)", (run_id, run_id, logic.MAX_STEPS)
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StateUnavailable(f"state store error: {exc}") from None

    async def reset(self, run_id: str, now: float) -> RunState | None:
        if await self.get(run_id, steps=False) is None:
            return None

        def _reset(state: RunState) -> RunState:
            logic.reset(state, now)
            return state

        return self._tx(run_id, "", _reset, create=False)

    async def list_runs(self, limit: int = 100) -> list[RunState]:
        try:
            rows = self._conn.execute(
                "SELECT state, updated_at FROM runs ORDER BY updated_at DESC LIMIT ?", (limit,)
            ).fetchall()
            runs = []
            for blob, updated in rows:
                state = logic.from_dict(orjson.loads(blob))
                state.updated_at = updated
                state.steps = self._steps(state.run_id, state.epoch)
                runs.append(state)
        except sqlite3.Error as exc:
            raise StateUnavailable(f"state store error: {exc}") from None
        return runs

    async def close(self) -> None:
        self._conn.close()
