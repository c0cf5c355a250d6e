"""Independent acceptance test of the issue "Many sidecars, one budget" (README: "Many sidecars, one budget",
"How budgets are held"; DESIGN sections 2, 4, 5), written from the contract only.

Everything is real and on loopback: `redis-server` (the Debian binary), several `tollgate serve` processes
(`python -m gateway serve`), a fake upstream written here (an aiohttp app speaking OpenAI Chat Completions,
streamed and not, and Anthropic Messages) that counts every call that reaches it, and official clients
(the `openai` SDK's AsyncOpenAI) or aiohttp.

Prices are chosen so that what a call costs is known exactly and equals what it reserves: input is free
(`input_per_mtok: 0`) and the fake answers with `completion_tokens = min(OUT_TOKENS, max_tokens)`, the
request asking for `max_tokens = OUT_TOKENS`. One call = 500 output tokens x $40/MTok = $0.02; a budget of
$0.40 pays for exactly 20 calls. For the token budget, every request body has exactly BODY_LEN bytes and
the fake reports `prompt_tokens = BODY_LEN` (the input bound the README names: the body's UTF-8 size), so
a call costs BODY_LEN + 500 tokens, which is also its reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.fakes.ports import free_port
from tests.redis_fixture import redis_binary

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]

OUT_TOKENS = 500
OUT_PER_MTOK = 40.0
CALL_USD = OUT_TOKENS * OUT_PER_MTOK / 1e6  # 0.02
BUDGET_CALLS = 20
BUDGET_USD = 0.40  # pays for exactly 20 calls
BODY_LEN = 400  # bytes of every raw request body of the token-budget test

BUDGET_CODES = {"budget_exhausted"}
TOKEN_BUDGET_CODES = {"budget_exhausted", "token_budget_exhausted"}




# --------------------------------------------------------------------------------------------------
# fake upstream
# --------------------------------------------------------------------------------------------------

TAG = re.compile(r"run=(\S+) gw=(\d+)")


@dataclass
class UpCall:
    run: str
    gw: int
    api: str
    stream: bool
    max_tokens: int | None
    input_tokens: int
    output_tokens: int
    answered: bool = False


@dataclass
class FakeUpstream:
    """OpenAI `/v1/chat/completions` (non-streamed and streamed with a usage chunk) and Anthropic
    `/v1/messages`. Each request carries `run=<id> gw=<i>` in its last user message: the fake counts per run
    and per gateway. `hold(run, gw)` parks matching calls until `release()`."""

    prompt_tokens: int = 300
    calls: list[UpCall] = field(default_factory=list)
    holds: dict[tuple[str, int | None], asyncio.Event] = field(default_factory=dict)
    waiting: list[UpCall] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        self.port = free_port()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()

    async def stop(self) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()

    def hold(self, run: str, gw: int | None = None) -> None:
        self.holds[(run, gw)] = asyncio.Event()

    def release(self) -> None:
        for ev in self.holds.values():
            ev.set()

    def reached(self, run: str, gw: int | None = None) -> int:
        return sum(1 for c in self.calls if c.run == run and (gw is None or c.gw == gw))

    def billed(self, run: str) -> tuple[int, int]:
        """(input, output) tokens of the answers this fake gave for `run`."""
        done = [c for c in self.calls if c.run == run and c.answered]
        return sum(c.input_tokens for c in done), sum(c.output_tokens for c in done)

    def _record(self, body: dict[str, Any], api: str) -> UpCall:
        msgs = body.get("messages") or []
        content = msgs[-1].get("content") if msgs else ""
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
        m = TAG.search(str(content))
        run, gw = (m.group(1), int(m.group(2))) if m else ("?", -1)
        mt = body.get("max_completion_tokens") or body.get("max_tokens")
        out = min(OUT_TOKENS, int(mt)) if mt else OUT_TOKENS
        call = UpCall(run, gw, api, bool(body.get("stream")), mt, self.prompt_tokens, out)
        self.calls.append(call)
        return call

    async def _park(self, call: UpCall) -> None:
        ev = self.holds.get((call.run, call.gw)) or self.holds.get((call.run, None))
        if ev is not None and not ev.is_set():
            self.waiting.append(call)
            try:
                await ev.wait()
            finally:
                self.waiting.remove(call)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        call = self._record(body, "openai")
        await self._park(call)
        usage = {
            "prompt_tokens": call.input_tokens,
            "completion_tokens": call.output_tokens,
            "total_tokens": call.input_tokens + call.output_tokens,
        }
        base = {"id": "chatcmpl-fake", "created": 1700000000, "model": body.get("model")}
        if not call.stream:
            call.answered = True
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await send({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        await send({**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]})
        await send({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**chunk, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        call.answered = True
        await resp.write_eof()
        return resp

    async def _messages(self, request: web.Request) -> web.Response:
        body = await request.json()
        call = self._record(body, "anthropic")
        await self._park(call)
        call.answered = True
        return web.json_response(
            {
                "id": "msg_fake",
                "type": "message",
                "role": "assistant",
                "model": body.get("model"),
                "content": [{"type": "text", "text": "ok"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": call.input_tokens, "output_tokens": call.output_tokens},
            }
        )


# --------------------------------------------------------------------------------------------------
# redis-server and tollgate serve processes
# --------------------------------------------------------------------------------------------------


class RedisServer:
    def __init__(self, workdir: Path, persist: bool = False) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        if self.persist:  # README: the Redis that holds shared budgets keeps its data
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self._log = open(self.dir / "redis.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    async def ready(self, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                assert self.proc is not None and self.proc.poll() is None, "redis-server exited"
                try:
                    r, w = await asyncio.open_connection("127.0.0.1", self.port)
                    w.write(b"PING\r\n")
                    line = await r.readline()
                    w.close()
                    await w.wait_closed()
                    if line.startswith(b"+PONG"):
                        return
                except OSError:
                    pass
                await asyncio.sleep(0.02)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None


class Cluster:
    """`n` tollgate serve processes sharing one Redis and one fake upstream."""

    def __init__(self, tmp: Path, upstream: FakeUpstream, redis: RedisServer, n: int, agent: str, state_extra: str = "",
                 extra: str = ""):
        self.tmp = tmp
        self.n = n
        self.ports = [(free_port(), free_port()) for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        self.config_text = f"""
