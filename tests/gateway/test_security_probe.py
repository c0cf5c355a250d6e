"""Hostile probes of tollgate's security contract (issue 7), beyond tests/gateway/test_security.py.

Each test names the README / DESIGN line it holds the gateway to. Areas: provider keys never shown to
the agent nor sent elsewhere, agent keys and the caller's wire format, the admin port's boundary, one
agent's run state never reachable by another agent, and content kept out of telemetry and the ledger.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.served import tollgate_command
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, tool_call
from tests.gateway.test_security import raw_request

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]
OA = {"model": "gpt-4o-mini", "messages": USER}
AN = {"model": "claude-3-5-haiku-latest", "max_tokens": 16, "messages": USER}

OPENAI_KEY = "sk-probe-openai-7f3a91c2d84b6e05"
ANTHROPIC_KEY = "sk-ant-probe-2c8e4f6a0b1d3957"


def fragments(secret: str) -> list[str]:
    """The key and its distinctive tail: a truncated copy still counts as a leak."""
    return [secret, secret[-12:]]


@pytest.fixture
async def keyed(gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]) -> Harness:
    """The gateway with canary provider keys."""
    fake_url = fake[1]
    return await gateway_factory(providers={
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": OPENAI_KEY},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": ANTHROPIC_KEY},
    })


async def post(h: Harness, path: str, body: Any, headers: dict[str, str] | None = None,
               base: str | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with h.session.post(f"{base or h.url}{path}", data=data, headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


# -- provider keys are never shown to the agent --------------------------------------------------------


def echo_body(key: str) -> dict[str, Any]:
    """What a misconfigured upstream (or a corporate egress proxy in front of it) answers: the request's
    credential echoed in its error message."""
    return {"error": {"message": f"Incorrect API key provided: Bearer {key}. Headers: x-api-key={key}",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


@pytest.mark.parametrize(("path", "body", "key"), [
    (CHAT, OA, OPENAI_KEY),
    (MESSAGES, AN, ANTHROPIC_KEY),
    ("/v1/embeddings", {"model": "gpt-4o-mini", "input": "x"}, OPENAI_KEY),
], ids=["chat", "messages", "forwarded"])
async def test_an_upstream_error_echoing_the_provider_key_does_not_show_it_to_the_agent(
        keyed: Harness, path: str, body: Any, key: str) -> None:
    """DESIGN section 3: provider keys 'are never taken from, nor shown to, the agent'. An upstream 401
    whose body echoes the credential tollgate sent must not carry tollgate's key to the agent (issue:
    'error bodies ... upstream error bodies that echo the request headers')."""
    keyed.fake.queue(Reply(status=401, body=echo_body(key)))
    status, headers, raw = await post(keyed, path, body)
    assert status == 401
    assert key in repr(keyed.fake.seen[-1].headers)  # the key really went upstream
    shown = raw.decode("utf-8", "replace") + repr(headers)
    for fragment in fragments(key):
        assert fragment not in shown, f"provider key {fragment!r} shown to the agent: {shown[:300]}"


async def test_an_upstream_response_header_echoing_the_provider_key_is_not_relayed(keyed: Harness) -> None:
    """DESIGN section 3: provider keys are never shown to the agent. A debugging upstream that echoes the
    request's Authorization in a response header must not hand tollgate's key to the agent."""
    keyed.fake.queue(Reply(body=openai_completion("ok"), headers={"X-Echo-Authorization": f"Bearer {OPENAI_KEY}"}))
    status, headers, raw = await post(keyed, CHAT, OA)
    assert status == 200, raw
    for fragment in fragments(OPENAI_KEY):
        assert fragment not in repr(headers), f"provider key relayed in a response header: {headers}"


async def test_no_upstream_ever_sees_another_upstreams_key(gateway_factory: GatewayFactory,
                                                          fake: tuple[FakeProvider, str]) -> None:
    """Issue: a key of provider A is never sent to provider B (nor to an MCP server). Two OpenAI-type
    providers on two servers, one MCP server; model calls, forwarded paths and the merged model list."""
    other = FakeProvider()
    server = TestServer(other.app(), host="127.0.0.1")
    await server.start_server()
    mcp = FakeProvider()
    mcp_server = TestServer(mcp.app(), host="127.0.0.1")
    await mcp_server.start_server()
    try:
        other_url = str(server.make_url("")).rstrip("/")
        mcp_url = str(mcp_server.make_url("")).rstrip("/")
        h = await gateway_factory(providers={
            "a": {"type": "openai", "base_url": f"{fake[1]}/v1", "api_key": OPENAI_KEY},
            "b": {"type": "openai", "base_url": f"{other_url}/v1", "api_key": "sk-probe-other-b-0a1b2c3d4e5f"},
        }, models={"gpt-*": "a", "other-*": "b"}, mcp_servers={"files": {"url": f"{mcp_url}/mcp"}})
        for body in (OA, {**OA, "model": "other-1"}, {**OA, "model": "b/gpt-4o-mini"}, {**OA, "model": "a/other-1"}):
            status, _, raw = await post(h, CHAT, body)
            assert status == 200, raw
        for model in ("gpt-4o-mini", "other-1", "b/x", "a/x"):
            status, _, raw = await post(h, "/v1/embeddings", {"model": model, "input": "x"})
            assert status == 200, raw
        async with h.session.get(f"{h.url}/v1/models") as resp:
            assert resp.status == 200
        mcp.queue(Reply(body={"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}))
        status, _, raw = await post(h, "/mcp/files", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                    {"Accept": "application/json, text/event-stream"})
        assert status == 200, raw
        assert all("sk-probe-other-b" not in repr(s.headers) for s in h.fake.seen)
        assert all(OPENAI_KEY not in repr(s.headers) for s in other.seen)
        assert mcp.seen and all("sk-probe" not in repr(s.headers) for s in mcp.seen)
        assert len(other.seen) >= 4 and len(h.fake.seen) >= 4
    finally:
        await server.close()
        await mcp_server.close()


# -- agent keys and the caller's wire format ----------------------------------------------------------

AGENT_A = "agent-probe-alice-5d1e9c3b"
AGENT_M = "agent-probe-mallory-8a2f4e6c"


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/v1/messages/batches"])
async def test_a_wrong_key_on_an_anthropic_path_answers_in_anthropic_format(gateway_factory: GatewayFactory,
                                                                            path: str) -> None:
    """DESIGN section 4: 'Errors use the wire format of the API that was called (... Anthropic
    {"type": "error", "error": {...}})'; 401 invalid_api_key for an unknown agent key. Anthropic's
    token counting and batches are Anthropic Messages API paths that tollgate forwards."""
    h = await gateway_factory(agents={"alice": {"keys": [AGENT_A]}})
    status, _, raw = await post(h, path, AN, {"x-api-key": "wrong-key", "anthropic-version": "2023-06-01"})
    assert status == 401
    body = orjson.loads(raw)
    assert body.get("type") == "error" and body["error"].get("type") == "authentication_error", body
    assert body["error"]["code"] == "invalid_api_key"
    assert h.fake.seen == []


async def test_a_stopped_run_on_an_anthropic_path_answers_in_anthropic_format(gateway_factory: GatewayFactory) -> None:
    """README: forwarded `/v1/...` paths are refused 'for a stopped run'; DESIGN section 4: errors use 'the
    wire format of the API that was called' (Anthropic `{"type": "error", "error": {"type":
    "permission_error", ...}}` for a 403 stop)."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    run = {"x-tollgate-run-id": "stopped-1", "anthropic-version": "2023-06-01"}
    assert (await post(h, MESSAGES, AN, run))[0] == 200
    assert (await post(h, MESSAGES, AN, run))[0] == 403
    status, headers, raw = await post(h, "/v1/messages/count_tokens", AN, run)
    assert status == 403 and headers.get("x-tollgate-stop-reason") == "llm_call_cap"
    body = orjson.loads(raw)
    assert body.get("type") == "error" and body["error"].get("type") == "permission_error", body


async def test_the_anthropic_sdk_reads_a_wrong_key_on_count_tokens(gateway_factory: GatewayFactory) -> None:
    """DESIGN section 4: errors in the called API's format 'so that official SDKs raise their usual
    exceptions' with the error's message: the Anthropic SDK reads `error.message` of its own format."""
    h = await gateway_factory(agents={"alice": {"keys": [AGENT_A]}})
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="wrong-key", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await client.messages.count_tokens(model="claude-3-5-haiku-latest", messages=USER)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body.get("type") == "error", body


# -- a run id names one run, whoever sends it (README, "Runs, identity, decisions") -----------------------


async def test_agents_naming_one_run_id_share_that_run(gateway_factory: GatewayFactory) -> None:
    """README: 'A run id names one run whoever sends it: agents that share an id ... share its budget,
    caps, histories, recorded tool results and stop, each under its own policy; agents that must not
    affect each other need distinct run ids.' Pinned both ways: the shared run sees both agents' calls
    and one agent's stop; distinct ids (and each agent's standing run) stay apart."""
    agents = {"alice": {"keys": [AGENT_A], "tools": {"allow": ["search"]}},
              "bob": {"keys": [AGENT_M], "tools": {"allow": ["search"]}}}
    h = await gateway_factory(agents=agents)
    alice = {"Authorization": f"Bearer {AGENT_A}"}
    bob = {"Authorization": f"Bearer {AGENT_M}"}
    assert (await post(h, CHAT, OA, {**alice, "x-tollgate-run-id": "team-1"}))[0] == 200
    assert (await post(h, CHAT, OA, {**bob, "x-tollgate-run-id": "team-1"}))[0] == 200
    assert (await post(h, CHAT, OA, alice))[0] == 200  # alice:default
    assert (await h.run("team-1"))["llm_calls"] == 2
    h.fake.queue(Reply(body=openai_completion(tool_calls=[tool_call("rm_rf")])))  # Bob's model goes astray
    assert (await post(h, CHAT, OA, {**bob, "x-tollgate-run-id": "team-1"}))[0] == 403
    status, headers, _ = await post(h, CHAT, OA, {**alice, "x-tollgate-run-id": "team-1"})
    assert (status, headers.get("x-tollgate-stop-reason")) == (403, "tool_not_allowed")  # the shared stop
    assert (await post(h, CHAT, OA, alice))[0] == 200  # Alice's other runs go on
    assert (await h.run("alice:default"))["status"] == "active"


@pytest.fixture
async def mcp_fake() -> AsyncIterator[tuple[FakeProvider, str]]:
    server_fake = FakeProvider()
    server = TestServer(server_fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield server_fake, str(server.make_url("")).rstrip("/") + "/mcp"
    finally:
        await server.close()


def rpc_call(name: str, arguments: dict[str, Any], rpc_id: int = 7) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def rpc_result(text: str, rpc_id: int = 7) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "result": {"content": [{"type": "text", "text": text}], "isError": False}}


MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


# -- the admin port --------------------------------------------------------------------------------------


async def spend(h: Harness, run_id: str) -> None:
    status, _, raw = await post(h, CHAT, OA, {"x-tollgate-run-id": run_id})
    assert status == 200, raw


async def test_a_cross_site_request_cannot_reset_a_run(gateway_factory: GatewayFactory) -> None:
    """README: without `admin.token` the admin port is open on loopback only; reset 'clears their
    budgets' (server.admin_exposure_warning). A web page in the operator's browser can send a simple
    cross-site POST to 127.0.0.1:9464 (no preflight for a body-less POST): a browser's cross-site request
    must not reset a run, or loopback-only is no boundary."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    await spend(h, "victim")
    status, _, _raw = await post(h, CHAT, OA, {"x-tollgate-run-id": "victim"})
    assert status == 403  # stopped: llm_call_cap
    async with h.session.post(f"{h.admin_url}/admin/runs/victim/reset", data=b"",
                              headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site",
                                       "Sec-Fetch-Mode": "no-cors", "Content-Type": "text/plain"}) as resp:
        answered = resp.status
    run = await h.run("victim")
    assert run["status"] == "stopped" and answered in (400, 401, 403), \
        f"a cross-site POST reset the run (answered {answered}, run now {run['status']})"


async def test_the_admin_port_refuses_a_foreign_host_name(gateway_factory: GatewayFactory) -> None:
    """README: the admin port 'listens on 127.0.0.1' and, without a token, relies on that. A DNS-rebinding
    page (evil.example resolving to 127.0.0.1) reaches it with `Host: evil.example`; the open admin API
    must answer only requests addressed to a loopback name, or any website can read every run."""
    h = await gateway_factory()
    await spend(h, "rebind-victim")
    port = h.admin_url.rsplit(":", 1)[1]
    status, _, _body = await raw_request(h.admin_url, b"GET", "/admin/runs", [])
    assert status == 200  # the loopback name works
    reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
    writer.write(b"GET /admin/runs HTTP/1.1\r\nHost: rebind.evil.example:" + port.encode() +
                 b"\r\nConnection: close\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert b"rebind-victim" not in data, f"admin API answered a foreign Host: {data[:120]!r}"


ADMIN_TOKEN = "adm-probe-token-3e7c1a9f"


@pytest.mark.parametrize("target", [
    "//admin/runs", "/admin//runs", "/admin/runs/", "/admin/./runs", "/healthz/../admin/runs", "/readyz/../metrics",
    "/%61dmin/runs", "/admin%2Fruns", "/healthz%2F..%2Fadmin%2Fruns", "/ADMIN/runs", "/metrics/", "/metrics;x",
    "/admin/runs?x=/healthz", "/admin/runs#/healthz", "/healthz/..%2fadmin/runs", "/admin/runs/r1%2Freset",
    "http://127.0.0.1/admin/runs", "/admin/approvals/", "*",
])
@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"OPTIONS", b"POST"])
async def test_admin_path_tricks_never_pass_without_the_token(gateway_factory: GatewayFactory, target: str,
                                                              method: bytes) -> None:
    """README: '`admin: {token: ...}` makes every admin endpoint but `/healthz` and `/readyz` require
    `Bearer <token>`'. No spelling of a path (doubled slashes, dot segments, encodings, case, absolute
    form) nor method reaches run data, metrics or a reset without it."""
    h = await gateway_factory(admin={"token": ADMIN_TOKEN})
    await spend(h, "r1")
    status, _, body = await raw_request(h.admin_url, method, target, [])
    assert status != 200 or (b"r1" not in body and b"tollgate_" not in body and b"gen_ai" not in body), \
        (method, target, status, body[:200])
    run = h.gateway.store
    state = await run.get("r1")
    assert state is not None and state.used.get("llm_calls", 0) >= 1  # never reset


@pytest.mark.parametrize("target", ["/admin/runs", "/admin/runs/r1", "/metrics", "/admin/approvals",
                                    "/mcp/../admin/runs", "/v1/%2e%2e/admin/runs", "//admin/runs"])
async def test_the_proxy_port_serves_no_admin_endpoint(gw: Harness, target: str) -> None:
    """DESIGN section 2: the admin endpoints are on the admin port; the proxy port serves model calls
    and MCP only ('a path tollgate does not serve is a JSON 404 `not_found`')."""
    await spend(gw, "r1")
    for method in (b"GET", b"POST"):
        status, _, body = await raw_request(gw.url, method, target, [])
        assert status in (400, 404), (target, method, status, body[:200])
        assert b'"runs"' not in body and b"llm_calls" not in body
    assert (await gw.run("r1"))["llm_calls"] == 1


# -- `tollgate runs` --------------------------------------------------------------------------------------


async def test_tollgate_runs_never_sends_the_admin_token_to_another_host(tmp_path: Path) -> None:
    """README: `tollgate runs [--admin URL]` sends `TOLLGATE_ADMIN_TOKEN` to the admin URL it is given, and
    only there: an admin URL that redirects (a reverse proxy, a mistyped or hostile host) must not make it
    carry the token to another origin. The token reads every run and resets any run's budget."""
    seen: list[dict[str, str]] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"runs": []})

    other_app = web.Application()
    other_app.router.add_get("/{tail:.*}", elsewhere)
    other = TestServer(other_app, host="127.0.0.1")
    await other.start_server()
    other_url = str(other.make_url("")).rstrip("/").replace("127.0.0.1", "localhost")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"{other_url}/admin/runs")

    first_app = web.Application()
    first_app.router.add_get("/{tail:.*}", redirect)
    first = TestServer(first_app, host="127.0.0.1")
    await first.start_server()
    try:
        proc = await asyncio.create_subprocess_exec(
            *tollgate_command(), "runs", "--admin", str(first.make_url("")).rstrip("/"),
            env={**os.environ, "TOLLGATE_ADMIN_TOKEN": ADMIN_TOKEN}, cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await first.close()
        await other.close()
    leaked = [h for h in seen if ADMIN_TOKEN in repr(h)]
    assert not leaked, f"the admin token followed a redirect to {other_url}: {leaked}"
    assert ADMIN_TOKEN not in (out + err).decode()


# -- content stays out of telemetry and the ledger -----------------------------------------------------

CANARY = "CANARY-customer-ssn-078-05-1120"


async def test_a_nonconforming_answer_puts_no_content_in_spans_or_the_ledger(
        gateway_factory: GatewayFactory, tmp_path: Path) -> None:
    """README: 'Message content is captured only with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
    ... (or otel.capture_content: true)'; the ledger holds 'a hash of the inputs (never content)'. An
    answer that breaks its schema must not copy the answer's text into span events or ledger rows."""
    h = await gateway_factory(ledger={"path": str(tmp_path / "ledger.db")})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, capture_content=False, exporter=exporter)
    h.gateway.services.update(telemetry=telemetry, metrics_render=telemetry.metrics.render)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {**OA, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    h.fake.default = Reply(body=openai_completion(orjson.dumps({"n": CANARY}).decode()))
    try:
        status, _, raw = await post(h, CHAT, body, {"x-tollgate-run-id": "content-1"})
        assert status == 422, raw
        await h.gateway.services["ledger"].flush()
        assert telemetry.force_flush()
    finally:
        spans = list(exporter.get_finished_spans())
        telemetry.shutdown()
    assert spans
    span_text = "\n".join(s.to_json() for s in spans)
    ledger_text = "\n".join(p.read_bytes().decode("latin-1") for p in tmp_path.rglob("ledger.db*"))
    assert "output_nonconforming" in ledger_text
    leaks = [f"{where}: {line.strip()[:160]}" for where, text in (("spans", span_text), ("ledger", ledger_text))
             for line in text.splitlines() if CANARY in line]
    assert not leaks, f"answer content recorded with content capture off: {leaks}"


async def test_a_nonconforming_answer_puts_no_content_in_the_admin_run_view(gateway_factory: GatewayFactory) -> None:
    """DESIGN section 2: the admin run view is ids, counters and step summaries; content never leaves
    the request path ('a hash of the inputs (never content)')."""
    h = await gateway_factory()
    body = {**OA, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}}
    h.fake.default = Reply(body=openai_completion(orjson.dumps({"n": CANARY}).decode()))
    status, _, raw = await post(h, CHAT, body, {"x-tollgate-run-id": "content-2"})
    assert status == 422, raw
    async with h.session.get(f"{h.admin_url}/admin/runs/content-2") as resp:
        view = await resp.text()
    async with h.session.get(f"{h.admin_url}/admin/runs") as resp:
        view += await resp.text()
    assert CANARY not in view


async def test_a_violation_quoting_a_secret_is_redacted_from_spans(gateway_factory: GatewayFactory) -> None:
    """README: content is captured 'after redaction of provider keys, agent keys, bearer tokens'. With
    capture on, an answer that repeats the agent's key and breaks its schema must not put the key on the
    span through the re-ask/violation event either."""
    h = await gateway_factory(agents={"alice": {"keys": [AGENT_A], "output": {"retries": 0}}},
                              otel={"capture_content": True})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, capture_content=True, exporter=exporter)
    h.gateway.services.update(telemetry=telemetry, metrics_render=telemetry.metrics.render)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {**OA, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    h.fake.default = Reply(body=openai_completion(orjson.dumps({"n": f"my key is {AGENT_A}"}).decode()))
    try:
        status, _, raw = await post(h, CHAT, body, {"Authorization": f"Bearer {AGENT_A}"})
        assert status == 422, raw
        assert telemetry.force_flush()
    finally:
        spans = list(exporter.get_finished_spans())
        telemetry.shutdown()
    text = "\n".join(s.to_json() for s in spans)
    assert spans
    leaks = [line.strip()[:160] for line in text.splitlines() if AGENT_A in line]
    assert not leaks, f"agent key on a span despite redaction: {leaks}"


async def test_refused_mcp_arguments_put_no_content_in_the_ledger(gateway_factory: GatewayFactory,
                                                                  mcp_fake: tuple[FakeProvider, str],
                                                                  tmp_path: Path) -> None:
    """README 'Traces, metrics, ledger': a ledger row holds 'a hash of the inputs (never content)'. A
    `tools/call` refused as `invalid_arguments` must not copy the arguments into its ledger row."""
    server, url = mcp_fake
    h = await gateway_factory(mcp_servers={"files": {"url": url}}, ledger={"path": str(tmp_path / "ledger.db")})
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    server.queue(Reply(body={"jsonrpc": "2.0", "id": 1, "result": {"tools": [
        {"name": "lookup", "description": "x", "inputSchema": schema}]}}))
    status, _, raw = await post(h, "/mcp/files", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, MCP_ACCEPT)
    assert status == 200 and b"lookup" in raw, raw
    status, _, raw = await post(h, "/mcp/files", rpc_call("lookup", {"n": CANARY}), MCP_ACCEPT)
    assert status == 200 and b"invalid_arguments" in raw, raw
    assert len(server.seen) == 1  # the call never reached the server
    await h.gateway.services["ledger"].flush()
    ledger_text = "\n".join(p.read_bytes().decode("latin-1") for p in tmp_path.rglob("ledger.db*"))
    assert "tools/call lookup" in ledger_text  # the row was written
    assert CANARY not in ledger_text, "tool-call arguments copied into a ledger row"


async def test_check_config_never_prints_a_provider_key(tmp_path: Path) -> None:
    """DESIGN section 1: `tollgate check-config FILE` names each error's key path; the issue: provider keys
    never appear in 'config errors that print the config, `tollgate` CLI output'. A YAML slip on the
    line of a (rendered, literal) key must not print the key."""
    secret = "sk-literal-probe-77aa88bb99cc0011"
    path = tmp_path / "tollgate.yaml"
    path.write_text("providers:\n  openai:\n    type: openai\n    base_url: http://127.0.0.1:1/v1\n"
                    f"    api_key: {secret}\t# prod\nmodels: {{\"gpt-*\": openai}}\n")
    proc = await asyncio.create_subprocess_exec(*tollgate_command(), "check-config", str(path), cwd=tmp_path,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = (out + err).decode()
    assert proc.returncode == 1, text
    for fragment in fragments(secret):
        assert fragment not in text, f"check-config printed the key: {text}"


async def test_upstream_tollgate_headers_are_not_relayed(keyed: Harness) -> None:
    """DESIGN section 4: a stop 'carries its reason ... in the `x-tollgate-stop-reason` header'; only
    tollgate sets its own headers. An upstream cannot forge a stop, a run id or a replay marker."""
    keyed.fake.queue(Reply(body=openai_completion("ok"), headers={
        "x-tollgate-stop-reason": "budget_exhausted", "X-Tollgate-Run-Id": "forged", "x-tollgate-idempotent-replay": "true",
        "x-tollgate-max-tokens": "1"}))
    status, headers, raw = await post(keyed, CHAT, OA, {"x-tollgate-run-id": "real"})
    assert status == 200, raw
    lower = {k.lower(): v for k, v in headers.items()}
    assert lower["x-tollgate-run-id"] == "real"
    assert "x-tollgate-stop-reason" not in lower and "x-tollgate-idempotent-replay" not in lower
    assert "x-tollgate-max-tokens" not in lower


@pytest.mark.parametrize("value", [b"a\x00b", b"a\x01b", b"a\x7fb", b"a\x0bb"])
async def test_control_characters_in_a_forwarded_header_never_reach_the_upstream(keyed: Harness,
                                                                                 value: bytes) -> None:
    """Issue: 'CR/LF or NUL in forwarded headers'. A header value with a control character is a 400
    `invalid_request` (DESIGN section 4 'bad header') and is never written to the upstream."""
    status, _, body = await raw_request(keyed.url, b"POST", CHAT, [(b"Content-Type", b"application/json"),
                                                                  (b"X-Custom", value)], orjson.dumps(OA))
    assert status == 400, body
    assert keyed.fake.seen == []


@pytest.mark.parametrize("name", ["..%2F..%2Fadmin", "%2e%2e", "files%2F..%2F..%2Fx", "files@127.0.0.1",
                                  "http:%2F%2Fevil", "files%00", "FILES", "files.", "files%20"])
async def test_mcp_server_names_cannot_choose_the_upstream(gateway_factory: GatewayFactory,
                                                           mcp_fake: tuple[FakeProvider, str], name: str) -> None:
    """DESIGN section 2: `/mcp/{server}` proxies to 'the configured MCP server'; an unknown server is a
    404 `mcp_server_not_found` (README); no name reaches anything but a configured URL, and a name that
    is not exactly a configured one reaches nothing."""
    server, url = mcp_fake
    h = await gateway_factory(mcp_servers={"files": {"url": url}})
    status, _, body = await raw_request(h.url, b"POST", f"/mcp/{name}",
                                        [(b"Content-Type", b"application/json"),
                                         (b"Accept", b"application/json, text/event-stream")],
                                        orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
    assert status in (400, 404), (name, status, body[:200])
    assert server.seen == [] and h.fake.seen == []


