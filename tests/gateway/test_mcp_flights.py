"""`tools/call` executions in their own tasks: a caller that goes away cuts its execution once, and
nothing cuts short the recording that follows."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.mcp_flights import CLIENT_LEFT, SHUTDOWN, Flight, Flights, cause_of, end_flights, flights_of


class Execution:
    """An execution that waits for `go`, and on a cut records (awaiting `recorded_go`) what cut it."""

    def __init__(self, *, keep: bool = False) -> None:
        self.keep = keep
        self.started = asyncio.Event()
        self.go = asyncio.Event()
        self.recording = asyncio.Event()
        self.recorded_go = asyncio.Event()
        self.answered = asyncio.Event()
        self.cuts: list[str] = []
        self.recorded = False

    async def __call__(self, flight: Flight) -> str:
        flight.keep = self.keep
        self.started.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cuts.append(cause_of(flight))
            self.recording.set()
            await self.recorded_go.wait()  # a store round trip: must not be interrupted
            self.recorded = True
            raise
        self.answered.set()
        return "answered"


async def test_a_caller_that_goes_away_cuts_its_execution_once_and_the_recording_completes() -> None:
    flights, execution = Flights(), Execution()
    caller = asyncio.create_task(flights.run(execution))
    await execution.started.wait()
    caller.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await caller
    await execution.recording.wait()
    [flight] = flights.running()
    assert flight.client_left and flight.cut == CLIENT_LEFT
    await flights.drain(timeout_s=0.0)  # the shutdown comes meanwhile: it must not cut the recording again
    execution.recorded_go.set()
    await flights.drain()
    assert execution.cuts == [CLIENT_LEFT] and execution.recorded
    assert len(flights) == 0


async def test_an_execution_marked_keep_runs_on_to_its_answer_when_its_caller_goes_away() -> None:
    flights, execution = Flights(), Execution(keep=True)
    caller = asyncio.create_task(flights.run(execution))
    await execution.started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    [flight] = flights.running()
    assert flight.client_left and flight.cut is None
    execution.go.set()
    await execution.answered.wait()
    await flights.drain()  # the execution is over: nothing left to cut
    assert execution.cuts == [] and len(flights) == 0


async def test_the_shutdown_cuts_what_still_runs_and_waits_for_its_recording() -> None:
    flights, kept = Flights(), Execution(keep=True)
    caller = asyncio.create_task(flights.run(kept))
    await kept.started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gw: Any = SimpleNamespace(services={})
    assert flights_of(gw) is flights_of(gw)
    gw.services["mcp_flights"] = flights
    draining = asyncio.create_task(end_flights(gw))
    await kept.recording.wait()
    assert not draining.done()  # it waits for the recording
    kept.recorded_go.set()
    await draining
    assert kept.cuts == [SHUTDOWN] and kept.recorded


async def test_the_answer_and_the_errors_of_an_execution_reach_its_caller() -> None:
    flights = Flights()

    async def answer(flight: Flight) -> int:
        return 7

    async def fail(flight: Flight) -> int:
        raise LookupError("broken")

    assert await flights.run(answer) == 7
    with pytest.raises(LookupError):
        await flights.run(fail)
    assert len(flights) == 0


async def test_end_flights_without_any_tool_call_is_a_no_op() -> None:
    gw: Any = SimpleNamespace(services={})
    await end_flights(gw)
    assert gw.services == {}


async def test_an_execution_recording_its_outcome_is_never_cut() -> None:
    flights = Flights()
    recording, finish = asyncio.Event(), asyncio.Event()

    async def record(flight: Flight) -> str:
        flight.recording = True  # the answer is in hand
        recording.set()
        await finish.wait()
        return "recorded"

    caller = asyncio.create_task(flights.run(record))
    await recording.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    draining = asyncio.create_task(flights.drain())
    [flight] = flights.running()
    assert flight.client_left and flight.cut is None
    finish.set()
    await draining
    assert len(flights) == 0 and flight.cut is None