providers:
  openai: {{type: openai, base_url: "http://127.0.0.1:{upstream.port}/v1", api_key: sk-upstream-secret-key}}
  anthropic: {{type: anthropic, base_url: "http://127.0.0.1:{upstream.port}", api_key: sk-ant-upstream-secret}}
models: {{"gpt-*": openai, "claude-*": anthropic}}
pricing:
  "gpt-*": {{input_per_mtok: 0.0, output_per_mtok: {OUT_PER_MTOK}}}
  "claude-*": {{input_per_mtok: 0.0, output_per_mtok: {OUT_PER_MTOK}}}
state: {{backend: redis, url: "redis://127.0.0.1:{redis.port}/0"{state_extra}}}
agents:
  default:
{agent}
{extra}
"""

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i][0]}"

    def admin(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i][1]}"

    async def start(self, session: aiohttp.ClientSession) -> None:
        for i, (port, admin) in enumerate(self.ports):
            d = self.tmp / f"gw{i}"
            d.mkdir(parents=True, exist_ok=True)
            cfg = d / "tollgate.yaml"
            cfg.write_text(self.config_text + f"ledger: {{path: {d / 'ledger.db'}}}\n")
            log = open(d / "gateway.log", "ab")  # noqa: SIM115
            self.logs.append(log)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.procs.append(
                subprocess.Popen(
                    [PY, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port), "--admin-port", str(admin)],
                    cwd=str(REPO),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )

        async def ready(i: int) -> None:
            while True:
                assert self.procs[i].poll() is None, f"gateway {i} exited:\n{self.log_tail(i)}"
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.admin(i)}/readyz") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)

        async with asyncio.timeout(30):
            await asyncio.gather(*(ready(i) for i in range(self.n)))

    def log_tail(self, i: int, lines: int = 30) -> str:
        p = self.tmp / f"gw{i}" / "gateway.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def sigkill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)

    def alive(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in self.logs:
            log.close()
        self.logs.clear()

    async def view(self, session: aiohttp.ClientSession, i: int, run: str) -> tuple[int, Any]:
        async with session.get(f"{self.admin(i)}/admin/runs/{run}") as r:
            return r.status, await r.json(content_type=None)

    async def settled(self, session: aiohttp.ClientSession, i: int, run: str, timeout: float = 15.0) -> dict[str, Any]:
        """The run's view once nothing of it is reserved (a stream settles after its last byte: poll)."""
        deadline = time.monotonic() + timeout
        while True:
            status, view = await self.view(session, i, run)
            if status == 200 and not view["reserved_usd"] and not view["reserved_tokens"]:
                return view  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway {i}: run {run} never settled: {status} {view}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def environment(
    tmp: Path, n: int, agent: str, *, persist: bool = False, state_extra: str = "", prompt_tokens: int = 300,
    extra: str = "",
) -> Any:
    upstream = FakeUpstream(prompt_tokens=prompt_tokens)
    await upstream.start()
    redis = RedisServer(tmp / "redis", persist=persist)
    redis.start()
    cluster: Cluster | None = None
    # limit=0: the 400 requests are all in flight at once, not 100 at a time (aiohttp's default pool)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=aiohttp.TCPConnector(limit=0))
    try:
        await redis.ready()
        cluster = Cluster(tmp, upstream, redis, n, agent, state_extra, extra)
        await cluster.start(session)
        yield upstream, redis, cluster, session
    finally:
        upstream.release()
        if cluster is not None:
            cluster.stop()
        redis.terminate()
        await session.close()
        await upstream.stop()


