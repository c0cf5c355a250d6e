"""gateway/respond.py, the respond stage: base_headers, echo_headers, error_response, stop_response and
malformed_upstream (DESIGN section 4: statuses, error bodies per protocol, x-tollgate-stop-reason)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.config import Agent, Limits, Provider
from gateway.errors import (
    ApprovalDenied,
    GatewayError,
    InvalidApiKey,
    InvalidRequest,
    ModelNotFound,
    OutputNonconforming,
    RequestTooLarge,
    ShuttingDown,
    Stopped,
    ToolNotAllowed,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.identity import Identity
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.base import Adapter
from gateway.providers.openai_chat import OpenAIChat
from gateway.respond import base_headers, echo_headers, error_response, malformed_upstream, stop_response
from gateway.routing import Route
from gateway.step import Step

MSG = [{"role": "user", "content": "hi"}]
RUN = "x-tollgate-run-id"
STOP = "x-tollgate-stop-reason"
MAX = "x-tollgate-max-tokens"
ADAPTERS: dict[str, Adapter] = {"openai": OpenAIChat(), "anthropic": AnthropicMessages()}


def make_step(protocol: str, *, on_stop: str = "error", stream: bool = False,
              max_set: int | None = None) -> Step:
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": MSG, "stream": stream}
    if protocol == "anthropic":
        body = {**body, "model": "claude-3-5-haiku-latest", "max_tokens": 8}
    raw = orjson.dumps(body)
    adapter = ADAPTERS[protocol]
    call = adapter.parse_request(body, raw, Limits())
    provider = Provider.model_validate({"type": protocol, "base_url": "http://up.test"})
    identity = Identity("bot", Agent.model_validate({"on_stop": on_stop}), "run-7")
    step = Step(adapter, identity, call, Route("p", provider, call.model, False), body, raw)
    step.max_tokens_set = max_set
    return step


def json_body(response: Any) -> Any:
    assert isinstance(response.body, bytes)
    return orjson.loads(response.body)


# -- base_headers / echo_headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("with_identity", "max_set", "expected"),
    [
        (False, None, {}),
        (True, None, {RUN: "run-7"}),
        (True, 512, {RUN: "run-7", MAX: "512"}),
        (False, 512, {MAX: "512"}),
    ],
)
def test_base_headers(with_identity: bool, max_set: int | None, expected: dict[str, str]) -> None:
    step = make_step("openai", max_set=max_set)
    identity = step.identity if with_identity else None
    assert base_headers(identity, step) == expected
    if max_set is None:
        assert base_headers(identity) == expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, {}),
        ({RUN: "run-1"}, {RUN: "run-1"}),
        ({RUN: "a.b_c:d@e/f+g=h-1"}, {RUN: "a.b_c:d@e/f+g=h-1"}),  # every allowed character
        ({RUN: "r" * 128}, {RUN: "r" * 128}),
        ({RUN: "r" * 129}, {}),  # too long
        ({RUN: ""}, {}),
        ({RUN: "run 1"}, {}),
        ({RUN: "run\r\nSet-Cookie: x"}, {}),
        ({RUN: "r\u00e9sum\u00e9"}, {}),
        ({RUN: "run;1"}, {}),
        ({RUN: "run%201"}, {}),
        ({"baggage": "tollgate.run_id=from-baggage"}, {RUN: "from-baggage"}),  # the run the request names
        ({"baggage": "tollgate.run_id=bad%20id"}, {}),
        ({RUN: "header", "baggage": "tollgate.run_id=from-baggage"}, {RUN: "header"}),
        ({"x-tollgate-agent": "bot"}, {}),
    ],
)
def test_echo_headers(headers: dict[str, str], expected: dict[str, str]) -> None:
    assert echo_headers(headers) == expected


# -- error_response ----------------------------------------------------------------------------------

ERRORS: list[tuple[GatewayError, int, str, str, str]] = [
    # error, status, code, OpenAI type, Anthropic type
    (InvalidRequest("bad", param="model"), 400, "invalid_request", "invalid_request_error",
     "invalid_request_error"),
    (InvalidApiKey("who"), 401, "invalid_api_key", "invalid_request_error", "authentication_error"),
    (ModelNotFound("none"), 404, "model_not_found", "invalid_request_error", "not_found_error"),
    (RequestTooLarge("big"), 413, "request_too_large", "invalid_request_error", "request_too_large"),
    (OutputNonconforming("no"), 422, "output_nonconforming", "invalid_request_error",
     "invalid_request_error"),
    (ApprovalDenied("denied"), 403, "approval_denied", "permission_error", "permission_error"),
    (UpstreamUnavailable("down"), 502, "upstream_unavailable", "server_error", "api_error"),
    (UpstreamTimeout("slow"), 504, "upstream_timeout", "server_error", "timeout_error"),
    (ShuttingDown("bye"), 503, "shutting_down", "server_error", "overloaded_error"),
]


@pytest.mark.parametrize(("error", "status", "code", "openai_type", "anthropic_type"), ERRORS)
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_error_response(protocol: str, error: GatewayError, status: int, code: str, openai_type: str,
                        anthropic_type: str) -> None:
    headers = {RUN: "run-7"}
    response = error_response(ADAPTERS[protocol], error, headers)
    assert response.status == status
    assert response.content_type == "application/json"
    assert response.headers[RUN] == "run-7"
    assert STOP not in response.headers  # not a stop
    if protocol == "openai":
        assert json_body(response) == {"error": {"message": error.message, "type": openai_type,
                                                 "param": error.param, "code": code}}
    else:
        inner = {"type": anthropic_type, "message": error.message, "code": code}
        assert json_body(response) == {"type": "error", "error": inner}


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Stopped("budget_exhausted", "spent $2.00 of $2.00"), "budget_exhausted"),
        (Stopped("loop_detected", "same call 3 times"), "loop_detected"),
        (ToolNotAllowed("tool 'rm' is not in the agent's allow-list"), "tool_not_allowed"),
    ],
)
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_error_response_for_a_stop_names_the_reason(protocol: str, error: Stopped, reason: str) -> None:
    headers = {RUN: "run-7"}
    response = error_response(ADAPTERS[protocol], error, headers)
    assert response.status == 403
    assert (response.headers[STOP], response.headers[RUN]) == (reason, "run-7")
    assert headers == {RUN: "run-7"}  # the caller's dict is not changed
    inner = json_body(response)["error"]
    assert (inner["code"], inner["type"], inner["message"]) == (reason, "permission_error", error.message)


# -- stop_response -----------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_set", [None, 256])
def test_stop_response_error(protocol: str, stream: bool, max_set: int | None) -> None:
    step = make_step(protocol, stream=stream, max_set=max_set)
    response = stop_response(step, Stopped("llm_call_cap", "40 calls"))
    assert response.status == 403
    assert response.content_type == "application/json"
    expected = {RUN: "run-7", STOP: "llm_call_cap", **({MAX: str(max_set)} if max_set else {})}
    assert {k: response.headers[k] for k in (RUN, STOP, MAX) if k in response.headers} == expected
    body = json_body(response)
    inner = body["error"]
    assert (inner["code"], inner["message"]) == ("llm_call_cap", "40 calls")
    assert (body.get("type") == "error") is (protocol == "anthropic")


STOP_TEXT = "tollgate stopped this run (time_cap): ran 600 s"


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_stop_response_message(protocol: str) -> None:
    response = stop_response(make_step(protocol, on_stop="message"), Stopped("time_cap", "ran 600 s"))
    assert response.status == 200
    assert response.content_type == "application/json"
    assert (response.headers[STOP], response.headers[RUN]) == ("time_cap", "run-7")
    body = json_body(response)
    if protocol == "openai":
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"] == {"role": "assistant", "content": STOP_TEXT}
        assert body["model"] == "gpt-4o-mini"
    else:
        assert (body["type"], body["role"], body["stop_reason"]) == ("message", "assistant", "end_turn")
        assert body["content"] == [{"type": "text", "text": STOP_TEXT}]
        assert body["model"] == "claude-3-5-haiku-latest"


@pytest.mark.parametrize(
    ("protocol", "last_event"),
    [
        ("openai", b"data: [DONE]\n\n"),
        ("anthropic", b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
    ],
)
def test_stop_response_message_while_streaming(protocol: str, last_event: bytes) -> None:
    step = make_step(protocol, on_stop="message", stream=True)
    response = stop_response(step, Stopped("time_cap", "ran 600 s"))
    assert response.status == 200
    assert response.content_type == "text/event-stream"
    assert response.headers[STOP] == "time_cap"
    assert isinstance(response.body, bytes)
    assert response.body.endswith(last_event)
    assert orjson.dumps(STOP_TEXT)[1:-1] in response.body


# -- malformed_upstream ------------------------------------------------------------------------------


@pytest.mark.parametrize("detail", ["unexpected end of data", ""])
def test_malformed_upstream(detail: str) -> None:
    error = malformed_upstream(detail)
    assert isinstance(error, UpstreamUnavailable)
    assert (error.status, error.code, error.stop_reason) == (502, "upstream_unavailable", None)
    assert error.message == f"upstream answered malformed JSON: {detail}"
