"""The Redis run store on a real redis-server: exact agreement with the pure logic (bit for bit), expiry
of finished runs, fail-closed behaviour when Redis dies or hangs, and recovery when it is back."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.errors import StateUnavailable
from gateway.store import logic
from gateway.store.base import Add, Claim, Denial, Push, Reservation, ReserveRequest, RunStore
from gateway.store.memory import MemoryRunStore
from gateway.store.redis import RedisRunStore
from gateway.store.redis_index import run_key
from tests.redis_fixture import RedisServer, own_redis, redis_server, start_server  # noqa: F401  (fixtures)

NOW = 1_000.0
CALL = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"), Claim("llm_calls", 1.0)), 16, 250)


def fresh(server: RedisServer, **kwargs: Any) -> RedisRunStore:
    return RedisRunStore.open(server.url, prefix=f"t-{uuid.uuid4().hex}:", **kwargs)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:  # noqa: F811
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


# -- exact agreement with logic ----------------------------------------------------------------------

LIMITS = [None, 0.02, 0.3, 0.1 + 0.2, 1.0, 1 / 3, 0.02 + 5e-10, 0.02 - 5e-10, 3.0, 10.0]


def random_request(r: random.Random) -> ReserveRequest:
    claims = []
    if r.random() < 0.8:
        claims.append(
            Claim(
                "usd",
                r.choice([0.001, 0.1, 1 / 3, 0.0, 0.002]),
                r.choice([0.0, 4e-6, 1e-7, 1 / 7]),
                r.choice(LIMITS),
                r.choice(["budget_exhausted", ""]),
            )
        )
    if r.random() < 0.5:
        claims.append(
            Claim(
                "tokens",
                float(r.randint(0, 400)),
                r.choice([0.0, 1.0]),
                r.choice([None, 1000.0, 2500.0]),
                "token_budget_exhausted",
            )
        )
    if r.random() < 0.5:
        claims.append(
            Claim("llm_calls", 1.0, 0.0, r.choice([None, 4.0, 6.0]), r.choice(["llm_call_cap", ""]))
        )
    max_units = r.choice([0, 16, 250, 1000])
    return ReserveRequest(tuple(claims), min(16, max_units), max_units)


async def apply(store: RunStore, op: tuple[Any, ...], grants: list[Reservation | None]) -> Any:
    """One operation; reservations are recorded by position so both stores settle the same one."""
    kind, run, now = op[0], op[1], op[2]
    if kind == "reserve":
        result = await store.reserve(run, "bot", op[3], now)
        grants.append(result if isinstance(result, Reservation) else None)
        if isinstance(result, Reservation):
            return ("ok", result.epoch, result.units, result.amounts)
        return result
    if kind == "settle":
        grant = grants[op[3]] if op[3] < len(grants) else None
        if grant is not None:
            actual = dict(grant.amounts) if op[4] is None else op[4]
            await store.settle(grant, actual, now)
        return None
    if kind == "add":
        return await store.add(run, "bot", op[3], op[4], limit=op[5], code=op[6], now=now)
    if kind == "push":
        return await store.push(run, "bot", op[3], op[4], op[5])
    if kind == "take":
        return await store.take(run, op[3], op[4])
    if kind == "stop":
        return await store.stop(run, "bot", op[3], op[4], now)
    if kind == "step":
        step = {"n": op[3], "x": 0.1 * op[3]} if op[4] is None else {"n": op[3], "epoch": op[4]}
        return await store.record_step(run, "bot", step, now)  # a step of an ended epoch is left out
    if kind == "apply":
        return await store.apply(run, "bot", op[3], op[4], now, in_flight=op[5])
    if kind == "get":
        state = await store.get(run, steps=False)
        return (
            None if state is None else (logic.to_dict(state)["used"], state.status)
        )  # steps may be left out
    state = await store.reset(run, now)
    return None if state is None else logic.to_dict(state)["epoch"]


def random_ops(r: random.Random, count: int) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    now = NOW
    reserves = 0
    for _ in range(count):
        now += r.choice([0.0, 0.001, 1 / 3, 2.5])
        run = r.choice(["a", "b"])
        roll = r.random()
        if roll < 0.35:
            ops.append(("reserve", run, now, random_request(r)))
            reserves += 1
        elif roll < 0.6 and reserves:
            actual = r.choice(
                [
                    None,
                    {},
                    {
                        "usd": r.choice([0.0005, 0.1, 1 / 9]),
                        "llm_calls": 1.0,
                        "output_tokens": float(r.randint(0, 300)),
                    },
                ]
            )
            ops.append(("settle", run, now, r.randrange(reserves), actual))
        elif roll < 0.7:
            ops.append(
                (
                    "add",
                    run,
                    now,
                    r.choice(["tool_calls", "usd"]),
                    r.choice([1.0, 0.1, 0.2]),
                    r.choice([None, None, 30.0, 0.3]),
                    r.choice(["tool_call_cap", ""]),
                )
            )
        elif roll < 0.8:
            ops.append(
                (
                    "push",
                    run,
                    now,
                    r.choice(["calls", "proposed"]),
                    [r.choice(["x", "y", 'é/"\\', ""]) for _ in range(r.randint(0, 3))],
                    r.choice([0, 2, 6]),
                )
            )
        elif roll < 0.84:
            ops.append(("take", run, now, r.choice(["calls", "proposed", "none"]), r.choice(["x", "y"])))
        elif roll < 0.87:
            adds = [
                Add(
                    r.choice(["tool_calls", "usd", "llm_calls"]),
                    r.choice([1.0, 0.1, 0.2]),
                    r.choice([None, 30.0, 0.3, 5.0]),
                    r.choice(["tool_call_cap", ""]),
                )
                for _ in range(r.randint(0, 2))
            ]
            pushes = [
                Push(
                    r.choice(["calls", "tools"]),
                    tuple(r.choice(["x", "z"]) for _ in range(r.randint(0, 2))),
                    r.choice([1, 6]),
                    *r.choice([(), (1, "loop_detected", "a loop")]),
                )
                for _ in range(r.randint(0 if adds else 1, 2))
            ]
            ops.append(("apply", run, now, adds, pushes, r.random() < 0.5))
        elif roll < 0.88:
            ops.append(("get", run, now))
        elif roll < 0.93:
            ops.append(("step", run, now, r.randint(0, 10**6), r.choice([None, None, 1, 2, 3])))
        elif roll < 0.94:
            ops.append(("stop", run, now, r.choice(["loop_detected", "time_cap", ""]), r.choice(["why", ""])))
        else:
            ops.append(("reset", run, now))
    return ops


def comparable(state: Any, ids: dict[str, int]) -> dict[str, Any]:
    data = logic.to_dict(state)
    data["open"] = {ids[rid]: held for rid, held in data["open"].items()}
    return data


@pytest.mark.parametrize("seed", range(8))
async def test_redis_reproduces_logic_bit_for_bit(redis_server: RedisServer, seed: int) -> None:  # noqa: F811
    """Random operation sequences near the limits (EPS edges, 0.1 + 0.2, 1/3, stops, resets, stale
    settles): every result and the final runs equal the memory store's exactly, floats included."""
    ops = random_ops(random.Random(seed), 400)
    memory, redis = MemoryRunStore(), fresh(redis_server)
    mem_grants: list[Reservation | None] = []
    red_grants: list[Reservation | None] = []
    try:
        for op in ops:
            expected = await apply(memory, op, mem_grants)
            got = await apply(redis, op, red_grants)
            assert got == expected, op
        for run in ("a", "b"):
            mem, red = await memory.get(run), await redis.get(run)
            assert (mem is None) == (red is None)
            if mem is None or red is None:
                continue
            mem_ids = {g.id: i for i, g in enumerate(mem_grants) if g is not None}
            red_ids = {g.id: i for i, g in enumerate(red_grants) if g is not None}
            assert comparable(red, red_ids) == comparable(mem, mem_ids)
        listed = await redis.list_runs()
        assert {r.run_id for r in listed} == {r.run_id for r in await memory.list_runs()}
        assert [r.updated_at or 0.0 for r in listed] == sorted(
            (r.updated_at or 0.0 for r in listed), reverse=True
        )
    finally:
        await redis.close()