# --------------------------------------------------------------------------------------------------
# wire-format checks
# --------------------------------------------------------------------------------------------------


def openai_error(body: Any, codes: set[str]) -> str | None:
    """None if `body` is an OpenAI error with one of `codes`, else what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not OpenAI's error format: {body!r}"
    err = body["error"]
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error lacks {sorted(missing)}: {body!r}"
    if err["param"] is not None or not isinstance(err["message"], str) or not err["message"]:
        return f"bad param/message: {body!r}"
    if err["code"] not in codes:
        return f"code {err['code']!r} not in {sorted(codes)}"
    return None


def anthropic_error(body: Any, codes: set[str]) -> str | None:
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(body.get("error"), dict):
        return f"not Anthropic's error format: {body!r}"
    err = body["error"]
    if not isinstance(err.get("type"), str) or not isinstance(err.get("message"), str) or not err["message"]:
        return f"bad type/message: {body!r}"
    if err.get("code") not in codes:
        return f"code {err.get('code')!r} not in {sorted(codes)}"
    return None


def tag(run: str, gw: int, k: int) -> str:
    return f"run={run} gw={gw} n={k:04d}"


def openai_body(run: str, gw: int, k: int, *, stream: bool = False, length: int | None = None) -> bytes:
    obj: dict[str, Any] = {
        "model": "gpt-fake",
        "max_tokens": OUT_TOKENS,
        "messages": [{"role": "user", "content": tag(run, gw, k)}],
    }
    if stream:
        obj["stream"] = True
        obj["stream_options"] = {"include_usage": True}
    raw = json.dumps(obj, separators=(",", ":")).encode()
    if length is not None:  # pad the message so that every body has exactly `length` bytes
        pad = length - len(raw) - 1
        assert pad >= 0
        obj["messages"][0]["content"] = tag(run, gw, k) + " " + "x" * pad
        raw = json.dumps(obj, separators=(",", ":")).encode()
        assert len(raw) == length, len(raw)
    return raw


def anthropic_body(run: str, gw: int, k: int) -> bytes:
    return json.dumps(
        {"model": "claude-fake", "max_tokens": OUT_TOKENS, "messages": [{"role": "user", "content": tag(run, gw, k)}]}
    ).encode()


def headers(run: str, anthropic: bool = False) -> dict[str, str]:
    h = {"content-type": "application/json", "x-tollgate-run-id": run}
    if anthropic:
        h["anthropic-version"] = "2023-06-01"
        h["x-api-key"] = "agent-side-key"
    return h


async def post(session: aiohttp.ClientSession, url: str, body: bytes, hdrs: dict[str, str]) -> tuple[int, Any, Any]:
    async with session.post(url, data=body, headers=hdrs) as r:
        raw = await r.read()
        try:
            parsed: Any = json.loads(raw) if raw and not raw.startswith(b"data:") else raw
        except ValueError:
            parsed = raw
        return r.status, parsed, r.headers.copy()


USD_AGENT = f"    budget: {{usd: {BUDGET_USD}}}\n"


# --------------------------------------------------------------------------------------------------
# 1. four gateways, one Redis, 400 concurrent requests on one run
# --------------------------------------------------------------------------------------------------


async def _sdk_call(client: openai.AsyncOpenAI, gw: int, run: str, k: int, stream: bool) -> tuple[str, Any]:
    """('ok', usage) | ('refused', (status, body)) | ('error', description)."""
    kwargs: dict[str, Any] = {
        "model": "gpt-fake",
        "max_tokens": OUT_TOKENS,
        "messages": [{"role": "user", "content": tag(run, gw, k)}],
    }
    try:
        if not stream:
            resp = await client.chat.completions.create(**kwargs)
            if resp.choices[0].message.content != "ok":
                return "error", f"answer {resp!r}"
            return "ok", resp.usage
        s = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        if text != "ok" or usage is None:
            return "error", f"stream text {text!r} usage {usage!r}"
        return "ok", usage
    except openai.APIStatusError as exc:
        try:
            body = exc.response.json()
        except ValueError:
            body = exc.response.text
        return "refused", (exc.status_code, body)
    except openai.APIError as exc:  # connection errors, an error event inside a stream
        return "error", f"{type(exc).__name__}: {exc}"


async def _four_gateways_400(tmp_path: Path, stream: bool) -> dict[str, Any]:
    run = "run-" + uuid.uuid4().hex[:12]
    async with asyncio.timeout(50), environment(tmp_path, 4, USD_AGENT) as (upstream, _redis, cluster, session):
        clients = [
            openai.AsyncOpenAI(
                base_url=f"{cluster.url(i)}/v1",
                api_key="agent-side-key",
                max_retries=0,
                timeout=30,
                default_headers={"x-tollgate-run-id": run},
            )
            for i in range(4)
        ]
        try:
            results = await asyncio.gather(*(_sdk_call(clients[k % 4], k % 4, run, k, stream) for k in range(400)))
        finally:
            for c in clients:
                await c.close()
        try:
            views = [await cluster.settled(session, i, run) for i in range(4)]
        except AssertionError as exc:  # say what the calls got: a reservation left open has a cause there
            statuses = Counter(200 if kind == "ok" else (v[0] if kind == "refused" else "error") for kind, v in results)
            odd = [v for kind, v in results if kind == "error" or (kind == "refused" and v[0] != 403)][:5]
            logs = "\n".join(cluster.log_tail(i) for i in range(4))
            raise AssertionError(f"{exc}\nstatuses {dict(statuses)}; odd answers {odd}\ngateway logs:\n{logs}") from None
        return {"run": run, "results": results, "views": views, "upstream": upstream}


def _check_four_gateways(out: dict[str, Any], label: str) -> None:
    results, views, upstream, run = out["results"], out["views"], out["upstream"], out["run"]
    kinds = Counter(kind for kind, _ in results)
    statuses = Counter(200 if kind == "ok" else (v[0] if kind == "refused" else "error") for kind, v in results)
    bad_refusals = [v for kind, v in results if kind == "refused" and (v[0] != 403 or openai_error(v[1], BUDGET_CODES))]
    messages = Counter(v[1]["error"]["message"][:60] for kind, v in results if kind == "refused" and v[0] == 403)
    reached = upstream.reached(run)
    ok_usage = [v for kind, v in results if kind == "ok"]
    print(
        f"\n[{label}] statuses={dict(statuses)} reached_upstream={reached}/400 "
        f"spent_usd={[v['spent_usd'] for v in views]} budget={BUDGET_USD} "
        f"reserved_usd={[v['reserved_usd'] for v in views]} reserved_tokens={[v['reserved_tokens'] for v in views]} "
        f"llm_calls={views[0]['llm_calls']} refusal messages={dict(messages)} "
        f"answers per gateway={dict(Counter(c.gw for c in upstream.calls if c.run == run))}"
    )
    assert kinds["error"] == 0, [v for kind, v in results if kind == "error"][:5]
    assert not [s for s in statuses if isinstance(s, int) and s >= 500], statuses
    assert not bad_refusals, bad_refusals[:5]
    assert reached <= BUDGET_CALLS, f"{reached} calls reached the upstream; the budget pays for {BUDGET_CALLS}"
    assert kinds["ok"] >= 1, "no call went through at all"
    assert kinds["ok"] == reached, f"{kinds['ok']} answers delivered, {reached} reached the upstream"
    assert all(u.completion_tokens == OUT_TOKENS for u in ok_usage)
    for v in views:
        assert v["spent_usd"] <= BUDGET_USD + 1e-9, v
        assert v["reserved_usd"] == 0 and v["reserved_tokens"] == 0, v
        # every answer the upstream gave is charged, and all gateways see the same run
        assert v["spent_usd"] == pytest.approx(reached * CALL_USD, abs=1e-9), (v["spent_usd"], reached)
        assert v["output_tokens"] == upstream.billed(run)[1], v
        assert (v["spent_usd"], v["output_tokens"], v["llm_calls"]) == (
            views[0]["spent_usd"],
            views[0]["output_tokens"],
            views[0]["llm_calls"],
        )


async def test_four_gateways_400_concurrent_usd_budget(tmp_path: Path) -> None:
    """Promise: "any number of gateway processes sharing a Redis hold a budget exactly as one process does
    (tested with four `tollgate serve` processes and 400 concurrent requests on one run)". 400 non-streamed
    calls through AsyncOpenAI on one run id, spread over 4 gateways, budget $0.40 = 20 calls: at most 20
    reach the upstream, spend <= budget on every gateway, nothing left reserved, every refusal a 403
    `budget_exhausted` in OpenAI's format, no 5xx."""
    _check_four_gateways(await _four_gateways_400(tmp_path, stream=False), "usd non-stream")


