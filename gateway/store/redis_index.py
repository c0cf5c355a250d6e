"""Reading a Redis run store's runs through its `updated_at` index (`<prefix>runs`, a sorted set of run
ids by `updated_at`): the listings of `RunStore.list_runs`, `runs_page` and `runs_updated`. Read-only,
but for the ids of runs that expired, which are removed from the index on the way. Every call goes
through the store's guard (a connection slot, its deadline, any Redis failure a StateUnavailable).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Protocol, TypeVar, cast

from redis.asyncio import Redis

from gateway.store.base import RunsCursor, RunsPage, RunState
from gateway.store.redis_scripts import decode_hash

T = TypeVar("T")


class Guard(Protocol):
    def __call__(self, fn: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...


def run_key(prefix: str, run_id: str) -> str:
    """The hash of one run (fields in `redis_scripts`)."""
    return f"{prefix}run:{run_id}"


def steps_key(prefix: str, run_id: str) -> str:
    """The list of one run's steps."""
    return f"{prefix}steps:{run_id}"


class RunIndex:
    def __init__(self, client: Redis, prefix: str, guard: Guard) -> None:
        self._client = client
        self._prefix = prefix
        self._index = f"{prefix}runs"
        self._guard = guard

    async def list_runs(self, limit: int = 100) -> list[RunState]:
        """Most recently updated first. Not atomic across runs (each run is read whole); ids of runs that
        expired are removed from the index on the way."""
        runs: list[RunState] = []
        start = 0
        while len(runs) < limit:
            last = start + limit - len(runs) - 1
            ids = cast(
                list[bytes], await self._guard(partial(self._client.zrevrange, self._index, start, last))
            )
            if not ids:
                break
            found = await self._read_runs(ids)
            runs.extend(found)
            start += len(found)
        return runs[:limit]

    async def runs_page(self, after: RunsCursor | None, limit: int) -> RunsPage:
        """`RunStore.runs_page`, from the `updated_at` index, whose members of equal score Redis orders by
        their bytes: the listing order itself. The members of the cursor's score are read whole (one
        MULTI with the page's later scores, so the two reads are one snapshot of the index): the page goes
        on after the cursor's run id among them, and nothing is skipped when the cursor's own run was
        updated or expired since."""
        if after is None:
            entries = cast(list[tuple[bytes, float]], await self._guard(partial(
                self._client.zrangebyscore, self._index, "-inf", "+inf", 0, limit + 1, withscores=True)))
        else:
            at, last = repr(float(after[0])), after[1].encode()
            pipe = self._client.pipeline(transaction=True)
            pipe.zrangebyscore(self._index, at, at, withscores=True)
            pipe.zrangebyscore(self._index, f"({at}", "+inf", start=0, num=limit + 1, withscores=True)
            tied, later = await self._guard(pipe.execute)
            entries = [e for e in tied if e[0] > last][:limit + 1] + later
        listed = entries[:limit]
        runs = await self._read_runs([run_id for run_id, _ in listed])
        more = len(entries) > limit
        return RunsPage(runs, (float(listed[-1][1]), listed[-1][0].decode()) if more else None)

    async def runs_updated(
        self, after: float, before: float, page: int = 1000
    ) -> AsyncIterator[list[RunState]]:
        """`RunStore.runs_updated`, from the `updated_at` index. A page that ends inside a run of equal
        scores takes every member of that score, so the next page starts strictly after it: no run is
        skipped when others of its score are updated or expire while paging."""
        low, high = f"({after!r}", repr(before)
        while True:
            entries = cast(list[tuple[bytes, float]], await self._guard(partial(
                self._client.zrangebyscore, self._index, low, high, start=0, num=page, withscores=True)))
            if not entries:
                return
            score = entries[-1][1]
            listed = entries
            if len(entries) == page:  # the page may have cut the members of its last score
                tied = cast(list[tuple[bytes, float]], await self._guard(partial(
                    self._client.zrangebyscore, self._index, repr(score), repr(score), withscores=True)))
                listed = [e for e in entries if e[1] < score] + tied
            runs = await self._read_runs([run_id for run_id, _ in listed])
            if runs:
                yield runs
            if len(entries) < page:
                return
            low = f"({score!r}"

    async def _read_runs(self, ids: list[bytes]) -> list[RunState]:
        """The runs `ids` names with their steps, in that order; ids of runs that expired are removed
        from the index."""
        pipe = self._client.pipeline(transaction=False)
        for run_id in ids:
            pipe.hgetall(run_key(self._prefix, run_id.decode()))
            pipe.lrange(steps_key(self._prefix, run_id.decode()), 0, -1)
        replies = await self._guard(pipe.execute)
        rows = list(zip(replies[::2], replies[1::2], strict=True))
        gone = [run_id for run_id, (fields, _) in zip(ids, rows, strict=True) if not fields]
        if gone:
            await self._guard(partial(self._client.zrem, self._index, *gone))
        return [decode_hash(fields, items) for fields, items in rows if fields]
