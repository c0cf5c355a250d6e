"""Hostile probes of operating tollgate as the README and DESIGN describe it: `tollgate check-config`,
custom guards (`module:Class`, the `StopCondition` protocol of docs/custom-guards.md), spans and the
Prometheus metrics of "## Traces, metrics, ledger", and DESIGN section 2's traced `/v1/...` paths.

The CLI runs as a subprocess (`python -m gateway`); the gateway is driven over loopback with fake
upstreams (tests/fakes/) and its spans are asserted as an OTLP/HTTP receiver decoded them
(tests/otel/otlp_sink.py), after `Telemetry.force_flush()` run off the loop.

Every test here failed on the code it was written against; each docstring quotes the promise and says
what happened instead.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from mcp import MCPError
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply
from tests.gateway.test_mcp_probe import mcp_client
from tests.otel.otlp_sink import OtlpSink, WireSpan, running_sink

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


# -- helpers ---------------------------------------------------------------------------------------------


def check_config(path: Path, *, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (pythonpath, REPO) if p is not None)
    return subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], cwd=path.parent,
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
async def sink(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OtlpSink]:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    async with running_sink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        yield sink


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start()
    yield server
    server.stop()


async def flushed(h: Harness, sink: OtlpSink) -> list[WireSpan]:
    assert await asyncio.to_thread(h.gateway.services["telemetry"].force_flush)
    return list(sink.spans)


async def post(h: Harness, body: dict[str, Any], *, run: str, agent: str = "default") -> int:
    headers = {"x-tollgate-run-id": run, "x-tollgate-agent": agent, "content-type": "application/json"}
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
        await resp.read()
        return resp.status


async def guard_decisions(h: Harness) -> list[Any]:
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("tollgate_guard_decisions")
    return [s for s in family.samples if s.name.endswith("_total")] if family is not None else []


# -- tollgate check-config --------------------------------------------------------------------------------


def test_check_config_refuses_an_otel_redact_pattern_that_serve_cannot_compile(tmp_path: Path) -> None:
    """DESIGN 1 / README "## Commands": `tollgate check-config FILE` validates a config; "each error names
    its key path; exit 1 on error". README "## Traces, metrics, ledger" names the `otel.redact` patterns
    (regexes, `otel/redact.py`). Instead, `otel: {redact: ["[unclosed"]}` passes check-config (exit 0,
    `ok: ...`), while `tollgate serve` on the very same file dies at startup with a raw
    `re.error: unterminated character set` traceback that names no key."""
    path = tmp_path / "tollgate.yaml"
    path.write_text('state: {backend: memory}\notel: {redact: ["[unclosed"]}\n')
    result = check_config(path)
    assert result.returncode == 1, f"check-config accepted an uncompilable otel.redact: {result.stdout!r}"
    assert any(line.startswith("error: otel.redact.0: ") for line in result.stderr.splitlines()), result.stderr


def test_check_config_refuses_a_state_url_that_is_not_a_redis_url(tmp_path: Path) -> None:
    """DESIGN 1: check-config "validate a config; errors name the key path; exit 1 on error"; DESIGN 5 /
    README "## Many sidecars, one budget": `state: {backend: redis, url: redis://...}`. Instead,
    `state: {backend: redis, url: "http://nothing"}` passes check-config (exit 0, `ok: ... state redis`),
    and `tollgate serve` on the same file refuses to start (`cannot start: bad redis url for the run store
    ...: Redis URL must specify one of the following schemes`): the check says ok to a config serve
    rejects, and neither names `state.url`."""
    path = tmp_path / "tollgate.yaml"
    path.write_text('state: {backend: redis, url: "http://nothing"}\n')
    result = check_config(path)
    assert result.returncode == 1, f"check-config accepted a non-Redis state.url: {result.stdout!r}"
    assert any(line.startswith("error: state.url: ") for line in result.stderr.splitlines()), result.stderr


# -- custom guards ----------------------------------------------------------------------------------------

GUARDS_MODULE = """
from guards.base import Decision


class _Allow:
    def before(self, ctx):
        return Decision.allow(self.name)

    def after(self, ctx, answer):
        return Decision.allow(self.name)