async def test_four_gateways_400_concurrent_usd_budget_streaming(tmp_path: Path) -> None:
    """Same promise with `stream: true` and `stream_options.include_usage` (the fake sends a usage chunk)."""
    _check_four_gateways(await _four_gateways_400(tmp_path, stream=True), "usd stream")


async def test_four_gateways_400_concurrent_token_budget(tmp_path: Path) -> None:
    """Same promise with a token budget (`budget: {tokens: N}`, tokens = input + output). Every body has
    exactly BODY_LEN bytes and the fake reports prompt_tokens = BODY_LEN and 500 output tokens, so a call
    costs BODY_LEN + 500 tokens, its reservation too; the budget pays for 20 calls. Raw aiohttp, so that
    the OpenAI wire format of each refusal is read as sent."""
    per_call = BODY_LEN + OUT_TOKENS
    budget = BUDGET_CALLS * per_call
    run = "run-" + uuid.uuid4().hex[:12]
    agent = f"    budget: {{tokens: {budget}}}\n"
    async with asyncio.timeout(50), environment(tmp_path, 4, agent, prompt_tokens=BODY_LEN) as (
        upstream,
        _redis,
        cluster,
        session,
    ):
        results = await asyncio.gather(
            *(
                post(session, f"{cluster.url(k % 4)}/v1/chat/completions", openai_body(run, k % 4, k, length=BODY_LEN), headers(run))
                for k in range(400)
            )
        )
        views = [await cluster.settled(session, i, run) for i in range(4)]
        statuses = Counter(s for s, _, _ in results)
        bad = [(s, b) for s, b, _ in results if s != 200 and (s != 403 or openai_error(b, TOKEN_BUDGET_CODES))]
        codes = Counter(b["error"]["code"] for s, b, _ in results if s == 403 and isinstance(b, dict))
        reached = upstream.reached(run)
        grants = Counter(c.max_tokens for c in upstream.calls if c.run == run)
        billed_in, billed_out = upstream.billed(run)
        no_echo = [(s, h) for s, _, h in results if h.get("x-tollgate-run-id") != run]
        stops = [(b, h) for s, b, h in results if s == 403 and "held" not in b["error"]["message"]]
        stop_headers = Counter(h.get("x-tollgate-stop-reason") for _, h in stops)
        per_gw = Counter(c.gw for c in upstream.calls if c.run == run)
        print(
            f"\n[token budget] answers per gateway={dict(per_gw)}; sticky stops={len(stops)} "
            f"x-tollgate-stop-reason={dict(stop_headers)}; missing run-id echo={len(no_echo)}"
        )
        print(
            f"\n[token budget] statuses={dict(statuses)} codes={dict(codes)} reached_upstream={reached}/400 "
            f"max_tokens seen upstream={dict(grants)} tokens spent="
            f"{[v['input_tokens'] + v['output_tokens'] for v in views]} budget={budget} "
            f"reserved_tokens={[v['reserved_tokens'] for v in views]} billed={billed_in + billed_out}"
        )
        assert not [s for s in statuses if s >= 500], statuses
        assert not bad, bad[:5]
        assert reached <= BUDGET_CALLS, f"{reached} calls reached the upstream; the budget pays for {BUDGET_CALLS}"
        assert statuses[200] >= 1 and statuses[200] == reached
        assert not no_echo, no_echo[:3]  # every answer echoes the run id, errors included
        for b, h in stops:  # a stop is never silent: its reason in the header too
            assert h.get("x-tollgate-stop-reason") == b["error"]["code"], (b, dict(h))
        for v in views:
            assert v["reserved_tokens"] == 0 and v["reserved_usd"] == 0, v
            assert v["input_tokens"] + v["output_tokens"] <= budget, v
            assert (v["input_tokens"], v["output_tokens"]) == (billed_in, billed_out), v


