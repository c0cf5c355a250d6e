"""`gateway.observe_runs`: a run's `invoke_agent` root is exported when it stops, is reset, or goes idle
(the sweep reads only the runs that went idle since the last one, and resumes where the sweeps of the
process before stopped); a run that resumes after its idle export gets its next root, which carries its
stop; of several gateway processes sharing a store, one exports each root (`RunStore.claim_root`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.errors import StateUnavailable
from gateway.observe_runs import _SWEPT_SERVICE, end_idle_runs
from gateway.store.base import RunState
from gateway.store.sqlite import SqliteRunStore
from otel.runs import run_ids
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.conftest import GatewayFactory, Harness
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)


async def test_the_idle_sweep_reaches_every_run_reading_only_what_went_idle_since(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory()
    gw = h.gateway
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    gw.services["telemetry"] = telemetry
    windows: list[tuple[float, float]] = []
    listing = gw.store.runs_updated
    failing = [True]

    def spy(after: float, before: float, page: int = 1000) -> AsyncIterator[list[RunState]]:
        windows.append((after, before))
        if failing[0]:
            failing[0] = False
            raise StateUnavailable("the store is away")
        return listing(after, before, page)

    gw.store.runs_updated = spy  # type: ignore[method-assign]
    t = 1_000_000.0
    await gw.store.record_step("ancient", "default", {}, t - 1000)  # went idle long before any sweep
    for i in range(2500):  # more than a page, more than the old sweep's 1000 most recent runs
        await gw.store.record_step(f"r-{i}", "default", {}, t + i * 0.01)
    with pytest.raises(StateUnavailable):
        await end_idle_runs(gw, 60, t + 100)
    assert await end_idle_runs(gw, 60, t + 100) == 2500  # the failed sweep, whole; one idle period back
    assert await end_idle_runs(gw, 60, t + 101) == 0
    await gw.store.record_step("r-7", "default", {}, t + 50)  # busy again, then idle again
    assert await end_idle_runs(gw, 60, t + 111) == 1
    assert windows == [(t - 20, t + 40), (t - 20, t + 40), (t + 40, t + 41), (t + 41, t + 51)]
    assert telemetry.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    ended = sorted(str((s.attributes or {})["tollgate.run_id"]) for s in roots)
    # each once, and not the run idle before any sweep; r-7 twice: its step after its idle root is news
    assert ended == sorted([*(f"r-{i}" for i in range(2500)), "r-7"])
    telemetry.shutdown()


async def test_a_restart_longer_than_the_idle_period_ends_the_runs_that_went_idle_meanwhile(
    gateway_factory: GatewayFactory, tmp_path: Path,
) -> None:
    """The first sweep of a restarted process starts where the last sweep of the one before it stopped
    (kept in the state file), not one idle period back: a gateway down longer than that still ends the
    runs whose steps it saw last."""
    path = tmp_path / "state.db"
    h = await gateway_factory(state={"backend": "sqlite", "path": str(path)})
    gw = h.gateway
    exporter = InMemorySpanExporter()
    gw.services["telemetry"] = telemetry = setup_telemetry({}, exporter=exporter)
    t = 1_000_000.0
    await gw.store.record_step("swept", "default", {}, t)
    assert await end_idle_runs(gw, 60, t + 100) == 1
    await gw.store.record_step("cut", "default", {}, t + 130)  # the process stops before it is idle
    await gw.store.close()
    gw.store = SqliteRunStore.open(path)  # a new process on the same file, an hour later
    del gw.services[_SWEPT_SERVICE]
    try:
        assert await end_idle_runs(gw, 60, t + 3600) == 1
    finally:
        await gw.store.close()
    assert telemetry.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    assert sorted(str((s.attributes or {})["tollgate.run_id"]) for s in roots) == ["cut", "swept"]
    telemetry.shutdown()


CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


async def traced(factory: GatewayFactory, llm_calls: int) -> tuple[Harness, InMemorySpanExporter, Telemetry]:
    """A gateway whose default agent stops at `llm_calls`, tracing to an in-memory exporter."""
    h = await factory(agents={"default": {"caps": {"llm_calls": llm_calls}}})
    exporter = InMemorySpanExporter()
    h.gateway.services["telemetry"] = telemetry = setup_telemetry({}, exporter=exporter)
    return h, exporter, telemetry


async def chat_step(h: Harness, run: str) -> int:
    async with h.session.post(f"{h.url}/v1/chat/completions", json=CHAT, headers={"x-tollgate-run-id": run}) as resp:
        return resp.status


async def test_a_run_that_resumes_after_going_idle_ends_under_a_root_that_carries_its_stop(
    gateway_factory: GatewayFactory,
) -> None:
    """A run idle for `otel.run_idle_s` (a human approval can take longer) has its root exported; it
    used to be the run's only root: "fine, 1 call", while the run went on and stopped. Now the steps
    after it are under the run's next root, in the same trace, which the stop exports."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=2)
    assert await chat_step(h, "paused") == 200
    assert await end_idle_runs(h.gateway, 60, time.time() + 100) == 1  # the run went idle
    assert [await chat_step(h, "paused"), await chat_step(h, "paused")] == [200, 403]  # resumes, hits the cap
    assert telemetry.force_flush()
    finished = exporter.get_finished_spans()
    roots = [s for s in finished if s.name.startswith("invoke_agent")]
    assert [(dict(r.attributes or {}).get("tollgate.llm_calls"), dict(r.attributes or {}).get("error.type"))
            for r in roots] == [(1, None), (2, "llm_call_cap")]
    idle, stop = (r.context for r in roots)
    assert idle is not None and stop is not None and idle.trace_id == stop.trace_id
    steps = [s for s in finished if s.name == "chat gpt-4o-mini"]
    assert [s.parent.span_id if s.parent else None for s in steps] == [idle.span_id, stop.span_id, stop.span_id]
    # the root is exported once its stopping step's span ended: it spans that step (it ended 1-2 ms before)
    assert steps[-1].end_time is not None and roots[-1].end_time is not None
    assert steps[-1].end_time <= roots[-1].end_time
    telemetry.shutdown()