async def test_floats_survive_exactly(redis_server: RedisServer) -> None:  # noqa: F811
    """Redis' cjson would write 0.1 + 0.2 as 0.3 (14 digits); the store keeps every bit."""
    store = fresh(redis_server)
    try:
        await store.add("r", "bot", "usd", 0.1, limit=None, code="", now=1_700_000_000.123456)
        await store.add("r", "bot", "usd", 0.2, limit=None, code="", now=1_700_000_000.123456)
        state = await store.get("r")
        assert state is not None
        assert state.used["usd"] == 0.1 + 0.2 and state.updated_at == 1_700_000_000.123456
    finally:
        await store.close()


async def test_four_stores_hold_one_limit(redis_server: RedisServer) -> None:  # noqa: F811
    """Four stores (four connection pools, as four processes would have) reserving at once: exactly 10."""
    prefix = f"t-{uuid.uuid4().hex}:"
    # an atomicity test, not a latency one: 400 calls queue for 4 x 32 connections opened at once, which
    # in a loaded full-suite run took over the 2 s deadline (twice in fresh clones; 0.3 s when alone)
    stores = [RedisRunStore.open(redis_server.url, prefix=prefix, connect_timeout_s=5, op_timeout_s=15)
              for _ in range(4)]
    request = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"),), 16, 250)
    try:
        results = await asyncio.gather(
            *(stores[i % 4].reserve("run", "bot", request, NOW) for i in range(400))
        )
        grants = [r for r in results if isinstance(r, Reservation)]
        assert len(grants) == 10 and len({g.id for g in grants}) == 10
        assert {r.reason for r in results if isinstance(r, Denial)} == {"budget_exhausted"}
        await asyncio.gather(*(stores[i % 4].settle(g, g.amounts, NOW) for i, g in enumerate(grants)))
        state = await stores[0].get("run")
        assert state is not None and state.open == {} and state.reserved["usd"] == 0.0
        assert state.used["usd"] <= 0.02 + logic.EPS
    finally:
        for store in stores:
            await store.close()


