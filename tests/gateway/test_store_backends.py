"""The run store's behaviour through every backend (memory, SQLite, Redis on a real redis-server),
SQLite durability and crash recovery, and atomicity under concurrent reserves."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import RunReset, StateUnavailable
from gateway.store.base import Add, Claim, Denial, Push, Reservation, ReserveRequest, RunsCursor, RunStore
from gateway.store.memory import MemoryRunStore
from gateway.store.redis import RedisRunStore
from gateway.store.sqlite import SqliteRunStore
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

NOW = 1_000.0
# $0.001 of input bound + 250 output tokens at $4/Mtok = $0.002 per call
USD = Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted")
PER_CALL = 0.002
CALL = ReserveRequest((USD, Claim("llm_calls", 1.0)), 16, 250)


def open_backend(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> RunStore:
    if name == "memory":
        return MemoryRunStore()
    if name == "sqlite":
        return SqliteRunStore.open(tmp_path / f"{uuid.uuid4().hex}.db")
    server: RedisServer = request.getfixturevalue("redis_server")
    return RedisRunStore.open(server.url, prefix=f"test-{uuid.uuid4().hex}:")  # a fresh keyspace per store


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    s = open_backend(request.param, request, tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def grant(store: RunStore, run_id: str = "run-1", request: ReserveRequest = CALL) -> Reservation:
    result = await store.reserve(run_id, "bot", request, NOW)
    assert isinstance(result, Reservation), result
    return result


async def test_unknown_runs(store: RunStore) -> None:
    assert await store.get("nope") is None
    assert await store.reset("nope", NOW) is None
    assert await store.take("nope", "proposed", "x") is False
    await store.settle(Reservation("r", "nope", 1, 0, {"usd": 1.0}), {"usd": 1.0}, NOW)
    assert await store.get("nope") is None  # settling never creates a run
    assert await store.list_runs() == []


async def test_reserve_and_settle(store: RunStore) -> None:
    res = await grant(store)
    assert res.units == 250 and res.amounts["usd"] == pytest.approx(PER_CALL)
    state = await store.get("run-1")
    assert state is not None and state.agent == "bot" and state.started_at == NOW
    assert state.reserved["usd"] == pytest.approx(PER_CALL) and res.id in state.open
    await store.settle(res, {"usd": 0.0005, "llm_calls": 1.0, "output_tokens": 20.0}, NOW + 1)
    await store.settle(res, {"usd": 0.0005, "llm_calls": 1.0, "output_tokens": 20.0}, NOW + 2)  # idempotent
    state = await store.get("run-1")
    assert state is not None
    assert state.used == {"usd": pytest.approx(0.0005), "llm_calls": 1.0, "output_tokens": 20.0}
    assert state.reserved["usd"] == pytest.approx(0.0) and state.open == {}
    view = state.view()
    assert (
        view["spent_usd"] == pytest.approx(0.0005) and view["reserved_usd"] == 0.0 and view["llm_calls"] == 1
    )


async def test_nothing_stays_reserved_once_nothing_is_in_flight(store: RunStore) -> None:
    """A huge reservation beside a small one: the running float sum rounds the small amount (1.8e19 +
    3100 - 1.8e19 is 4096), which must not stay held once both settled, in any order."""
    huge = ReserveRequest((Claim("tokens", 100, 1.0),), 16, 2**64 - 1)
    small = ReserveRequest((Claim("tokens", 100, 1.0),), 16, 3000)
    for first_small in (True, False):
        run = f"round-{first_small}"
        a, b = await grant(store, run, small), await grant(store, run, huge)
        for res in ((a, b) if first_small else (b, a)):
            await store.settle(res, {"tokens": 10.0}, NOW + 1)
        state = await store.get(run)
        assert state is not None and state.open == {}
        assert state.reserved == {"tokens": 0.0} and state.used["tokens"] == 20.0


async def test_a_spent_limit_stops_the_run_though_another_is_only_held(store: RunStore) -> None:
    """Tokens are held by a step in flight, USD is spent: the run stops on USD, in every backend."""
    usd = Claim("usd", 0.0, 0.001, 0.1, "budget_exhausted")
    tokens = Claim("tokens", 0.0, 1.0, 1000.0, "token_budget_exhausted")
    spend = await grant(store, request=ReserveRequest((usd,), 16, 100))
    await store.settle(spend, {"usd": 0.095}, NOW)  # 0.005 left: 16 units need 0.016
    await grant(store, request=ReserveRequest((tokens,), 16, 1000))  # all tokens held, in flight
    denial = await store.reserve("run-1", "bot", ReserveRequest((tokens, usd), 16, 100), NOW)
    assert isinstance(denial, Denial) and not denial.held and denial.reason == "budget_exhausted"
    state = await store.get("run-1")
    assert state is not None and state.stop_reason == "budget_exhausted"


async def test_denial_stops_the_run_and_sticks(store: RunStore) -> None:
    grants = [await grant(store) for _ in range(10)]
    held = await store.reserve("run-1", "bot", CALL, NOW)  # in flight, not spent: refused, not stopped
    assert isinstance(held, Denial) and held.held and held.reason == "budget_exhausted"
    assert held.detail == ("usd limit 0.02: 0.02 is held by 10 step(s) in flight and this step needs at least "
                           "0.001064; the run goes on: retry once they settle")
    state = await store.get("run-1")
    assert state is not None and state.status == "active"
    for res in grants:  # settled at their reservations: now the budget is spent
        await store.settle(res, res.amounts, NOW + 1)
    denial = await store.reserve("run-1", "bot", CALL, NOW + 2)
    assert isinstance(denial, Denial) and denial.reason == "budget_exhausted" and not denial.held
    cheap = ReserveRequest((Claim("llm_calls", 1.0),))
    again = await store.reserve("run-1", "bot", cheap, NOW)
    assert isinstance(again, Denial) and again.reason == "budget_exhausted"
    state = await store.get("run-1")
    assert state is not None and state.status == "stopped" and state.stop_reason == "budget_exhausted"
    assert state.stop_detail == denial.detail
    other = await grant(store, "run-2")  # other runs are unaffected
    assert other.units == 250


async def test_add_with_limit(store: RunStore) -> None:
    for _ in range(3):
        assert (
            await store.add("run-1", "bot", "tool_calls", 1.0, limit=3.0, code="tool_call_cap", now=NOW)
            is None
        )
    denial = await store.add("run-1", "bot", "tool_calls", 1.0, limit=3.0, code="tool_call_cap", now=NOW)
    assert isinstance(denial, Denial) and denial.reason == "tool_call_cap"
    state = await store.get("run-1")
    assert state is not None and state.used["tool_calls"] == 3.0 and state.stop_reason == "tool_call_cap"
    assert isinstance(await store.reserve("run-1", "bot", CALL, NOW), Denial)


async def test_apply_is_all_or_nothing(store: RunStore) -> None:
    adds = [Add("tool_calls", 2.0, 5.0, "tool_call_cap"), Add("usd", 0.1)]
    assert await store.apply("run-1", "bot", adds, [Push("calls", ("a", "b"), 6)], NOW) is None
    breach = [Add("usd", 0.5), Add("tool_calls", 4.0, 5.0, "tool_call_cap")]
    denial = await store.apply("run-1", "bot", breach, [Push("calls", ("c",), 6)], NOW + 1)
    assert isinstance(denial, Denial) and denial.reason == "tool_call_cap"
    state = await store.get("run-1", steps=False)
    assert state is not None and state.stop_reason == "tool_call_cap"
    assert state.used == {"tool_calls": 2.0, "usd": 0.1} and state.lists == {"calls": ["a", "b"]}  # nothing applied
    again = await store.apply("run-1", "bot", [Add("usd", 0.1)], [], NOW + 2)
    assert isinstance(again, Denial) and again.reason == "tool_call_cap"  # sticky
    assert await store.apply("run-1", "bot", [], [Push("calls", ("d",), 2)], NOW + 3) is None  # history still kept
    state = await store.get("run-1")
    assert state is not None and state.lists == {"calls": ["b", "d"]} and state.updated_at == NOW + 3


async def test_an_in_flight_apply_on_a_stopped_run_refuses_only_a_breach(store: RunStore) -> None:
    """The answer of a step admitted before its run stopped counts and goes on when it fits the limits
    (a serial order of the steps gives that); one that breaches a limit is refused with the run's own
    reason and applies nothing; a fresh step's adds are still refused (sticky)."""
    await store.apply("run-1", "bot", [Add("tool_calls", 6.0)], [Push("calls", ("a",), 3)], NOW)
    await store.stop("run-1", "bot", "llm_call_cap", "llm_calls limit 7 would be exceeded", NOW + 1)
    fits = [Add("tool_calls", 3.0, 9.0, "tool_call_cap")]
    assert isinstance(await store.apply("run-1", "bot", fits, [], NOW + 2), Denial)  # not in flight: sticky
    assert await store.apply("run-1", "bot", fits, [Push("calls", ("b",), 3)], NOW + 3, in_flight=True) is None
    breach = [Add("tool_calls", 1.0, 9.0, "tool_call_cap")]
    denial = await store.apply("run-1", "bot", breach, [Push("calls", ("c",), 3)], NOW + 4, in_flight=True)
    assert denial == Denial("llm_call_cap", "llm_calls limit 7 would be exceeded")  # the run's own reason
    loop = await store.apply("run-1", "bot", [], [Push("calls", ("b", "b"), 3, 1, "loop_detected", "x")], NOW + 5,
                             in_flight=True)
    assert loop == Denial("llm_call_cap", "llm_calls limit 7 would be exceeded")
    state = await store.get("run-1", steps=False)
    assert state is not None and state.status == "stopped" and state.stop_reason == "llm_call_cap"
    assert state.used == {"tool_calls": 9.0} and state.lists == {"calls": ["a", "b"]}