async def test_a_stopped_runs_root_is_exported_when_its_client_leaves_while_the_stop_is_written(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step hooks run however the answer ends: a client leaving while the stop's ledger row is
    written (up to 2 s) skipped them, and with them the export of the run's root (the idle sweep leaves
    stopped runs alone), so the stopped run had no root at all."""
    from gateway import proxy

    h, exporter, telemetry = await traced(gateway_factory, llm_calls=1)
    assert await chat_step(h, "gone") == 200
    writing = asyncio.Event()

    async def slow_row(gw: object, step: object) -> None:  # a ledger slow to write: the client leaves meanwhile
        writing.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(proxy, "ledger_stop_now", slow_row)
    task = asyncio.create_task(chat_step(h, "gone"))
    await writing.wait()
    task.cancel()

    def roots() -> list[str]:
        telemetry.force_flush()
        return [s.name for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]

    for _ in range(400):  # the gateway sees the client leave on its own: nothing to await
        if roots():
            break
        await asyncio.sleep(0.005)
    assert roots() == ["invoke_agent default"]
    telemetry.shutdown()


async def test_sidecars_sharing_a_redis_store_export_each_root_of_a_run_once(
    gateway_factory: GatewayFactory, redis_server: RedisServer,  # noqa: F811
) -> None:
    """Two gateway processes on one Redis: both sweep every idle run, and a run's steps alternate between
    them. Each root segment is exported once across both (the segment was counted per process: each
    sweep exported every idle run's root again, and a sidecar new to a run started at segment 0), and
    every step goes under a root that is exported."""
    state = {"backend": "redis", "url": redis_server.url}
    agents = {"default": {"caps": {"llm_calls": 3}}}
    sidecars = [await gateway_factory(agents=agents, state=state) for _ in range(2)]
    exporters = []
    for h in sidecars:
        exporters.append(exporter := InMemorySpanExporter())
        h.gateway.services["telemetry"] = setup_telemetry({}, exporter=exporter)
    a, b = sidecars
    run = f"shared-{uuid.uuid4().hex}"
    others = [f"{run}-{i}" for i in range(30)]

    async def sweep_both() -> None:  # every run with no step since now is judged idle (30 s ago, 30 s on)
        later = time.time() + 30
        await asyncio.gather(*(end_idle_runs(h.gateway, 30, later) for h in sidecars))

    assert await chat_step(a, run) == 200
    for i, other in enumerate(others):
        assert await chat_step(sidecars[i % 2], other) == 200
    await sweep_both()  # the run and the 30 others went idle: both sidecars judge every one of them
    assert await chat_step(b, run) == 200  # the run resumes on the other sidecar
    await sweep_both()
    assert [await chat_step(a, run), await chat_step(b, run), await chat_step(a, run)] == [200, 403, 403]
    await sweep_both()
    finished = []
    for h, exporter in zip(sidecars, exporters, strict=True):
        telemetry = h.gateway.services["telemetry"]
        assert isinstance(telemetry, Telemetry) and telemetry.force_flush()
        finished += exporter.get_finished_spans()
        telemetry.shutdown()
    roots = [s for s in finished if s.name.startswith("invoke_agent")]
    ids = [(r.context.trace_id, r.context.span_id) for r in roots if r.context is not None]
    assert len(ids) == len(set(ids)) == 3 + len(others)  # no root twice
    mine = sorted((r for r in roots if dict(r.attributes or {})["tollgate.run_id"] == run),
                  key=lambda r: int(dict(r.attributes or {}).get("tollgate.run.segment", 0)))
    assert [(dict(r.attributes or {}).get("tollgate.llm_calls"), dict(r.attributes or {}).get("error.type"))
            for r in mine] == [(1, None), (2, None), (3, "llm_call_cap")]
    assert [r.context.span_id for r in mine if r.context] == [run_ids(run, 1, s)[1] for s in range(3)]
    steps = sorted((s for s in finished if s.name == "chat gpt-4o-mini"
                    and dict(s.attributes or {}).get("tollgate.run_id") == run), key=lambda s: s.start_time or 0)
    seg = [r.context.span_id for r in mine if r.context]
    assert [s.parent.span_id if s.parent else None for s in steps] == [seg[0], seg[1], seg[2], seg[2], seg[2]]


def roots_of(telemetry: Telemetry, exporter: InMemorySpanExporter) -> list[Any]:
    assert telemetry.force_flush()
    return [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]


def totals(roots: list[Any]) -> list[tuple[Any, Any]]:
    return [(dict(r.attributes or {}).get("tollgate.llm_calls"), dict(r.attributes or {}).get("error.type"))
            for r in roots]


async def test_a_sweep_whose_claim_the_store_fails_is_retried_whole(gateway_factory: GatewayFactory) -> None:
    """The sweep's mark moved past a run whose claim failed: a run that simply stopped calling never came
    in a later window, and never had a root (found by review)."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=10)
    gw = h.gateway
    assert await chat_step(h, "flaky") == 200
    real = gw.store.claim_root
    failing = [True]

    async def flaky(*args: Any, **kwargs: Any) -> tuple[int, float | None] | None:
        if failing.pop() if failing else False:
            raise StateUnavailable("the store timed out")
        return await real(*args, **kwargs)

    gw.store.claim_root = flaky  # type: ignore[method-assign]
    t = time.time()
    with pytest.raises(StateUnavailable):
        await end_idle_runs(gw, 60, t + 100)
    assert await end_idle_runs(gw, 60, t + 100) == 1  # the next sweep, whole: the claim again
    assert totals(roots_of(telemetry, exporter)) == [(1, None)]
    telemetry.shutdown()


async def test_a_reset_the_store_refuses_leaves_the_epochs_roots_as_they_were(
    gateway_factory: GatewayFactory,
) -> None:
    """The reset claims the ending epoch's root with the reset itself: a claim made before a reset that
    then failed left the epoch, which went on, with its roots ended, so its stop was on no root."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=2)
    gw = h.gateway
    assert await chat_step(h, "kept") == 200
    real = gw.store.reset

    async def refused(run_id: str, now: float) -> None:
        raise StateUnavailable("the store timed out")

    gw.store.reset = refused  # type: ignore[method-assign]
    async with h.session.post(f"{h.admin_url}/admin/runs/kept/reset") as resp:
        assert resp.status == 503
    gw.store.reset = real  # type: ignore[method-assign]
    assert [await chat_step(h, "kept"), await chat_step(h, "kept")] == [200, 403]  # the epoch goes on, stops
    assert totals(roots_of(telemetry, exporter)) == [(2, "llm_call_cap")]
    async with h.session.post(f"{h.admin_url}/admin/runs/kept/reset") as resp:
        assert resp.status == 200  # a stopped run's root was exported by its stop: the reset adds none
    assert totals(roots_of(telemetry, exporter)) == [(2, "llm_call_cap")]
    telemetry.shutdown()


async def test_a_stops_root_is_exported_when_its_client_leaves_during_the_claim(
    gateway_factory: GatewayFactory,
) -> None:
    """The claim is the store's once sent: a handler cancelled while it was answered lost the export, and
    no later refusal or reset could export that root again (found by review)."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=1)
    gw = h.gateway
    assert await chat_step(h, "cut") == 200
    real = gw.store.claim_root
    asked, answer = asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> tuple[int, float | None] | None:
        claimed = await real(*args, **kwargs)
        asked.set()
        await answer.wait()  # the answer still on its way back
        return claimed

    gw.store.claim_root = slow  # type: ignore[method-assign]
    task = asyncio.create_task(chat_step(h, "cut"))
    await asyncio.wait_for(asked.wait(), 5)
    task.cancel()

    def step_spans() -> int:
        telemetry.force_flush()
        return sum(s.name == "chat gpt-4o-mini" for s in exporter.get_finished_spans())

    for _ in range(400):  # the gateway sees the client leave on its own: nothing to await
        if roots_of(telemetry, exporter):
            break
        await asyncio.sleep(0.005)
    assert totals(roots_of(telemetry, exporter)) == [(1, "llm_call_cap")]
    assert step_spans() == 2  # the cancelled step's hooks ran all the same
    answer.set()
    telemetry.shutdown()


async def exported_roots(telemetry: Telemetry, exporter: InMemorySpanExporter, count: int) -> list[Any]:
    """The roots exported, once there are `count` (a lost claim's root is exported in the background)."""
    async with asyncio.timeout(5):
        while len(roots_of(telemetry, exporter)) < count:
            await asyncio.sleep(0.01)
    return roots_of(telemetry, exporter)


@pytest.mark.parametrize("where", ["stop", "sweep"])
async def test_a_claim_whose_answer_is_lost_still_has_its_root_exported(
    gateway_factory: GatewayFactory, where: str,
) -> None:
    """A claim the store ran but whose answer failed (a deadline passed while it came back) is the store's:
    the stop's root was then exported by nobody (not a refusal after it, not a reset), nor the idle root
    by the sweep retried whole, which found nothing new (found by review)."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=1)
    gw = h.gateway
    assert await chat_step(h, "lost") == 200
    real = gw.store.claim_root

    async def ran_then_failed(*args: Any, **kwargs: Any) -> tuple[int, float | None] | None:
        await real(*args, **kwargs)
        raise StateUnavailable("the store's answer came after its deadline")

    gw.store.claim_root = ran_then_failed  # type: ignore[method-assign]
    if where == "stop":
        assert await chat_step(h, "lost") == 403
        expected = [(1, "llm_call_cap")]
    else:
        with pytest.raises(StateUnavailable):
            await end_idle_runs(gw, 60, time.time() + 100)
        expected = [(1, None)]
    assert totals(await exported_roots(telemetry, exporter, 1)) == expected
    gw.store.claim_root = real  # type: ignore[method-assign]
    if where == "sweep":
        assert await end_idle_runs(gw, 60, time.time() + 100) == 1  # retried: nothing new, nothing twice
    assert totals(roots_of(telemetry, exporter)) == expected
    telemetry.shutdown()


async def test_a_resets_root_carries_the_epoch_as_the_reset_found_it(gateway_factory: GatewayFactory) -> None:
    """The admin read the run, then reset it: a step landing in between was missing from the ended
    epoch's root, and a reset overlapping another lost the root it claimed (found by review). The reset
    answers the epoch it ended itself."""
    h, exporter, telemetry = await traced(gateway_factory, llm_calls=10)
    gw = h.gateway
    assert await chat_step(h, "late-step") == 200
    real = gw.store.reset

    async def with_a_step_first(run_id: str, now: float) -> Any:
        assert await chat_step(h, run_id) == 200  # lands while the reset is on its way
        return await real(run_id, now)

    gw.store.reset = with_a_step_first  # type: ignore[method-assign]
    async with h.session.post(f"{h.admin_url}/admin/runs/late-step/reset") as resp:
        assert resp.status == 200
    assert totals(roots_of(telemetry, exporter)) == [(2, None)]
    telemetry.shutdown()


@pytest.mark.parametrize("decision", ["approve", "deny"])
async def test_a_parked_tool_call_goes_under_the_root_of_the_run_as_its_wait_ended(
    gateway_factory: GatewayFactory, decision: str,
) -> None:
    """An approval can outlast `otel.run_idle_s`: the call, approved or denied, went under the root exported
    while it waited (the run read before the wait), not the next one, which counts it (found by review)."""
    from tests.gateway.test_mcp_probe import admin, call, gateway, pending, post, raw_server

    tools = {"allow": ["files/read_file", "files/delete_*"], "approval": ["files/delete_*"],
             "tiers": {"files/delete_*": "dangerous"}, "approval_timeout_s": 30}
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=tools)
        exporter = InMemorySpanExporter()
        h.gateway.services["telemetry"] = telemetry = setup_telemetry({}, exporter=exporter)
        assert (await post(h, call("read_file", {"path": "x"}, rpc_id=1)))[0] == 200
        task = asyncio.create_task(post(h, call("delete_file", {"path": "a"})))
        [item] = await pending(h)
        assert await end_idle_runs(h.gateway, 60, time.time() + 100) == 1  # the run's root 0, while it waits
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": decision, "by": "ops"})
        _, answer = await task
        assert ("result" if decision == "approve" else "error") in answer, answer
        [root] = roots_of(telemetry, exporter)  # flushed: every span ended so far
        delete = next(s for s in exporter.get_finished_spans() if s.name == "tools/call delete_file")
        assert root.context is not None and delete.parent is not None
        assert delete.parent.trace_id == root.context.trace_id
        assert delete.parent.span_id == run_ids(str(dict(root.attributes or {})["tollgate.run_id"]), 1, 1)[1]
        telemetry.shutdown()