class PolicyAfterOptions(_Allow):
    name = "policy_after_options"

    def __init__(self, limit: int = 1, policy=None) -> None:
        assert policy is not None and hasattr(policy, "budget"), f"no policy given: {policy!r}"
        self.limit, self.policy = limit, policy


class KeywordOnlyPolicy(_Allow):
    name = "keyword_only_policy"

    def __init__(self, *, policy, limit: int = 1) -> None:
        self.limit, self.policy = limit, policy
"""


@pytest.mark.parametrize("cls", ["PolicyAfterOptions", "KeywordOnlyPolicy"])
def test_a_guard_constructor_with_a_policy_parameter_receives_the_policy(tmp_path: Path, cls: str) -> None:
    """docs/custom-guards.md: "`options` are the constructor's keyword arguments (a constructor with a
    `policy` parameter also receives the agent's policy)". Instead the policy is passed positionally
    into the constructor's *first* parameter, whatever its name (`guards/registry.py`:
    `cls(policy, **options)`): `__init__(self, limit=1, policy=None)` with `options: {limit: 3}` is a
    config error "got multiple values for argument 'limit'", and a keyword-only `policy`
    (`__init__(self, *, policy, limit=1)`) is "takes 1 positional argument but 2 ... were given", both
    reported as `agents.bot.guards.0.use` by check-config (exit 1) and fatal to `tollgate serve`."""
    (tmp_path / "qa_policy_guards.py").write_text(textwrap.dedent(GUARDS_MODULE))
    path = tmp_path / "tollgate.yaml"
    path.write_text(f'agents:\n  bot:\n    guards:\n      - use: "qa_policy_guards:{cls}"\n'
                    "        options: {limit: 3}\n")
    result = check_config(path, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr


async def test_a_custom_guards_claim_limit_holds_for_mcp_tool_calls(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """docs/custom-guards.md: "`Decision.allow(name, claims=...)` claims amounts reserved atomically
    before the call (`Claim` ..., with a limit); a claimed counter other than `usd` and `tokens` counts per
    step"; a guard "reads `ctx.call` (the provider-neutral `Call`, the same for OpenAI, Anthropic and
    MCP)"; DESIGN 6: "one guard works for every provider". On model calls a claim of one `probe_calls`
    per step with limit 2 refuses the third step. On MCP `tools/call` steps the guard runs but its
    claims are dropped (`gateway/mcp_calls.py:_apply` applies only `verdict.effects`): all four calls
    reach the tool server and the run stays active."""
    h = await gateway_factory(
        mcp_servers={"files": {"url": files.url}},
        agents={"bot": {"guards": [{"use": "tests.gateway.test_config_probe:ClaimCap", "options": {"limit": 2}}]}},
    )
    outcomes: list[str] = []
    async with mcp_client(h, run="claim-mcp") as client:
        for i in range(4):
            try:
                result = await client.call_tool("read_file", {"path": f"note-{i}.txt"})
                outcomes.append("error" if result.is_error else "ok")
            except Exception as exc:  # noqa: BLE001 - a refusal is a JSON-RPC error the SDK raises
                outcomes.append(f"refused: {exc}")
    executed = [name for name, _ in files.seen.calls() if name == "read_file"]
    assert len(executed) <= 2, f"claim limit 2 did not hold for MCP tool calls: {outcomes}"


# -- spans and metrics ------------------------------------------------------------------------------------


async def test_an_mcp_tool_call_records_its_guard_decisions(
    sink: OtlpSink, gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README "## Traces, metrics, ledger": "Guard decisions are the `tollgate.guards` attribute and
    `tollgate.guard` events for stops", and `GET /metrics` has `tollgate_guard_decisions_total`; DESIGN:
    every tool call the agent makes is a step whose record stage writes "span attributes and events,
    metrics, ledger row", by the same stages as model calls. The guard chain does run on an MCP
    `tools/call` (a custom guard's reject refuses it), yet its `tools/call read_file` span carries no
    `tollgate.guards` attribute, and its decisions are not counted in `tollgate_guard_decisions_total`
    (no sample at all after a run of MCP calls only), while a model call's span lists
    `caps:allow,progress:allow,budget:allow,loop:allow` and is counted."""
    h = await gateway_factory(mcp_servers={"files": {"url": files.url}})
    async with mcp_client(h, run="mcp-guards") as client:
        result = await client.call_tool("read_file", {"path": "a.txt"})
        assert not result.is_error
    spans = [s for s in await flushed(h, sink) if s.name == "tools/call read_file"]
    assert spans, [s.name for s in sink.spans]
    assert "tollgate.guards" in spans[0].attributes, sorted(spans[0].attributes)
    assert "caps:allow" in spans[0].value("tollgate.guards")
    assert sum(s.value for s in await guard_decisions(h)) > 0, "no guard decision of the MCP step counted"