# --------------------------------------------------------------------------------------------------
# 2. Redis killed mid-run
# --------------------------------------------------------------------------------------------------


async def _redis_outage(tmp_path: Path, persist: bool) -> None:
    run = "run-" + uuid.uuid4().hex[:12]
    agent = "    budget: {usd: 100.0}\n"
    async with asyncio.timeout(50), environment(tmp_path, 2, agent, persist=persist) as (upstream, redis, cluster, session):
        oa = "/v1/chat/completions"
        an = "/v1/messages"
        k = 0

        def nxt() -> int:
            nonlocal k
            k += 1
            return k

        # before: a few calls on both gateways, both APIs
        for i in range(2):
            s, b, _ = await post(session, cluster.url(i) + oa, openai_body(run, i, nxt()), headers(run))
            assert s == 200, (s, b)
            s, b, _ = await post(session, cluster.url(i) + an, anthropic_body(run, i, nxt()), headers(run, True))
            assert s == 200, (s, b)
        before = upstream.reached(run)
        assert before == 4
        await cluster.settled(session, 0, run)

        # two calls in flight (held at the upstream) when Redis goes away
        upstream.hold(run)
        inflight = [
            asyncio.create_task(post(session, cluster.url(0) + oa, openai_body(run, 0, nxt()), headers(run))),
            asyncio.create_task(post(session, cluster.url(1) + an, anthropic_body(run, 1, nxt()), headers(run, True))),
        ]
        async with asyncio.timeout(10):
            while len(upstream.waiting) < 2:
                await asyncio.sleep(0.01)
        redis.terminate()
        at_kill = upstream.reached(run)

        # while Redis is down: fail closed, 503 state_unavailable in the caller's format, nothing upstream
        down: list[tuple[str, int, Any, Any]] = []
        for i in range(2):
            s, b, h = await post(session, cluster.url(i) + oa, openai_body(run, i, nxt()), headers(run))
            down.append(("openai", s, b, h))
            s, b, h = await post(session, cluster.url(i) + oa, openai_body(run, i, nxt(), stream=True), headers(run))
            down.append(("openai-stream", s, b, h))
            s, b, h = await post(session, cluster.url(i) + an, anthropic_body(run, i, nxt()), headers(run, True))
            down.append(("anthropic", s, b, h))
        # the calls in flight finish while Redis is still down
        upstream.release()
        async with asyncio.timeout(15):
            inflight_done = await asyncio.gather(*inflight)
        during = upstream.reached(run) - at_kill
        admin_down = [await cluster.view(session, i, run) for i in range(2)]
        print(
            f"\n[redis outage persist={persist}] while down: {[(api, s, (b.get('error') or {}).get('code') if isinstance(b, dict) else b) for api, s, b, _ in down]}"
            f" reached upstream while down={during}; in-flight answers={[s for s, _, _ in inflight_done]};"
            f" admin while down={[s for s, _ in admin_down]}"
        )

        # Redis back on the same port (same directory): requests succeed with no manual action
        redis.start()
        await redis.ready()
        after: list[tuple[int, int, Any]] = []
        for i in range(2):
            s, b, _ = await post(session, cluster.url(i) + oa, openai_body(run, i, nxt()), headers(run))
            after.append((i, s, b))
            s, b, _ = await post(session, cluster.url(i) + an, anthropic_body(run, i, nxt()), headers(run, True))
            after.append((i, s, b))
        views = [await cluster.settled(session, i, run) for i in range(2)]
        expected_calls = upstream.reached(run)
        # settlements Redis did not take are replayed in the background: poll for them
        deadline = time.monotonic() + 15
        while True:
            views = [await cluster.settled(session, i, run) for i in range(2)]
            wanted = (expected_calls if persist else expected_calls - before) * CALL_USD
            if all(v["spent_usd"] == pytest.approx(wanted, abs=1e-9) for v in views) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        print(
            f"[redis outage persist={persist}] after restart first statuses={[(i, s) for i, s, _ in after]}; "
            f"reached total={expected_calls}; spent_usd={[v['spent_usd'] for v in views]} "
            f"(expected {wanted:.4f}); output_tokens={[v['output_tokens'] for v in views]}; "
            f"reserved={[(v['reserved_usd'], v['reserved_tokens']) for v in views]}"
        )

        for api, s, b, h in down:
            assert s == 503, (api, s, b)
            assert h.get("x-tollgate-run-id") == run, (api, dict(h))
            check = anthropic_error if api == "anthropic" else openai_error
            assert check(b, {"state_unavailable"}) is None, (api, check(b, {"state_unavailable"}))
        assert during == 0, f"{during} calls reached the upstream while Redis was down"
        for s, b, _ in inflight_done:
            assert s in (200, 503), (s, b)
        assert [(i, s) for i, s, _ in after] == [(0, 200), (0, 200), (1, 200), (1, 200)], after
        for v in views:
            assert v["reserved_usd"] == 0 and v["reserved_tokens"] == 0, v
            assert v["spent_usd"] == pytest.approx(wanted, abs=1e-9), (v, wanted)
        assert views[0]["spent_usd"] == views[1]["spent_usd"]