async def test_a_dead_processes_reservation_is_charged_once_its_lease_runs_out(
        redis_server: RedisServer) -> None:  # noqa: F811
    """Process A reserves and dies (never settles). Within the lease B is refused as held; after it, B's
    reserve charges A's reservation in full (as SQLite's recovery does) and goes on: never held forever."""
    prefix = f"t-{uuid.uuid4().hex}:"
    dead, alive = (RedisRunStore.open(redis_server.url, prefix=prefix, lease_s=60) for _ in range(2))
    request = ReserveRequest((Claim("tokens", 100.0, 1.0, 1000.0, "token_budget_exhausted"),), 16, 500)
    try:
        first = await dead.reserve("run", "bot", request, NOW)
        assert isinstance(first, Reservation) and first.units == 500
        held = await alive.reserve("run", "bot", request, NOW + 59)
        assert isinstance(held, Reservation) and held.units == 300  # 600 of 1000 held by the dead one
        await alive.settle(held, {"tokens": 150.0}, NOW + 59)
        later = await alive.reserve("run", "bot", request, NOW + 61)
        assert isinstance(later, Reservation) and later.units == 150  # 1000 - 600 charged - 150 used - 100
        state = await alive.get("run")
        assert state is not None and state.used["tokens"] == 750.0 and first.id not in state.open
        assert (state.used["output_tokens"], state.used["input_tokens"]) == (500.0, 100.0)  # as logic.charged
        assert state.used["unreported_usage"] == 1.0  # no provider's count: the run's root says "charged"
        assert state.reserved["tokens"] == 250.0 and list(state.open) == [later.id]
        await dead.settle(first, {"tokens": 10.0}, NOW + 62)  # a late settle of the expired one: no-op
        assert (await alive.get("run")).used["tokens"] == 750.0  # type: ignore[union-attr]
    finally:
        await dead.close()
        await alive.close()


async def test_a_dead_processes_reservation_of_several_choices_charges_every_choices_output(
        redis_server: RedisServer) -> None:  # noqa: F811
    """`n` = 3 (3 tokens per output unit): the lease charges 3 x 200 output tokens, as logic.charged."""
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisRunStore.open(redis_server.url, prefix=prefix, lease_s=60)
    request = ReserveRequest((Claim("tokens", 100.0, 3.0, 10_000.0, "token_budget_exhausted"),), 16, 200)
    try:
        assert isinstance(await store.reserve("run", "bot", request, NOW), Reservation)
        assert isinstance(await store.reserve("run", "bot", request, NOW + 61), Reservation)  # expires the first
        state = await store.get("run")
        assert state is not None
        assert (state.used["output_tokens"], state.used["input_tokens"]) == (600.0, 100.0)
    finally:
        await store.close()


# -- expiry ------------------------------------------------------------------------------------------


