"""A real `redis-server` on a free loopback port, for tests (never a mock).

Import the fixtures where they are needed (`from tests.redis_fixture import redis_server`).
Without `redis-server` on PATH the tests skip locally and FAIL in CI (env `CI` set): CI installs it
(`scripts/system-deps.sh`), so its absence there is a broken setup, not a reason to pass.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.ports import free_port

READY_TIMEOUT_S = 5.0


def redis_binary() -> str:
    """Path of redis-server, or skip (locally) / fail (in CI)."""
    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (scripts/system-deps.sh installs it)")
        pytest.skip("redis-server is not installed")
    return found


class RedisServer:
    """One redis-server process; `stop()` and `start()` again keep the same port (a Redis restart)."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.binary = redis_binary()
        self.workdir = workdir
        self.extra = extra
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            "",
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self.ping():
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        """Terminate (or SIGKILL) and wait, so the port is free for a restart."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def start_server(workdir: Path, *extra: str) -> RedisServer:
    """Start a server; a port taken between choosing and binding gets another try."""
    for attempt in range(3):
        server = RedisServer(workdir, *extra)
        try:
            server.start()
            return server
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for a whole session; tests keep apart by key prefix."""
    server = start_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that stop, pause or restart it."""
    server = start_server(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "redis"])
def memory_or_redis(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The `state:` config of a test run once on the memory store and once on the session's Redis."""
    if request.param == "memory":
        return {"backend": "memory"}
    server: RedisServer = request.getfixturevalue("redis_server")
    return {"backend": "redis", "url": server.url}
