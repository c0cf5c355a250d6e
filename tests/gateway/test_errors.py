"""DESIGN section 4 without guards: every error in the wire format of the API called, the official SDKs
raising their usual exception classes, upstream errors passed through unchanged, and DESIGN section 3's
run id echoed on every answer."""

from __future__ import annotations

import socket
import time
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_message, anthropic_stream, openai_completion, openai_stream

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RUN_HEADER = "x-tollgate-run-id"
OA_MODEL = "gpt-4o-mini"
AN_MODEL = "claude-3-5-haiku-latest"
USER = [{"role": "user", "content": "hi"}]

# Anthropic's documented error categories per status (docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    502: "api_error",
    504: "timeout_error",
}


# -- helpers ------------------------------------------------------------------------------------------


def oa(h: Harness, api_key: str = "agent-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key=api_key, max_retries=0)


def an(h: Harness, api_key: str = "agent-key") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key=api_key, max_retries=0)


def body_for(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": OA_MODEL, "messages": USER, **extra}
    return {"model": AN_MODEL, "max_tokens": 64, "messages": USER, **extra}


async def post(
    h: Harness, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with h.session.post(f"{h.url}{path}", data=data, headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def wire_error(path: str, raw: bytes, status: int, code: str) -> dict[str, Any]:
    """Assert the error body has exactly the shape of the API that was called; return the inner error."""
    data = orjson.loads(raw)
    if path == MESSAGES:
        assert set(data) == {"type", "error"}, data
        assert data["type"] == "error"
        err = data["error"]
        assert set(err) == {"type", "message", "code"}, err
        assert err["type"] == ANTHROPIC_TYPE[status], err
    else:
        assert set(data) == {"error"}, data
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["type"], str) and err["type"]
        assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    return err  # type: ignore[no-any-return]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nested(depth: int) -> Any:
    """A JSON value whose own nesting depth (objects and arrays) is `depth`."""
    value: Any = {}
    for _ in range(depth - 1):
        value = {"x": value}
    return value


BOTH = pytest.mark.parametrize("path", [CHAT, MESSAGES])


# -- 400 invalid_request ------------------------------------------------------------------------------

MALFORMED: list[tuple[str, bytes]] = [
    ("truncated json", b'{"model": "gpt-4o-mini", "messages": ['),
    ("not json at all", b"hello"),
    ("empty body", b""),
    ("array body", b'[{"model": "gpt-4o-mini"}]'),
    ("string body", b'"just a string"'),
    ("number body", b"42"),
    ("null body", b"null"),
    ("invalid utf-8", b'{"model": "\xff\xfe"}'),
]


@BOTH
@pytest.mark.parametrize("raw", [r for _, r in MALFORMED], ids=[n for n, _ in MALFORMED])
async def test_400_malformed_body(gw: Harness, path: str, raw: bytes) -> None:
    status, headers, body = await post(gw, path, raw)
    assert status == 400
    wire_error(path, body, 400, "invalid_request")
    assert headers[RUN_HEADER] == "default:default"
    assert gw.fake.seen == []


SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("missing model", {"messages": USER, "max_tokens": 5}),
    ("empty model", {"model": "", "messages": USER, "max_tokens": 5}),
    ("model not a string", {"model": 7, "messages": USER, "max_tokens": 5}),
    ("missing messages", {"model": "{model}", "max_tokens": 5}),
    ("messages not a list", {"model": "{model}", "messages": "hi", "max_tokens": 5}),
    ("message not an object", {"model": "{model}", "messages": ["hi"], "max_tokens": 5}),
    ("stream not a boolean", {"model": "{model}", "messages": USER, "stream": "yes", "max_tokens": 5}),
]


@BOTH
@pytest.mark.parametrize("body", [b for _, b in SHAPES], ids=[n for n, _ in SHAPES])
async def test_400_bad_request_shape(gw: Harness, path: str, body: dict[str, Any]) -> None:
    if body.get("model") == "{model}":
        body = {**body, "model": OA_MODEL if path == CHAT else AN_MODEL}
    status, headers, raw = await post(gw, path, body)
    assert status == 400
    wire_error(path, raw, 400, "invalid_request")
    assert headers[RUN_HEADER] == "default:default"
    assert gw.fake.seen == []


BAD_HEADERS: list[tuple[str, dict[str, str]]] = [
    ("run id with spaces", {RUN_HEADER: "my run"}),
    ("run id empty", {RUN_HEADER: ""}),
    ("run id too long", {RUN_HEADER: "r" * 129}),
    ("run id in baggage invalid", {"baggage": "tollgate.run_id=bad%20id"}),
    ("agent header invalid", {"x-tollgate-agent": "bad agent!"}),
    ("agent header too long", {"x-tollgate-agent": "a" * 65}),
]


@BOTH
@pytest.mark.parametrize("headers", [h for _, h in BAD_HEADERS], ids=[n for n, _ in BAD_HEADERS])
async def test_400_bad_header(gw: Harness, path: str, headers: dict[str, str]) -> None:
    status, _, raw = await post(gw, path, body_for(path), headers)
    assert status == 400
    wire_error(path, raw, 400, "invalid_request")
    assert gw.fake.seen == []


@BOTH
async def test_400_json_deeper_than_limit(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(limits={"max_json_depth": 6})
    # the body object is level 1, so `metadata` of depth 5 makes exactly 6 levels: allowed
    status, _, _ = await post(h, path, body_for(path, metadata=nested(5)))
    assert status == 200
    status, _, raw = await post(h, path, body_for(path, metadata=nested(6)))
    assert status == 400
    wire_error(path, raw, 400, "invalid_request")
    assert len(h.fake.seen) == 1


@BOTH
async def test_400_pathologically_deep_json(gw: Harness, path: str) -> None:
    raw = b"[" * 200_000 + b"]" * 200_000
    status, _, body = await post(gw, path, raw)
    assert status == 400
    wire_error(path, body, 400, "invalid_request")


async def test_400_sdks_raise_bad_request(gw: Harness) -> None:
    async with oa(gw) as client:
        with pytest.raises(openai.BadRequestError) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=USER,  # type: ignore[arg-type]
                                                 extra_headers={RUN_HEADER: "not a valid id"})
    assert oe.value.status_code == 400
    assert oe.value.code == "invalid_request"
    async with an(gw) as client:
        with pytest.raises(anthropic.BadRequestError) as ae:
            await client.messages.create(model=AN_MODEL, max_tokens=8, messages=USER,  # type: ignore[arg-type]
                                         extra_body={"metadata": nested(70)})
    assert ae.value.status_code == 400
    assert ae.value.body["error"]["code"] == "invalid_request"  # type: ignore[index]
    assert ae.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert gw.fake.seen == []


# -- 401 invalid_api_key ------------------------------------------------------------------------------

KEYED = {"bot": {"keys": ["bot-secret"]}, "other": {"keys": ["other-secret"]}}

NO_KEY: list[tuple[str, dict[str, str]]] = [
    ("no credential", {}),
    ("unknown bearer", {"Authorization": "Bearer wrong-secret"}),
    ("empty bearer", {"Authorization": "Bearer "}),
    ("basic scheme", {"Authorization": "Basic Ym90LXNlY3JldA=="}),
    ("unknown x-api-key", {"x-api-key": "wrong-secret"}),
    ("prefix of a key", {"Authorization": "Bearer bot-secre"}),
    ("agent header instead of key", {"x-tollgate-agent": "bot"}),
]


@BOTH
@pytest.mark.parametrize("headers", [h for _, h in NO_KEY], ids=[n for n, _ in NO_KEY])
async def test_401_missing_or_unknown_key(gateway_factory: GatewayFactory, path: str, headers: dict[str, str]) -> None:
    h = await gateway_factory(agents=KEYED)
    status, _, raw = await post(h, path, body_for(path), headers)
    assert status == 401
    wire_error(path, raw, 401, "invalid_api_key")
    assert h.fake.seen == []


async def test_401_on_other_v1_paths(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=KEYED)
    async with h.session.get(f"{h.url}/v1/models") as resp:
        assert resp.status == 401
        wire_error(CHAT, await resp.read(), 401, "invalid_api_key")
    status, _, raw = await post(h, "/v1/embeddings", {"model": "gpt-4o-mini", "input": "x"})
    assert status == 401
    wire_error(CHAT, raw, 401, "invalid_api_key")
    assert h.fake.seen == []


async def test_401_sdks_raise_authentication_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=KEYED)
    async with oa(h, "wrong-secret") as client:
        with pytest.raises(openai.AuthenticationError) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=USER)  # type: ignore[arg-type]
    assert oe.value.status_code == 401
    assert oe.value.code == "invalid_api_key"
    async with an(h, "wrong-secret") as client:
        with pytest.raises(anthropic.AuthenticationError) as ae:
            await client.messages.create(model=AN_MODEL, max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert ae.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert ae.value.body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert h.fake.seen == []


async def test_agent_keys_identify_the_agent_and_never_go_upstream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=KEYED)
    async with oa(h, "bot-secret") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=OA_MODEL, messages=USER,  # type: ignore[arg-type]
            extra_headers={"x-tollgate-agent": "other"},  # a header cannot claim another identity
        )
    assert raw.headers[RUN_HEADER] == "bot:default"
    assert raw.parse().choices[0].message.content == "Hello!"
    # Anthropic SDK: the agent key travels as x-api-key
    async with an(h, "other-secret") as aclient:
        araw = await aclient.messages.with_raw_response.create(model=AN_MODEL, max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert araw.headers[RUN_HEADER] == "other:default"
    assert (await araw.parse()).content[0].text == "Hello!"  # type: ignore[union-attr]
    openai_seen, anthropic_seen = h.fake.seen
    assert openai_seen.headers["Authorization"] == "Bearer sk-provider-openai"
    assert anthropic_seen.headers["x-api-key"] == "sk-ant-provider"
    for seen in h.fake.seen:
        assert "bot-secret" not in repr(seen.headers) and "other-secret" not in repr(seen.headers)


# -- 404 model_not_found ------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("model", ["mistral-large", "nosuch/gpt-4o-mini", "openai/", "GPT-4O"])
async def test_404_no_provider_for_model(gw: Harness, path: str, model: str) -> None:
    status, headers, raw = await post(gw, path, body_for(path, model=model))
    assert status == 404
    wire_error(path, raw, 404, "model_not_found")
    assert headers[RUN_HEADER] == "default:default"
    assert gw.fake.seen == []


async def test_404_sdks_raise_not_found(gw: Harness) -> None:
    async with oa(gw) as client:
        with pytest.raises(openai.NotFoundError) as oe:
            await client.chat.completions.create(model="llama-3-70b", messages=USER)  # type: ignore[arg-type]
    assert oe.value.code == "model_not_found"
    assert oe.value.body["param"] is None  # type: ignore[index]
    async with an(gw) as client:
        with pytest.raises(anthropic.NotFoundError) as ae:
            await client.messages.create(model="llama-3-70b", max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert ae.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]
    async with oa(gw) as client:  # streaming requests fail the same way, before any byte is sent
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="llama-3-70b", messages=USER, stream=True)  # type: ignore[arg-type]
    assert gw.fake.seen == []


