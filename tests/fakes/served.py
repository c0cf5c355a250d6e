"""A real `tollgate serve` process on loopback ports, for tests of the process itself (signals, crashes,
restarts, several gateways on one state), and the helpers such tests share."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from tests.fakes.ports import free_port


def tollgate_command() -> list[str]:
    """The console script when installed (what users run), else `python -m gateway`."""
    script = Path(sys.executable).parent / "tollgate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]


async def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll an (async) condition with a deadline; returns its first truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without OTLP exporters or HTTP proxies (loopback only), unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OTEL_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update({"PYTHONUNBUFFERED": "1", **extra})
    return env


class Served:
    """One `python -m gateway serve` on loopback, from `home/<config>`."""

    def __init__(self, home: Path, config: dict[str, Any], name: str = "tollgate.yaml") -> None:
        self.home = home
        self.config_path = home / name
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.admin_port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.log = home / f"serve-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def spawn(self) -> None:
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path),
                "--port", str(self.port), "--admin-port", str(self.admin_port),
                cwd=self.home, env=clean_env(), stdout=log, stderr=log)

    async def start(self) -> Served:
        await self.spawn()
        proc = self.proc
        assert proc is not None
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(f"tollgate exited with {proc.returncode}: {self.output()}")
                try:
                    async with session.get(f"{self.admin_url}/readyz") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await wait_for(ready, 15.0, "/readyz")
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        await self.wait(10)

    async def stop(self) -> int:
        self.signal(signal.SIGTERM)
        return await self.wait(20)

    async def run(self, run_id: str) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.admin_url}/admin/runs/{run_id}") as resp:
                raw = await resp.read()
                try:
                    return resp.status, orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return resp.status, raw.decode(errors="replace")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
