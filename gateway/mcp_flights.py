"""`tools/call` executions in flight, each in a task of its own, so its client leaving cannot skip its
recording.

Why: aiohttp cancels the handler of a client that goes away (`handler_cancellation`), and cancels it
again when the shutdown gives up on it. A call must be recorded whatever happens to its handler (its
step in the run view, its span, its ledger row, its count carried, its write claim released or kept),
and recording awaits the run store. So the handler only awaits the execution (shielded) and, when the
handler is cancelled, ends the execution itself, once, in a controlled way (`Flights.run`):
* a call not yet sent to the server (parked for approval included) is cut (`Flight.cut`
  `client_disconnected`): its approval is denied, its count carried to an identical retry, and it is
  recorded;
* a call the execution marked `keep` (a sent `write`/`dangerous` call) runs on to its answer, which is
  judged and recorded as always: the tool runs once, and the identical retry gets its result;
* any other call already sent is cut and recorded as `client_disconnected`;
* an execution marked `recording` (judging the server's answer, or recording its outcome) is never cut:
  the tool's result is in hand, finishing is a few store round trips.
Nothing else cancels an execution, so its recording, once begun, is never interrupted. At shutdown,
`end_flights` (after the connections drained, before the store and the ledger close) cuts what still
runs (`shutting_down`) and waits for the recordings. This module imports nothing of the MCP proxy, so
`tollgate serve` can hold the hook without loading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from gateway.runtime import Gateway

T = TypeVar("T")
CLIENT_LEFT: Final = "client_disconnected"
SHUTDOWN: Final = "shutting_down"
SERVICE: Final = "mcp_flights"
DRAIN_S: Final = 5.0  # how long the shutdown waits for the recordings of the calls it cut
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Flight:
    """What the handler and the execution of one call tell each other."""

    keep: bool = False  # set by the execution: run on to the answer if the client leaves now
    keep_for: float = 0.0  # with `keep`: how long at most after the client left (0: until the answer)
    recording: bool = False  # set by the execution: never cut from now on (not even at shutdown)
    client_left: bool = False  # set by the handler: nobody will read the answer
    cut: str | None = None  # why the execution was cancelled (`client_disconnected`, `shutting_down`)


class Flights:
    """The executions of this process. Use it from the event loop."""

    def __init__(self, closing: Callable[[], bool] = lambda: False) -> None:
        self._running: dict[asyncio.Task[Any], Flight] = {}
        self._closing = closing  # the gateway is shutting down: a cancelled caller is the shutdown's doing

    def __len__(self) -> int:
        return len(self._running)

    def running(self) -> list[Flight]:
        """The executions running now (an observer's view: a metric, a test)."""
        return list(self._running.values())

    async def run(self, execute: Callable[[Flight], Coroutine[Any, Any, T]]) -> T:
        """`execute(flight)` in its own task; its result, or its exception. When the caller is cancelled
        (its client left), the execution is cut unless it is marked `keep`, and the cancellation goes
        on to the caller."""
        flight = Flight()
        task = asyncio.get_running_loop().create_task(execute(flight))
        self._running[task] = flight
        task.add_done_callback(self._done)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            shutdown = self._closing()
            flight.client_left = not shutdown
            if not flight.keep:
                self._cut(task, flight, SHUTDOWN if shutdown else CLIENT_LEFT)
            elif flight.keep_for > 0:  # a server that never answers must not hold it (and its claim) forever
                asyncio.get_running_loop().call_later(flight.keep_for, self._cut, task, flight, CLIENT_LEFT)
            raise

    async def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Cut every execution still running (`shutting_down`; one cut already, or recording, is left to
        finish its recording) and wait up to `timeout_s` for all of them to end."""
        for task, flight in list(self._running.items()):
            self._cut(task, flight, SHUTDOWN)
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout_s)

    @staticmethod
    def _cut(task: asyncio.Task[Any], flight: Flight, cause: str) -> None:
        if flight.cut is None and not flight.recording and not task.done():
            flight.cut = cause
            task.cancel()

    def _done(self, task: asyncio.Task[Any]) -> None:
        flight = self._running.pop(task, None)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here, so one nobody awaits any more is logged once, below
        if exc is not None and flight is not None and flight.client_left:
            log.error("a tools/call whose client had left failed", exc_info=exc)


@contextlib.contextmanager
def uncut(flight: Flight) -> Iterator[None]:
    """A section its client leaving cannot cut: a store write and the decision it carries (a count, a
    stop). A section that raises (a stop) ends as it decided; one that ends normally after the client
    left is cut then (CancelledError, `client_disconnected`), unless the execution is kept."""
    was = flight.recording
    flight.recording = True
    try:
        yield
    finally:
        flight.recording = was
    if not was and flight.client_left and not flight.keep and flight.cut is None:
        flight.cut = CLIENT_LEFT
        raise asyncio.CancelledError


def cause_of(flight: Flight) -> str:
    """Why an execution was cancelled: its cut, else the loop itself is ending (shutdown)."""
    return flight.cut or SHUTDOWN



def flights_of(gw: Gateway) -> Flights:
    """The process's executions, `gw.services["mcp_flights"]`, created on first use."""
    flights = gw.services.get(SERVICE)
    if not isinstance(flights, Flights):
        flights = gw.services[SERVICE] = Flights(lambda: gw.shutting_down)
    return flights


async def end_flights(gw: Gateway, timeout_s: float = DRAIN_S) -> None:
    """At shutdown, once no connection is left: cut the `tools/call` executions still running and wait
    up to `timeout_s` for their recordings, before the run store and the ledger close."""
    flights = gw.services.get(SERVICE)
    if isinstance(flights, Flights):
        await flights.drain(timeout_s)