# -- 413 request_too_large ----------------------------------------------------------------------------


@BOTH
async def test_413_body_over_limit(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(limits={"max_body_bytes": 400})
    small = body_for(path)
    status, _, _ = await post(h, path, small)
    assert status == 200
    big = body_for(path, messages=[{"role": "user", "content": "x" * 1000}])
    status, headers, raw = await post(h, path, big)
    assert status == 413
    wire_error(path, raw, 413, "request_too_large")
    assert headers[RUN_HEADER] == "default:default"
    assert len(h.fake.seen) == 1


@BOTH
async def test_413_chunked_body_over_limit(gateway_factory: GatewayFactory, path: str) -> None:
    """Without a Content-Length the limit is enforced while reading."""
    h = await gateway_factory(limits={"max_body_bytes": 400})
    payload = orjson.dumps(body_for(path, messages=[{"role": "user", "content": "y" * 2000}]))

    async def chunks() -> Any:
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    async with h.session.post(f"{h.url}{path}", data=chunks(), headers={"Content-Type": "application/json"}) as resp:
        assert "Content-Length" not in resp.request_info.headers
        assert resp.status == 413
        wire_error(path, await resp.read(), 413, "request_too_large")
    assert h.fake.seen == []


@BOTH
async def test_413_too_many_messages_or_tools(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(limits={"max_messages": 2, "max_tools": 1})
    three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    status, _, raw = await post(h, path, body_for(path, messages=three))
    assert status == 413
    wire_error(path, raw, 413, "request_too_large")
    if path == CHAT:
        tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
        tools = [tool, {**tool, "function": {**tool["function"], "name": "u"}}]
    else:
        tools = [{"name": "t", "input_schema": {"type": "object"}}, {"name": "u", "input_schema": {"type": "object"}}]
    status, _, raw = await post(h, path, body_for(path, tools=tools))
    assert status == 413
    wire_error(path, raw, 413, "request_too_large")
    status, _, _ = await post(h, path, body_for(path, tools=tools[:1]))
    assert status == 200
    assert len(h.fake.seen) == 1


async def test_413_sdks_raise_status_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(limits={"max_body_bytes": 300})
    big = [{"role": "user", "content": "z" * 1000}]
    async with oa(h) as client:
        with pytest.raises(openai.APIStatusError) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=big)  # type: ignore[arg-type]
    assert oe.value.status_code == 413
    assert oe.value.code == "request_too_large"
    async with an(h) as aclient:
        with pytest.raises(anthropic.ContentTooLargeError) as ae:
            await aclient.messages.create(model=AN_MODEL, max_tokens=8, messages=big)  # type: ignore[arg-type]
    assert ae.value.status_code == 413
    assert ae.value.body["error"]["code"] == "request_too_large"  # type: ignore[index]
    assert h.fake.seen == []


# -- 502 upstream_unavailable / 504 upstream_timeout ----------------------------------------------------


def unreachable_providers() -> dict[str, Any]:
    port = closed_port()
    return {
        "openai": {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "api_key": "k",
                   "timeouts": {"connect": 2}},
        "anthropic": {"type": "anthropic", "base_url": f"http://127.0.0.1:{port}", "api_key": "k",
                      "timeouts": {"connect": 2}},
    }


@BOTH
@pytest.mark.parametrize("stream", [False, True])
async def test_502_upstream_unreachable(gateway_factory: GatewayFactory, path: str, stream: bool) -> None:
    h = await gateway_factory(providers=unreachable_providers())
    status, headers, raw = await post(h, path, body_for(path, stream=stream), {RUN_HEADER: "run-502"})
    assert status == 502
    wire_error(path, raw, 502, "upstream_unavailable")
    assert headers[RUN_HEADER] == "run-502"


async def test_502_sdks_raise_server_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(providers=unreachable_providers())
    async with oa(h) as client:
        with pytest.raises(openai.InternalServerError) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=USER)  # type: ignore[arg-type]
    assert oe.value.status_code == 502
    assert oe.value.code == "upstream_unavailable"
    async with an(h) as aclient:
        with pytest.raises(anthropic.InternalServerError) as ae:
            await aclient.messages.create(model=AN_MODEL, max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert ae.value.status_code == 502
    assert ae.value.body["error"]["code"] == "upstream_unavailable"  # type: ignore[index]


async def test_502_upstream_answers_garbage(gw: Harness) -> None:
    """A 200 whose body is not JSON cannot be judged: 502, never a silent pass."""
    gw.fake.queue(Reply(body=b"<html>oops</html>"))
    status, _, raw = await post(gw, CHAT, body_for(CHAT))
    assert status == 502
    wire_error(CHAT, raw, 502, "upstream_unavailable")


def slow_providers(fake_url: str, first_byte: float) -> dict[str, Any]:
    timeouts = {"first_byte": first_byte}
    return {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "k", "timeouts": timeouts},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "k", "timeouts": timeouts},
    }


