"""Added latency of the MCP proxy per `tools/call`: the server called directly vs through tollgate.

Not collected by pytest. Three processes on loopback: the official SDK's `MCPServer` (Streamable
HTTP under uvicorn), `tollgate serve` (uvloop when installed) and this client (the SDK's `Client`).
Calls are sequential; direct and proxied blocks alternate so drift hits both alike.

    .venv/bin/python -m tests.gateway.bench_mcp [--calls 3000] [--mode legacy|auto|both]
                                                [--state memory|sqlite]

`legacy` is the handshake era (session, SSE answers), `auto` the 2026-07-28 era (JSON answers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx2
import orjson
import uvicorn
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from tests.fakes.mcp_server import build_server
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def start(args: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def measure(url: str, mode: str, calls: int, tool: str = "read_file") -> list[float]:
    headers = {"x-tollgate-agent": "bench", "x-tollgate-run-id": f"bench-{mode}"}
    out: list[float] = []
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        await client.list_tools()
        for i in range(calls):
            t0 = time.perf_counter()
            try:
                await client.call_tool(tool, {"path": f"f{i % 50}"})
            except MCPError:
                pass  # the refused-call figure measures the refusal itself
            out.append(time.perf_counter() - t0)
    return out


MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientInfo":
        {"name": "bench", "version": "0"}, "io.modelcontextprotocol/clientCapabilities": {}}


async def measure_raw(url: str, mode: str, calls: int, tool: str = "read_file") -> list[float]:
    """Prebuilt HTTP requests on one keep-alive connection: isolates the proxy from SDK client costs."""
    headers = {"x-tollgate-agent": "bench", "x-tollgate-run-id": f"bench-raw-{mode}",
               "content-type": "application/json", "accept": "application/json, text/event-stream"}
    out: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        if mode == "legacy":
            init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}}
            async with http.post(url, data=orjson.dumps(init), headers=headers) as resp:
                await resp.read()
                headers = {**headers, "mcp-session-id": resp.headers["mcp-session-id"],
                           "mcp-protocol-version": "2025-11-25"}
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            async with http.post(url, data=orjson.dumps(note), headers=headers) as resp:
                await resp.read()
        else:
            headers = {**headers, "mcp-protocol-version": MODERN, "mcp-method": "tools/call", "mcp-name": tool}
        for i in range(calls):
            params: dict[str, object] = {"name": tool, "arguments": {"path": f"f{i % 50}"}}
            if mode != "legacy":
                params["_meta"] = META
            body = orjson.dumps({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": params})
            t0 = time.perf_counter()
            async with http.post(url, data=body, headers=headers) as resp:
                data = await resp.read()
            out.append(time.perf_counter() - t0)
            assert b'"result"' in data or tool != "read_file", data
        if "mcp-session-id" in headers:
            async with http.delete(url, headers=headers) as resp:
                await resp.read()
    return out


def row(label: str, samples: list[float]) -> str:
    return (f"{label:<34} n={len(samples):<6} p50={pct(samples, 0.50):7.3f} ms  p90={pct(samples, 0.90):7.3f} ms"
            f"  p99={pct(samples, 0.99):7.3f} ms  mean={statistics.fmean(samples) * 1000:7.3f} ms")


async def bench(mcp_url: str, gw_url: str, modes: list[str], calls: int) -> None:
    rounds = 6
    for client, run in (("SDK Client", measure), ("raw HTTP", measure_raw)):
        for mode in modes:
            await run(mcp_url, mode, 200)  # warm-up both paths
            await run(gw_url, mode, 200)
            direct: list[float] = []
            proxied: list[float] = []
            for _ in range(rounds):
                direct += await run(mcp_url, mode, calls // rounds)
                proxied += await run(gw_url, mode, calls // rounds)
            refused = await run(gw_url, mode, max(calls // 3, 100), tool="admin_reset")
            era = "handshake era, SSE answers" if mode == "legacy" else "2026-07-28, JSON answers"
            print(f"-- {client}, {era}")
            print(row("direct to the MCP server", direct))
            print(row("through tollgate", proxied))
            print(row("refused by tollgate (not allowed)", refused))
            print(f"   added latency: p50 {pct(proxied, 0.5) - pct(direct, 0.5):+.3f} ms, "
                  f"p99 {pct(proxied, 0.99) - pct(direct, 0.99):+.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--mode", choices=["legacy", "auto", "both"], default="both")
    parser.add_argument("--state", choices=["memory", "sqlite"], default="memory")
    parser.add_argument("--serve-mcp", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_mcp:
        app = build_server([]).streamable_http_app()
        uvicorn.run(app, host="127.0.0.1", port=args.serve_mcp, log_level="warning")
        return
    mcp_port, gw_port, admin_port = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tollgate.yaml"
        config.write_text(
            f"mcp_servers:\n  files: {{url: http://127.0.0.1:{mcp_port}/mcp}}\n"
            f"state: {{backend: {args.state}, path: {tmp}/state.db}}\n"
            "agents:\n  bench:\n    tools: {allow: [files/read_file], on_violation: drop}\n"
        )
        server = start(["-m", "tests.gateway.bench_mcp", "--serve-mcp", str(mcp_port)], mcp_port)
        gateway = start(["-m", "gateway", "serve", "--config", str(config), "--port", str(gw_port),
                         "--admin-port", str(admin_port)], gw_port)
        try:
            print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, state {args.state}, "
                  f"{args.calls} calls per path and mode")
            modes = ["legacy", "auto"] if args.mode == "both" else [args.mode]
            asyncio.run(bench(f"http://127.0.0.1:{mcp_port}/mcp", f"http://127.0.0.1:{gw_port}/mcp/files",
                              modes, args.calls))
        finally:
            for proc in (gateway, server):
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
