"""`Connection.wait`, the one timed wait of an upstream exchange, driven through `Http1Pool` against a
loopback upstream on its own thread (so it answers while the test's event loop is blocked)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from gateway.config import Timeouts
from gateway.errors import UpstreamTimeout
from gateway.http1 import Http1Pool

BOTH_LOOPS = True  # asyncio's loop and uvloop (tests/conftest.py): uvloop is where the order matters


class ThreadedUpstream:
    """A keep-alive upstream on a thread of its own, so it answers while the test's event loop is
    blocked. Each (bodiless) request is answered with `head_and_start`, and `rest`, when set, after
    `more` is set. With `stall` set, each write is preceded by a byte on `stall`'s other end (see
    `Stall`) and a pause, so the loop is busy in an I/O callback when the answer arrives."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.head_and_start = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        self.rest = b""
        self.more = threading.Event()
        self.stall: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        if self.stall is not None:
            self.stall.send(b"!")
            time.sleep(0.05)  # the loop is inside the stall's callback now
        conn.sendall(data)

    def _serve(self) -> None:
        try:
            self._answer()
        except OSError:
            pass  # the client gave up on the connection (a timeout closes it) or the test closed it

    def _answer(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            pending = b""
            while chunk := conn.recv(65536):
                pending += chunk
                while b"\r\n\r\n" in pending:
                    _, pending = pending.split(b"\r\n\r\n", 1)
                    # read before the head goes: the test sets the next answer once this one arrived,
                    # which may be before this thread looks again (the warm-up answer must stay whole)
                    head, rest = self.head_and_start, self.rest
                    self._send(conn, head)
                    if rest:
                        self.more.wait(5)
                        self._send(conn, rest)

    def close(self) -> None:
        self.more.set()
        self.listener.close()
        self.thread.join(timeout=5)


class Stall(asyncio.Protocol):
    """Blocks the event loop for `seconds` in its `data_received`, as a burst of requests on other
    connections does: the loop reads no other socket meanwhile."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def data_received(self, data: bytes) -> None:
        time.sleep(self.seconds)


@pytest.mark.parametrize("phase", ["headers", "body"])
async def test_an_answer_that_arrived_while_the_loop_was_busy_is_not_a_timeout(phase: str) -> None:
    """The event loop is busy for longer than the timeout while the upstream answers: when it turns
    again, the expired timer and the answer are due together. The answer arrived in time, so it
    counts (uvloop runs timers before it reads sockets; asyncio reads them first)."""
    loop = asyncio.get_running_loop()
    upstream = ThreadedUpstream()
    ours, theirs = socket.socketpair()
    stall, _ = await loop.create_connection(lambda: Stall(0.4), sock=ours)
    pool = Http1Pool(loop)
    timeouts = Timeouts(connect=1, first_byte=0.2, idle=0.2)
    try:
        warm = await pool.open("GET", upstream.url + "/warm", {}, None, timeouts)
        assert await warm.read() == b"ok"  # pooled now: the next open writes its request at once
        if phase == "headers":
            upstream.stall = theirs
            resp = await pool.open("GET", upstream.url + "/x", {}, None, timeouts)
            assert resp.status == 200 and await resp.read() == b"ok"
        else:
            upstream.head_and_start = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok"
            upstream.rest = b"!!"
            resp = await pool.open("GET", upstream.url + "/x", {}, None, timeouts)
            upstream.stall = theirs
            upstream.more.set()
            assert await resp.read() == b"ok!!"
    finally:
        await pool.close()
        upstream.close()
        stall.close()
        theirs.close()


async def test_a_timer_that_expires_with_nothing_arrived_is_still_a_timeout() -> None:
    """The other side of the rule above: a busy loop does not stretch a timeout when nothing came."""
    loop = asyncio.get_running_loop()
    upstream = ThreadedUpstream()
    upstream.head_and_start = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok"
    upstream.rest = b"!!"  # never sent: `more` stays unset
    pool = Http1Pool(loop)
    try:
        resp = await pool.open("GET", upstream.url + "/x", {}, None, Timeouts(connect=1, first_byte=0.5, idle=0.2))
        loop.call_soon(time.sleep, 0.4)
        with pytest.raises(UpstreamTimeout):
            await resp.read()
    finally:
        await pool.close()
        upstream.close()
