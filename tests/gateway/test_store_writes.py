"""The run store's side-effecting tool calls (`claim_write`, `renew_write`, `finish_write`,
`release_write`) through every backend (memory, SQLite, Redis on a real redis-server): one claim wins
among concurrent callers (several Redis stores standing for several sidecars), a lapsed lease can be
taken over, results are recorded and bounded, a reset run starts empty; plus what only one backend
has (SQLite across a restart, Redis keys expiring with the run and apart from it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway.errors import StateUnavailable
from gateway.store.base import RunStore, WriteClaim
from gateway.store.redis import RedisRunStore
from gateway.store.sqlite import SqliteRunStore
from tests.gateway.test_store_backends import open_backend
from tests.redis_fixture import RedisServer, free_port, redis_server  # noqa: F401  (fixture)

NOW = 1_000.0
LEASE = 30.0
KEEP = 100
CLAIMED, RUNNING = WriteClaim("claimed"), WriteClaim("running")


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    s = open_backend(request.param, request, tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def claim(store: RunStore, token: str, *, key: str = "files/write_note:abc", epoch: int = 1,
                now: float = NOW, run_id: str = "run-1", keep: int = KEEP) -> WriteClaim:
    return await store.claim_write(run_id, "bot", epoch, key, token, lease_s=LEASE, keep=keep, now=now)


async def finish(store: RunStore, token: str, result: bytes | None, *, key: str = "files/write_note:abc",
                 epoch: int = 1, run_id: str = "run-1") -> None:
    await store.finish_write(run_id, "bot", epoch, key, token, result, keep=KEEP, now=NOW)


async def test_one_claim_holds_until_its_result_is_recorded_then_every_caller_gets_the_result(
    store: RunStore,
) -> None:
    assert await claim(store, "a") == CLAIMED
    assert await claim(store, "b") == RUNNING
    assert await claim(store, "a") == CLAIMED  # the holder asking again (an answer it lost) still holds it
    await finish(store, "a", b'{"result": 1}')
    assert await claim(store, "b") == WriteClaim("done", b'{"result": 1}')
    assert await claim(store, "a", now=NOW + 10 * LEASE) == WriteClaim("done", b'{"result": 1}')  # never lapses
    await finish(store, "b", b'{"result": 2}')  # a late second finisher: the first result stands
    assert await claim(store, "c") == WriteClaim("done", b'{"result": 1}')


async def test_a_call_that_ran_without_a_kept_result_stays_done(store: RunStore) -> None:
    assert await claim(store, "a") == CLAIMED
    await finish(store, "a", None)
    assert await claim(store, "b") == WriteClaim("done", None)
    await finish(store, "c", b"{}", key="never-claimed")  # recorded even when its claim was lost meanwhile
    assert await claim(store, "d", key="never-claimed") == WriteClaim("done", b"{}")


async def test_a_lapsed_claim_is_taken_over_and_its_former_holder_cannot_renew_or_release_it(
    store: RunStore,
) -> None:
    """A holder that crashed leaves its claim: the next caller after its lease may run the call."""
    assert await claim(store, "dead") == CLAIMED
    assert await claim(store, "b", now=NOW + LEASE - 1) == RUNNING
    assert await claim(store, "b", now=NOW + LEASE) == CLAIMED
    assert await claim(store, "c", now=NOW + LEASE + 1) == RUNNING  # b's own lease runs from its claim
    assert not await store.renew_write("run-1", 1, "files/write_note:abc", "dead", until=NOW + 99 * LEASE)
    await store.release_write("run-1", 1, "files/write_note:abc", "dead")
    assert await claim(store, "c", now=NOW + LEASE + 1) == RUNNING


async def test_renewal_extends_only_the_holders_claim_and_never_creates_one(store: RunStore) -> None:
    assert await claim(store, "a") == CLAIMED
    assert await store.renew_write("run-1", 1, "files/write_note:abc", "a", until=NOW + 3 * LEASE)
    assert await claim(store, "b", now=NOW + 2 * LEASE) == RUNNING  # the first lease alone would have lapsed
    assert not await store.renew_write("run-1", 1, "files/write_note:abc", "b", until=NOW + 9 * LEASE)
    assert not await store.renew_write("run-1", 1, "other-key", "a", until=NOW + 9 * LEASE)
    assert await claim(store, "b", key="other-key") == CLAIMED
    await finish(store, "a", b"{}")
    assert not await store.renew_write("run-1", 1, "files/write_note:abc", "a", until=NOW + 9 * LEASE)


async def test_a_released_claim_is_free_for_the_next_caller(store: RunStore) -> None:
    """The call did not run (refused, not approved, never sent): a retry runs it."""
    assert await claim(store, "a") == CLAIMED
    await store.release_write("run-1", 1, "files/write_note:abc", "b")  # not the holder: nothing happens
    assert await claim(store, "b") == RUNNING
    await store.release_write("run-1", 1, "files/write_note:abc", "a")
    assert await claim(store, "b") == CLAIMED
    await finish(store, "b", b"{}")
    await store.release_write("run-1", 1, "files/write_note:abc", "b")  # a done call stays done
    assert await claim(store, "c") == WriteClaim("done", b"{}")


async def test_concurrent_claims_of_one_call_have_exactly_one_winner(
    store: RunStore, request: pytest.FixtureRequest
) -> None:
    stores = [store]
    if isinstance(store, RedisRunStore):  # several processes: each its own store on the same keyspace
        stores += [RedisRunStore.open(request.getfixturevalue("redis_server").url, prefix=store._prefix)
                   for _ in range(3)]
    try:
        for round_ in range(5):
            key = f"files/write_note:{round_}"
            found = await asyncio.gather(*(claim(stores[i % len(stores)], f"t{i}", key=key) for i in range(24)))
            assert sorted(f.state for f in found) == ["claimed"] + ["running"] * 23
    finally:
        for extra in stores[1:]:
            await extra.close()


async def test_a_reset_run_starts_with_nothing_claimed_or_recorded(store: RunStore) -> None:
    await store.stop("run-1", "bot", "tool_call_cap", "cap", NOW)  # the run exists
    assert await claim(store, "a") == CLAIMED
    assert await claim(store, "a", key="done-key") == CLAIMED
    await finish(store, "a", b'{"old": true}', key="done-key")
    fresh = await store.reset("run-1", NOW + 1)
    assert fresh is not None and fresh.epoch == 2
    assert await claim(store, "b", epoch=2) == CLAIMED
    assert await claim(store, "b", epoch=2, key="done-key") == CLAIMED
    # a caller of the former epoch still in flight records nothing the new epoch sees
    await finish(store, "a", b'{"old": true}', key="late-key")
    assert await claim(store, "c", epoch=2, key="late-key") == CLAIMED


async def test_runs_keep_their_own_calls_and_at_most_keep_of_them(store: RunStore) -> None:
    assert await claim(store, "a") == CLAIMED
    assert await claim(store, "b", run_id="run-2") == CLAIMED  # another run: its own calls
    for n in range(5):
        assert await claim(store, "a", key=f"k{n}", run_id="run-3", keep=3) == CLAIMED
        await finish(store, "a", f'{{"n": {n}}}'.encode(), key=f"k{n}", run_id="run-3")
    assert await claim(store, "b", key="k4", run_id="run-3", keep=3) == WriteClaim("done", b'{"n": 4}')
    assert await claim(store, "b", key="k2", run_id="run-3", keep=3) == WriteClaim("done", b'{"n": 2}')
    assert await claim(store, "b", key="k0", run_id="run-3", keep=3) == CLAIMED  # the oldest were dropped


async def test_sqlite_keeps_recorded_results_and_claims_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteRunStore.open(path)
    try:
        assert await claim(first, "a") == CLAIMED
        await finish(first, "a", b'{"kept": 1}')
        assert await claim(first, "crashed", key="in-flight") == CLAIMED
    finally:
        await first.close()
    second = SqliteRunStore.open(path)
    try:
        assert await claim(second, "b") == WriteClaim("done", b'{"kept": 1}')
        assert await claim(second, "b", key="in-flight") == RUNNING  # its lease has not run out yet
        assert await claim(second, "b", key="in-flight", now=NOW + LEASE) == CLAIMED
    finally:
        await second.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:  # noqa: F811
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_redis_keeps_results_apart_from_the_run_and_expiring_with_it(
    redis_server: RedisServer, raw: Redis  # noqa: F811
) -> None:
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisRunStore.open(redis_server.url, prefix=prefix, ttl_s=50, idle_ttl_s=100)
    try:
        assert await claim(store, "a") == CLAIMED
        await finish(store, "a", b'{"big": "' + b"x" * 4000 + b'"}')
        fields = await raw.hgetall(f"{prefix}run:run-1")
        assert all(b"x" * 4000 not in value for value in fields.values())  # the hot path's read of the run stays small
        run_ttl = await raw.ttl(f"{prefix}run:run-1")
        assert 90 <= run_ttl <= 100
        for key in ("writes", "writeorder"):
            assert run_ttl - 2 <= await raw.ttl(f"{prefix}{key}:run-1") <= run_ttl
        # the run expired (as `run_ttl_s` makes a stopped one do) and a new one has the same id: it never
        # sees the calls of the former one, though their keys outlived it
        await raw.delete(f"{prefix}run:run-1")
        await store.record_step("run-1", "bot", {"n": 1}, NOW)
        assert await claim(store, "b") == CLAIMED
    finally:
        await store.close()


async def test_redis_results_live_as_long_as_their_run_whatever_writes_it_next(
    redis_server: RedisServer, raw: Redis  # noqa: F811
) -> None:
    """A run in use long after its last tool write keeps its recorded results: each write of the run
    (a step here) renews their expiry with the run's, so a repeat is still a replay, never a second run."""
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisRunStore.open(redis_server.url, prefix=prefix, ttl_s=50, idle_ttl_s=100)
    try:
        assert await claim(store, "a") == CLAIMED
        await finish(store, "a", b'{"ok": true}')
        for key in ("run", "writes", "writeorder"):
            await raw.expire(f"{prefix}{key}:run-1", 5)  # as if the last tool write were long ago
        await store.record_step("run-1", "bot", {"n": 1}, NOW)
        for key in ("run", "writes", "writeorder"):
            assert 90 <= await raw.ttl(f"{prefix}{key}:run-1") <= 100
    finally:
        await store.close()


