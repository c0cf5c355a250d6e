"""In-process run store. Atomic because the event loop runs each operation without awaiting inside."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

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
from gateway.store.writes import Bodies, WriteBook, field


class MemoryRunStore:
    """Runs live as long as the process. Used for tests and throwaway sidecars."""

    def __init__(self) -> None:
        self._runs: dict[str, RunState] = {}
        self._writes: dict[str, WriteBook] = {}  # run id -> its side-effecting tool calls
        self._bodies = Bodies()  # their recorded results, bounded across runs
        self._ids = itertools.count(1)
        self._idle_swept: float | None = None

    def _run(self, run_id: str, agent: str) -> RunState:
        state = self._runs.get(run_id)
        if state is None:
            state = self._runs[run_id] = RunState(run_id=run_id, agent=agent)
        return state

    def _judged(self, run_id: str, agent: str, epoch: int | None) -> RunState:
        """The run a stop or effects judged on `epoch` change: RunReset, no run created, when a reset has
        ended that epoch (`logic.same_epoch`)."""
        state = self._runs.get(run_id)
        logic.same_epoch(state or RunState(run_id=run_id, agent=agent), epoch)
        return state if state is not None else self._run(run_id, agent)

    async def get(self, run_id: str, *, steps: bool = True, reservations: bool = True) -> RunState | None:
        state = self._runs.get(run_id)
        return None if state is None else logic.from_dict(logic.to_dict(state))

    async def reserve(self, run_id: str, agent: str, request: ReserveRequest, now: float) -> Reservation | Denial:
        return logic.reserve(self._run(run_id, agent), request, now, f"r{next(self._ids)}")

    async def settle(self, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
        state = self._runs.get(reservation.run_id)
        if state is not None:
            logic.settle(state, reservation, actual, now)

    async def add(
        self, run_id: str, agent: str, counter: str, amount: float, *, limit: float | None, code: str, now: float
    ) -> Denial | None:
        return logic.add(self._run(run_id, agent), counter, amount, limit, code, now)

    async def push(self, run_id: str, agent: str, key: str, values: Sequence[str], keep: int) -> list[str]:
        return logic.push(self._run(run_id, agent), key, values, keep)

    async def apply(
        self, run_id: str, agent: str, adds: Sequence[Add], pushes: Sequence[Push], now: float,
        *, in_flight: bool = False, epoch: int | None = None,
    ) -> Denial | None:
        return logic.apply(self._judged(run_id, agent, epoch), adds, pushes, now, in_flight=in_flight)

    async def take(self, run_id: str, key: str, value: str) -> bool:
        state = self._runs.get(run_id)
        return state is not None and logic.take(state, key, value)

    async def stop(
        self, run_id: str, agent: str, reason: str, detail: str, now: float, *, epoch: int | None = None
    ) -> Denial:
        return logic.stop(self._judged(run_id, agent, epoch), reason, detail, now)

    async def record_step(self, run_id: str, agent: str, step: Mapping[str, Any], now: float) -> int:
        return logic.record_step(self._run(run_id, agent), step, now)

    async def reset(self, run_id: str, now: float) -> RunState | None:
        state = self._runs.get(run_id)
        if state is None:
            return None
        before = logic.from_dict(logic.to_dict(state))
        ended = logic.reset(state, now)
        self._writes.pop(run_id, None)  # the new epoch names none of them: only their memory goes
        fresh = logic.from_dict(logic.to_dict(state))
        if ended is not None:
            fresh.ended = before, ended
        return fresh

    async def claim_root(
        self, run_id: str, epoch: int, *, final: bool, stopped: bool = False, upto: float | None = None,
        now: float,
    ) -> RootClaim | None:
        state = self._runs.get(run_id)
        if state is None:
            return None
        return logic.claim_root(state, epoch, final=final, stopped=stopped, upto=upto, now=now)

    async def list_runs(self, limit: int = 100) -> list[RunState]:
        runs = sorted(self._runs.values(), key=lambda r: r.updated_at or 0.0, reverse=True)[:limit]
        return [logic.from_dict(logic.to_dict(r)) for r in runs]

    async def runs_page(self, after: RunsCursor | None, limit: int) -> RunsPage:
        """`RunStore.runs_page`: the page's runs picked from every run without sorting them all (a
        process's runs, not a database's). str order is code point order, which is UTF-8 byte order."""
        entries = ((r.updated_at or 0.0, r.run_id) for r in self._runs.values())
        order = heapq.nsmallest(limit + 1, entries if after is None else (e for e in entries if e > after))
        chunk = order[:limit]
        runs = [logic.from_dict(logic.to_dict(self._runs[run_id])) for _, run_id in chunk]
        return RunsPage(runs, chunk[-1] if len(order) > limit else None)

    async def runs_updated(
        self, after: float, before: float, page: int = 1000
    ) -> AsyncIterator[list[RunState]]:
        window = sorted(
            (r.updated_at, r.run_id) for r in self._runs.values()
            if r.updated_at is not None and after < r.updated_at <= before
        )
        for start in range(0, len(window), page):
            chunk = (self._runs.get(run_id) for _, run_id in window[start:start + page])
            yield [logic.from_dict(logic.to_dict(r)) for r in chunk if r is not None]

    async def claim_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, *, lease_s: float, keep: int, now: float
    ) -> WriteClaim:
        self._run(run_id, agent)  # a run with calls to replay exists, as in the other backends
        book = self._writes.setdefault(run_id, WriteBook())
        return book.claim(field(epoch, key), token, now + lease_s, keep, now)

    async def renew_write(self, run_id: str, epoch: int, key: str, token: str, *, until: float) -> bool:
        book = self._writes.get(run_id)
        return book is not None and book.renew(field(epoch, key), token, until)

    async def finish_write(
        self, run_id: str, agent: str, epoch: int, key: str, token: str, result: bytes | None, *, keep: int,
        now: float,
    ) -> None:
        self._run(run_id, agent)
        recorded = self._writes.setdefault(run_id, WriteBook()).finish(field(epoch, key), token, result, keep)
        if recorded is not None:
            self._bodies.add(recorded)

    async def release_write(self, run_id: str, epoch: int, key: str, token: str) -> None:
        book = self._writes.get(run_id)
        if book is not None:
            book.release(field(epoch, key), token)

    async def idle_swept(self) -> float | None:
        return self._idle_swept

    async def set_idle_swept(self, upto: float) -> None:
        self._idle_swept = upto if self._idle_swept is None else max(self._idle_swept, upto)

    async def close(self) -> None:
        return None