def loop_claim(*values: str) -> Push:
    return Push("calls", values, 3, distinct_limit=1, code="loop_detected", detail="3 calls, 1 distinct")


async def test_a_push_with_a_distinct_limit_stops_a_loop_atomically(store: RunStore) -> None:
    """Pushes judged on one snapshot (as by steps on several gateways) still stop the loop they make."""
    for _ in range(2):
        assert await store.apply("run-1", "bot", [Add("tool_calls", 1.0)], [loop_claim("a")], NOW) is None
    denial = await store.apply("run-1", "bot", [Add("tool_calls", 1.0)], [loop_claim("a")], NOW + 1)
    assert denial == Denial("loop_detected", "3 calls, 1 distinct")
    state = await store.get("run-1", steps=False)
    assert state is not None and state.stop_reason == "loop_detected" and state.stop_detail == "3 calls, 1 distinct"
    assert state.lists == {"calls": ["a", "a"]} and state.used == {"tool_calls": 2.0}  # nothing of it applied


@pytest.mark.parametrize(
    ("history", "values", "loop"),
    [
        ((), ("a", "a", "a"), True),  # one push can make the whole window
        (("a",), ("a",), False),  # not full yet
        (("a", "b"), ("a",), False),  # two distinct
        (("b", "a", "a"), ("a",), True),  # the window slides past "b"
        (("a", "a"), ("b",), False),
    ],
)
async def test_distinct_limit_table(store: RunStore, history: tuple[str, ...], values: tuple[str, ...],
                                    loop: bool) -> None:
    if history:
        await store.push("run-1", "bot", "calls", list(history), 3)
    denial = await store.apply("run-1", "bot", [], [loop_claim(*values)], NOW)
    assert (denial is not None) is loop


