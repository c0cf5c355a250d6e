"""Spans and ledger rows of the `/v1` paths tollgate forwards unguarded (embeddings, files, ...), and of
model calls refused before their step exists (gateway/observe_forward.py)."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.call import digest
from gateway.observe_forward import body_model
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, openai_completion

MSG = [{"role": "user", "content": "hi"}]
EMBEDDING = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1]}],
             "model": "text-embedding-3-small", "usage": {"prompt_tokens": 2, "total_tokens": 2}}


async def traced(gateway_factory: GatewayFactory, **config: Any) -> tuple[Harness, Telemetry, InMemorySpanExporter]:
    h = await gateway_factory(**config)
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    return h, telemetry, exporter


def finished(telemetry: Telemetry, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert telemetry.force_flush()
    return list(exporter.get_finished_spans())


def traceparent(span: ReadableSpan) -> str:
    ctx = span.context
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


async def test_embeddings_are_an_inference_span_whose_context_goes_upstream(gateway_factory: GatewayFactory) -> None:
    h, telemetry, exporter = await traced(gateway_factory)
    h.fake.queue(Reply(body=EMBEDDING))
    async with h.session.post(f"{h.url}/v1/embeddings", data=orjson.dumps({"model": "gpt-embed", "input": "x"}),
                              headers={"content-type": "application/json", "x-tollgate-run-id": "emb",
                                       "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}) as resp:
        assert resp.status == 200
        await resp.read()
    [span] = [s for s in finished(telemetry, exporter) if s.name == "embeddings gpt-embed"]
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "embeddings" and attrs["gen_ai.request.model"] == "gpt-embed"
    assert attrs["gen_ai.provider.name"] == "openai" and attrs["http.response.status_code"] == 200
    assert attrs["tollgate.run_id"] == "emb" and "error.type" not in attrs
    assert span.parent is not None and f"{span.parent.trace_id:032x}" == "ab" * 16  # the agent's trace
    assert h.fake.seen[-1].headers["traceparent"] == traceparent(span)  # the span's, not the agent's
    # embeddings produce no output tokens: a 0 was reported, and added to the output-token histogram
    assert attrs["gen_ai.usage.input_tokens"] == 2 and "gen_ai.usage.output_tokens" not in attrs
    metrics = telemetry.metrics.render()[0].decode()
    assert 'gen_ai_operation_name="embeddings"' in metrics
    tokens = [line for line in metrics.splitlines() if line.startswith("gen_ai_client_token_usage_count")]
    assert any('gen_ai_token_type="input"' in t for t in tokens)
    assert not any('gen_ai_token_type="output"' in t for t in tokens), tokens
    telemetry.shutdown()


async def test_the_openai_sdk_s_embeddings_and_chat_attributes_reach_the_span(gateway_factory: GatewayFactory) -> None:
    """semconv.md 1.2/1.3: `gen_ai.embeddings.dimension.count`, `gen_ai.request.encoding_formats` and
    `openai.response.system_fingerprint` are recommended; the official SDK sends the first two."""
    h, telemetry, exporter = await traced(gateway_factory)
    h.fake.queue(Reply(body=EMBEDDING), Reply(body={**openai_completion(), "system_fingerprint": "fp_9"}))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        await client.embeddings.create(model="gpt-embed", input="x", dimensions=256, encoding_format="float")
        await client.chat.completions.create(model="gpt-4o-mini", messages=MSG)  # type: ignore[arg-type]
    spans = {s.name: dict(s.attributes or {}) for s in finished(telemetry, exporter)}
    embed, chat = spans["embeddings gpt-embed"], spans["chat gpt-4o-mini"]
    assert (embed["gen_ai.embeddings.dimension.count"], embed["gen_ai.request.encoding_formats"]) == (256, ("float",))
    assert chat["openai.response.system_fingerprint"] == "fp_9"
    telemetry.shutdown()


async def test_other_paths_are_http_spans_without_the_query_or_genai_metrics(gateway_factory: GatewayFactory) -> None:
    h, telemetry, exporter = await traced(gateway_factory)
    h.fake.queue(Reply(status=404, body={"error": {"message": "no such file"}}))
    async with h.session.get(f"{h.url}/v1/files/file-1?key=secret", headers={"x-tollgate-run-id": "f"}) as resp:
        assert resp.status == 404
        await resp.read()
    [span] = [s for s in finished(telemetry, exporter) if s.name == "GET"]
    attrs = dict(span.attributes or {})
    assert attrs["http.request.method"] == "GET" and attrs["http.response.status_code"] == 404
    assert str(attrs["url.full"]).endswith("/v1/files/file-1") and "secret" not in str(attrs)
    assert attrs["error.type"] == "404" and "gen_ai.operation.name" not in attrs
    assert "gen_ai_client_operation_duration_seconds_count" not in telemetry.metrics.render()[0].decode()
    telemetry.shutdown()


async def test_an_unreachable_upstream_is_the_spans_error(gateway_factory: GatewayFactory) -> None:
    h, telemetry, exporter = await traced(gateway_factory, providers={
        "openai": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "k",
                   "timeouts": {"connect": 1}}}, models={"gpt-*": "openai"})
    async with h.session.post(f"{h.url}/v1/embeddings", json={"model": "gpt-embed", "input": "x"}) as resp:
        assert resp.status == 502
    [span] = [s for s in finished(telemetry, exporter) if s.name.startswith("embeddings")]
    assert dict(span.attributes or {})["error.type"] == "upstream_unavailable"
    telemetry.shutdown()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/files"])
async def test_a_stopped_run_refused_on_another_path_leaves_a_span_and_a_ledger_row(
        gateway_factory: GatewayFactory, path: str) -> None:
    h, telemetry, exporter = await traced(gateway_factory, agents={"default": {"caps": {"llm_calls": 1}}})
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    for expected in (200, 403):
        async with h.session.post(f"{h.url}/v1/chat/completions", json=chat,
                                  headers={"x-tollgate-run-id": "stopped"}) as resp:
            assert resp.status == expected
    body = orjson.dumps({"model": "gpt-embed", "input": "x"})
    headers = {"x-tollgate-run-id": "stopped", "content-type": "application/json"}
    async with h.session.post(f"{h.url}{path}", data=body, headers=headers) as resp:
        assert resp.status == 403 and resp.headers["x-tollgate-stop-reason"] == "llm_call_cap"
    assert len(h.fake.seen) == 1
    spans = [s for s in finished(telemetry, exporter) if s.name in ("embeddings gpt-embed", "POST")]
    assert [dict(s.attributes or {})["tollgate.stop_reason"] for s in spans] == ["llm_call_cap"]
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = [r for r in ledger.rows() if r["run_id"] == "stopped"]
    assert (rows[-1]["decision"], rows[-1]["reason"], rows[-1]["operation"]) == (
        "stop", "llm_call_cap", "embeddings" if path.endswith("embeddings") else "http")
    # the model the body names, and its hash as a model call's row hashes its body
    assert (rows[-1]["model"], rows[-1]["input_hash"]) == ("gpt-embed", digest(body))
    telemetry.shutdown()


@pytest.mark.parametrize(("body", "model"), [
    (b'{"model": "text-embedding-3-small", "input": "x"}', "text-embedding-3-small"),
    (b' \n {"input": "x", "model": "m"}', "m"),
    (b'{"model": 3}', None), (b'{"input": "x"}', None), (b'["model"]', None), (b"", None),
    (b"--boundary\r\nContent-Disposition: form-data", None), (b'{"model": "m"', None), (b"\xff\xfe", None),
])
def test_body_model(body: bytes, model: str | None) -> None:
    assert body_model(body) == model


# -- model calls refused before their step exists ------------------------------------------------------


@pytest.mark.parametrize(("payload", "headers", "status", "code"), [
    ({"model": "nobody-serves-this", "messages": MSG}, {}, 404, "model_not_found"),
    ({"model": "gpt-4o-mini", "messages": MSG}, {"x-tollgate-grammar": "no-such-grammar"}, 400,
     "invalid_request"),
])
async def test_a_model_call_refused_before_its_step_is_a_span_and_a_ledger_row(
    gateway_factory: GatewayFactory, payload: dict[str, Any], headers: dict[str, str], status: int, code: str
) -> None:
    h, telemetry, exporter = await traced(gateway_factory)
    raw = orjson.dumps(payload)
    async with h.session.post(f"{h.url}/v1/chat/completions", data=raw, headers={
            "x-tollgate-run-id": "refused", "content-type": "application/json", **headers}) as resp:
        assert resp.status == status and code in await resp.text()
    assert h.fake.seen == []
    [span] = [s for s in finished(telemetry, exporter)
              if dict(s.attributes or {}).get("tollgate.run_id") == "refused"]
    attrs = dict(span.attributes or {})
    assert span.name == f"chat {payload['model']}" and attrs["error.type"] == code
    assert attrs["gen_ai.provider.name"] == ("openai_compatible" if status == 404 else "openai")  # Required
    assert "tollgate.stop_reason" not in attrs  # a refusal, not a stop
    assert "gen_ai_client_operation_duration_seconds_count" not in telemetry.metrics.render()[0].decode()
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    [row] = ledger.rows("refused")
    assert (row["decision"], row["reason"], row["operation"], row["model"], row["input_hash"]) == (
        "error", code, "chat", payload["model"], digest(raw))
    telemetry.shutdown()


BAD_SCHEMA = {"$ref": "#"}  # a schema tollgate cannot check: a 400 once the call is parsed and routed


@pytest.mark.parametrize(("path", "payload", "status", "provider", "routed"), [
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, 400, "openai", True),
    ("/v1/messages", {"model": "claude-3-5-haiku-latest", "max_tokens": 10, "messages": MSG,
                      "output_format": {"type": "json_schema", "schema": BAD_SCHEMA}}, 400, "anthropic", True),
    ("/v1/responses", {"model": "gpt-4o-mini", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}}, 400, "openai", True),
    # no route: the provider the request's API implies, and no server (no upstream was chosen)
    ("/v1/messages", {"model": "nobody-serves-this", "max_tokens": 10, "messages": MSG}, 404, "anthropic", False),
    ("/v1/responses", {"model": "nobody-serves-this", "input": "hi"}, 404, "openai_compatible", False),
    # routed to a provider of the other API: it could never go there, so that is no route either
    ("/v1/chat/completions", {"model": "claude-3-5-haiku-latest", "messages": MSG}, 400, "openai_compatible",
     False),
    ("/v1/embeddings", {"model": "claude-3-5-haiku-latest", "input": "x"}, 400, "openai_compatible", False),
    ("/v1/completions", {"model": "nobody-serves-this", "prompt": "x"}, 404, "openai_compatible", False),
])
async def test_a_refused_model_call_s_span_names_its_provider_and_server(
    gateway_factory: GatewayFactory, fake: tuple[Any, str], path: str, payload: dict[str, Any], status: int,
    provider: str, routed: bool,
) -> None:
    """semconv notes 1.2: `gen_ai.provider.name` is Required on an inference span. A call refused once
    parsed has its route's provider, named as that provider's other spans name it, and its server
    (`server.address`/`server.port`, sampling-relevant, at span start); without a usable route, the
    provider the API implies and no server."""
    h, telemetry, exporter = await traced(gateway_factory)
    h.fake.queue(Reply(body=openai_completion()))  # the routed chat call that names the same provider
    async with h.session.post(f"{h.url}{path}", data=orjson.dumps(payload), headers={
            "x-tollgate-run-id": "refused", "content-type": "application/json"}) as resp:
        assert resp.status == status, await resp.text()
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps(
            {"model": "gpt-4o-mini", "messages": MSG}), headers={"x-tollgate-run-id": "served"}) as resp:
        assert resp.status == 200
    spans = finished(telemetry, exporter)
    [span] = [s for s in spans if dict(s.attributes or {}).get("tollgate.run_id") == "refused"]
    [served] = [dict(s.attributes or {}) for s in spans
                if dict(s.attributes or {}).get("tollgate.run_id") == "served"]
    attrs = dict(span.attributes or {})
    operation = {"/v1/embeddings": "embeddings", "/v1/completions": "text_completion"}.get(path, "chat")
    assert span.name == f"{operation} {payload['model']}" and attrs["gen_ai.provider.name"] == provider
    port = int(fake[1].rsplit(":", 1)[1])
    if routed:
        assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", port)
        if provider == "openai":
            assert attrs["gen_ai.provider.name"] == served["gen_ai.provider.name"]
    else:
        assert "server.address" not in attrs and "server.port" not in attrs
    if provider != "openai":  # `openai.*` only with the `openai` flavour (semconv notes 1.1)
        assert not [k for k in attrs if k.startswith("openai.")]
    telemetry.shutdown()


async def test_a_request_that_is_no_model_call_leaves_no_step(gateway_factory: GatewayFactory) -> None:
    """Refused before it parsed as a call (not JSON): nothing names a model or a call to record."""
    h, telemetry, exporter = await traced(gateway_factory)
    headers = {"x-tollgate-run-id": "junk", "content-type": "application/json"}
    async with h.session.post(f"{h.url}/v1/chat/completions", data=b"{not json", headers=headers) as resp:
        assert resp.status == 400
    assert finished(telemetry, exporter) == []
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    assert ledger.rows("junk") == []
    telemetry.shutdown()