async def test_redis_killed_fails_closed_then_recovers(tmp_path: Path) -> None:
    """Promise: "When the run store is unreachable, steps fail closed with 503 `state_unavailable` in the
    caller's wire format"; "A settlement Redis did not take ... is replayed in the background as soon as
    Redis takes it"; connections closed by "a restart ... are replaced before a command is sent on them,
    not answered with a 503". redis-server (appendonly yes, as the README requires of a Redis that holds
    budgets) is terminated with two calls in flight, then restarted on the same port: while it is down
    OpenAI, OpenAI-streamed and Anthropic calls get 503 `state_unavailable` in their own format and nothing
    reaches the upstream; afterwards the very next calls succeed and the run's spend equals exactly what
    the upstream answered (the in-flight calls' settlements included), nothing left reserved."""
    await _redis_outage(tmp_path, persist=True)


async def test_redis_killed_without_persistence_recovers(tmp_path: Path) -> None:
    """Same with the Redis of the brief (`--save "" --appendonly no`): the restart loses the run. Promise:
    "If Redis loses a run while steps of it are in flight (... a restart without its data), each of those
    steps' usage is charged to the run created afresh (once ...)". So after the restart the run's spend is
    what the in-flight calls and the calls after the restart cost, nothing less, nothing twice."""
    await _redis_outage(tmp_path, persist=False)