async def test_push_and_take(store: RunStore) -> None:
    assert await store.push("run-1", "bot", "calls", ["a", "b"], 3) == ["a", "b"]
    assert await store.push("run-1", "bot", "calls", ["c", "d"], 3) == ["b", "c", "d"]
    await store.push("run-1", "bot", "proposed", ["p1", "p2", "p1"], 10)
    assert await store.take("run-1", "proposed", "p1") is True
    assert await store.take("run-1", "proposed", "p9") is False
    state = await store.get("run-1")
    assert state is not None
    assert state.lists == {"calls": ["b", "c", "d"], "proposed": ["p2", "p1"]}


async def test_stop_reset_and_a_stale_settle(store: RunStore) -> None:
    old = await grant(store)
    await store.record_step("run-1", "bot", {"operation": "chat"}, NOW)
    await store.push("run-1", "bot", "calls", ["a"], 6)
    first = await store.stop("run-1", "bot", "loop_detected", "repeating search", NOW + 1)
    assert first == Denial("loop_detected", "repeating search")
    # the first stop wins, and is what a later stop answers: its step reports the run's own reason
    assert await store.stop("run-1", "bot", "time_cap", "later", NOW + 2) == first
    state = await store.get("run-1")
    assert state is not None and (state.stop_reason, state.stop_detail) == (
        "loop_detected",
        "repeating search",
    )
    reset = await store.reset("run-1", NOW + 3)
    assert reset is not None and reset.status == "active" and reset.epoch == 2
    assert reset.used == {} and reset.reserved == {} and reset.lists == {} and reset.steps == []
    await store.settle(old, old.amounts, NOW + 4)  # in flight across the reset: settles into nothing
    new = await grant(store)
    assert new.epoch == 2
    state = await store.get("run-1")
    assert state is not None and state.used == {} and list(state.open) == [new.id]


