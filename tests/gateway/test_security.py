"""Security (issue 7): agent keys compared in constant time, provider keys never emitted, the admin port
on loopback behind an optional bearer token, and no request able to choose where tollgate connects."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import Config, parse_config
from gateway.identity import Identifier
from gateway.server import admin_exposure_warning
from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import FakeProvider, Reply, anthropic_stream, openai_completion, openai_stream
from tests.gateway.test_serve import Served, free_port, serve  # noqa: F401  (the `serve` fixture)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


# -- agent keys: constant time -----------------------------------------------------------------------


@pytest.fixture
def digest_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bytes]]:
    """Every `hmac.compare_digest` call, recorded, with the real result."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    return calls


AGENT_KEYS = {f"agent{i}": {"keys": [f"key-{i}-a-0123456789", f"key-{i}-b-0123456789"]} for i in range(5)}
ALL_KEYS = [k for a in AGENT_KEYS.values() for k in a["keys"]]


@pytest.mark.parametrize(
    "presented",
    [ALL_KEYS[0], ALL_KEYS[-1], ALL_KEYS[4], "wrong", "", None, ALL_KEYS[0][:-1], ALL_KEYS[0] + "x", "\udcff\udcfe"],
    ids=["first", "last", "middle", "wrong", "empty", "missing", "prefix", "longer", "undecodable"],
)
def test_every_agent_key_is_compared_every_time(digest_calls: list[tuple[bytes, bytes]], presented: str | None) -> None:
    identifier = Identifier(parse_config({"agents": AGENT_KEYS}, env={}))
    found = identifier.agent_for_key(presented)
    assert len(digest_calls) == len(ALL_KEYS)  # no early exit on a match, none on a mismatch
    assert {a for a, _ in digest_calls} == {k.encode() for k in ALL_KEYS}
    expected = next((name for name, a in AGENT_KEYS.items() if presented in a["keys"]), None)
    assert found == expected


async def test_every_agent_key_is_compared_through_the_gateway(gateway_factory: GatewayFactory,
                                                              digest_calls: list[tuple[bytes, bytes]]) -> None:
    h = await gateway_factory(agents=AGENT_KEYS)
    for auth, status in ((f"Bearer {ALL_KEYS[0]}", 200), (f"Bearer {ALL_KEYS[-1]}", 200), ("Bearer nope", 401)):
        digest_calls.clear()
        async with h.session.post(f"{h.url}{CHAT}", json={"model": "gpt-4o-mini", "messages": USER},
                                  headers={"Authorization": auth}) as resp:
            assert resp.status == status
        assert len(digest_calls) == len(ALL_KEYS)
    digest_calls.clear()
    async with h.session.post(f"{h.url}{MESSAGES}", headers={"x-api-key": ALL_KEYS[3]},
                              json={"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": USER}) as resp:
        assert resp.status == 200
        assert resp.headers["x-tollgate-run-id"] == "agent1:default"
    assert len(digest_calls) == len(ALL_KEYS)


async def test_undecodable_key_bytes_are_a_401_not_a_crash(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=AGENT_KEYS)
    status, _, body = await raw_request(h.url, b"POST", CHAT, [(b"Authorization", b"Bearer \xff\xfe\x80key"),
                                           (b"Content-Type", b"application/json")],
                                           orjson.dumps({"model": "gpt-4o-mini", "messages": USER}))
    assert status == 401, body
    assert orjson.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "headers",
    [{"baggage": "tollgate.run_id=abc%0A"}, {"baggage": "tollgate.run_id=abc%0D%0A"},
     {"x-tollgate-agent": "bot", "baggage": "tollgate.run_id=%0A"}],
)
async def test_a_run_id_with_a_line_break_is_a_400_before_the_upstream(gw: Harness,
                                                                       headers: dict[str, str]) -> None:
    """A percent-encoded line break in baggage cannot become a run id (nor a response header)."""
    async with gw.session.post(f"{gw.url}{CHAT}", json={"model": "gpt-4o-mini", "messages": USER},
                               headers=headers) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_request"
    assert gw.fake.seen == []