async def test_redis_unreachable_fails_every_write_operation_with_state_unavailable() -> None:
    store = RedisRunStore.open(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(StateUnavailable):
            await claim(store, "a")
        with pytest.raises(StateUnavailable):
            await store.renew_write("run-1", 1, "k", "a", until=NOW)
        with pytest.raises(StateUnavailable):
            await finish(store, "a", b"{}")
        with pytest.raises(StateUnavailable):
            await store.release_write("run-1", 1, "k", "a")
    finally:
        await store.close()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_result_bodies_are_bounded_across_runs_the_oldest_losing_theirs_first(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs never leave these stores: past MAX_RESULT_BYTES of bodies, the oldest lose theirs but stay
    done (a repeat is refused, never run again)."""
    from gateway.store import sqlite_writes, writes

    monkeypatch.setattr(writes, "MAX_RESULT_BYTES", 1000)
    monkeypatch.setattr(sqlite_writes, "MAX_RESULT_BYTES", 1000)
    monkeypatch.setattr(writes.Bodies.__init__, "__defaults__", (1000,))
    s = open_backend(backend, request, tmp_path)
    try:
        for n in range(12):  # 12 x 100 bytes over two runs
            run_id, key = f"run-{n % 2}", f"files/write_note:{n}"
            assert await claim(s, "a", key=key, run_id=run_id) == CLAIMED
            await finish(s, "a", bytes([65 + n]) * 100, key=key, run_id=run_id)
        first = await claim(s, "b", key="files/write_note:0", run_id="run-0")
        last = await claim(s, "b", key="files/write_note:11", run_id="run-1")
        assert first == WriteClaim("done", None)  # done all the same: never run again
        assert last == WriteClaim("done", bytes([65 + 11]) * 100)
    finally:
        await s.close()