async def test_stopped_runs_expire_and_active_ones_do_not(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    store = fresh(redis_server, ttl_s=1, idle_ttl_s=3600)
    key = partial(run_key, store._prefix)  # the layout is part of what this test checks
    try:
        await store.reserve("done", "bot", CALL, NOW)
        await store.reserve("busy", "bot", CALL, NOW)
        assert 3000 < await raw.ttl(key("busy")) <= 3600  # an active run: the idle TTL, refreshed by use
        await store.stop("done", "bot", "time_cap", "too long", NOW + 1)
        assert 0 < await raw.pttl(key("done")) <= 1000
        await asyncio.sleep(1.3)
        assert await store.get("done") is None
        assert [r.run_id for r in await store.list_runs()] == ["busy"]
        assert await raw.zscore(f"{store._prefix}runs", "done") is None  # pruned from the index
        assert (await store.get("busy")) is not None
        reset = await store.reset("busy", NOW + 2)
        assert reset is not None and reset.epoch == 2 and 3000 < await raw.ttl(key("busy"))
    finally:
        await store.close()


async def test_activity_refreshes_a_stopped_runs_ttl(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    store = fresh(redis_server, ttl_s=2, idle_ttl_s=0)
    try:
        await store.push("r", "bot", "calls", ["a"], 6)
        assert await raw.ttl(run_key(store._prefix, "r")) == -1  # idle_ttl_s=0: active runs never expire
        await store.stop("r", "bot", "loop_detected", "x", NOW)
        await asyncio.sleep(1.2)
        await store.record_step("r", "bot", {"k": 1}, NOW + 1)  # the step of the stopping call
        assert await raw.pttl(run_key(store._prefix, "r")) > 1500
    finally:
        await store.close()


# -- Redis down, hung, back --------------------------------------------------------------------------


async def expect_unavailable(store: RedisRunStore, within: float = 3.0) -> None:
    ops = [
        store.get("r"),
        store.reserve("r", "bot", CALL, NOW),
        store.settle(Reservation("x-1", "r", 1, 0, {"usd": 0.1}), {"usd": 0.1}, NOW),
        store.add("r", "bot", "tool_calls", 1.0, limit=5.0, code="tool_call_cap", now=NOW),
        store.push("r", "bot", "calls", ["a"], 6),
        store.take("r", "calls", "a"),
        store.stop("r", "bot", "x", "y", NOW),
        store.record_step("r", "bot", {}, NOW),
        store.reset("r", NOW),
        store.list_runs(),
    ]
    for op in ops:
        started = time.monotonic()
        with pytest.raises(StateUnavailable, match=r"run state store \(redis at 127.0.0.1:\d+\) unavailable"):
            await op
        assert time.monotonic() - started < within


async def test_redis_killed_fails_closed_fast_then_recovers(own_redis: RedisServer) -> None:  # noqa: F811
    store = RedisRunStore.open(own_redis.url)
    try:
        assert isinstance(await store.reserve("r", "bot", CALL, NOW), Reservation)
        own_redis.stop(kill=True)
        await expect_unavailable(store, within=3.0)
        own_redis.start()  # same port, empty (no persistence): the scripts load again on their own
        granted = await store.reserve("r", "bot", CALL, NOW)
        assert isinstance(granted, Reservation)
        await store.settle(granted, {"usd": 0.001}, NOW)
        state = await store.get("r")
        assert state is not None and state.used == {"usd": 0.001} and state.open == {}
    finally:
        await store.close()


async def test_redis_hung_times_out_then_recovers(own_redis: RedisServer) -> None:  # noqa: F811
    """A Redis that accepts but never answers (SIGSTOP): the op timeout (2 s) answers 503, not a hang."""
    store = RedisRunStore.open(own_redis.url)
    assert own_redis.proc is not None
    try:
        await store.get("r")
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StateUnavailable, match="no answer within 2 s|Timeout"):
                await store.reserve("r", "bot", CALL, NOW)
            assert time.monotonic() - started < 3.0
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        assert isinstance(await store.reserve("r", "bot", CALL, NOW), Reservation)
    finally:
        await store.close()


async def test_settles_lost_to_an_outage_are_replayed(tmp_path: Path) -> None:
    """A persistent Redis restarts with the run: the settle that failed while it was down is applied
    (real usage, not the reservation), and a reserve whose reply was lost is released at zero. (The
    background replay may apply them at any moment once Redis is back: the next write waits for nothing.)"""
    server = start_server(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    store = RedisRunStore.open(server.url)
    try:
        first = await store.reserve("r", "bot", CALL, NOW)
        assert isinstance(first, Reservation)
        server.stop(kill=True)
        with pytest.raises(StateUnavailable):
            await store.settle(first, {"usd": 0.0005, "llm_calls": 1.0}, NOW)
        with pytest.raises(StateUnavailable):
            await store.reserve("r", "bot", CALL, NOW)
        server.start()
        await store.record_step("r", "bot", {"n": 1}, NOW)
        state = await store.get("r")
        assert state is not None and state.open == {} and state.reserved["usd"] == 0.0
        assert state.used == {"usd": 0.0005, "llm_calls": 1.0}
    finally:
        await store.close()
        server.stop()


async def test_open_is_lazy_and_never_echoes_a_password() -> None:
    from tests.redis_fixture import free_port

    store = RedisRunStore.open(f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        with pytest.raises(StateUnavailable) as info:
            await store.get("r")
        assert "s3cret" not in str(info.value)
    finally:
        await store.close()
    with pytest.raises(StateUnavailable, match="bad redis url") as bad:
        RedisRunStore.open("http://:s3cret-pw@example.com/0")
    assert "s3cret" not in str(bad.value)