async def test_a_refuse_only_request_the_limits_cannot_pay_stops_nothing(store: RunStore) -> None:
    """`refuse_only` (a re-ask): a budget claim that does not fit refuses this request alone; the same
    request without it stops the run, as any step's does, and so does a count that does not fit."""
    tight = ReserveRequest((Claim("tokens", 500.0, 1.0, 400.0, "token_budget_exhausted"),), 16, 64)
    denial = await store.reserve("run-1", "bot", ReserveRequest(tight.claims, 16, 64, refuse_only=True), NOW)
    assert isinstance(denial, Denial) and denial.held and denial.reason == "token_budget_exhausted"
    assert "would be exceeded" in denial.detail
    state = await store.get("run-1")
    assert state is not None and (state.status, state.reserved.get("tokens", 0.0), state.open) == ("active", 0.0, {})
    stopped = await store.reserve("run-1", "bot", tight, NOW)
    assert isinstance(stopped, Denial) and not stopped.held
    state = await store.get("run-1")
    assert state is not None and state.stop_reason == "token_budget_exhausted"
    capped = ReserveRequest((Claim("llm_calls", 1.0, 0.0, 0.0, "llm_call_cap"),), 0, 0, refuse_only=True)
    counted = await store.reserve("run-2", "bot", capped, NOW)
    assert isinstance(counted, Denial) and not counted.held and counted.reason == "llm_call_cap"


async def test_a_stop_or_effects_judged_on_an_ended_epoch_change_nothing(store: RunStore) -> None:
    """`epoch`: the run's epoch a stop or effects were judged on. A reset since ends it: the store raises
    RunReset and the fresh run is neither stopped nor counted (checked atomically with the write)."""
    await store.push("run-1", "bot", "calls", ["a"], 6)
    await store.reset("run-1", NOW)
    add, push = Add("tool_calls", 1.0, 5.0, "tool_call_cap"), Push("calls", ("b",), 6)
    with pytest.raises(RunReset) as raised:
        await store.stop("run-1", "bot", "loop_detected", "judged before the reset", NOW + 1, epoch=1)
    assert (raised.value.judged, raised.value.current) == (1, 2)
    with pytest.raises(RunReset):
        await store.apply("run-1", "bot", [add], [push], NOW + 1, in_flight=True, epoch=1)
    state = await store.get("run-1")
    assert state is not None and (state.status, state.used, state.lists, state.epoch) == ("active", {}, {}, 2)
    assert await store.apply("run-1", "bot", [add], [push], NOW + 2, epoch=2) is None  # the fresh run's own
    assert await store.stop("run-1", "bot", "time_cap", "judged now", NOW + 3, epoch=2) == Denial(
        "time_cap", "judged now")
    state = await store.get("run-1")
    assert state is not None and (state.used, state.lists["calls"], state.stop_reason) == (
        {"tool_calls": 1.0}, ["b"], "time_cap")
    with pytest.raises(RunReset):  # a run that is gone was not the one judged: nothing is created
        await store.stop("run-2", "bot", "time_cap", "judged on epoch 3", NOW, epoch=3)
    assert await store.get("run-2") is None
    assert await store.stop("run-3", "bot", "time_cap", "unchecked", NOW) == Denial("time_cap", "unchecked")


async def test_record_step_answers_the_epoch_it_files_the_step_under(store: RunStore) -> None:
    """A step refused before it read the run learns its epoch (its trace) from `record_step`; one that
    names an epoch a reset ended is left out of the fresh run's list and keeps its own epoch."""
    assert await store.record_step("run-e", "bot", {"n": 1}, NOW) == 1  # creates the run
    await store.reset("run-e", NOW + 1)
    assert await store.record_step("run-e", "bot", {"n": 2}, NOW + 2) == 2
    assert await store.record_step("run-e", "bot", {"n": 3, "epoch": 1}, NOW + 3) == 1  # in flight across it
    assert await store.record_step("run-e", "bot", {"n": 4, "epoch": 2}, NOW + 4) == 2
    state = await store.get("run-e")
    assert state is not None and [s["n"] for s in state.steps] == [2, 4]


async def test_record_step_and_list_runs(store: RunStore) -> None:
    await store.record_step("run-a", "bot", {"n": 1}, NOW + 1)
    await store.record_step("run-b", "bot", {"n": 2}, NOW + 3)
    await store.record_step("run-c", "other", {"n": 3}, NOW + 2)
    runs = await store.list_runs()
    assert [r.run_id for r in runs] == ["run-b", "run-c", "run-a"]  # most recently updated first
    assert [r.run_id for r in await store.list_runs(limit=2)] == ["run-b", "run-c"]
    assert runs[0].steps == [{"n": 2}] and runs[1].agent == "other"