async def test_a_step_the_budget_stopped_does_not_record_budget_allow(
    sink: OtlpSink, gateway_factory: GatewayFactory
) -> None:
    """README "## Traces, metrics, ledger": "Guard decisions are the `tollgate.guards` attribute and
    `tollgate.guard` events for stops"; `tollgate_guard_decisions_total` on `/metrics`. A model call the
    USD budget refuses (403 `budget_exhausted`, error.type `budget_exhausted`, a `tollgate.guard` event
    `budget`/`stop`) has `tollgate.guards` = `caps:allow,progress:allow,budget:allow,loop:allow`: the
    span says the budget guard allowed the step it stopped. The metric agrees with the attribute:
    `tollgate_guard_decisions_total{guard="budget",decision="allow"}` is counted and no
    `decision="stop"` sample ever appears for the budget (its stops come from the store's claim, which
    `gateway/observe.py` records as an event only)."""
    h = await gateway_factory(
        pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
        agents={"default": {"budget": {"usd": 0.00005}}},
    )
    assert await post(h, CHAT, run="budget-guards") == 403
    spans = [s for s in await flushed(h, sink) if s.name == "chat gpt-4o-mini"]
    assert spans and spans[0].value("error.type") == "budget_exhausted"
    assert ("tollgate.guard", "budget", "stop") in [
        (name, attrs["tollgate.guard.name"][1], attrs["tollgate.guard.decision"][1])
        for name, attrs in spans[0].events]
    assert "budget:allow" not in spans[0].value("tollgate.guards").split(","), spans[0].value("tollgate.guards")
    budget_stops = [s for s in await guard_decisions(h)
                    if s.labels.get("guard") == "budget" and s.labels.get("decision") == "stop"]
    assert budget_stops and budget_stops[0].value >= 1


async def test_an_mcp_servers_http_error_is_no_json_rpc_code_on_its_span(sink: OtlpSink,
                                                                          gateway_factory: GatewayFactory) -> None:
    """A `tools/call` the server answers with an HTTP 500 and no JSON-RPC response: `error.type` "500",
    but no `rpc.response.status_code` (which names a JSON-RPC error code, semconv)."""
    from aiohttp import web

    from tests.gateway.test_mcp_probe import RawServer, call, raw

    class Failing(RawServer):
        async def handle(self, request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read()) if request.method == "POST" else {}
            if body.get("method") == "tools/call":
                return web.Response(status=500, text="boom")
            return await super().handle(request)

    server = await Failing().start()
    try:
        h = await gateway_factory(mcp_servers={"files": {"url": server.url}},
                                  agents={"bot": {"tools": {"allow": ["files/read_file"]}}})
        status, _, _ = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 500  # the server's own error answer, relayed as it came
        [span] = [s for s in await flushed(h, sink) if s.name == "tools/call read_file"]
        assert span.value("error.type") == "500" and "rpc.response.status_code" not in span.attributes
    finally:
        await server.close()