# -- provider keys are never emitted -------------------------------------------------------------------

OPENAI_KEY = "sk-canary-openai-5b1f0e7d9c2a4e68"
ANTHROPIC_KEY = "sk-ant-canary-93c1d2e8f7a64b05"
DOWN_KEY = "sk-canary-down-0d4e7a91b3c25f86"
PROVIDER_KEYS = (OPENAI_KEY, ANTHROPIC_KEY, DOWN_KEY)
BOT_KEY = "agent-canary-bot-6e2f9a0b"
CAPPED_KEY = "agent-canary-capped-1c7d3e5f"


def fragments(secret: str) -> list[str]:
    """The key and its distinctive middle: a truncated or masked copy still counts as a leak."""
    return [secret, secret[3:-3], secret[-12:]]


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG, captured (restored afterwards)."""
    saved = {name: lg.level for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    for name in saved:
        logging.getLogger(name).setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    yield caplog
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


async def test_provider_keys_never_emitted(gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str],
                                          tmp_path: Path, all_logs: pytest.LogCaptureFixture,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Traffic with successes, every kind of error and guard stops; then everything tollgate emitted
    (logs at DEBUG, stdout/stderr, spans with content capture, /metrics, admin views, ledger and state
    files, every response status, header and body) is searched for the provider keys."""
    fake_url = fake[1]
    providers = {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": OPENAI_KEY,
                   "timeouts": {"first_byte": 0.5, "idle": 0.5}},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": ANTHROPIC_KEY,
                      "timeouts": {"first_byte": 0.5, "idle": 0.5}},
        "down": {"type": "openai", "base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key": DOWN_KEY,
                 "timeouts": {"connect": 1}},
    }
    pricing = {"gpt-*": {"input_per_mtok": 1, "output_per_mtok": 2}, "claude-*": {"input_per_mtok": 1, "output_per_mtok": 2},
               "down-*": {"input_per_mtok": 1, "output_per_mtok": 2}}
    agents = {
        "bot": {"keys": [BOT_KEY], "budget": {"usd": 5.0}, "tools": {"allow": ["search"]}},
        "capped": {"keys": [CAPPED_KEY], "caps": {"llm_calls": 2}, "on_stop": "message"},
    }
    h = await gateway_factory(providers=providers, models={"gpt-*": "openai", "claude-*": "anthropic", "down-*": "down"},
                              pricing=pricing, agents=agents, otel={"capture_content": True},
                              ledger={"path": str(tmp_path / "ledger.db")},
                              state={"backend": "sqlite", "path": str(tmp_path / "state.db")})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, capture_content=True, exporter=exporter)
    h.gateway.services.update(telemetry=telemetry, metrics_render=telemetry.metrics.render)
    emitted: list[str] = []

    async def send(method: str, path: str, body: Any = None, key: str | None = BOT_KEY, run: str = "leak-1",
                   headers: dict[str, str] | None = None, admin: bool = False) -> int:
        hdrs = {"x-tollgate-run-id": run, **(headers or {})}
        if key:
            hdrs["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
        base = h.admin_url if admin else h.url
        async with h.session.request(method, f"{base}{path}", data=data, headers=hdrs) as resp:
            raw = await resp.read()
            emitted.append(f"{resp.status} {resp.reason} {dict(resp.headers)!r} {raw.decode('utf-8', 'replace')}")
            return resp.status

    oa = {"model": "gpt-4o-mini", "messages": USER}
    an = {"model": "claude-3-5-haiku-latest", "max_tokens": 32, "messages": USER}
    try:
        assert await send("POST", CHAT, oa) == 200
        assert await send("POST", MESSAGES, an) == 200
        h.fake.queue(Reply(chunks=openai_stream(["a", "b"])), Reply(chunks=anthropic_stream(["c"])))
        assert await send("POST", CHAT, {**oa, "stream": True}) == 200
        assert await send("POST", MESSAGES, {**an, "stream": True}) == 200
        # the SDKs, as an agent runs them (keys travel as Bearer and x-api-key)
        async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key=BOT_KEY, max_retries=0) as client:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
            h.fake.queue(Reply(status=401, body={"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                                           "param": None, "code": "invalid_api_key"}}))
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        async with anthropic.AsyncAnthropic(base_url=h.url, api_key=BOT_KEY, max_retries=0) as aclient:
            await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=8, messages=USER)  # type: ignore[arg-type]
        # errors of every kind
        h.fake.queue(Reply(status=500, body={"error": {"message": "boom"}}))
        assert await send("POST", CHAT, oa) == 500
        h.fake.queue(Reply(delay=2.0, body={}))
        assert await send("POST", CHAT, oa) == 504
        h.fake.queue(Reply(chunks=openai_stream(["x", "y"]), cut_after=2))
        assert await send("POST", CHAT, {**oa, "stream": True}) == 200
        h.fake.queue(Reply(chunks=openai_stream(["x"]), chunk_delay=2.0))
        assert await send("POST", CHAT, {**oa, "stream": True}) == 200
        h.fake.queue(Reply(body=b"<html>not json</html>"))
        assert await send("POST", MESSAGES, an) == 502
        assert await send("POST", CHAT, {**oa, "model": "down-model"}) == 502
        assert await send("POST", CHAT, {**oa, "model": "nope-model"}) == 404
        assert await send("POST", CHAT, b"{not json") == 400
        assert await send("POST", CHAT, oa, key="sk-wrong-key") == 401
        assert await send("POST", CHAT, oa, key=None) == 401
        assert await send("POST", CHAT, {**oa, "metadata": {"x": [[[[[[[[[[[]]]]]]]]]]]}}, run="bad run") == 400
        assert await send("GET", "/v1/../../admin/x") in (400, 404)
        assert await send("GET", "/v1/models") == 200
        h.fake.queue(Reply(body={"object": "list", "data": []}))
        assert await send("POST", "/v1/embeddings", {"model": "gpt-4o-mini", "input": "x"}) == 200
        assert await send("POST", "/mcp/nothere", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}) in (400, 404)
        # an upstream echoing the key in an answer's metadata (its id, model, fingerprint, finish reason, an
        # error code): the agent's copy is scrubbed, and so is what spans, metrics and the ledger report
        from tests.fakes.responses import response_body
        from tests.fakes.upstream import openai_completion as completion

        echoed = completion("x", model=OPENAI_KEY, finish=OPENAI_KEY)
        echoed.update(id=OPENAI_KEY, system_fingerprint=OPENAI_KEY, service_tier=OPENAI_KEY)
        h.fake.queue(Reply(body=echoed), Reply(chunks=openai_stream(["a"], model=OPENAI_KEY)))
        assert await send("POST", CHAT, oa, run="leak-echo") == 200
        assert await send("POST", CHAT, {**oa, "stream": True}, run="leak-echo") == 200
        failed = response_body("", usage=(1, 1), status="failed")
        failed["error"] = {"code": OPENAI_KEY, "message": f"bad key {OPENAI_KEY}"}
        h.fake.queue(Reply(body=failed))
        await send("POST", "/v1/responses", {"model": "gpt-4o-mini", "input": "hi"}, run="leak-echo")
        # guard decisions: a refused tool call stops the run; a call cap ends with a message
        tool = {"id": "c1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}
        from tests.fakes.upstream import openai_completion

        h.fake.queue(Reply(body=openai_completion(tool_calls=[tool])))
        assert await send("POST", CHAT, oa, run="leak-tools") == 403
        assert await send("POST", CHAT, oa, run="leak-tools") == 403
        for _ in range(3):
            await send("POST", CHAT, oa, key=CAPPED_KEY, run="leak-cap")
        # the admin side
        for path in ("/admin/runs", "/admin/runs/leak-1", "/admin/runs/leak-tools", "/admin/runs/leak-cap",
                     "/admin/runs/leak-echo", "/metrics",
                     "/healthz", "/readyz", "/admin/approvals"):
            await send("GET", path, admin=True)
        await send("POST", "/admin/runs/leak-tools/reset", admin=True)
        await h.gateway.services["ledger"].flush()
        assert telemetry.force_flush()
    finally:
        spans = list(exporter.get_finished_spans())
        telemetry.shutdown()

    # the keys were really used: the upstream saw them
    seen = repr([s.headers for s in h.fake.seen])
    assert OPENAI_KEY in seen and ANTHROPIC_KEY in seen
    assert len(spans) > 10
    sources: dict[str, str] = {
        "responses": "\n".join(emitted),
        "logs": all_logs.text + "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in all_logs.records),
        "stdout/stderr": "".join(capfd.readouterr()),
        "spans": "\n".join(s.to_json() for s in spans),
        "files": "\n".join(p.read_bytes().decode("latin-1") for p in tmp_path.rglob("*") if p.is_file()),
    }
    assert sources["logs"], "nothing was logged: the capture is not working"
    assert "leak-tools" in sources["files"] and "tool_not_allowed" in sources["files"]  # the ledger was written
    for where, text in sources.items():
        for secret in (*PROVIDER_KEYS, BOT_KEY, CAPPED_KEY):
            for fragment in fragments(secret):
                assert fragment not in text, f"{fragment!r} leaked into {where}"


# -- the admin port ------------------------------------------------------------------------------------


def test_listen_and_admin_default_to_loopback() -> None:
    config = parse_config({}, env={})
    assert config.admin.host == "127.0.0.1"
    assert config.listen.host == "127.0.0.1"
    assert config.admin.token is None


def listening_on(port: int) -> list[str]:
    """Local addresses of the listening TCP sockets on `port` (IPv4 and IPv6)."""
    found: list[str] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, state = fields[1], fields[3]
            host, _, hex_port = addr.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(host)
    return found


async def test_serve_binds_the_admin_port_to_loopback(serve: Any) -> None:  # noqa: F811
    served: Served = await serve()
    admin_port = int(served.admin_url.rsplit(":", 1)[1])
    assert listening_on(admin_port) == ["0100007F"]  # 127.0.0.1 only, never 0.0.0.0 or ::
    assert f"admin http://127.0.0.1:{admin_port}" in served.output()


@pytest.mark.parametrize(("host", "token", "warned"), [
    ("127.0.0.1", None, False), ("::1", None, False), ("[::1]", None, False), ("localhost", None, False),
    ("127.0.0.2", None, False), ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("admin.internal", None, True), ("0.0.0.0", "t0k", False),
])
def test_admin_beyond_loopback_without_token_warns(host: str, token: str | None, warned: bool) -> None:
    config = parse_config({"admin": {"host": host, "token": token}}, env={})
    warning = admin_exposure_warning(config, host)
    assert (warning is not None) == warned
    if warning:
        assert host in warning and "admin.token" in warning


ADMIN_TOKEN = "adm-canary-token-8d2c"
PROTECTED = [("GET", "/admin/runs"), ("GET", "/admin/runs/r1"), ("POST", "/admin/runs/r1/reset"), ("GET", "/metrics"),
             ("GET", "/admin/approvals")]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_admin_token_required(gateway_factory: GatewayFactory, method: str, path: str) -> None:
    h = await gateway_factory(admin={"token": ADMIN_TOKEN})
    async with h.session.post(f"{h.url}{CHAT}", json={"model": "gpt-4o-mini", "messages": USER},
                              headers={"x-tollgate-run-id": "r1"}) as resp:
        assert resp.status == 200
    for auth in (None, "Bearer wrong", f"Bearer {ADMIN_TOKEN}x", f"Bearer {ADMIN_TOKEN[:-1]}", ADMIN_TOKEN,
                 f"Basic {ADMIN_TOKEN}", "Bearer ", f"Token {ADMIN_TOKEN}"):
        headers = {"Authorization": auth} if auth is not None else {}
        async with h.session.request(method, f"{h.admin_url}{path}", headers=headers) as resp:
            assert resp.status == 401, (auth, resp.status)
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            body = await resp.json()
            assert body["error"]["code"] == "unauthorized"
            assert ADMIN_TOKEN not in await resp.text()
    for auth in (f"Bearer {ADMIN_TOKEN}", f"bearer {ADMIN_TOKEN}", f"Bearer  {ADMIN_TOKEN} "):
        async with h.session.request(method, f"{h.admin_url}{path}", headers={"Authorization": auth}) as resp:
            assert resp.status == 200, (auth, resp.status, await resp.text())


async def test_health_stays_open_with_a_token(gateway_factory: GatewayFactory, digest_calls: list[Any]) -> None:
    h = await gateway_factory(admin={"token": ADMIN_TOKEN})
    for path in ("/healthz", "/readyz"):
        async with h.session.get(f"{h.admin_url}{path}") as resp:
            assert resp.status == 200
    assert digest_calls == []
    async with h.session.get(f"{h.admin_url}/admin/runs", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        assert resp.status == 200
    assert len(digest_calls) == 1  # the token is compared in constant time


async def test_admin_token_with_undecodable_bytes_is_401(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(admin={"token": ADMIN_TOKEN})
    status, _, body = await raw_request(h.admin_url, b"GET", "/admin/runs", [(b"Authorization", b"Bearer \xff\xfe")])
    assert status == 401, body


async def test_admin_without_token_is_open_on_loopback(gw: Harness) -> None:
    async with gw.session.get(f"{gw.admin_url}/admin/runs") as resp:
        assert resp.status == 200


async def test_upstream_cookies_are_never_replayed(gateway_factory: GatewayFactory,
                                                  fake: tuple[FakeProvider, str]) -> None:
    """A cookie one call's upstream sets must not ride along on the next call (possibly another agent's)."""
    provider, url = fake
    # a host name: aiohttp's default jar ignores cookies from IP addresses, which would hide the bug
    base = url.replace("127.0.0.1", "localhost")
    h = await gateway_factory(providers={"openai": {"type": "openai", "base_url": f"{base}/v1", "api_key": "sk-p"}},
                              models={"gpt-*": "openai"})
    provider.queue(Reply(body=openai_completion("ok"), headers={"Set-Cookie": "session=agent-a; Path=/"}),
                   Reply(body=openai_completion("ok")))
    for run in ("a", "b"):
        async with h.session.post(f"{h.url}{CHAT}", json={"model": "gpt-4o-mini", "messages": USER},
                                  headers={"x-tollgate-run-id": run}) as resp:
            assert resp.status == 200, await resp.text()
    assert [s.headers.get("Cookie") for s in provider.seen] == [None, None]


# -- nothing in a request chooses the upstream (no SSRF) ---------------------------------------------------


async def raw_request(base: str, method: bytes, target: str | bytes, headers: list[tuple[bytes, bytes]] | None = None,
                      body: bytes = b"") -> tuple[int, bytes, bytes]:
    """One request written byte for byte (no client-side normalisation of the target)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        target_bytes = target if isinstance(target, bytes) else target.encode()
        head = [method + b" " + target_bytes + b" HTTP/1.1", b"Host: " + host.encode() + b":" + port.encode(),
                b"Connection: close", b"Content-Length: %d" % len(body)]
        head += [k + b": " + v for k, v in headers or ()]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    head_bytes, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), head_bytes, payload


@pytest.fixture
async def ssrf(gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]) -> Any:
    """The gateway with its providers under base paths, and an 'evil' server that must never be reached."""
    evil = FakeProvider()
    server = TestServer(evil.app(), host="127.0.0.1")
    await server.start_server()
    fake_url = fake[1]
    providers = {
        "openai": {"type": "openai", "base_url": f"{fake_url}/tenant-a/v1", "api_key": "sk-provider-openai"},
        "anthropic": {"type": "anthropic", "base_url": f"{fake_url}/tenant-b", "api_key": "sk-ant-provider"},
    }
    h = await gateway_factory(providers=providers, models={"gpt-*": "openai", "claude-*": "anthropic",
                                                           "text-embedding-*": "openai"})
    try:
        yield h, evil, str(server.make_url("")).rstrip("/"), fake_url.removeprefix("http://")
    finally:
        await server.close()


def assert_contained(h: Harness, evil: FakeProvider, fake_host: str) -> None:
    assert evil.seen == [], [(s.method, s.path) for s in evil.seen]
    for seen in h.fake.seen:
        assert seen.path.startswith(("/tenant-a/v1/", "/tenant-b/v1/")), seen.path
        assert ".." not in seen.path, seen.path
        assert seen.headers["Host"] == fake_host, seen.headers


def evil_models(evil_url: str) -> list[str]:
    evil_host = evil_url.removeprefix("http://")
    return [
        evil_url + "/x", f"openai/{evil_url}/x", "openai/../../admin", "../../admin", "openai/..%2f..%2fadmin",
        f"openai/@{evil_host}/x", f"@{evil_host}", f"gpt-4o-mini@{evil_host}", "gpt-4o-mini/../../../admin",
        f"gpt-4o-mini#@{evil_host}", f"gpt-4o-mini?x=@{evil_host}", "gpt-4o-mini/../../..", f"openai//{evil_host}",
        f"anthropic/{evil_url}", "claude-3/../../../admin", f"claude-x@{evil_host}", "gpt-\r\nHost: evil",
        "gpt-4o-mini%2f..%2f..%2fadmin", "gpt-4o-mini\\..\\..\\admin",
    ]


async def test_model_names_cannot_choose_the_upstream(ssrf: Any) -> None:
    h, evil, evil_url, fake_host = ssrf
    for model in evil_models(evil_url):
        for path, body in ((CHAT, {"model": model, "messages": USER}),
                           (MESSAGES, {"model": model, "max_tokens": 8, "messages": USER}),
                           ("/v1/embeddings", {"model": model, "input": "x"})):
            async with h.session.post(f"{h.url}{path}", json=body) as resp:
                assert resp.status in (200, 400, 404), (model, path, resp.status)
    assert_contained(h, evil, fake_host)
    # what reached the provider went to the fixed paths, the model only ever in the body
    assert {s.path for s in h.fake.seen} <= {"/tenant-a/v1/chat/completions", "/tenant-b/v1/messages",
                                             "/tenant-a/v1/embeddings", "/tenant-b/v1/embeddings"}


async def test_headers_cannot_choose_the_upstream(ssrf: Any) -> None:
    h, evil, evil_url, fake_host = ssrf
    evil_host = evil_url.removeprefix("http://")
    tricks = [
        {"Host": evil_host}, {"X-Forwarded-Host": evil_host}, {"X-Forwarded-Proto": "https", "X-Forwarded-Port": "1"},
        {"Forwarded": f"host={evil_host};proto=http"}, {"X-Original-URL": "/admin"}, {"X-Rewrite-URL": "/admin"},
        {"X-Forwarded-Prefix": "/../../admin"}, {"X-HTTP-Method-Override": "DELETE"},
        {"x-tollgate-upstream": evil_url}, {"Proxy": evil_url}, {"X-Host": evil_host},
    ]
    for extra in tricks:
        for path, body in ((CHAT, {"model": "gpt-4o-mini", "messages": USER}),
                           (MESSAGES, {"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": USER}),
                           ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"})):
            async with h.session.post(f"{h.url}{path}", json=body, headers=extra) as resp:
                assert resp.status == 200, (extra, path, await resp.text())
        async with h.session.get(f"{h.url}/v1/models", headers=extra) as resp:
            assert resp.status == 200
    assert_contained(h, evil, fake_host)
    assert all(s.method in ("POST", "GET") for s in h.fake.seen)


async def test_paths_cannot_leave_the_base_path(ssrf: Any) -> None:
    h, evil, evil_url, fake_host = ssrf
    evil_host = evil_url.removeprefix("http://")
    targets = [
        "/v1/../../admin", "/v1/../admin", "/v1/%2e%2e/%2e%2e/admin", "/v1/%2E%2E/admin", "/v1/..%2f..%2fadmin",
        "/v1/..%2F..%2Fadmin", "/v1/%252e%252e/%252e%252e/admin", "/v1/files/..", "/v1/files/.", "/v1/./../admin",
        "/v1/..\\..\\admin", "/v1/%5c..%5c..%5cadmin", "/v1/.%2e/admin", "/v1/files/%2e%2e%2f%2e%2e%2fadmin",
        f"/v1//{evil_host}/x", f"/v1/@{evil_host}/x", f"http://{evil_host}/v1/models", f"http://{evil_host}/v1/files",
        f"/v1/files?url=http://{evil_host}/", f"/v1/files#@{evil_host}", "//admin", "/v1/../../../../etc/passwd",
    ]
    statuses = {}
    for target in targets:
        for method in (b"GET", b"POST"):
            status, _, body = await raw_request(h.url, method, target, [(b"Content-Type", b"application/json")],
                                                b'{"model": "text-embedding-3-small", "input": "x"}' if method == b"POST" else b"")
            statuses[(target, method)] = status
            assert status < 500, (target, method, status, body[:200])
    assert_contained(h, evil, fake_host)
    escaped = [t for (t, _), s in statuses.items() if s == 200 and ("%" in t or ".." in t or "\\" in t)
               and "?" not in t and "#" not in t]
    assert escaped == [], escaped
    assert statuses[("/v1/../../admin", b"GET")] == 400
    assert statuses[("/v1/%2e%2e/%2e%2e/admin", b"POST")] == 400


def test_configured_upstreams_are_the_only_destinations(tmp_path: Path) -> None:
    """The routing table is built from the config alone: a provider/model prefix picks a configured
    provider or nothing."""
    from gateway.errors import ModelNotFound
    from gateway.routing import Router

    config: Config = parse_config({"providers": {"openai": {"type": "openai", "base_url": "http://up/v1"}},
                                   "models": {"gpt-*": "openai"}}, env={})
    router = Router(config)
    for model in ("http://evil/x", "evil/gpt-4o", "https:/gpt-4o", "gpt-4o@evil"):
        try:
            route = router.route(model)
        except ModelNotFound:
            continue
        assert route.provider.base_url == "http://up/v1"
    assert re.match(r"^http://up/v1$", router.route("openai/http://evil/x").provider.base_url)


async def test_passthrough_never_forwards_client_credentials_elsewhere(gateway_factory: GatewayFactory) -> None:
    """Without passthrough_auth the agent's credentials never reach the provider (tollgate's key does)."""
    h = await gateway_factory()
    async with h.session.post(f"{h.url}/v1/embeddings", json={"model": "gpt-4o-mini", "input": "x"},
                              headers={"Authorization": "Bearer agent-own", "x-api-key": "agent-own-2",
                                       "Proxy-Authorization": "Basic agent-own-3"}) as resp:
        assert resp.status == 200
    assert "agent-own" not in repr(h.fake.seen[-1].headers)
