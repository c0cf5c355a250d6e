"""`gateway.store.redis_index`: the key layout the Lua scripts and the index reads share, and a listing
through the index that drops the ids of runs that are gone (the listings' orders are in
tests/gateway/test_store_backends.py, for every backend)."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from gateway.store.redis import RedisRunStore
from gateway.store.redis_index import run_key, steps_key
from tests.gateway.test_store_redis_faults import CALL, NOW
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixtures)


def test_keys_are_named_by_prefix_and_run() -> None:
    assert (run_key("t:", "r/1"), steps_key("t:", "r/1")) == ("t:run:r/1", "t:steps:r/1")


async def test_a_listing_drops_ids_of_runs_that_are_gone(redis_server: RedisServer) -> None:  # noqa: F811
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisRunStore.open(redis_server.url, prefix=prefix)
    raw = Redis.from_url(redis_server.url)
    try:
        await store.reserve("kept", "bot", CALL, NOW)
        await store.reserve("lost", "bot", CALL, NOW + 1)
        await raw.delete(run_key(prefix, "lost"))  # expired, or lost by Redis
        assert [r.run_id for r in await store.list_runs()] == ["kept"]
        assert await raw.zscore(f"{prefix}runs", "lost") is None
        page = await store.runs_page(None, 10)
        assert [r.run_id for r in page.runs] == ["kept"] and page.next is None
    finally:
        await raw.aclose()
        await store.close()