async def test_runs_updated_pages_a_window_in_update_order(store: RunStore) -> None:
    """The idle sweep's read: runs last updated in (after, before], oldest first and by run id among
    equal times, in pages that neither skip nor repeat a run, each with its steps. A page holds `page`
    runs, or more where it ends among runs of one time (Redis takes those whole)."""
    for run_id, at in (("w-early", 1.0), ("w-d", 3.0), ("w-b", 3.0), ("w-c", 3.0), ("w-a", 2.0),
                       ("w-e", 4.0), ("w-late", 5.0)):
        await store.record_step(run_id, "bot", {"run": run_id}, NOW + at)
    window = store.runs_updated(NOW + 1, NOW + 4, page=2)
    listed = [[(r.run_id, r.updated_at) for r in page] async for page in window]
    assert [run for page in listed for run in page] == [
        ("w-a", NOW + 2), ("w-b", NOW + 3), ("w-c", NOW + 3), ("w-d", NOW + 3), ("w-e", NOW + 4)]
    assert all(len(page) <= 2 or len({at for _, at in page[1:]}) == 1 for page in listed)
    [[only]] = [page async for page in store.runs_updated(NOW + 4, NOW + 5)]
    assert (only.run_id, only.steps) == ("w-late", [{"run": "w-late"}])
    assert [page async for page in store.runs_updated(NOW + 5, NOW + 9)] == []
    await store.record_step("w-a", "bot", {"run": "again"}, NOW + 6)  # busy again: out of its old window
    assert [[r.run_id for r in p] async for p in store.runs_updated(NOW, NOW + 2)] == [["w-early"]]
    for i in (3, 1, 5, 2, 4):  # more runs of one time than a page holds
        await store.record_step(f"t-{i}", "bot", {}, NOW + 7)
    pages = [[r.run_id for r in page] async for page in store.runs_updated(NOW + 6, NOW + 7, page=2)]
    assert [run for page in pages for run in page] == ["t-1", "t-2", "t-3", "t-4", "t-5"]


async def all_pages(store: RunStore, limit: int, after: RunsCursor | None = None) -> list[list[str]]:
    """Run ids of every page of `runs_page` from `after`, checking each `next` is its page's last run."""
    pages = []
    while True:
        page = await store.runs_page(after, limit)
        pages.append([r.run_id for r in page.runs])
        if page.next is None:
            return pages
        last = page.runs[-1]
        assert page.next == (last.updated_at, last.run_id) and len(page.runs) == limit
        after = page.next


async def test_runs_page_lists_every_run_once_in_update_order(store: RunStore) -> None:
    """The admin API's listing: least recently updated first, by run id among equal times (a tie longer
    than a page included), `next` exactly when runs follow, each run with its steps."""
    for run_id, at in (("p-late", 5.0), ("p-d", 3.0), ("p-b", 3.0), ("p-c", 3.0), ("p-a", 2.0), ("p-early", 1.0)):
        await store.record_step(run_id, "bot", {"run": run_id}, NOW + at)
    assert await all_pages(store, 2) == [["p-early", "p-a"], ["p-b", "p-c"], ["p-d", "p-late"]]
    assert await all_pages(store, 6) == [["p-early", "p-a", "p-b", "p-c", "p-d", "p-late"]]
    assert await all_pages(store, 5) == [["p-early", "p-a", "p-b", "p-c", "p-d"], ["p-late"]]
    whole = await store.runs_page(None, 1000)
    assert (whole.next, whole.runs[0].steps, whole.runs[0].agent) == (None, [{"run": "p-early"}], "bot")
    assert whole.runs[-1].updated_at == NOW + 5
    for i in (3, 1, 5, 2, 4):  # more runs of one time than a page holds
        await store.record_step(f"t-{i}", "bot", {}, NOW + 7)
    assert await all_pages(store, 2, (NOW + 5, "p-late")) == [["t-1", "t-2"], ["t-3", "t-4"], ["t-5"]]
    assert await all_pages(store, 2, (NOW + 7, "t-5")) == [[]]