# --------------------------------------------------------------------------------------------------
# 3. a gateway SIGKILLed with calls in flight
# --------------------------------------------------------------------------------------------------

LEASE_S = 5


async def test_gateway_sigkill_with_calls_in_flight(tmp_path: Path) -> None:
    """Promise: "A reservation of a gateway process that died mid-call (SIGKILL, a lost host) is held (other
    steps that need its budget get 403 `budget_exhausted`, "held by steps in flight", and may retry) for at
    most `state.reservation_lease_s`: the next reserve after that charges it in full"; the budget holds
    exactly under any concurrency. Gateway 0 has 5 calls parked at the upstream when it is SIGKILLed; at the
    same moment 400 concurrent calls on the same run go to the 3 others. They go on (answer 200 or a 403
    `budget_exhausted`, never a 5xx), at most 20 calls reach the upstream in all, and after the lease the
    dead gateway's reservations are charged in full: spend <= budget, nothing reserved."""
    run = "run-" + uuid.uuid4().hex[:12]
    async with asyncio.timeout(50), environment(
        tmp_path, 4, USD_AGENT, state_extra=f", reservation_lease_s: {LEASE_S}"
    ) as (upstream, _redis, cluster, session):
        oa = "/v1/chat/completions"
        upstream.hold(run, 0)
        doomed = [
            asyncio.create_task(post(session, cluster.url(0) + oa, openai_body(run, 0, k), headers(run))) for k in range(5)
        ]
        async with asyncio.timeout(10):
            while len(upstream.waiting) < 5:
                await asyncio.sleep(0.01)
        reserved_at = time.monotonic()
        wave = [
            asyncio.create_task(
                post(session, cluster.url(1 + k % 3) + oa, openai_body(run, 1 + k % 3, 100 + k), headers(run))
            )
            for k in range(400)
        ]
        await asyncio.sleep(0)  # let the wave start before the kill
        cluster.sigkill(0)
        killed_at = time.monotonic()
        doomed_results = await asyncio.gather(*doomed, return_exceptions=True)
        results = await asyncio.gather(*wave)
        mid = [await cluster.view(session, i, run) for i in (1, 2, 3)]
        mid_within_lease = time.monotonic() - reserved_at < LEASE_S - 0.5

        statuses = Counter(s for s, _, _ in results)
        bad = [(s, b) for s, b, _ in results if s != 200 and (s != 403 or openai_error(b, BUDGET_CODES))]
        held_msgs = Counter(b["error"]["message"][:70] for s, b, _ in results if s == 403 and isinstance(b, dict))

        # the other gateways go on: a fresh run is served normally by each of them
        fresh = "run-" + uuid.uuid4().hex[:12]
        fresh_statuses = []
        for i in (1, 2, 3):
            s, _, _ = await post(session, cluster.url(i) + oa, openai_body(fresh, i, 9000 + i), headers(fresh))
            fresh_statuses.append(s)

        # after the lease, the next reserve charges the dead gateway's reservations in full
        poke: list[tuple[int, Any]] = []
        deadline = killed_at + LEASE_S + 10
        while True:
            s, b, _ = await post(session, cluster.url(1) + oa, openai_body(run, 1, 8000 + len(poke)), headers(run))
            poke.append((s, b))
            views = [await cluster.view(session, i, run) for i in (1, 2, 3)]
            if all(st == 200 and not v["reserved_usd"] for st, v in views) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        views = [await cluster.settled(session, i, run) for i in (1, 2, 3)]
        reached = upstream.reached(run)
        reached_dead = upstream.reached(run, 0)
        print(
            f"\n[sigkill] doomed results={[type(r).__name__ if isinstance(r, BaseException) else r[0] for r in doomed_results]} "
            f"wave statuses={dict(statuses)} 403 messages={dict(held_msgs)} "
            f"mid spent/reserved={[(v['spent_usd'], v['reserved_usd']) for _, v in mid]} "
            f"reached upstream={reached} (dead gateway {reached_dead}); fresh run on survivors={fresh_statuses}; "
            f"pokes after kill={[(s, (b.get('error') or {}).get('code') if isinstance(b, dict) else None) for s, b in poke]} "
            f"final spent_usd={[v['spent_usd'] for v in views]} reserved={[v['reserved_usd'] for v in views]} "
            f"status={[v['status'] for v in views]} stop={[v['stop_reason'] for v in views]} budget={BUDGET_USD}"
        )
        assert all(isinstance(r, BaseException) for r in doomed_results), doomed_results
        assert not [s for s in statuses if s >= 500], statuses
        assert not bad, bad[:5]
        assert statuses[200] >= 1, "the surviving gateways served no call"
        assert reached <= BUDGET_CALLS, f"{reached} calls reached the upstream; the budget pays for {BUDGET_CALLS}"
        assert reached_dead == 5
        for st, v in mid:
            assert st == 200
            assert v["spent_usd"] + v["reserved_usd"] <= BUDGET_USD + 1e-9, v
            if mid_within_lease:  # the dead gateway's reservations, still held
                assert v["reserved_usd"] == pytest.approx(5 * CALL_USD, abs=1e-9), v
        assert fresh_statuses == [200, 200, 200]
        assert not [s for s, _ in poke if s >= 500], poke
        for v in views:
            assert v["reserved_usd"] == 0 and v["reserved_tokens"] == 0, v
            assert v["spent_usd"] <= BUDGET_USD + 1e-9, v
            # the settled calls plus the dead gateway's 5 reservations charged in full, nothing more
            assert v["spent_usd"] == pytest.approx(reached * CALL_USD, abs=1e-9), (v, reached)


