"""Hostile probe: MULTI-REPLICA CONSISTENCY of gateways sharing one real Redis.

Two (or more) gateways built by `gateway_factory` on the same `state: {backend: redis, url}` are two
replicas (two sidecars). Every test cites the README / DESIGN line it relies on; a failing test is a
defect of the product, not of the test.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis
from aiohttp import web

from gateway.store.redis import RedisRunStore
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.upstream import openai_completion, serving, tool_call
from tests.gateway.test_mcp import TOOLS, admin, mcp_client, pending, text
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401

ZERO_PRICES = {"gpt-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}}
PRICED = {"gpt-*": {"input_per_mtok": 1000.0, "output_per_mtok": 1000.0}}
TOOL_SPEC = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "fetch", "parameters": {"type": "object"}}}]


def unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


def body(text_: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text_}], "max_tokens": 20,
            "tools": TOOL_SPEC, **extra}


# -- a gated fake upstream: each request waits until the test releases it (no sleeps) -------------------


class Gated:
    """An OpenAI-compatible upstream whose answers are scripted; a request may be held at a gate."""

    def __init__(self) -> None:
        self.replies: list[tuple[dict[str, Any], asyncio.Event | None]] = []
        self.default: dict[str, Any] = openai_completion()
        self.seen = 0
        self.arrived = asyncio.Event()

    def queue(self, reply: dict[str, Any], gate: asyncio.Event | None = None) -> None:
        self.replies.append((reply, gate))

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen += 1
        reply, gate = self.replies.pop(0) if self.replies else (self.default, None)
        self.arrived.set()
        if gate is not None:
            await gate.wait()
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def wait_seen(self, count: int) -> None:
        while self.seen < count:
            self.arrived.clear()
            await self.arrived.wait()


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Gated, str]]:
    up = Gated()
    async with serving(up.handle) as url:
        yield up, url


async def replicas(factory: GatewayFactory, server: RedisServer, agent: dict[str, Any], upstream: str | None = None,
                   count: int = 2, pricing: dict[str, Any] = ZERO_PRICES, url: str | None = None) -> list[Harness]:
    extra: dict[str, Any] = {}
    if upstream is not None:
        extra["providers"] = {"openai": {"type": "openai", "base_url": f"{upstream}/v1", "api_key": "sk-x"}}
        extra["models"] = {"gpt-*": "openai"}
    return [await factory(state={"backend": "redis", "url": url or server.url}, pricing=pricing,
                          agents={"default": agent}, **extra) for _ in range(count)]


async def post(h: Harness, run_id: str, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    headers = {"x-tollgate-run-id": run_id, "content-type": "application/json"}
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps(data), headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def reset(h: Harness, run_id: str) -> int:
    async with h.session.post(f"{h.admin_url}/admin/runs/{run_id}/reset") as resp:
        await resp.read()
        return resp.status


def code(answer: dict[str, Any]) -> str | None:
    err = answer.get("error")
    return err.get("code") if isinstance(err, dict) else None


def calls_of(answer: dict[str, Any]) -> list[str]:
    message = answer["choices"][0]["message"]
    return [c["function"]["name"] for c in message.get("tool_calls") or []]


# -- reset on A while B has a step of the run in flight ---------------------------------------------------


async def test_reset_on_a_while_b_in_flight_tool_count_does_not_stop_the_fresh_run(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """README "How budgets are held" (loop paragraph): "a step in flight while its run is reset does not
    stop the fresh run"; DESIGN 5: reset clears "stop, spend, counters and loop history"."""
    up, url = gated
    a, b = await replicas(gateway_factory, redis_server, {"caps": {"tool_calls": 1}}, url)
    run_id = unique("reset-inflight-cap")
    gate = asyncio.Event()
    # B's step (old epoch) will come back proposing two calls: over the cap of the OLD run
    up.queue(openai_completion(tool_calls=[tool_call("search", '{"q":1}', "c1"),
                                           tool_call("fetch", '{"q":2}', "c2")]), gate)
    task = asyncio.create_task(post(b, run_id, body()))
    await asyncio.wait_for(up.wait_seen(1), 10)
    assert await reset(a, run_id) == 200
    gate.set()
    await asyncio.wait_for(task, 10)
    fresh = await a.run(run_id)
    assert (fresh["status"], fresh["stop_reason"]) == ("active", None), fresh
    status, answer = await post(a, run_id, body())
    assert status == 200, answer