async def test_runs_page_never_skips_a_run_updated_while_a_client_pages(store: RunStore) -> None:
    """A run updated between two pages moves to the end of the order, so it comes in a later page (again,
    if it was listed), and a run created meanwhile comes too: nothing is skipped, even when the cursor's
    own run is the one that moved."""
    for i in range(6):
        await store.record_step(f"u-{i}", "bot", {}, NOW + i)
    first = await store.runs_page(None, 2)
    assert [r.run_id for r in first.runs] == ["u-0", "u-1"] and first.next is not None
    await store.record_step("u-1", "bot", {"again": True}, NOW + 10)  # the cursor's run, listed already
    await store.record_step("u-3", "bot", {}, NOW + 11)  # not listed yet
    await store.record_step("u-new", "other", {}, NOW + 12)
    rest = [run for page in await all_pages(store, 2, first.next) for run in page]
    assert rest == ["u-2", "u-4", "u-5", "u-1", "u-3", "u-new"]


async def test_the_idle_sweeps_mark_only_moves_forward(store: RunStore) -> None:
    assert await store.idle_swept() is None  # no sweep marked this store yet
    for upto, kept in ((NOW, NOW), (NOW - 5, NOW), (NOW + 0.1, NOW + 0.1)):  # replicas sweep at their pace
        await store.set_idle_swept(upto)
        assert await store.idle_swept() == kept


async def test_each_root_of_a_run_epoch_is_claimed_once(store: RunStore) -> None:
    """`claim_root` (`logic.claim_root` in every backend): the segments, their starts, the news that a
    later one needs, a stop ending the epoch's roots, and what a snapshot says a span goes under."""
    assert await store.claim_root("nope", 1, final=True, now=NOW) is None  # never creates a run
    await store.record_step("run-1", "bot", {"n": 1}, NOW)
    assert await store.claim_root("run-1", 1, final=False, upto=NOW - 1, now=NOW + 10) is None  # not idle then
    assert await store.claim_root("run-1", 1, final=False, upto=NOW, now=NOW + 10) == (0, None)
    assert await store.claim_root("run-1", 1, final=False, upto=NOW + 5, now=NOW + 11) is None  # nothing new
    state = await store.get("run-1", steps=False, reservations=False)
    assert state is not None and (state.root_segment(), state.root_segment(step=False)) == (1, 0)
    assert state.updated_at == NOW  # a claim is no activity of the run
    await grant(store)  # a step of the run: news
    await store.stop("run-1", "bot", "loop_detected", "repeating", NOW + 20)
    assert await store.claim_root("run-1", 1, final=False, upto=NOW + 30, now=NOW + 30) is None  # stopped
    assert await store.claim_root("run-1", 1, final=True, stopped=True, now=NOW + 21) == (1, NOW + 10)
    assert await store.claim_root("run-1", 1, final=True, stopped=True, now=NOW + 22) is None
    state = await store.get("run-1", steps=False, reservations=False)
    assert state is not None and state.root_segment() == state.root_segment(step=False) == 1
    fresh = await store.reset("run-1", NOW + 40)
    assert fresh is not None and (fresh.roots, fresh.roots_final, fresh.root_segment()) == (0, False, 0)
    assert fresh.ended is None  # the stop exported the epoch's last root
    assert await store.claim_root("run-1", 1, final=True, now=NOW + 41) is None  # the ended epoch
    await store.record_step("run-1", "bot", {"n": 2}, NOW + 42)
    assert await store.claim_root("run-1", 2, final=False, upto=NOW + 42, now=NOW + 43) == (0, None)
    await store.record_step("run-1", "bot", {"n": 3}, NOW + 44)
    again = await store.reset("run-1", NOW + 45)  # the reset claims the ending epoch's root itself
    assert again is not None and again.epoch == 3 and again.ended is not None
    ended, claimed = again.ended
    assert claimed == (1, NOW + 43) and ended.epoch == 2 and ended.updated_at == NOW + 44
    assert [s["n"] for s in ended.steps] == [2, 3]  # the epoch as it was: its totals are the root's
    assert (await store.get("run-1")).ended is None  # type: ignore[union-attr]  # never stored


async def test_100_concurrent_claims_of_one_root_have_one_winner(store: RunStore) -> None:
    await store.record_step("run-1", "bot", {"n": 1}, NOW)
    won = await asyncio.gather(*(store.claim_root("run-1", 1, final=i % 2 == 0, upto=NOW, now=NOW + 1)
                                 for i in range(100)))
    assert [w for w in won if w is not None] == [(0, None)]


