"""The Redis run store under operational faults, piece by piece, on a real redis-server: connections
Redis closed while idle, writes that fail, replies lost after a command ran, settles replayed with no
traffic, releases that reach Redis before their reserve, runs Redis lost mid-call, and the warning about
a Redis that would lose runs. (`test_redis_fault_probe` drives the same faults through a gateway.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.errors import StateUnavailable
from gateway.store.base import Claim, Reservation, ReserveRequest
from gateway.store.redis import TOMBSTONE_MIN_S, RedisRunStore
from gateway.store.redis_index import run_key, steps_key
from gateway.store.redis_link import Granted, closed_by_peer
from tests.redis_fixture import RedisServer, own_redis, redis_server, start_server  # noqa: F401  (fixtures)

NOW = 1_000.0
CALL = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"), Claim("llm_calls", 1.0)), 16, 250)


def fresh(url: str, **kwargs: Any) -> RedisRunStore:
    return RedisRunStore.open(url, prefix=f"t-{uuid.uuid4().hex}:", **kwargs)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:  # noqa: F811
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def until(check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll `check` until it holds (for what this process cannot await: a FIN arriving)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def pooled(store: RedisRunStore) -> list[Any]:
    return list(store._client.connection_pool._available_connections)  # type: ignore[attr-defined]


async def grant(store: RedisRunStore, run_id: str = "r") -> Reservation:
    result = await store.reserve(run_id, "bot", CALL, NOW)
    assert isinstance(result, Reservation), result
    return result


# -- connections ---------------------------------------------------------------------------------------


async def test_connections_redis_closed_while_idle_are_replaced_before_a_command(
    redis_server: RedisServer, raw: Redis  # noqa: F811
) -> None:
    store = fresh(redis_server.url)
    try:
        await asyncio.gather(*(grant(store, f"r{i}") for i in range(4)))  # several pooled connections
        assert len(pooled(store)) > 1
        await raw.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await until(lambda: all(closed_by_peer(c._reader) for c in pooled(store)))
        for i in range(len(pooled(store))):  # every dead connection is met once
            await grant(store, f"r{i}")
    finally:
        await store.close()


async def test_a_failed_write_is_made_again_on_a_new_connection(redis_server: RedisServer) -> None:  # noqa: F811
    """The socket breaks under the write (an RST that arrived as it was written): Redis ran nothing, so
    the command goes once more, on a new connection."""
    store = fresh(redis_server.url)
    try:
        await store.get("r")
        conn = pooled(store)[0]
        real = conn._send_packed_command

        async def broken(command: Any) -> None:
            conn._send_packed_command = real
            raise ConnectionResetError(104, "Connection reset by peer")

        conn._send_packed_command = broken
        await grant(store)
        state = await store.get("r")
        assert state is not None and len(state.open) == 1
    finally:
        await store.close()


class CutAfterWrite:
    """A TCP proxy to Redis that, once armed, forwards a client's next bytes and then closes that client's
    connection without a reply: the command ran, its answer is lost."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.armed = False
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target)

        async def down() -> None:
            while data := await sreader.read(65536):
                cwriter.write(data)
                await cwriter.drain()

        task = asyncio.create_task(down())
        self.tasks.add(task)
        try:
            while data := await creader.read(65536):
                cut = self.armed
                self.armed = False
                if cut:
                    task.cancel()  # its reply goes nowhere
                    await asyncio.gather(task, return_exceptions=True)
                swriter.write(data)
                await swriter.drain()
                if cut:
                    assert await sreader.read(65536)  # Redis ran it and answered
                    break
        finally:
            cwriter.close()
            swriter.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_a_command_that_reached_redis_is_never_sent_twice(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    proxy = CutAfterWrite(redis_server.port)
    store = fresh(await proxy.start())
    try:
        await store.add("r", "bot", "llm_calls", 1.0, limit=None, code="", now=NOW)
        proxy.armed = True
        with pytest.raises(StateUnavailable, match="Connection closed by server"):
            await store.add("r", "bot", "llm_calls", 1.0, limit=None, code="", now=NOW)
        state = await store.get("r")
        assert state is not None and state.used["llm_calls"] == 2.0  # ran once, never re-sent
    finally:
        await store.close()
        await proxy.close()


# -- settles replayed without traffic; releases before their reserve ---------------------------------


async def test_settles_are_replayed_in_the_background_with_no_traffic(tmp_path: Path) -> None:
    server = start_server(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    store = RedisRunStore.open(server.url)
    try:
        first = await grant(store)
        server.stop(kill=True)
        with pytest.raises(StateUnavailable):
            await store.settle(first, {"usd": 0.0005, "llm_calls": 1.0}, NOW)
        with pytest.raises(StateUnavailable):
            await store.reserve("r", "bot", CALL, NOW)  # its answer may be lost: released later
        assert store.unsettled == 2
        server.start()
        async with asyncio.timeout(10):
            assert await store.replayed() == 0  # no call on the store: the background replay did it
        state = await store.get("r")
        assert state is not None and state.open == {} and state.used == {"usd": 0.0005, "llm_calls": 1.0}
    finally:
        await store.close()
        server.stop()


async def test_close_ends_the_background_replay(own_redis: RedisServer) -> None:  # noqa: F811
    store = RedisRunStore.open(own_redis.url)
    first = await grant(store)
    own_redis.stop(kill=True)
    with pytest.raises(StateUnavailable):
        await store.settle(first, {"usd": 0.0005}, NOW)
    replayer = store._replayer
    assert replayer is not None and not replayer.done()
    await store.close()
    assert replayer.done() and store.unsettled == 1


async def test_a_release_that_found_nothing_bars_its_late_reserve(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    store = fresh(redis_server.url, lease_s=7200)
    try:
        release = [None, "late-1", NOW, [], 7200, None]
        assert await store._eval("settle", "r", "", release) == 0
        reserve = [NOW, "late-1", 16, 250, [["usd", 0.001, 4e-6, 0.02, "budget_exhausted"]], None, NOW - 7200]
        with pytest.raises(ResponseError, match="RELEASED reservation late-1"):
            await store._eval("reserve", "r", "bot", reserve)
        assert await store.get("r") is None  # the refused reserve created nothing
        assert await raw.ttl(f"{store._prefix}released:r") >= 7200 > TOMBSTONE_MIN_S
        await grant(store)  # other ids reserve as before
    finally:
        await store.close()


async def test_a_reserve_whose_answer_was_lost_is_released_and_stays_released(
    redis_server: RedisServer  # noqa: F811
) -> None:
    """The store's own path: the reserve fails (here: before it is sent), its release is replayed
    first and leaves a tombstone, and the same id can never be granted after."""
    store = fresh(redis_server.url)
    try:
        await store.get("r")
        conn = pooled(store)[0]

        real = conn._send_packed_command

        async def lost(command: Any) -> None:
            conn._send_packed_command = real
            raise TimeoutError  # redis-py: "Timeout writing to socket", never written again

        conn._send_packed_command = lost
        with pytest.raises(StateUnavailable):
            await store.reserve("r", "bot", CALL, NOW)
        (rid,) = list(store._unsettled)
        async with asyncio.timeout(5):
            assert await store.replayed() == 0
        late = [NOW, rid, 16, 250, [["usd", 0.001, 4e-6, 0.02, "budget_exhausted"]], None, NOW - 3600]
        with pytest.raises(ResponseError, match="RELEASED"):
            await store._eval("reserve", "r", "bot", late)
        assert await store.get("r") is None  # nothing reserved, nothing held, no run made
    finally:
        await store.close()


# -- a run Redis lost while a step was in flight ---------------------------------------------------


async def test_a_settle_charges_a_run_redis_lost_meanwhile(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    store = fresh(redis_server.url)
    try:
        granted = await grant(store)
        assert isinstance(granted, Granted) and granted.agent == "bot"
        await raw.delete(run_key(store._prefix, "r"), steps_key(store._prefix, "r"))  # FLUSHALL, a restart without its data
        await store.settle(granted, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 1)
        state = await store.get("r")
        assert state is not None and state.agent == "bot" and state.epoch == 1
        assert state.used == {"usd": 0.0005, "llm_calls": 1.0} and state.open == {}
        await store.settle(Reservation("x", "other", 1, 0, {"usd": 1.0}), {"usd": 1.0}, NOW)
        assert await store.get("other") is None  # a reservation no store here granted names no known run
    finally:
        await store.close()


# -- the durability warning --------------------------------------------------------------------------


async def warnings_of(url: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    store = RedisRunStore.open(url)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.store.redis"):
            await grant(store)
            await store.get("r")
    finally:
        await store.close()
    return [r.getMessage() for r in caplog.records if r.name == "gateway.store.redis"]


async def test_a_settle_is_charged_once_whatever_came_first(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    """Every settled, released or expired id is remembered: a settle replayed after its reply was lost,
    or one arriving after its lease charged the reservation in full, charges nothing again, also when
    Redis lost the run meanwhile (the run is only charged afresh for steps that never settled)."""
    store = fresh(redis_server.url, lease_s=60)
    try:
        done = await grant(store)
        await store.settle(done, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 1)
        await store.settle(done, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 2)  # a replay: nothing again
        old = await grant(store)
        late = await store.reserve("r", "bot", CALL, NOW + 100)  # past old's lease: old charged in full
        assert isinstance(late, Reservation)
        await store.settle(old, {"usd": 0.0001, "llm_calls": 1.0}, NOW + 101)  # its own settle, too late
        held = (await store.get("r")).used  # type: ignore[union-attr]
        await raw.delete(run_key(store._prefix, "r"))  # Redis loses the run
        await store.settle(done, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 102)  # settled before: nothing
        await store.settle(late, {"usd": 0.0002, "llm_calls": 1.0}, NOW + 103)  # in flight: charged afresh
        state = await store.get("r")
        assert state is not None
        assert held["usd"] == pytest.approx(0.0005 + CALL.claims[0].fixed + 250 * CALL.claims[0].per_unit)
        assert state.used == pytest.approx({"usd": 0.0002, "llm_calls": 1.0})
    finally:
        await store.close()


async def test_the_warning_names_what_would_lose_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cases: list[tuple[tuple[str, ...], str | None]] = [
        (("--appendonly", "yes", "--appendfsync", "everysec"), None),
        (("--appendonly", "yes", "--appendfsync", "no"), "appendfsync no"),
        (("--save", "900 1"), "RDB snapshots only (save '900 1')"),
        (("--appendonly", "yes", "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"),
         "maxmemory-policy allkeys-lru"),
        (("--appendonly", "yes", "--maxmemory-policy", "allkeys-lru"), None),  # no limit: nothing is evicted
        (("--user", "default", "on", "nopass", "~*", "&*", "+@all", "-config"), None),  # CONFIG refused
    ]
    for i, (extra, expected) in enumerate(cases):
        server = start_server(tmp_path / f"redis-{i}", *extra)
        try:
            found = await warnings_of(server.url, caplog)
        finally:
            server.stop()
        if expected is None:
            assert found == [], (extra, found)
        else:
            assert len(found) == 1 and expected in found[0], (extra, found)


async def test_a_check_cut_short_is_made_again(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    store = RedisRunStore.open(own_redis.url)
    own_redis.stop(kill=True)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.store.redis"):
            with pytest.raises(StateUnavailable):
                await store.get("r")
            own_redis.start()
            await store.get("r")
            await store.get("r")
        assert [r.name for r in caplog.records].count("gateway.store.redis") == 1
    finally:
        await store.close()


# -- callers cancelled mid-call (a client that left cancels its handler: aiohttp handler_cancellation) ---


async def test_a_settle_cancelled_in_flight_is_still_settled(redis_server: RedisServer) -> None:  # noqa: F811
    """Found by a four-gateway acceptance run: a stream's client that closes at `[DONE]` cancels the
    handler while its settle is on the wire; the settle was lost (not kept for replay) and its
    reservation held the shared budget until the lease. Cancelled at each point of its way (redis-py
    finishes some of them anyway): every one is settled, once."""
    store = fresh(redis_server.url)
    try:
        for turns in range(1, 8):
            reservation = await grant(store)
            task = asyncio.create_task(store.settle(reservation, {"usd": 0.0005, "llm_calls": 1.0}, NOW))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # queued for a connection slot (a burst of steps): cancelled before a byte of it is written
        reservation = await grant(store)
        slots = store._slots
        taken = slots._value  # type: ignore[attr-defined]
        for _ in range(taken):  # every slot taken
            await slots.acquire()
        task = asyncio.create_task(store.settle(reservation, {"usd": 0.0005, "llm_calls": 1.0}, NOW))
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(taken):
            slots.release()
        async with asyncio.timeout(10):
            assert await store.replayed() == 0
        state = await store.get("r")
        assert state is not None and state.open == {} and state.reserved.get("usd", 0.0) == 0.0
        assert state.used == {"usd": pytest.approx(8 * 0.0005), "llm_calls": 8.0}
    finally:
        await store.close()


async def test_a_reserve_cancelled_in_flight_holds_nothing(redis_server: RedisServer) -> None:  # noqa: F811
    """A reserve whose caller was cancelled may have run in Redis, its answer never read: it is released
    (one redis-py finished anyway is settled here, as its caller would)."""
    store = fresh(redis_server.url)
    try:
        for turns in range(1, 8):
            task = asyncio.create_task(store.reserve("r", "bot", CALL, NOW))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                granted = await task
                assert isinstance(granted, Reservation)
                await store.settle(granted, {}, NOW)
        async with asyncio.timeout(10):
            assert await store.replayed() == 0
        state = await store.get("r")
        assert state is None or (state.open == {} and state.reserved.get("usd", 0.0) == 0.0)
    finally:
        await store.close()