@BOTH
@pytest.mark.parametrize("stream", [False, True])
async def test_504_first_byte_timeout(
    gateway_factory: GatewayFactory, fake: tuple[Any, str], path: str, stream: bool
) -> None:
    h = await gateway_factory(providers=slow_providers(fake[1], 0.3))
    h.fake.queue(Reply(delay=3.0, body=openai_completion() if path == CHAT else anthropic_message()))
    started = time.monotonic()
    status, headers, raw = await post(h, path, body_for(path, stream=stream))
    elapsed = time.monotonic() - started
    assert status == 504
    wire_error(path, raw, 504, "upstream_timeout")
    assert headers[RUN_HEADER] == "default:default"
    assert elapsed < 2.0, f"the first_byte timeout of 0.3s took {elapsed:.2f}s"


async def test_504_sdks_raise_timeout_classes(gateway_factory: GatewayFactory, fake: tuple[Any, str]) -> None:
    h = await gateway_factory(providers=slow_providers(fake[1], 0.2))
    h.fake.queue(Reply(delay=3.0, body=openai_completion()), Reply(delay=3.0, body=anthropic_message()))
    async with oa(h) as client:
        with pytest.raises(openai.InternalServerError) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=USER)  # type: ignore[arg-type]
    assert oe.value.status_code == 504
    assert oe.value.code == "upstream_timeout"
    async with an(h) as aclient:
        with pytest.raises(anthropic.GatewayTimeoutError) as ae:
            await aclient.messages.create(model=AN_MODEL, max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert ae.value.status_code == 504
    assert ae.value.body["error"]["code"] == "upstream_timeout"  # type: ignore[index]


# -- upstream 4xx/5xx passed through unchanged ----------------------------------------------------------

PASS_THROUGH = [
    (400, openai.BadRequestError, anthropic.BadRequestError),
    (401, openai.AuthenticationError, anthropic.AuthenticationError),
    (403, openai.PermissionDeniedError, anthropic.PermissionDeniedError),
    (404, openai.NotFoundError, anthropic.NotFoundError),
    (422, openai.UnprocessableEntityError, anthropic.UnprocessableEntityError),
    (429, openai.RateLimitError, anthropic.RateLimitError),
    (500, openai.InternalServerError, anthropic.InternalServerError),
    (503, openai.InternalServerError, anthropic.ServiceUnavailableError),
    (529, openai.InternalServerError, anthropic.OverloadedError),
]


@BOTH
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [s for s, _, _ in PASS_THROUGH])
async def test_upstream_error_bytes_and_status_unchanged(gw: Harness, path: str, stream: bool, status: int) -> None:
    upstream_body = b'{"error" : {"message":"upstream says no",  "type":"x_error", "code":"up_%d"}}' % status
    if path == MESSAGES:
        upstream_body = b'{"type":"error","error":{"type":"x_error",   "message":"upstream says no"}}'
    gw.fake.queue(Reply(status=status, body=upstream_body, headers={"x-upstream-request-id": "req-9"}))
    got, headers, raw = await post(gw, path, body_for(path, stream=stream), {RUN_HEADER: "run-up"})
    assert got == status
    assert raw == upstream_body
    assert headers["x-upstream-request-id"] == "req-9"
    assert headers[RUN_HEADER] == "run-up"