# --------------------------------------------------------------------------------------------------
# 4. one trace per run across the gateways: each invoke_agent root exported once
# --------------------------------------------------------------------------------------------------


async def test_four_gateways_export_each_root_of_a_run_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Promise (README, spans): "sidecars sharing a Redis export each root once, however many of them
    sweep the run or serve its steps". Four `tollgate serve` processes on one Redis, exporting OTLP to one
    receiver, `otel.run_idle_s: 1`: each of three runs takes a step on one gateway, goes idle (all four
    sweep it), resumes on the next gateway, goes idle again, and is stopped by its cap on a third; a
    refusal follows on a fourth. Each run has exactly its three roots (segments 0, 1, 2, the last with
    the stop), each exported once, and every step span is under one of them."""
    from tests.otel.otlp_sink import running_sink

    runs = [f"roots-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    async with running_sink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")

        def roots(run: str) -> list[Any]:
            return [s for s in sink.spans if s.name.startswith("invoke_agent") and s.value("tollgate.run_id") == run]

        def steps(run: str) -> list[Any]:
            return [s for s in sink.spans if s.name == "chat gpt-4o-mini" and s.value("tollgate.run_id") == run]

        async def exported(count: int, step_spans: int = 0) -> None:
            async with asyncio.timeout(20):  # a sweep every 0.25 s, an export every 0.05 s
                while not all(len(roots(run)) >= count and len(steps(run)) >= step_spans for run in runs):
                    await asyncio.sleep(0.05)

        async with environment(tmp_path, 4, "    caps: {llm_calls: 3}", extra="otel: {run_idle_s: 1.0}") as env:
            _upstream, _redis, cluster, session = env

            async def step(i: int, run: str) -> int:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(f"{cluster.url(i)}/v1/chat/completions", json=body,
                                        headers={"x-tollgate-run-id": run}) as r:
                    await r.read()
                    return r.status

            assert [await step(0, run) for run in runs] == [200] * 3
            await exported(1)
            assert [await step(1, run) for run in runs] == [200] * 3  # each resumes on another gateway
            await exported(2)
            for run in runs:  # the third call, and at once the one the cap refuses: no idle time between
                assert [await step(2, run), await step(3, run)] == [200, 403]
            assert [await step(0, run) for run in runs] == [403] * 3  # a refusal of the stopped run
            await exported(3, step_spans=5)
            # each gateway exports what it still holds; the receiver keeps serving meanwhile
            await asyncio.to_thread(cluster.stop)
        for run in runs:
            mine = sorted(roots(run), key=lambda s: int(s.attributes.get("tollgate.run.segment", ("", 0))[1]))
            assert len({s.span_id for s in mine}) == len(mine) == 3, [(s.span_id, s.attributes) for s in mine]
            assert [s.attributes.get("tollgate.run.segment", ("", 0))[1] for s in mine] == [0, 1, 2]
            assert [s.attributes.get("tollgate.llm_calls", ("", None))[1] for s in mine] == [1, 2, 3]
            assert mine[-1].attributes["error.type"][1] == "llm_call_cap"
            assert len(steps(run)) == 5 and {s.parent_span_id for s in steps(run)} <= {s.span_id for s in mine}
