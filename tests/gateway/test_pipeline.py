"""gateway/pipeline.py, the pure request side: parse_json, shape, upstream_request, add_credentials and
output_limit, and the max_tokens guard.before reports. Responses are in test_respond.py,
read_body in test_pipeline_read_body.py."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from gateway.config import Agent, Limits, Provider
from gateway.errors import InvalidRequest, TokenBudgetHeld
from gateway.identity import Identity
from gateway.pipeline import (
    add_credentials,
    guard_before,
    output_limit,
    parse_json,
    settle,
    shape,
    upstream_request,
)
from gateway.pricing import ModelPrice, Rate
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.openai_chat import OpenAIChat
from gateway.routing import Route
from gateway.step import Step
from gateway.store.base import Claim, Reservation, ReserveRequest
from tests.conftest import GatewayFactory

MSG = [{"role": "user", "content": "hi"}]
OPENAI = Provider(type="openai", base_url="http://up.test/v1", api_key="sk-provider")
ANTHROPIC = Provider(type="anthropic", base_url="http://an.test", api_key="sk-ant-provider")


def make_step(protocol: str = "openai", body: dict[str, Any] | None = None, *,
              provider: Provider | None = None, model: str | None = None, prefixed: bool = False,
              price: ModelPrice | None = None, raw: bytes | None = None) -> Step:
    adapter = OpenAIChat() if protocol == "openai" else AnthropicMessages()
    if body is None:
        body = {"model": "gpt-4o-mini", "messages": MSG}
        if protocol == "anthropic":
            body = {"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": MSG}
    raw = orjson.dumps(body) if raw is None else raw
    call = adapter.parse_request(body, raw, Limits())
    provider = provider or (OPENAI if protocol == "openai" else ANTHROPIC)
    route = Route("p", provider, model or call.model, prefixed)
    return Step(adapter, Identity("bot", Agent(), "run-1"), call, route, body, raw, price=price)


# -- parse_json --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (b'{"model": "m"}', {"model": "m"}),
        (b"{}", {}),
        (b'  {"a": [1, {"b": null}]}\n', {"a": [1, {"b": None}]}),
        (b'{"a": "\\u00e9"}', {"a": "\u00e9"}),
    ],
)
def test_parse_json_objects(raw: bytes, body: dict[str, Any]) -> None:
    assert parse_json(raw, Limits()) == body


@pytest.mark.parametrize("raw", [b"", b"{", b"{'a': 1}", b'{"a": 1} x', b"\xff\xfe", b"NaN", b'{"a": 1,}'])
def test_parse_json_invalid(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_json(raw, Limits())
    assert info.value.message.startswith("request body is not valid JSON: ")
    assert info.value.status == 400


@pytest.mark.parametrize("raw", [b"[]", b'[{"model": "m"}]', b'"text"', b"1", b"1.5", b"null", b"true"])
def test_parse_json_non_objects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_json(raw, Limits())
    assert info.value.message == "request body must be a JSON object"


def nested(depth: int, kind: str = "object") -> bytes:
    """A body nesting `depth` levels (the top-level object is level 1)."""
    inner = "1"
    for _ in range(depth - 1):
        inner = f'{{"a": {inner}}}' if kind == "object" else f"[{inner}]"
    return f'{{"x": {inner}}}'.encode()


@pytest.mark.parametrize(
    ("raw", "limit", "ok"),
    [
        (nested(3), 3, True),
        (nested(4), 3, False),
        (nested(3, "list"), 3, True),
        (nested(4, "list"), 3, False),
        (nested(64), 64, True),
        (nested(65), 64, False),
        (b'{"a": "{{{{{{[[[[[["}', 2, True),  # brackets inside strings are not nesting
        (b'{"a": {}, "b": {}, "c": [], "d": [{}]}', 2, False),  # siblings do not add up, depth does
        (b'{"a": {}, "b": {}, "c": [], "d": []}', 2, True),
        (b'{"a": 1}', 1, True),
        (b'{"a": {}}', 1, False),
    ],
)
def test_parse_json_depth_limit(raw: bytes, limit: int, ok: bool) -> None:
    limits = Limits(max_json_depth=limit)
    if ok:
        assert parse_json(raw, limits) == orjson.loads(raw)
        return
    with pytest.raises(InvalidRequest) as info:
        parse_json(raw, limits)
    assert info.value.message == f"request JSON nests deeper than {limit} levels"


# -- shape -------------------------------------------------------------------------------------------

SPACED = b'{ "model" : "gpt-4o-mini" ,\n "messages": [{"role": "user", "content": "hi"}] }'


@pytest.mark.parametrize(
    ("protocol", "extra"),
    [
        ("openai", {}),
        ("openai", {"stream": True, "stream_options": {"include_usage": True}}),  # usage already asked
        ("anthropic", {}),
        ("anthropic", {"stream": True}),  # Anthropic streams carry usage
    ],
)
def test_shape_forwards_the_original_bytes_when_nothing_changed(protocol: str, extra: dict[str, Any]) -> None:
    base = make_step(protocol).body
    body = {**base, **extra}
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2)  # not how orjson would write it by default
    step = make_step(protocol, body, raw=raw)
    assert shape(step) is raw
    assert (step.changed, step.hide_usage) == (False, False)


def test_shape_keeps_the_agents_exact_bytes() -> None:
    step = make_step(body=orjson.loads(SPACED), raw=SPACED)
    assert shape(step) == SPACED


def test_shape_strips_the_provider_prefix() -> None:
    body = {"model": "openai/gpt-4o-mini", "messages": MSG}
    step = make_step(body=body, model="gpt-4o-mini", prefixed=True)
    out = shape(step)
    assert orjson.loads(out) == {"model": "gpt-4o-mini", "messages": MSG}
    assert step.changed is True and step.hide_usage is False


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        (None, {"include_usage": True}),
        ({"include_usage": False}, {"include_usage": True}),
        ({"other": 1}, {"other": 1, "include_usage": True}),
    ],
)
def test_shape_asks_for_stream_usage_and_hides_it(options: dict[str, Any] | None,
                                                  sent: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": MSG, "stream": True}
    if options is not None:
        body["stream_options"] = options
    step = make_step(body=body)
    out = orjson.loads(shape(step))
    assert out["stream_options"] == sent
    assert (step.changed, step.hide_usage) == (True, True)


def test_shape_serializes_earlier_changes() -> None:
    step = make_step()
    step.body["max_completion_tokens"] = 50
    step.changed = True
    assert orjson.loads(shape(step)) == {"model": "gpt-4o-mini", "messages": MSG, "max_completion_tokens": 50}


# -- upstream_request / add_credentials --------------------------------------------------------------

AGENT_HEADERS = [
    ("Authorization", "Bearer agent-key"), ("x-api-key", "agent-key-2"), ("traceparent", "00-abc-def-01"),
    ("tracestate", "v=1"), ("Baggage", "tollgate.run_id=r"), ("x-tollgate-run-id", "r"), ("Host", "gw"),
    ("Content-Length", "10"), ("Content-Type", "text/plain"), ("Accept", "application/json"),
    ("OpenAI-Organization", "org-1"), ("anthropic-beta", "tools-1"), ("Connection", "x-hop"), ("x-hop", "1"),
]
KEPT = {"accept": "application/json", "openai-organization": "org-1", "anthropic-beta": "tools-1",
        "content-type": "application/json"}


def lower(headers: dict[str, str]) -> dict[str, str]:
    out = {k.lower(): v for k, v in headers.items()}
    assert len(out) == len(headers)  # no name twice in different spellings
    return out


def provider(kind: str, **extra: Any) -> Provider:
    base = {"openai": "http://up.test/v1", "anthropic": "http://an.test"}[kind]
    provider: Provider = Provider.model_validate({"type": kind, "base_url": base, **extra})
    return provider


@pytest.mark.parametrize(
    ("prov", "url", "auth"),
    [
        (provider("openai", api_key="sk-p"), "http://up.test/v1/chat/completions",
         {"authorization": "Bearer sk-p"}),
        (provider("openai", api_key="sk-p", base_url="http://up.test/v1/"),
         "http://up.test/v1/chat/completions",
         {"authorization": "Bearer sk-p"}),
        (provider("openai"), "http://up.test/v1/chat/completions", {}),  # no key: the agent's still dropped
        (provider("openai", api_key="sk-p", passthrough_auth=True), "http://up.test/v1/chat/completions",
         {"authorization": "Bearer agent-key", "x-api-key": "agent-key-2"}),
        (provider("anthropic", api_key="sk-a"), "http://an.test/v1/messages",
         {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}),
        (provider("anthropic", api_key="sk-a", base_url="http://an.test/base/"),
         "http://an.test/base/v1/messages",
         {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}),
        (provider("anthropic"), "http://an.test/v1/messages", {"anthropic-version": "2023-06-01"}),
        (provider("anthropic", api_key="sk-a", passthrough_auth=True), "http://an.test/v1/messages",
         {"authorization": "Bearer agent-key", "x-api-key": "agent-key-2",
          "anthropic-version": "2023-06-01"}),
    ],
    ids=["openai", "openai-slash", "openai-nokey", "openai-pass", "anthropic", "anthropic-base",
         "anthropic-nokey", "anthropic-pass"],
)
def test_upstream_request(prov: Provider, url: str, auth: dict[str, str]) -> None:
    step = make_step("openai" if prov.type == "openai" else "anthropic", provider=prov)
    got_url, headers = upstream_request(step, CIMultiDict(AGENT_HEADERS))
    assert got_url == url
    assert lower(headers) == {**KEPT, **auth}


def test_a_repeated_agent_header_is_forwarded_line_for_line() -> None:
    """Two `anthropic-beta` lines stay two lines (a dict kept only the first); ours replace theirs."""
    step = make_step("anthropic", provider=provider("anthropic", api_key="sk-a"))
    agent = CIMultiDict([("anthropic-beta", "a-1"), ("Anthropic-Beta", "b-2"), ("x-api-key", "agent"),
                         ("X-Api-Key", "agent-2"), ("content-type", "text/plain")])
    _, headers = upstream_request(step, agent)
    assert headers.getall("anthropic-beta") == ["a-1", "b-2"]
    assert headers.getall("x-api-key") == ["sk-a"]
    assert headers.getall("content-type") == ["application/json"]


@pytest.mark.parametrize("spelling", ["anthropic-version", "Anthropic-Version"])
def test_the_agents_anthropic_version_wins(spelling: str) -> None:
    step = make_step("anthropic", provider=provider("anthropic", api_key="sk-a"))
    _, headers = upstream_request(step, CIMultiDict([(spelling, "2024-10-22")]))
    assert lower(headers) == {"anthropic-version": "2024-10-22", "x-api-key": "sk-a",
                              "content-type": "application/json"}


@pytest.mark.parametrize(
    ("prov", "before", "after"),
    [
        (provider("openai", api_key="k"), {}, {"Authorization": "Bearer k"}),
        (provider("openai", api_key="k"), {"Authorization": "Bearer old"}, {"Authorization": "Bearer k"}),
        (provider("openai"), {"X": "1"}, {"X": "1"}),
        (provider("openai", api_key="k", passthrough_auth=True), {"Authorization": "Bearer a"},
         {"Authorization": "Bearer a"}),
        (provider("anthropic", api_key="k"), {}, {"x-api-key": "k", "anthropic-version": "2023-06-01"}),
        (provider("anthropic", api_key="k"), {"anthropic-version": "v9"},
         {"x-api-key": "k", "anthropic-version": "v9"}),
        (provider("anthropic"), {}, {"anthropic-version": "2023-06-01"}),
        (provider("anthropic", api_key="k", passthrough_auth=True), {"x-api-key": "a"},
         {"x-api-key": "a", "anthropic-version": "2023-06-01"}),
    ],
)
def test_add_credentials(prov: Provider, before: dict[str, str], after: dict[str, str]) -> None:
    headers = dict(before)
    add_credentials(prov, headers)
    assert headers == after


# -- output_limit ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("price_limit", "provider_limit", "expected"),
    [
        (None, 32768, 16384),  # no price: the provider's limit, lowered to gpt-4o-mini's own
        (8192, 32768, 8192),  # the model's own limit wins
        (65536, 32768, 65536),
        (None, 1000, 1000),
    ],
)
def test_output_limit(price_limit: int | None, provider_limit: int, expected: int) -> None:
    prov = provider("openai", max_output_tokens=provider_limit)
    price = ModelPrice(Rate(1e-6), Rate(2e-6), max_output_tokens=price_limit)
    assert output_limit(make_step(provider=prov, price=price)) == expected
    if price_limit is None:
        assert output_limit(make_step(provider=prov)) == expected


@pytest.mark.parametrize(("model", "provider_limit", "expected"), [
    ("gpt-4o-mini", 32768, 16384),  # known lower than the default: a larger grant would be a 400
    ("gpt-4o-mini", 1000, 1000),  # an operator's lower default still caps it
    ("gpt-4.1", 32768, 32768),
])
def test_a_known_model_limit_lowers_the_providers_default(model: str, provider_limit: int, expected: int) -> None:
    step = make_step(provider=provider("openai", max_output_tokens=provider_limit), model=model)
    assert output_limit(step) == expected


# -- guard.before: the max_tokens sent ---------------------------------------------------------------


async def test_a_reask_that_sends_the_agents_own_limit_reports_that_limit(
    gateway_factory: GatewayFactory,
) -> None:
    """A clamp holds for the attempt it was made for: when another step's reservation made the first
    attempt's grant smaller than the agent's `max_tokens` and the re-ask's grant pays it in full, the
    re-ask sends the agent's own limit, and `max_tokens_set` (the header, the span) says so."""
    h = await gateway_factory(pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
                              agents={"default": {"budget": {"usd": 0.001}}})
    gw = h.gateway
    adapter = gw.adapters["openai"]
    body = {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 300}
    raw = orjson.dumps(body)
    call = adapter.parse_request(body, raw, gw.config.limits)
    identity = gw.identifier.identify({"x-tollgate-run-id": "reclamp"})
    step = Step(adapter, identity, call, gw.router.route(call.model), dict(body), raw,
                price=gw.pricer.lookup(call.model, "openai"))
    other = await gw.store.reserve("reclamp", "default", ReserveRequest((Claim("usd", 0.0005),)), time.time())
    assert isinstance(other, Reservation)
    await guard_before(gw, step)
    assert step.max_tokens_set is not None and step.max_tokens_set < 300  # the other step holds half
    await settle(gw, step, None, charged=False)
    await gw.store.settle(other, {}, time.time())  # the other step released its reservation
    step.attempts = 1
    await guard_before(gw, step)
    assert step.max_tokens_set == 300 == step.call.max_tokens