async def test_upstream_non_json_error_passes_through(gw: Harness) -> None:
    gw.fake.queue(Reply(status=502, body=b"<html>bad gateway</html>", headers={"Content-Type": "text/html"}))
    status, headers, raw = await post(gw, CHAT, body_for(CHAT))
    assert status == 502
    assert raw == b"<html>bad gateway</html>"
    assert headers["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(("status", "oa_cls", "an_cls"), PASS_THROUGH)
async def test_upstream_errors_raise_matching_sdk_classes(
    gw: Harness, status: int, oa_cls: type[Exception], an_cls: type[Exception]
) -> None:
    gw.fake.queue(Reply(status=status, body={"error": {"message": "no", "type": "t", "param": None, "code": "c"}}))
    async with oa(gw) as client:
        with pytest.raises(oa_cls) as oe:
            await client.chat.completions.create(model=OA_MODEL, messages=USER)  # type: ignore[arg-type]
    assert type(oe.value) is oa_cls
    assert oe.value.code == "c"  # type: ignore[attr-defined]
    gw.fake.queue(Reply(status=status, body={"type": "error", "error": {"type": "t", "message": "no"}}))
    async with an(gw) as aclient:
        with pytest.raises(an_cls) as ae:
            await aclient.messages.create(model=AN_MODEL, max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert type(ae.value) is an_cls
    assert ae.value.status_code == status  # type: ignore[attr-defined]
    assert len(gw.fake.seen) == 2  # max_retries=0: nothing retried behind the agent's back


# -- run id: header, baggage, standing run; echoed on every answer ----------------------------------------

RUN_IDS: list[tuple[str, dict[str, str], str]] = [
    ("default standing run", {}, "default:default"),
    ("agent header", {"x-tollgate-agent": "planner"}, "planner:default"),
    ("run header", {RUN_HEADER: "run-42"}, "run-42"),
    ("run header with allowed punctuation", {RUN_HEADER: "team/a:b@c+d=e.f_g-1"}, "team/a:b@c+d=e.f_g-1"),
    ("baggage", {"baggage": "tollgate.run_id=run-bag"}, "run-bag"),
    ("baggage among members", {"baggage": "k1=v1, tollgate.run_id = run-7;prop=1 ,k2=v2"}, "run-7"),
    ("baggage percent-encoded", {"baggage": "tollgate.run_id=team%2Frun-8"}, "team/run-8"),
    ("header wins over baggage", {RUN_HEADER: "from-header", "baggage": "tollgate.run_id=from-bag"}, "from-header"),
    ("baggage without the key", {"baggage": "other.run_id=zzz", "x-tollgate-agent": "a1"}, "a1:default"),
]


@BOTH
@pytest.mark.parametrize(("headers", "expected"), [(h, e) for _, h, e in RUN_IDS], ids=[n for n, _, _ in RUN_IDS])
async def test_run_id_resolution(gw: Harness, path: str, headers: dict[str, str], expected: str) -> None:
    status, got, _ = await post(gw, path, body_for(path), headers)
    assert status == 200
    assert got[RUN_HEADER] == expected
    run = await gw.run(expected)
    assert run["run_id"] == expected
    assert run["agent"] == headers.get("x-tollgate-agent", "default")


@BOTH
async def test_run_id_echoed_on_stream_and_error_answers(gw: Harness, path: str) -> None:
    chunks = openai_stream(["a"]) if path == CHAT else anthropic_stream(["a"])
    gw.fake.queue(Reply(chunks=chunks))
    hdr = {RUN_HEADER: "run-echo"}
    async with gw.session.post(f"{gw.url}{path}", json=body_for(path, stream=True), headers=hdr) as resp:
        assert resp.status == 200
        assert resp.headers[RUN_HEADER] == "run-echo"
        await resp.read()
    for body in (b"{", body_for(path, model="unknown-model")):
        status, headers, _ = await post(gw, path, body, hdr)
        assert status in (400, 404)
        assert headers[RUN_HEADER] == "run-echo"
    gw.fake.queue(Reply(status=500, body={"error": {"message": "boom"}}))
    status, headers, _ = await post(gw, path, body_for(path), hdr)
    assert status == 500
    assert headers[RUN_HEADER] == "run-echo"


async def test_run_id_echoed_on_other_v1_paths(gw: Harness) -> None:
    async with gw.session.get(f"{gw.url}/v1/models", headers={RUN_HEADER: "run-m"}) as resp:
        assert resp.status == 200
        assert resp.headers[RUN_HEADER] == "run-m"
    gw.fake.queue(Reply(body={"object": "list", "data": []}))
    status, headers, _ = await post(gw, "/v1/embeddings", {"model": "gpt-4o-mini", "input": "x"}, {RUN_HEADER: "run-e"})
    assert status == 200
    assert headers[RUN_HEADER] == "run-e"


@BOTH
async def test_run_id_echoed_even_when_identity_fails(gateway_factory: GatewayFactory, path: str) -> None:
    """DESIGN section 3: every response echoes x-tollgate-run-id, including a 401 for a request that
    named its run with a valid header."""
    h = await gateway_factory(agents=KEYED)
    status, headers, _ = await post(h, path, body_for(path), {RUN_HEADER: "run-401", "Authorization": "Bearer nope"})
    assert status == 401
    assert headers.get(RUN_HEADER) == "run-401"