async def test_get_returns_a_snapshot(store: RunStore) -> None:
    await grant(store)
    await store.push("run-1", "bot", "calls", ["a"], 6)
    snap = await store.get("run-1")
    assert snap is not None
    snap.used["usd"] = 5.0
    snap.lists["calls"].append("b")
    snap.status = "stopped"
    state = await store.get("run-1")
    assert state is not None and "usd" not in state.used and state.lists["calls"] == ["a"]
    assert state.status == "active"


@pytest.mark.parametrize("other", ["sqlite", "redis"])
async def test_backends_agree(other: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The same script gives the same run on every backend (the arithmetic lives once, in logic; Redis
    runs its Lua twin)."""

    async def script(s: RunStore) -> dict[str, Any]:
        reservations = [await grant(s) for _ in range(4)]
        await s.settle(reservations[0], {"usd": 0.001, "llm_calls": 1.0}, NOW)
        await s.settle(reservations[1], dict(reservations[1].amounts), NOW)
        await s.add("run-1", "bot", "tool_calls", 2.0, limit=5.0, code="tool_call_cap", now=NOW)
        await s.push("run-1", "bot", "calls", ["x", "y"], 6)
        await s.record_step("run-1", "bot", {"k": "v"}, NOW)
        await s.reserve(
            "run-1", "bot", ReserveRequest((Claim("usd", 1.0, 0.0, 0.02, "budget_exhausted"),)), NOW
        )
        state = await s.get("run-1")
        assert state is not None
        await s.close()
        data = state.view()
        data["open"] = len(state.open)
        data["lists"] = state.lists
        return data

    memory = await script(MemoryRunStore())
    theirs = await script(open_backend(other, request, tmp_path))
    assert memory == theirs
    assert memory["status"] == "stopped" and memory["open"] == 2


# -- concurrency -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (
            ReserveRequest((Claim("usd", 0.001, 4e-6, 10 * PER_CALL, "budget_exhausted"),), 16, 250),
            "budget_exhausted",
        ),
        (
            ReserveRequest((Claim("tokens", 1000.0, 1.0, 12_500.0, "token_budget_exhausted"),), 16, 250),
            "token_budget_exhausted",
        ),
        (ReserveRequest((Claim("llm_calls", 1.0, 0.0, 10.0, "llm_call_cap"),)), "llm_call_cap"),
    ],
    ids=["usd", "tokens", "llm-calls"],
)
async def test_200_concurrent_reserves_on_a_budget_for_10_grant_exactly_10(
    store: RunStore, request_: ReserveRequest, reason: str
) -> None:
    results = await asyncio.gather(*(store.reserve("run-1", "bot", request_, NOW) for _ in range(200)))
    grants = [r for r in results if isinstance(r, Reservation)]
    denials = [r for r in results if isinstance(r, Denial)]
    assert len(grants) == 10 and len(denials) == 190
    assert {d.reason for d in denials} == {reason}
    assert len({g.id for g in grants}) == 10
    await asyncio.gather(*(store.settle(g, g.amounts, NOW) for g in grants))
    state = await store.get("run-1")
    assert state is not None and state.open == {}
    claim = request_.claims[0]
    assert claim.limit is not None
    assert state.used[claim.counter] <= claim.limit + 1e-9
    assert state.reserved[claim.counter] == pytest.approx(0.0)


async def test_200_concurrent_steps_that_reserve_then_settle(store: RunStore) -> None:
    """Interleaved reserve / await / settle: spend never exceeds the budget, and exactly 10 steps run."""
    request = ReserveRequest((Claim("usd", 0.001, 4e-6, 10 * PER_CALL, "budget_exhausted"),), 16, 250)
    ran = 0

    async def step() -> None:
        nonlocal ran
        result = await store.reserve("run-1", "bot", request, NOW)
        if isinstance(result, Denial):
            return
        ran += 1
        await asyncio.sleep(0)  # the upstream call
        await store.settle(result, result.amounts, NOW)  # no usage reported: charged the reservation

    await asyncio.gather(*(step() for _ in range(200)))
    state = await store.get("run-1")
    assert state is not None
    assert ran == 10
    assert state.used["usd"] == pytest.approx(10 * PER_CALL) and state.used["usd"] <= 10 * PER_CALL + 1e-9
    assert state.reserved["usd"] == pytest.approx(0.0) and state.open == {}


# -- SQLite durability -----------------------------------------------------------------------------


async def test_sqlite_spend_and_stops_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteRunStore.open(path)
    for _ in range(3):
        res = await grant(first)
        await first.settle(res, {"usd": 0.0015, "llm_calls": 1.0}, NOW)
    await grant(first, "run-stopped")
    await first.stop("run-stopped", "bot", "loop_detected", "repeating", NOW)
    await first.close()

    second = SqliteRunStore.open(path)
    try:
        state = await second.get("run-1")
        assert state is not None
        assert state.used == {"usd": pytest.approx(0.0045), "llm_calls": 3.0} and state.open == {}
        stopped = await second.get("run-stopped")
        assert stopped is not None and (stopped.status, stopped.stop_reason) == ("stopped", "loop_detected")
        denial = await second.reserve("run-stopped", "bot", CALL, NOW)
        assert isinstance(denial, Denial) and denial.reason == "loop_detected"
        # the budget still holds: 0.02 - 0.0045 left pays for 7 full calls and one of 125 tokens
        units = []
        while isinstance(result := await second.reserve("run-1", "bot", CALL, NOW), Reservation):
            units.append(result.units)
        assert units == [250] * 7 + [125]
        assert result.reason == "budget_exhausted"
    finally:
        await second.close()


# A process that reserves, settles one reservation, leaves the others open and dies by SIGKILL.
_CRASHING = """
import asyncio, os, signal, sys
import orjson
from gateway.store.base import Claim, ReserveRequest
from gateway.store.sqlite import SqliteRunStore

async def main() -> None:
    store = SqliteRunStore.open(sys.argv[1])
    usd = Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted")
    call = ReserveRequest((usd, Claim("llm_calls", 1.0)), 16, 250)
    settled = await store.reserve("run-1", "bot", call, 1000.0)
    await store.settle(settled, {"usd": 0.001, "llm_calls": 1.0}, 1000.0)
    open_1 = await store.reserve("run-1", "bot", call, 1000.0)
    open_2 = await store.reserve("run-1", "bot", call, 1000.0)
    await store.reserve("run-2", "bot", call, 1000.0)
    out = [[r.id, r.epoch, r.amounts] for r in (settled, open_1, open_2)]
    sys.stdout.buffer.write(orjson.dumps(out))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no settle, no close

asyncio.run(main())
"""


async def test_sqlite_keeps_the_claimed_roots_across_a_restart(tmp_path: Path) -> None:
    """A restarted process (or one whose cache dropped the run) never exports a root twice."""
    path = tmp_path / "state.db"
    first = SqliteRunStore.open(path)
    await first.record_step("run-1", "bot", {"n": 1}, NOW)
    assert await first.claim_root("run-1", 1, final=False, upto=NOW, now=NOW + 10) == (0, None)
    await first.close()
    second = SqliteRunStore.open(path)
    try:
        assert await second.claim_root("run-1", 1, final=False, upto=NOW, now=NOW + 20) is None
        state = await second.get("run-1")
        assert state is not None and (state.roots, state.roots_mark, state.roots_end) == (1, NOW, NOW + 10)
    finally:
        await second.close()


async def test_sqlite_recovers_reservations_of_a_crashed_process_as_spend(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING, str(path),
        stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[2],
    )
    out, _ = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    dead = [Reservation(rid, "run-1", epoch, 250, held) for rid, epoch, held in orjson.loads(out)]
    settled, open_1, open_2 = dead
    restarted = SqliteRunStore.open(path)  # the OS released the dead process's lock
    try:
        state = await restarted.get("run-1")
        assert state is not None
        assert state.open == {} and state.reserved["usd"] == pytest.approx(0.0)
        assert state.used["usd"] == pytest.approx(0.001 + 2 * PER_CALL)  # never zero for unseen answers
        assert state.used["llm_calls"] == 3.0
        other = await restarted.get("run-2")
        assert other is not None and other.open == {} and other.used["usd"] == pytest.approx(PER_CALL)
        # a late settle of the dead process's reservations cannot count twice
        await restarted.settle(open_1, {"usd": 0.0}, NOW)
        await restarted.settle(open_2, {"usd": 0.0}, NOW)
        again = await restarted.get("run-1")
        assert again is not None and again.used == state.used
        # the new process's reservation ids do not collide with the dead one's
        assert (await grant(restarted)).id not in {open_1.id, open_2.id, settled.id}
    finally:
        await restarted.close()


async def test_sqlite_uses_wal(tmp_path: Path) -> None:
    store = SqliteRunStore.open(tmp_path / "state.db")
    await store.close()
    conn = sqlite3.connect(tmp_path / "state.db")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_sqlite_unopenable_file_is_state_unavailable(tmp_path: Path) -> None:
    with pytest.raises(StateUnavailable, match="cannot open state file"):
        SqliteRunStore.open(tmp_path / "missing-dir" / "state.db")