async def test_a_grant_too_small_to_think_refuses_the_step_not_the_run(gateway_factory: GatewayFactory) -> None:
    """A budget that pays a small answer but not extended thinking (Anthropic needs max_tokens above a
    thinking budget of at least 1,024): the step is refused before anything is counted or sent, its
    reservation released, and the run goes on (a call without thinking passes, clamped)."""
    h = await gateway_factory(pricing={"claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
                              agents={"default": {"budget": {"tokens": 1000}}})
    gw = h.gateway
    adapter = gw.adapters["anthropic"]
    identity = gw.identifier.identify({"x-tollgate-run-id": "think"})

    def step_of(body: dict[str, Any]) -> Step:
        raw = orjson.dumps(body)
        call = adapter.parse_request(body, raw, gw.config.limits)
        return Step(adapter, identity, call, gw.router.route(call.model), dict(body), raw,
                    price=gw.pricer.lookup(call.model, "anthropic"))

    plain = {"model": "claude-3-5-haiku-latest", "max_tokens": 4000, "messages": MSG}
    thinking = step_of({**plain, "thinking": {"type": "enabled", "budget_tokens": 2000}})
    with pytest.raises(TokenBudgetHeld, match="extended thinking") as info:
        await guard_before(gw, thinking)
    assert type(info.value) is TokenBudgetHeld and info.value.stop_reason is None  # not a stop
    assert thinking.reservation is None and thinking.body["thinking"]["budget_tokens"] == 2000
    state = await gw.store.get("think", steps=False, reservations=False)
    assert state is None or (not state.stopped and not state.reserved.get("tokens"))
    step = step_of(plain)
    await guard_before(gw, step)
    assert step.max_tokens_set is not None and 16 <= step.max_tokens_set < 1000