async def test_an_mcp_call_over_the_tool_call_cap_records_the_caps_stop(
    sink: OtlpSink, gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """As a model call the budget stopped: the `tools/call` the run store refused at `caps.tool_calls` read
    `caps:allow` in `tollgate.guards` (its count is the store's, not the guard's), and no
    `decision="stop"` sample of the caps was ever counted for MCP calls."""
    h = await gateway_factory(mcp_servers={"files": {"url": files.url}}, agents={"bot": {"caps": {"tool_calls": 1}}})
    async with mcp_client(h, run="mcp-cap") as client:
        assert not (await client.call_tool("read_file", {"path": "a.txt"})).is_error
        with pytest.raises(MCPError, match="tool_call_cap"):
            await client.call_tool("read_file", {"path": "b.txt"})
    spans = [s for s in await flushed(h, sink) if s.name == "tools/call read_file"]
    [stopped] = [s for s in spans if "error.type" in s.attributes and s.value("error.type") == "tool_call_cap"]
    guards = stopped.value("tollgate.guards").split(",")
    assert guards[-4:].count("caps:stop") == 1 and "caps:allow" not in guards[-4:], guards  # the count's judgement
    cap_stops = [s for s in await guard_decisions(h)
                 if (s.labels.get("guard"), s.labels.get("decision")) == ("caps", "stop")]
    assert cap_stops and cap_stops[0].labels.get("reason") == "tool_call_cap" and cap_stops[0].value == 1


async def test_a_response_the_provider_failed_is_an_error_span(sink: OtlpSink, gateway_factory: GatewayFactory) -> None:
    """A Responses answer with `status: failed` is relayed as it came (and billed from its usage), but
    its span was UNSET with no `error.type`, and the duration metric counted it a success."""
    h = await gateway_factory()
    failed = {**response_body("", usage=(10, 0)), "status": "failed", "output": [],
              "error": {"code": "server_error", "message": "The model failed"}}
    h.fake.queue(Reply(body=failed))
    async with h.session.post(f"{h.url}/v1/responses", json={"model": "gpt-4o-mini", "input": "hi"},
                              headers={"x-tollgate-run-id": "failed-1"}) as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "failed"
    [span] = [s for s in await flushed(h, sink) if s.name == "chat gpt-4o-mini"]
    assert (span.status_code, span.value("error.type")) == (2, "server_error")


async def test_the_upstream_status_label_is_the_status_the_upstream_answered(gateway_factory: GatewayFactory) -> None:
    """`tollgate_upstream_requests_total{status}`: the upstream's own status. A 200 whose body is not
    JSON (a 502 to the agent) was counted `unreachable`, as if no answer had come."""
    h = await gateway_factory()
    h.fake.queue(Reply(body=b"{not json"))
    assert await post(h, CHAT, run="bad-200") == 502
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        text = await resp.text()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "tollgate_upstream_requests"]
    statuses = {s.labels["status"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert statuses == {"200": 1.0}, statuses


async def test_an_anthropic_stream_the_provider_ends_with_an_error_event_is_that_error(
    sink: OtlpSink, gateway_factory: GatewayFactory,
) -> None:
    """An `error` event mid-stream (an overload) is relayed as it came; tollgate then added an error event
    of its own ("upstream stream ended before the answer was complete") and named the span's error
    `upstream_unavailable` instead of the provider's `overloaded_error`."""
    h = await gateway_factory()
    start = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
             "model": "claude-3-5-haiku-latest", "content": [], "usage": {"input_tokens": 5, "output_tokens": 1}}}
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    h.fake.queue(Reply(chunks=[b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n",
                               b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"]))
    body = {"model": "claude-3-5-haiku-latest", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with h.session.post(f"{h.url}/v1/messages", json=body, headers={"x-tollgate-run-id": "overload"}) as resp:
        raw = await resp.read()
    assert raw.count(b"event: error") == 1 and b"overloaded_error" in raw, raw
    [span] = [s for s in await flushed(h, sink) if s.name.startswith("chat ")]
    assert (span.status_code, span.value("error.type")) == (2, "overloaded_error")


async def test_get_v1_models_is_traced(sink: OtlpSink, gateway_factory: GatewayFactory) -> None:
    """DESIGN 2: "`GET /v1/models` and other `/v1/...` paths (embeddings, ...): forwarded to the provider,
    traced." Other forwarded paths are: `GET /v1/files` and `GET /v1/models/{id}` each leave a `GET`
    CLIENT span. `GET /v1/models` (answered by `gateway/model_list.py:list_models`, which reads every
    provider's list upstream) leaves no span at all."""
    h = await gateway_factory()
    async with h.session.get(f"{h.url}/v1/models", headers={"x-tollgate-run-id": "models-1"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"], "the fake provider's model list is not empty"
    assert h.fake.seen and h.fake.seen[-1].path == "/v1/models", "the list was read upstream"
    spans = await flushed(h, sink)
    assert spans, "GET /v1/models went upstream and left no span"