async def test_reset_on_a_while_b_in_flight_late_loop_history_does_not_shorten_the_fresh_window(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """README loop paragraph: "within the last `loop.window` calls, `loop.max_distinct` or fewer distinct
    fingerprints is `loop_detected`"; DESIGN 5: reset clears the loop history; "a step in flight while its
    run is reset does not stop the fresh run"."""
    up, url = gated
    a, b = await replicas(gateway_factory, redis_server, {"loop": {"window": 3, "max_distinct": 1}}, url)
    run_id = unique("reset-inflight-loop")
    same = openai_completion(tool_calls=[tool_call("search", '{"q":1}')])
    up.default = same
    assert (await post(a, run_id, body("first")))[0] == 200  # old epoch: history [F]
    gate = asyncio.Event()
    up.queue(same, gate)
    task = asyncio.create_task(post(b, run_id, body("second")))
    await asyncio.wait_for(up.wait_seen(2), 10)
    assert await reset(a, run_id) == 200
    gate.set()
    await asyncio.wait_for(task, 10)
    # a fresh run: two proposals of F fit a window of 3 (the third would be the loop)
    for n in range(2):
        status, answer = await post(a, run_id, body(f"fresh {n}"))
        assert status == 200, (n, answer)


async def test_reset_on_a_while_b_in_flight_settle_does_not_charge_the_fresh_epoch(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """DESIGN 5: "`POST /admin/runs/{id}/reset` starts the run afresh: stop, spend, counters and loop
    history are cleared"; logic.settle: stale epochs are dropped."""
    up, url = gated
    a, b = await replicas(gateway_factory, redis_server, {"budget": {"usd": 5.0}, "caps": {"llm_calls": 50}},
                          url, pricing=PRICED)
    run_id = unique("reset-inflight-settle")
    gate = asyncio.Event()
    up.queue(openai_completion(prompt_tokens=100, completion_tokens=20), gate)
    task = asyncio.create_task(post(b, run_id, body()))
    await asyncio.wait_for(up.wait_seen(1), 10)
    assert await reset(a, run_id) == 200
    gate.set()
    status, _ = await asyncio.wait_for(task, 10)
    assert status == 200
    for h in (a, b):
        fresh = await h.run(run_id)
        assert (fresh["spent_usd"], fresh["reserved_usd"], fresh["llm_calls"], fresh["input_tokens"],
                fresh["output_tokens"], fresh["status"]) == (0.0, 0.0, 0, 0, 0, "active"), fresh


async def test_stop_by_a_while_b_in_flight_keeps_the_first_reason_on_both(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """DESIGN 4: a guard stop is "sticky until reset"; README: "A stopped run answers with the reason that
    stopped it, whatever else has run out since"."""
    up, url = gated
    agent = {"caps": {"tool_calls": 1, "llm_calls": 2}}
    a, b = await replicas(gateway_factory, redis_server, agent, url)
    run_id = unique("stop-inflight")
    gate = asyncio.Event()
    up.queue(openai_completion(tool_calls=[tool_call("search", "{}", "c1"), tool_call("fetch", "{}", "c2")]), gate)
    task = asyncio.create_task(post(b, run_id, body("b")))
    await asyncio.wait_for(up.wait_seen(1), 10)
    status, answer = await post(a, run_id, body("a"))  # second llm call of the cap 2: fine
    assert status == 200, answer
    status, answer = await post(a, run_id, body("a2"))
    assert (status, code(answer)) == (403, "llm_call_cap")
    gate.set()
    await asyncio.wait_for(task, 10)
    for h in (a, b):
        view = await h.run(run_id)
        assert (view["status"], view["stop_reason"]) == ("stopped", "llm_call_cap")
        status, answer = await post(h, run_id, body("again"))
        assert (status, code(answer)) == (403, "llm_call_cap")


# -- caps exact across replicas under concurrency ---------------------------------------------------------


async def test_llm_call_cap_is_exact_across_three_replicas_under_concurrency(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """README "Many sidecars, one budget": "any number of gateway processes sharing a Redis hold a budget
    exactly as one process does"; "The caps and the budget hold exactly under any concurrency"."""
    up, url = gated
    hs = await replicas(gateway_factory, redis_server, {"caps": {"llm_calls": 7}}, url, count=3)
    run_id = unique("llm-cap")
    results = await asyncio.gather(*(post(hs[i % 3], run_id, body(f"m{i}")) for i in range(60)))
    assert sum(1 for s, _ in results if s == 200) == 7 == up.seen
    assert {code(a) for s, a in results if s != 200} == {"llm_call_cap"}
    views = [await h.run(run_id) for h in hs]
    assert all(v["llm_calls"] == 7 and v["stop_reason"] == "llm_call_cap" for v in views), views


async def test_tool_call_cap_is_exact_across_replicas_under_concurrency(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """DESIGN 5: "A tool call counts once toward `tool_calls`, when the model proposes it in an answer
    tollgate returns"; README: "The caps and the budget hold exactly under any concurrency"."""
    up, url = gated
    hs = await replicas(gateway_factory, redis_server, {"caps": {"tool_calls": 5}}, url, count=2)
    run_id = unique("tool-cap")
    gate = asyncio.Event()
    for i in range(12):
        up.queue(openai_completion(tool_calls=[tool_call("search", f'{{"q":{i}}}')]), gate)
    tasks = [asyncio.create_task(post(hs[i % 2], run_id, body(f"t{i}"))) for i in range(12)]
    await asyncio.wait_for(up.wait_seen(12), 10)  # all in flight at once, then answered together
    gate.set()
    results = await asyncio.gather(*tasks)
    delivered = sum(len(calls_of(a)) for s, a in results if s == 200)
    assert delivered == 5, [(s, code(a)) for s, a in results]
    assert {code(a) for s, a in results if s != 200} == {"tool_call_cap"}
    for h in hs:
        view = await h.run(run_id)
        assert (view["tool_calls"], view["stop_reason"]) == (5, "tool_call_cap")


# -- the admin API of every replica shows one run ----------------------------------------------------------


async def test_admin_run_view_and_listing_are_identical_on_both_replicas(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """DESIGN 2: a run as the admin API shows it; README "Many sidecars, one budget": runs are kept in
    Redis, shared by every gateway."""
    up, url = gated
    a, b = await replicas(gateway_factory, redis_server, {"budget": {"usd": 5.0}}, url, pricing=PRICED)
    run_id = unique("views")
    up.default = openai_completion(tool_calls=[tool_call("search", '{"q":1}')], prompt_tokens=7, completion_tokens=3)
    for h in (a, b, a):
        assert (await post(h, run_id, body(f"{h.url}")))[0] == 200
    one, two = await a.run(run_id), await b.run(run_id)
    assert one == two
    assert (one["llm_calls"], one["tool_calls"], one["input_tokens"], one["output_tokens"], len(one["steps"])) == \
        (3, 3, 21, 9, 3)
    async with a.session.get(f"{a.admin_url}/admin/runs?limit=1000") as r1, \
            b.session.get(f"{b.admin_url}/admin/runs?limit=1000") as r2:
        l1 = {r["run_id"]: r for r in (await r1.json())["runs"]}
        l2 = {r["run_id"]: r for r in (await r2.json())["runs"]}
    assert l1[run_id] == l2[run_id] == one


async def test_two_deployments_on_separate_redis_dbs_do_not_share_runs(
    gateway_factory: GatewayFactory, gated: tuple[Gated, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """DESIGN 5: `state: {backend: redis, url: redis://...}` (the url names the db); README: one budget
    is shared by the processes "sharing a Redis"."""
    _up, url = gated
    db1 = redis_server.url.rsplit("/", 1)[0] + "/1"
    [a] = await replicas(gateway_factory, redis_server, {"caps": {"llm_calls": 1}}, url, count=1)
    [c] = await replicas(gateway_factory, redis_server, {"caps": {"llm_calls": 1}}, url, count=1, url=db1)
    run_id = unique("dbs")
    assert (await post(a, run_id, body()))[0] == 200
    assert (await post(c, run_id, body()))[0] == 200  # the other deployment's run, its own cap
    status, answer = await post(a, run_id, body())
    assert (status, code(answer)) == (403, "llm_call_cap")
    assert (await c.run(run_id))["llm_calls"] == 1


# -- RunStore.runs_updated on Redis: pagination across replicas -------------------------------------------


def two_stores(server: RedisServer) -> tuple[RedisRunStore, RedisRunStore, str]:
    prefix = unique("probe") + ":"
    return RedisRunStore.open(server.url, prefix=prefix), RedisRunStore.open(server.url, prefix=prefix), prefix


async def collect(store: RedisRunStore, after: float, before: float, page: int,
                  between: Any = None) -> list[str]:
    seen: list[str] = []
    pages = 0
    async for chunk in store.runs_updated(after, before, page=page):
        seen.extend(r.run_id for r in chunk)
        pages += 1
        if between is not None:
            await between(pages)
    return seen


async def test_runs_updated_pages_many_runs_sharing_one_updated_at_without_skips_or_repeats(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """base.RunStore.runs_updated: "Every run last updated in (`after`, `before`], least recently updated
    first (ties by run id), in pages of at most `page`"."""
    a, b, _ = two_stores(redis_server)
    try:
        t = 1_700_000_000.123456
        ids = [f"r{i:02d}" for i in range(11)]
        for i, run_id in enumerate(ids):  # written by both replicas, all at one instant
            await (a if i % 2 else b).record_step(run_id, "bot", {"n": i}, t)
        await a.record_step("early", "bot", {}, t - 5)
        await a.record_step("late", "bot", {}, t + 5)
        for page in (1, 2, 3, 4, 1000):
            got = await collect(a, t - 10, t + 1, page)
            assert got == ["early", *ids], (page, got)
    finally:
        await a.close()
        await b.close()


async def test_runs_updated_does_not_skip_an_idle_run_when_another_replica_touches_listed_ties(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """base.RunStore.runs_updated: "Every run last updated in (`after`, `before`]" is listed; "a run
    updated meanwhile may show its new `updated_at`, or come in a later page" (only THAT run may move)."""
    a, b, _ = two_stores(redis_server)
    try:
        t = 1_700_000_100.5
        ids = ["a", "b", "c", "d", "e"]
        for run_id in ids:
            await a.record_step(run_id, "bot", {}, t)

        async def busy_again(pages: int) -> None:
            if pages == 1:  # replica B: the listed runs get a step (they are no longer idle)
                await b.record_step("a", "bot", {}, t + 100)
                await b.record_step("b", "bot", {}, t + 100)

        got = await collect(a, t - 1, t + 1, 2, busy_again)
        assert got[:2] == ["a", "b"]
        assert sorted(set(got[2:])) == ["c", "d", "e"], got  # untouched idle runs must all be listed
    finally:
        await a.close()
        await b.close()


async def test_runs_updated_does_not_skip_a_run_after_expired_ties_are_pruned(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """redis.py docstring / README: "Stopped runs expire after `state.run_ttl_s`"; the index is "pruned
    lazily of expired runs"; base.RunStore.runs_updated lists "Every run last updated in (after, before]"."""
    a, b, prefix = two_stores(redis_server)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=2)
    try:
        t = 1_700_000_200.25
        for run_id in ["a", "b", "c", "d", "e"]:
            await b.record_step(run_id, "bot", {}, t)
        for run_id in ["a", "b"]:  # they expire (as run_ttl_s makes a stopped run do)
            client.pexpire(f"{prefix}run:{run_id}", 1)
            client.pexpire(f"{prefix}steps:{run_id}", 1)
        for _ in range(1000):
            if not client.exists(f"{prefix}run:a", f"{prefix}run:b"):
                break
            await asyncio.sleep(0.002)
        got = await collect(a, t - 1, t + 1, 2)
        assert got == ["c", "d", "e"], got
    finally:
        client.close()
        await a.close()
        await b.close()


async def test_runs_updated_lists_a_run_written_by_another_replica_during_paging_once(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """base.RunStore.runs_updated: "a run updated meanwhile may show its new `updated_at`, or come in a later
    page" (at most once: no page repeats a run that was not updated after it was listed)."""
    a, b, _ = two_stores(redis_server)
    try:
        t = 1_700_000_300.0
        for i in range(8):
            await a.record_step(f"r{i}", "bot", {}, t + i)

        async def move(pages: int) -> None:
            if pages == 1:
                await b.record_step("r5", "bot", {}, t + 20)  # not listed yet: moves later, still inside

        got = await collect(a, t - 1, t + 30, 3, move)
        assert sorted(got) == [f"r{i}" for i in range(8)] and len(got) == 8, got
    finally:
        await a.close()
        await b.close()


# -- MCP: approvals and idempotent writes across replicas -------------------------------------------------


@pytest.fixture
def files() -> Any:
    server = mcp_server.start(slow_s=0.3)
    yield server
    server.stop()


async def mcp_replicas(factory: GatewayFactory, files: mcp_server.RunningServer, server: RedisServer,
                       tools: dict[str, Any] = TOOLS, count: int = 2) -> list[Harness]:
    return [await factory(mcp_servers={"files": {"url": files.url, "headers": {"x-server-token": "s3cret"}}},
                          agents={"bot": {"tools": tools}}, state={"backend": "redis", "url": server.url})
            for _ in range(count)]


async def test_a_repeat_of_a_write_through_another_replica_gets_its_recorded_result_never_runs_twice(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, redis_server: RedisServer  # noqa: F811
) -> None:
    """README (MCP): recorded results are kept in the run store: "a repeat through any sidecar of the run
    gets the recorded result": the write never runs twice."""
    a, b = await mcp_replicas(gateway_factory, files, redis_server)
    run_id = unique("seq-write")
    async with mcp_client(a, run=run_id) as one:
        assert text(await one.call_tool("write_note", {"text": "seq"})).endswith("saved: seq")
    async with mcp_client(b, run=run_id) as two:
        assert text(await two.call_tool("write_note", {"text": "seq"})).endswith("saved: seq")
    assert files.notes.count("seq") == 1


async def test_approval_parked_on_a_decided_through_b_is_a_clear_error_and_a_still_decides(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, redis_server: RedisServer  # noqa: F811
) -> None:
    """README (MCP): "Tools matching `tools.approval` wait for `POST /admin/approvals/{id}`"; approvals.py:
    "a parked call waits on the sidecar that holds its connection, so the decision must reach that
    sidecar's admin port". Deciding elsewhere must be a clear error, never a silent success."""
    a, b = await mcp_replicas(gateway_factory, files, redis_server)
    run_id = unique("approval")
    async with mcp_client(a, run=run_id) as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "x"}))
        [item] = await pending(a)
        status, listed = await admin(b, "GET", "/admin/approvals")
        assert status == 200 and all(x["id"] != item["id"] for x in listed["approvals"])
        status, answer = await admin(b, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "bob"})
        assert status == 404 and answer["error"]["code"] == "not_found", answer
        assert files.seen.calls() == []
        assert not task.done()
        status, decided = await admin(a, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "al"})
        assert status == 200 and decided["status"] == "approved"
        assert text(await asyncio.wait_for(task, 10)) == "deleted x"
