"""gateway/providers/openai_responses.py: the OpenAI Responses adapter (`POST /v1/responses`), wire JSON <->
Call/Answer, its stream reader, and the error and stop messages it renders (checked with the `openai` SDK)."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace
from typing import Annotated, Any, get_args

import httpx2
import orjson
import pytest
from openai import APIError, OpenAI
from openai.types import ErrorObject
from openai.types.responses import Response, ResponseErrorEvent, ResponseInputParam, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming
from pydantic import Field, TypeAdapter

from gateway import errors
from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage, digest
from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.providers import responses_stop
from gateway.providers.openai_responses import (
    OpenAIResponses,
    ResponsesStreamReader,
    stop_events,
    usage_from,
)
from gateway.providers.responses_tools import tool_name
from gateway.providers.sse import SseEvent, SseParser, format_event
from tests.fakes.responses import call_item, message_item, response_body, response_stream

ADAPTER = OpenAIResponses()
# the SDK's stream event union, discriminated by `type` as its PropertyInfo says (one error per bad event)
EVENT = TypeAdapter[ResponseStreamEvent](
    Annotated[get_args(ResponseStreamEvent)[0], Field(discriminator="type")]
)
CREATE = TypeAdapter[ResponseCreateParamsNonStreaming](ResponseCreateParamsNonStreaming)
INPUT = TypeAdapter[ResponseInputParam](ResponseInputParam)

# -- requests ------------------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}
FN = {"type": "function", "name": "get", "description": "d", "strict": True,
      "parameters": {"type": "object", "properties": {}}}
CUSTOM = {"type": "custom", "name": "patch", "description": "applies a diff"}
HOSTED = [
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
    {"type": "image_generation"},
]
REASONING = {"type": "reasoning", "id": "rs_1", "summary": []}
SAID = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}]}
SAID_EASY = {"role": "assistant", "content": "ok"}


def fc(call_id: str, name: str = "get", arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def fc_out(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def ctc(call_id: str, name: str, text: str) -> dict[str, Any]:
    return {"type": "custom_tool_call", "call_id": call_id, "name": name, "input": text}


def ctc_out(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "custom_tool_call_output", "call_id": call_id, "output": output}


def body_of(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "input": "hi", **fields}


def parse(body: dict[str, Any], limits: Limits | None = None) -> Call:
    return ADAPTER.parse_request(body, orjson.dumps(body), limits or Limits())


PARSED = [
    ({}, {"stream": False, "max_tokens": None, "tools": (), "tool_choice": None, "tool_results": (),
          "params": RequestParams()}),
    ({"stream": True}, {"stream": True}),
    ({"stream": False}, {"stream": False}),
    ({"stream": None}, {"stream": False}),  # the SDK sends `stream=None` as null: not streaming
    ({"max_output_tokens": 100}, {"max_tokens": 100}),
    ({"max_output_tokens": None}, {"max_tokens": None}),
    ({"temperature": 0, "top_p": 0.5}, {"params": RequestParams(temperature=0.0, top_p=0.5)}),
    ({"temperature": 1.5}, {"params": RequestParams(temperature=1.5)}),
    ({"input": [USER]}, {"tool_results": ()}),
    ({"tools": [FN]}, {"tools": (ToolSpec("get", "d", FN["parameters"]),)}),
    ({"tools": [CUSTOM]}, {"tools": ()}),  # free-text input: no JSON arguments to validate
    # tools OpenAI runs itself are named by their type
    ({"tools": HOSTED}, {"tools": tuple(ToolSpec(str(t["type"])) for t in HOSTED)}),
    ({"tools": [FN, HOSTED[0], CUSTOM]},
     {"tools": (ToolSpec("get", "d", FN["parameters"]), ToolSpec("web_search_preview"))}),
    ({"tools": []}, {"tools": ()}),
    ({"tools": None}, {"tools": ()}),
    ({"tool_choice": "auto"}, {"tool_choice": None}),
    ({"tool_choice": "none"}, {"tool_choice": None}),
    ({"tool_choice": "required"}, {"tool_choice": None}),
    ({"tool_choice": {"type": "function", "name": "get"}}, {"tool_choice": "get"}),
    ({"tool_choice": {"type": "custom", "name": "patch"}}, {"tool_choice": "patch"}),
    ({"tool_choice": {"type": "web_search_preview"}}, {"tool_choice": "web_search_preview"}),
    ({"tool_choice": {"type": "file_search"}}, {"tool_choice": "file_search"}),
    ({"tool_choice": {"type": "mcp", "server_label": "deepwiki"}}, {"tool_choice": "mcp"}),
    ({"tool_choice": {"type": "allowed_tools", "mode": "required",
                      "tools": [{"type": "function", "name": "get"}]}}, {"tool_choice": None}),
    # tool results of the latest round: the outputs after the model's last message
    ({"input": [USER, fc("a"), fc("b", "f"), fc_out("a", "r1"),
                fc_out("b", [{"type": "input_text", "text": "p"}])]},
     {"tool_results": (ToolResult("a", "r1"), ToolResult("b", "p"))}),
    ({"input": [USER, REASONING, ctc("c", "patch", "diff"), ctc_out("c", "applied")]},
     {"tool_results": (ToolResult("c", "applied"),)}),
    ({"input": [USER, fc("old"), fc_out("old", "x"), SAID, fc("new"), fc_out("new", "y")]},
     {"tool_results": (ToolResult("new", "y"),)}),
    ({"input": [USER, fc("old"), fc_out("old", "x"), SAID_EASY, fc("new"), fc_out("new", "y")]},
     {"tool_results": (ToolResult("new", "y"),)}),
    ({"input": [USER, fc("a"), fc_out("a", "x"), SAID, USER]}, {"tool_results": ()}),
    ({"input": [USER, fc("a"), fc_out("a", "x"), SAID_EASY]}, {"tool_results": ()}),
    # refused fields in their unset forms are no request to continue anything
    ({"previous_response_id": None, "conversation": None, "prompt": None, "background": False},
     {"stream": False}),
    ({"background": None, "store": True}, {"stream": False}),
]


@pytest.mark.parametrize(("fields", "expected"), PARSED)
def test_parse_request(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    body = body_of(**fields)
    raw = orjson.dumps(body)
    call = ADAPTER.parse_request(body, raw, Limits())
    assert (call.protocol, call.operation, call.model) == ("openai_responses", "chat", "gpt-4o-mini")
    assert (call.input_bytes, call.request_hash, call.raw) == (len(raw), digest(raw), body)
    assert call.tool_call is None
    assert {key: getattr(call, key) for key in expected} == expected


@pytest.mark.parametrize("fields", [f for f, _ in PARSED])
def test_request_fixtures_are_real_create_params(fields: dict[str, Any]) -> None:
    fields = {k: v for k, v in fields.items() if v is not None and k != "stream"}
    validated = CREATE.validate_python(body_of(**fields))
    list(validated.get("tools") or ())  # a lazy iterable: validated as it is read


def test_raw_bytes_decide_size_and_hash() -> None:
    body = body_of()
    spaced = b'{"model": "gpt-4o-mini", "input": "hi"}'
    one, other = parse(body), ADAPTER.parse_request(body, spaced, Limits())
    assert (one.input_bytes, other.input_bytes) == (len(orjson.dumps(body)), 39)
    assert one.request_hash != other.request_hash


@pytest.mark.parametrize(
    ("fields", "limits", "cls", "param", "fragment"),
    [
        ({"model": None}, None, InvalidRequest, "model", "model"),
        ({"model": ""}, None, InvalidRequest, "model", "model"),
        ({"model": 4}, None, InvalidRequest, "model", "model"),
        ({"input": None}, None, InvalidRequest, "input", "input"),
        ({"input": []}, None, InvalidRequest, "input", "input"),
        ({"input": {"role": "user", "content": "hi"}}, None, InvalidRequest, "input", "input"),
        ({"input": 7}, None, InvalidRequest, "input", "input"),
        ({"input": ["hi"]}, None, InvalidRequest, "input", "input[0]"),
        ({"input": [USER, None]}, None, InvalidRequest, "input", "input[1]"),
        ({"input": [USER, [USER]]}, None, InvalidRequest, "input", "input[1]"),
        ({"input": [USER, {"type": "item_reference", "id": "msg_1"}]}, None, InvalidRequest, "input",
         "input[1]"),
        ({"input": [USER, {"type": None, "id": "msg_1"}]}, None, InvalidRequest, "input", "input[1]"),
        ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, None, InvalidRequest, "input",
         "input[0]"),
        # continuing state stored upstream: the input cannot be seen, so it cannot be bounded
        ({"previous_response_id": "resp_1"}, None, InvalidRequest, "previous_response_id",
         "previous_response_id"),
        ({"conversation": "conv_1"}, None, InvalidRequest, "conversation", "conversation"),
        ({"conversation": {"id": "conv_1"}}, None, InvalidRequest, "conversation", "conversation"),
        ({"prompt": {"id": "pmpt_1", "version": "2"}}, None, InvalidRequest, "prompt", "prompt"),
        ({"background": True}, None, InvalidRequest, "background", "background"),
        ({"stream": "yes"}, None, InvalidRequest, "stream", "stream"),
        ({"stream": 1}, None, InvalidRequest, "stream", "stream"),
        ({"stream": 0}, None, InvalidRequest, "stream", "stream"),
        ({"stream": "false"}, None, InvalidRequest, "stream", "stream"),
        ({"max_output_tokens": 0}, None, InvalidRequest, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": -5}, None, InvalidRequest, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": 1.5}, None, InvalidRequest, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": True}, None, InvalidRequest, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": "100"}, None, InvalidRequest, "max_output_tokens", "max_output_tokens"),
        ({"temperature": "hot"}, None, InvalidRequest, "temperature", "temperature"),
        ({"temperature": True}, None, InvalidRequest, "temperature", "temperature"),
        ({"top_p": [1]}, None, InvalidRequest, "top_p", "top_p"),
        ({"tools": {"get": FN}}, None, InvalidRequest, "tools", "tools"),
        ({"tools": ["get"]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"tools": [FN, {"type": "function"}]}, None, InvalidRequest, "tools", "tools[1]"),
        ({"tools": [FN, {"type": "function", "name": 3}]}, None, InvalidRequest, "tools", "tools[1]"),
        ({"tools": [{"type": "custom"}]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"tools": [{"name": "get"}]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"tools": [{"type": ["function"], "name": "get"}]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"tool_choice": "any"}, None, InvalidRequest, "tool_choice", "tool_choice"),
        ({"tool_choice": 3}, None, InvalidRequest, "tool_choice", "tool_choice"),
        ({"tool_choice": {}}, None, InvalidRequest, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "function"}}, None, InvalidRequest, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "function", "name": 1}}, None, InvalidRequest, "tool_choice",
         "tool_choice"),
        ({"tool_choice": {"type": "custom"}}, None, InvalidRequest, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": ["function"], "name": "get"}}, None, InvalidRequest, "tool_choice",
         "tool_choice"),
        ({"input": [USER] * 3}, Limits(max_messages=2), RequestTooLarge, None, "3 input items exceed"),
        ({"tools": [FN, CUSTOM]}, Limits(max_tools=1), RequestTooLarge, None, "2 tools exceed the limit"),
        ({"tools": HOSTED}, Limits(max_tools=4), RequestTooLarge, None, "5 tools exceed the limit of 4"),
    ],
)
def test_parse_request_refuses(
    fields: dict[str, Any], limits: Limits | None, cls: type[GatewayError], param: str | None, fragment: str
) -> None:
    body = {k: v for k, v in body_of(**fields).items() if v is not None}
    with pytest.raises(GatewayError) as info:
        parse(body, limits)
    assert (type(info.value), info.value.param) == (cls, param)
    assert fragment in info.value.message
    assert (info.value.status, errors.error_code(info.value)) == (
        (400, "invalid_request") if cls is InvalidRequest else (413, "request_too_large"))


UNTYPED_REFERENCES = [{"id": "msg_1"}, {"type": None, "id": "msg_1"}]  # `type` is optional in ItemReference


@pytest.mark.parametrize("item", UNTYPED_REFERENCES)
def test_the_sdk_takes_an_untyped_id_as_an_item_reference(item: dict[str, Any]) -> None:
    INPUT.validate_python([USER, item])
    with pytest.raises(ValueError, match="validation error"):
        INPUT.validate_python([USER, {**item, "type": "item_ref"}])


@pytest.mark.parametrize("item", UNTYPED_REFERENCES[:1])
def test_an_untyped_item_reference_is_refused(item: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body_of(input=[USER, item]))
    assert info.value.param == "input"


def test_limits_are_inclusive() -> None:
    call = parse(body_of(input=[USER, USER], tools=[FN, CUSTOM]), Limits(max_messages=2, max_tools=2))
    assert (len(call.tools), call.tool_results) == (1, ())  # the custom tool counts, is not listed
    call = parse(body_of(input="x" * 1000), Limits(max_messages=1))  # a string is one item
    assert call.input_bytes > 1000


@pytest.mark.parametrize(
    ("tool", "name"),
    [
        (FN, "get"),
        (CUSTOM, "patch"),
        ({"type": "function", "name": "web_search_preview"}, "web_search_preview"),
        *[(t, t["type"]) for t in HOSTED],
        ({"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
         "computer"),  # both computer tool types make `computer_call` items: one allow-list name
        ({"type": "mcp", "server_label": "other", "name": "ignored"}, "mcp"),
        ({"type": "function"}, ""),
        ({}, ""),
        ("get", ""),
        (None, ""),
    ],
)
def test_tool_name(tool: Any, name: str) -> None:
    assert tool_name(tool) == name


# -- answers -------------------------------------------------------------------------------------------


def sdk_usage(inp: int = 10, out: int = 5, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    """Usage with every field the SDK's `ResponseUsage` requires."""
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning}}


def response(*output: dict[str, Any], status: str = "completed", **extra: Any) -> dict[str, Any]:
    return {**response_body(""), "output": list(output), "status": status, "usage": sdk_usage(), **extra}


WEB = {"id": "ws_1", "type": "web_search_call", "status": "completed",
       "action": {"type": "search", "query": "q"}}
TWO_PARTS = {**message_item("", "msg_2"), "content": [
    {"type": "output_text", "text": "a", "annotations": []},
    {"type": "refusal", "refusal": "no"},
    {"type": "output_text", "text": "b", "annotations": []},
]}
CUSTOM_CALL = {"id": "ctc_1", "type": "custom_tool_call", "status": "completed",
               **ctc("call_c", "patch", "*** diff")}
REASONING_OUT = {**REASONING, "summary": [{"type": "summary_text", "text": "thinking"}]}
ANSWERS = [
    (response(message_item("Hello!")), "Hello!", (), ("completed",)),
    (response(message_item("Let me."), call_item("get", '{"q":1}', "call_a"), call_item("f", "{}", "call_b")),
     "Let me.", (ToolCall("call_a", "get", '{"q":1}'), ToolCall("call_b", "f", "{}")), ("completed",)),
    (response(REASONING_OUT, WEB, message_item("x ", "msg_1"), TWO_PARTS), "x ab", (), ("completed",)),
    (response(CUSTOM_CALL), "", (ToolCall("call_c", "patch", "*** diff"),), ("completed",)),
    (response(call_item("get"), message_item("after")), "after", (ToolCall("call_1", "get", "{}"),),
     ("completed",)),
    (response(message_item("cut"), status="incomplete", incomplete_details={"reason": "max_output_tokens"}),
     "cut", (), ("max_output_tokens",)),
    (response(status="incomplete", incomplete_details={"reason": "content_filter"}), "", (),
     ("content_filter",)),
]


def test_a_message_of_only_a_refusal_is_a_refusal() -> None:
    refusal = {**message_item("", "msg_r"), "content": [{"type": "refusal", "refusal": "no"}]}
    assert ADAPTER.parse_answer(response(refusal)).refused
    assert not ADAPTER.parse_answer(response(TWO_PARTS)).refused  # it holds text: an answer


@pytest.mark.parametrize(("body", "text", "calls", "finish"), ANSWERS)
def test_parse_answer(
    body: dict[str, Any], text: str, calls: tuple[ToolCall, ...], finish: tuple[str]
) -> None:
    hosted = sum(1 for item in body["output"] if item["type"] == "web_search_call")  # counted, not judged
    usage = Usage(10, 5, web_search_requests=hosted)  # billed apart, per call: counted from the items
    reasoning = tuple(item["id"] for item in body["output"] if item["type"] == "reasoning")
    assert ADAPTER.parse_answer(body) == Answer("resp_fake", "gpt-4o-mini", text, calls, finish, usage,
                                                hosted_calls=hosted, reasoning=reasoning)
    parsed = Response.model_validate(body)  # a real response, whose text the SDK reads the same
    assert parsed.output_text == text


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"id": "r", "model": "m", "status": "incomplete", "incomplete_details": None, "output": []},
         Answer("r", "m", finish_reasons=("incomplete",))),
        ({"status": "failed", "output": [message_item("x")], "usage": None},
         Answer(text="x", finish_reasons=("failed",), provider_error="failed")),  # no error code given
        ({"status": "failed", "output": [], "error": {"code": "rate_limit_exceeded", "message": "m"}},
         Answer(finish_reasons=("failed",), provider_error="rate_limit_exceeded")),
        ({"status": "failed", "output": [], "error": {"code": 5}}, Answer(finish_reasons=("failed",), provider_error="failed")),
        ({"output": [message_item("x")]}, Answer(text="x")),  # no status: no finish reason
        ({"output": None, "usage": "none"}, Answer()),
        ({}, Answer()),
    ],
)
def test_parse_answer_of_partial_bodies(body: dict[str, Any], expected: Answer) -> None:
    assert ADAPTER.parse_answer(body) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ("10", None),
        ([10, 5], None),
        ({}, None),  # no counts at all is no report: settled at the reservation, never free
        (sdk_usage(), Usage(10, 5)),
        (sdk_usage(100, 20, cached=64, reasoning=12),
         Usage(input_tokens=100, output_tokens=20, cache_read_tokens=64, reasoning_tokens=12)),
        ({"input_tokens": 7, "output_tokens": 3, "input_tokens_details": None, "output_tokens_details": None},
         Usage(7, 3)),
        ({"input_tokens": 7.0, "output_tokens": 3}, Usage(7, 3)),
        # counts no provider reports are not believed: the step settles at its reservation
        ({"input_tokens": -1, "output_tokens": 3}, None),
        ({"input_tokens": 1, "output_tokens": 1e300}, None),
        ({"input_tokens": 10**30, "output_tokens": 1}, None),
        ({"input_tokens": "10", "output_tokens": 5}, None),
        ({"input_tokens": 1.5, "output_tokens": 5}, None),
        ({"input_tokens": True, "output_tokens": 5}, None),
        ({**sdk_usage(), "input_tokens_details": {"cached_tokens": -4}}, None),
        ({**sdk_usage(), "output_tokens_details": {"reasoning_tokens": "2"}}, None),
    ],
)
def test_usage_from(usage: Any, expected: Usage | None) -> None:
    assert usage_from(usage) == expected
    if usage is not None:
        assert ADAPTER.parse_answer({"usage": usage}).usage == expected


# -- the stream reader ---------------------------------------------------------------------------------


def sse(data: Any, event: str | None = None) -> SseEvent:
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    [parsed] = SseParser().feed(format_event(payload, event))
    return parsed


def events_of(raws: list[bytes]) -> list[SseEvent]:
    return [e for raw in raws for e in SseParser().feed(raw)]


def replace_final(raws: list[bytes], kind: str, **response_fields: Any) -> list[bytes]:
    """The stream with its last event replaced by a `kind` event whose response has these fields."""
    final = orjson.loads(events_of(raws[-1:])[0].data)
    final["response"] = {**final["response"], **response_fields}
    return [*raws[:-1], format_event(orjson.dumps({**final, "type": kind}), kind)]


TEXT = response_stream(["Hel", "lo"])
CALLS = response_stream(["Let me."], calls=[("get", '{"q":1}', "call_a"), ("f", "{}", "call_b")])
ONLY_CALL = response_stream([], calls=[("get", "{}", "call_a")])
INCOMPLETE = replace_final(response_stream(["cut"]), "response.incomplete", status="incomplete",
                           incomplete_details={"reason": "max_output_tokens"})
TEXT_ANSWER = Answer("resp_fake", "gpt-4o-mini", "Hello", (), ("completed",), Usage(10, 5))
CALLS_LIST = (ToolCall("call_a", "get", '{"q":1}'), ToolCall("call_b", "f", "{}"))
CALLS_ANSWER = Answer("resp_fake", "gpt-4o-mini", "Let me.", CALLS_LIST, ("completed",), Usage(10, 5))
ONLY_ANSWER = Answer("resp_fake", "gpt-4o-mini", "", (ToolCall("call_a", "get", "{}"),), ("completed",),
                     Usage(10, 5))
CUT_ANSWER = Answer("resp_fake", "gpt-4o-mini", "cut", (), ("max_output_tokens",), Usage(10, 5))


@pytest.mark.parametrize(
    ("raws", "holds_from", "answer", "chars", "complete"),
    [
        (TEXT, None, TEXT_ANSWER, 5, True),
        (CALLS, 8, CALLS_ANSWER, 7 + 7 + 2, True),  # the first function_call item starts the holding
        (ONLY_CALL, 2, ONLY_ANSWER, 2, True),
        (INCOMPLETE, None, CUT_ANSWER, 3, True),  # an incomplete response ended properly too
    ],
)
@pytest.mark.parametrize("hide", [True, False])
def test_stream_reader(
    raws: list[bytes], holds_from: int | None, answer: Answer, chars: int, complete: bool, hide: bool
) -> None:
    reader = ADAPTER.stream_reader(hide_usage=hide)
    events = events_of(raws)
    holding = []
    steps = []
    for event in events:
        steps.append(reader.feed(event))
        holding.append(reader.holding)
    assert [s.out for s in steps] == [e.raw for e in events]  # relayed unchanged (the relay holds)
    assert [s.done for s in steps] == [False] * (len(events) - 1) + [True]
    # the final event is always held: it repeats the whole output, judged with its calls
    first = len(events) - 1 if holds_from is None else holds_from
    assert holding == [False] * first + [True] * (len(events) - first)
    assert (reader.answer(), reader.output_chars, reader.complete) == (answer, chars, complete)


def test_a_custom_tool_call_item_starts_the_holding() -> None:
    item = {"id": "ctc_1", "type": "custom_tool_call", "status": "completed",
            **ctc("call_c", "patch", "diff")}
    head = events_of(response_stream(["a"], complete=False))
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in head:
        reader.feed(event)
    assert not reader.holding
    where = {"output_index": 1, "sequence_number": 50}
    reader.feed(sse({"type": "response.output_item.added", **where, "item": {**item, "input": ""}}))
    assert reader.holding
    reader.feed(sse({"type": "response.custom_tool_call_input.delta", **where, "item_id": "ctc_1",
                     "delta": "diff"}))
    reader.feed(sse({"type": "response.output_item.done", **where, "item": item}))
    assert reader.answer().tool_calls == (ToolCall("call_c", "patch", "diff"),)
    assert not reader.complete


@pytest.mark.parametrize(
    "kind", ["web_search_call", "reasoning", "message", "file_search_call", "code_interpreter_call"]
)
def test_items_the_agent_does_not_run_are_not_held(kind: str) -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    reader.feed(sse({"type": "response.output_item.added", "output_index": 0, "sequence_number": 2,
                     "item": {"id": "x_1", "type": kind, "status": "in_progress"}}))
    assert not reader.holding


def test_delta_is_the_text_of_the_last_event() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    deltas = [(reader.feed(e), reader.delta)[1] for e in events_of(CALLS)]
    assert deltas == ["", "", "", "", "Let me."] + [""] * (len(deltas) - 5)
    deltas = [(reader.feed(e), reader.delta)[1] for e in events_of(TEXT)[:6]]
    assert deltas == ["", "", "", "", "Hel", "lo"]


def test_a_stream_cut_short_is_not_complete() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    steps = [reader.feed(e) for e in events_of(response_stream(["Hel", "lo"], calls=[("get", "{}", "c")],
                                                               complete=False))]
    assert not any(s.done for s in steps)
    assert (reader.complete, reader.holding) == (False, True)
    answer = reader.answer()
    assert (answer.text, answer.tool_calls, answer.usage) == ("Hello", (ToolCall("c", "get", "{}"),), None)


def test_the_answer_comes_from_the_final_response() -> None:
    raws = replace_final(TEXT, "response.completed", id="resp_other", model="gpt-4o-2024",
                         output=[message_item("Hello")], usage=sdk_usage(30, 2, cached=16, reasoning=1))
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in events_of(raws):
        reader.feed(event)
    assert reader.answer() == Answer("resp_other", "gpt-4o-2024", "Hello", (), ("completed",),
                                     Usage(30, 2, cache_read_tokens=16, reasoning_tokens=1))


@pytest.mark.parametrize("missing", ["null", "absent"])
def test_a_final_response_without_output_keeps_the_streamed_calls(missing: str) -> None:
    raws = replace_final(CALLS, "response.completed", output=None)
    if missing == "absent":
        final = orjson.loads(events_of(raws[-1:])[0].data)
        del final["response"]["output"]
        raws = [*raws[:-1], format_event(orjson.dumps(final), "response.completed")]
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in events_of(raws):
        reader.feed(event)
    with sdk(b"".join(raws)) as client, client.responses.stream(model="m", input="hi") as stream:
        final = stream.until_done().get_final_response()
    assert [getattr(i, "name", None) for i in final.output] == [None, "get", "f"]  # the SDK keeps them
    answer = reader.answer()
    assert (answer.text, answer.tool_calls, answer.usage) == ("Let me.", CALLS_LIST, Usage(10, 5))


def test_relayed_events_assemble_in_the_sdk() -> None:
    reader = ADAPTER.stream_reader(hide_usage=True)
    relayed = b"".join(reader.feed(e).out for e in events_of(CALLS))
    with sdk(relayed) as client, client.responses.stream(model="m", input="hi") as stream:
        final = stream.until_done().get_final_response()
    calls = [(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert (final.output_text, calls) == ("Let me.", [(c.id, c.name, c.arguments) for c in CALLS_LIST])
    assert final.usage is not None and final.usage.total_tokens == 15  # never hidden: ask_usage asks nothing


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"type": "error", "sequence_number": 3, "code": "server_error", "message": "boom", "param": None},
         "boom"),
        ({"type": "error", "sequence_number": 3, "code": "rate_limit_exceeded", "message": None},
         "rate_limit"),
    ],
)
def test_failures_in_the_stream_raise(data: dict[str, Any], message: str) -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in events_of(TEXT[:3]):
        reader.feed(event)
    with pytest.raises(ValueError, match=message):
        reader.feed(sse(data, str(data["type"])))
    assert not reader.complete


def test_a_failed_response_is_final_relayed_and_settled_from_its_usage() -> None:
    """The upstream's own failure passes through unchanged (held and judged like any final event); its
    usage is billed."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in events_of(TEXT[:3]):
        reader.feed(event)
    failed = {**response_body("", usage=(10, 2)), "status": "failed", "output": [],
              "error": {"code": "server_error", "message": "x"}}
    event = sse({"type": "response.failed", "sequence_number": 3, "response": failed}, "response.failed")
    step = reader.feed(event)
    assert (step.out, step.done, reader.complete, reader.holding) == (event.raw, True, True, True)
    answer = reader.answer()
    assert (answer.finish_reasons, answer.provider_error) == (("failed",), "server_error")  # the span's error.type
    assert answer.usage is not None and (answer.usage.input_tokens, answer.usage.output_tokens) == (10, 2)


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"{nope", "not valid JSON"), (b"[1]", "not a JSON object"), (b'"text"', "not a JSON object")],
)
def test_malformed_events_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ADAPTER.stream_reader(hide_usage=False).feed(sse(data))


@pytest.mark.parametrize("raw", [b": keep-alive\n\n", b"event: ping\n\n", b"data:\n\n"])
def test_events_without_data_are_relayed(raw: bytes) -> None:
    [event] = SseParser().feed(raw)
    reader = ADAPTER.stream_reader(hide_usage=True)
    step = reader.feed(event)
    assert (step.out, step.done, reader.complete, reader.holding) == (raw, False, False, False)
    assert reader.answer() == Answer()


def test_unknown_events_are_relayed_and_ignored() -> None:
    data = {"type": "response.something_new", "sequence_number": 4, "output_index": 0, "delta": "zz"}
    reader = ADAPTER.stream_reader(hide_usage=False)
    step = reader.feed(sse(data, "response.something_new"))
    raw = sse(data, "response.something_new").raw
    assert (step.out, step.done, reader.delta, reader.output_chars) == (raw, False, "", 0)


# -- errors --------------------------------------------------------------------------------------------

ERRORS = [
    (InvalidRequest("bad", param="model"), "invalid_request_error", "model", "invalid_request"),
    (errors.InvalidGrammar("no regex"), "invalid_request_error", None, "invalid_request"),
    (errors.InvalidApiKey("who"), "invalid_request_error", None, "invalid_api_key"),
    (errors.ModelNotFound("no"), "invalid_request_error", None, "model_not_found"),
    (RequestTooLarge("big"), "invalid_request_error", None, "request_too_large"),
    (errors.OutputNonconforming("no"), "invalid_request_error", None, "output_nonconforming"),
    (errors.Stopped("budget_exhausted", "spent"), "permission_error", None, "budget_exhausted"),
    (errors.ToolNotAllowed("rm"), "permission_error", None, "tool_not_allowed"),
    (errors.ApprovalTimeout("late"), "permission_error", None, "approval_timeout"),
    (errors.UpstreamUnavailable("down"), "server_error", None, "upstream_unavailable"),
    (errors.UpstreamTimeout("slow"), "server_error", None, "upstream_timeout"),
    (errors.ShuttingDown("bye"), "server_error", None, "shutting_down"),
]


@pytest.mark.parametrize(("error", "kind", "param", "code"), ERRORS)
def test_error_body(error: GatewayError, kind: str, param: str | None, code: str) -> None:
    body = ADAPTER.error_body(error)
    expected = {"message": error.message, "type": kind, "param": param, "code": code}
    assert orjson.loads(body) == {"error": expected}
    parsed = ErrorObject.model_validate(orjson.loads(body)["error"])
    assert (parsed.code, parsed.message, parsed.type) == (code, error.message, kind)


@pytest.mark.parametrize(("error", "kind", "param", "code"), ERRORS)
def test_error_event_makes_the_sdk_raise(
    error: GatewayError, kind: str, param: str | None, code: str
) -> None:
    raw = ADAPTER.error_event(error)
    [event] = SseParser().feed(raw)
    data = orjson.loads(event.data)
    got = (event.event, data["type"], data["code"], data["message"])
    assert got == ("error", "error", code, error.message)
    assert data["error"] == {"message": error.message, "type": kind, "param": param, "code": code}
    with sdk(events_of(TEXT)[0].raw + raw) as client, pytest.raises(APIError) as info:
        for _ in client.responses.create(model="m", input="hi", stream=True):
            pass
    assert (info.value.message, info.value.code, info.value.type) == (error.message, code, kind)


def test_error_event_is_a_response_error_event() -> None:
    [event] = SseParser().feed(ADAPTER.error_event(errors.UpstreamTimeout("slow")))
    parsed = EVENT.validate_json(event.data)
    assert isinstance(parsed, ResponseErrorEvent) and parsed.code == "upstream_timeout"


# -- stop messages -------------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responses_stop, "time", SimpleNamespace(time=lambda: 1_700_000_000.25))


@pytest.fixture
def moving_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time goes on while the events are built (a millisecond boundary can pass at any point)."""
    ticks = itertools.count()
    now = SimpleNamespace(time=lambda: 1_700_000_000 + next(ticks) / 500)
    monkeypatch.setattr(responses_stop, "time", now)


def sdk(payload: bytes, content_type: str = "text/event-stream") -> OpenAI:
    """An OpenAI client whose every request is answered with `payload` (no network)."""
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, content=payload, headers={"content-type": content_type}))
    return OpenAI(api_key="k", base_url="http://tollgate.test/v1", max_retries=0,
                  http_client=httpx2.Client(transport=transport))


CALL = Call("openai_responses", "chat", "gpt-4o-mini", stream=True)
REASONS = [("budget_exhausted", "spent $2.00"), ("loop_detected", 'said "again"\nand ü')]


def stop_says(reason: str, detail: str) -> str:
    return f"tollgate stopped this run ({reason}): {detail}"


@pytest.mark.parametrize(("reason", "detail"), REASONS)
def test_stop_answer_reaches_the_sdk(clock: None, reason: str, detail: str) -> None:
    raw = ADAPTER.stop_answer(CALL, reason, detail)
    with sdk(raw, "application/json") as client:
        parsed = client.responses.create(model="gpt-4o-mini", input="hi")
    assert (parsed.output_text, parsed.status, parsed.model, parsed.created_at) == (
        stop_says(reason, detail), "completed", "gpt-4o-mini", 1_700_000_000)
    assert parsed.id.startswith("resp") and [i.type for i in parsed.output] == ["message"]
    assert parsed.usage is not None and parsed.usage.total_tokens == 0
    expected = Answer(parsed.id, "gpt-4o-mini", stop_says(reason, detail), (), ("completed",), Usage())
    assert ADAPTER.parse_answer(orjson.loads(raw)) == expected


def test_stop_answer_is_a_valid_response(clock: None) -> None:
    parsed = Response.model_validate_json(ADAPTER.stop_answer(CALL, *REASONS[0]))
    assert parsed.output_text == stop_says(*REASONS[0])


def stream_events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    return [(e.event, orjson.loads(e.data)) for e in SseParser().feed(raw)]


@pytest.mark.parametrize(("reason", "detail"), REASONS)
def test_stop_stream_reaches_the_sdk(clock: None, reason: str, detail: str) -> None:
    raw = ADAPTER.stop_stream(CALL, reason, detail)
    events = stream_events(raw)
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    with sdk(raw) as client, client.responses.stream(model="gpt-4o-mini", input="hi") as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen[-1] == "response.completed"
    got = (final.output_text, final.status, final.model)
    assert got == (stop_says(reason, detail), "completed", "gpt-4o-mini")
    reader = ADAPTER.stream_reader(hide_usage=False)
    steps = [reader.feed(e) for e in SseParser().feed(raw)]
    assert steps[-1].done and reader.complete
    assert (reader.answer().text, reader.answer().tool_calls) == (stop_says(reason, detail), ())


STOP_KINDS = ["response.created", "response.in_progress", "response.output_item.added",
              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.mark.parametrize("kind", STOP_KINDS)
def test_stop_stream_events_are_response_stream_events(clock: None, kind: str) -> None:
    events = [data for name, data in stream_events(ADAPTER.stop_stream(CALL, *REASONS[1])) if name == kind]
    assert len(events) == 1
    parsed = EVENT.validate_python(events[0])
    assert parsed.type == kind


def test_stop_stream_keeps_one_response_id(moving_clock: None) -> None:
    raw = ADAPTER.stop_stream(CALL, *REASONS[0])
    ids = {data["response"]["id"] for _, data in stream_events(raw) if "response" in data}
    assert len(ids) == 1
    with sdk(raw) as client, client.responses.stream(model="gpt-4o-mini", input="hi") as stream:
        assert stream.until_done().get_final_response().output_text == stop_says(*REASONS[0])


def test_stop_events(clock: None) -> None:
    shown = [message_item("a", "msg_a"), {**WEB}]
    created = {"id": "resp_up", "object": "response", "status": "in_progress", "output": shown}
    raw = stop_events("time_cap", "too slow", index=2, sequence=7, response=created)
    events = stream_events(raw)
    assert [data["sequence_number"] for _, data in events] == list(range(7, 7 + len(events)))
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert {data["output_index"] for _, data in events if "output_index" in data} == {2}
    assert events[-1][0] == "response.completed"
    final = events[-1][1]["response"]
    assert final["output"][:2] == shown and final["status"] == "completed" and final["id"] == "resp_up"
    [added] = [data["item"] for name, data in events if name == "response.output_item.added"]
    [done] = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert final["output"][2] == done and added["id"] == done["id"] and done["role"] == "assistant"
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == done["content"][0]["text"] == stop_says("time_cap", "too slow")


def relay(raws: list[bytes]) -> tuple[ResponsesStreamReader, bytes]:
    """Feed a stream as the relay does: what comes before the holding reaches the agent."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    shown = b""
    for event in events_of(raws):
        step = reader.feed(event)
        if not reader.holding:
            shown += step.out
    return reader, shown


HELD_AFTER_TEXT = response_stream(["Let me."], calls=[("get", "{}", "call_a")])


@pytest.mark.parametrize(
    ("raws", "shown_items", "shown_text"),
    [(HELD_AFTER_TEXT, 1, "Let me."), (ONLY_CALL, 0, "")],
)
def test_stream_stop_tail_continues_the_relayed_response(
    clock: None, raws: list[bytes], shown_items: int, shown_text: str
) -> None:
    reader, shown = relay(raws)
    tail = ADAPTER.stream_stop_tail(CALL, reader, "loop_detected", "again")
    before, after = stream_events(shown), stream_events(tail)
    last = max(data["sequence_number"] for _, data in before)
    sequence = [data["sequence_number"] for _, data in after]
    assert sequence[0] > last and sequence == sorted(set(sequence))
    assert after[0][0] == "response.output_item.added" and after[-1][0] == "response.completed"
    assert {data["output_index"] for _, data in after if "output_index" in data} == {shown_items}
    output = after[-1][1]["response"]["output"]
    assert [i["type"] for i in output] == ["message"] * (shown_items + 1)  # the held call is not there
    text = "".join(p["text"] for i in output for p in i["content"])
    assert text == shown_text + stop_says("loop_detected", "again")


@pytest.mark.parametrize("raws", [HELD_AFTER_TEXT, ONLY_CALL])
def test_stream_stop_tail_assembles_in_the_sdk(clock: None, raws: list[bytes]) -> None:
    reader, shown = relay(raws)
    tail = ADAPTER.stream_stop_tail(CALL, reader, "loop_detected", "again")
    with sdk(shown + tail) as client, client.responses.stream(model="gpt-4o-mini", input="hi") as stream:
        final = stream.until_done().get_final_response()
    assert final.output_text.endswith(stop_says("loop_detected", "again"))
    assert [i.type for i in final.output if i.type == "function_call"] == []


@pytest.mark.parametrize("reader", [object(), None, ResponsesStreamReader()])
def test_stream_stop_tail_before_anything_was_shown_is_a_stop_stream(clock: None, reader: Any) -> None:
    assert ADAPTER.stream_stop_tail(CALL, reader, *REASONS[0]) == ADAPTER.stop_stream(CALL, *REASONS[0])


# -- request edits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "after"),
    [
        ({}, None, {"max_output_tokens": 9}),
        ({"max_output_tokens": None}, None, {"max_output_tokens": 9}),
        ({"max_output_tokens": 100}, "max_output_tokens", {"max_output_tokens": 9}),
        ({"max_output_tokens": 9}, "max_output_tokens", {"max_output_tokens": 9}),
        ({"max_output_tokens": 5}, "max_output_tokens", {"max_output_tokens": 5}),  # the agent's lower value
        ({"max_tokens": 50}, None, {"max_tokens": 50, "max_output_tokens": 9}),  # not this API's field
    ],
)
@pytest.mark.parametrize("prefer", [True, False])
def test_max_tokens_field_and_set(body: dict[str, Any], field: str | None, after: dict[str, Any],
                                  prefer: bool) -> None:
    body = copy.deepcopy(body)
    assert ADAPTER.max_tokens_field(body) == field
    ADAPTER.set_max_tokens(body, 9, prefer_completion_field=prefer)
    assert body == after
    assert parse(body_of(**body)).max_tokens == after["max_output_tokens"]


@pytest.mark.parametrize(
    "body", [body_of(stream=True), body_of(stream=True, stream_options={"include_obfuscation": False})]
)
def test_ask_usage_asks_nothing(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    assert ADAPTER.ask_usage(body) is False
    assert body == before


@pytest.mark.parametrize(
    ("body", "answer", "head"),
    [
        (body_of(temperature=0), "{bad", [{"role": "user", "content": "hi"}]),
        (body_of(input=[USER, fc("a"), fc_out("a", "r")]), "not json", [USER, fc("a"), fc_out("a", "r")]),
        (body_of(input=[SAID]), "x", [SAID]),
    ],
)
def test_with_instruction(body: dict[str, Any], answer: str, head: list[dict[str, Any]]) -> None:
    before = orjson.dumps(body)
    out = ADAPTER.with_instruction(body, answer, "Answer with JSON only.")
    assert out == {**body, "input": [*head, {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "Answer with JSON only."}]}
    assert orjson.dumps(body) == before  # the original body is not touched
    INPUT.validate_python(out["input"])
    assert parse(out).tool_results == ()  # the re-ask is a new round


def test_with_instruction_after_an_empty_answer() -> None:
    out = ADAPTER.with_instruction(body_of(), "", "Answer with JSON only.")
    said, ask = out["input"][-2:]
    assert said["role"] == "assistant" and isinstance(said["content"], str)
    assert ask == {"role": "user", "content": "Answer with JSON only."}
    INPUT.validate_python(out["input"])


@pytest.mark.parametrize(
    ("item", "arguments"),
    [
        ({"type": "computer_call", "call_id": "c", "actions": [{"type": "click", "x": 1, "y": 2}], "action": None},
         '{"actions":[{"type":"click","x":1,"y":2}]}'),
        ({"type": "computer_call", "call_id": "c", "action": {"type": "screenshot"}}, '{"action":{"type":"screenshot"}}'),
        ({"type": "apply_patch_call", "call_id": "c", "operation": {"type": "delete_file", "path": "a"}},
         '{"operation":{"path":"a","type":"delete_file"}}'),
        ({"type": "shell_call", "call_id": "c"}, "{}"),
    ],
)
def test_agent_run_calls_have_object_arguments(item: dict[str, Any], arguments: str) -> None:
    """A JSON object, as tool arguments are validated (a batched `actions` list is not refused)."""
    [call] = ADAPTER.parse_answer({"output": [item]}).tool_calls
    assert call.arguments == arguments


def test_calls_of_tools_openai_ran_are_counted_not_judged() -> None:
    search = {"type": "web_search_call", "id": "ws", "status": "completed", "action": {"type": "search"}}
    mcp = {"type": "mcp_call", "id": "mc", "name": "read", "server_label": "files", "arguments": "{}"}
    answer = ADAPTER.parse_answer({"output": [search, mcp, message_item("ok")], "status": "completed"})
    assert (answer.hosted_calls, answer.tool_calls, answer.text) == (2, (), "ok")


@pytest.mark.parametrize(
    ("body", "changed", "after"),
    [
        ({"tools": [{"type": "web_search"}]}, True, 3),
        ({"tools": [{"type": "web_search"}], "max_tool_calls": 2}, False, 2),
        ({"tools": [{"type": "web_search"}], "max_tool_calls": 7}, True, 3),
        ({"tools": [{"type": "mcp", "server_label": "x"}], "max_tool_calls": 0}, False, 0),  # lower: kept
        ({"tools": [{"type": "web_search"}], "max_tool_calls": True}, False, True),  # no count: the API refuses
        ({"tools": [FN, {"type": "custom", "name": "c"}, {"type": "shell"}]}, False, None),  # the agent runs these
        ({"tools": "x"}, False, None),
        ({}, False, None),
    ],
)
def test_limit_hosted_calls(body: dict[str, Any], changed: bool, after: int | None) -> None:
    assert ADAPTER.limit_hosted_calls(body, 3) is changed
    assert body.get("max_tool_calls") == after


def test_with_no_tool_calls_left_tools_openai_runs_are_not_offered() -> None:
    body: dict[str, Any] = {"tools": [FN, {"type": "web_search"}, {"type": "shell"}], "max_tool_calls": 4,
                            "tool_choice": {"type": "web_search"}}
    assert ADAPTER.limit_hosted_calls(body, 0) is True
    assert body == {"tools": [FN, {"type": "shell"}]}
    only: dict[str, Any] = {"tools": [{"type": "web_search"}], "tool_choice": "required", "parallel_tool_calls": True}
    assert ADAPTER.limit_hosted_calls(only, 0) is True
    assert only == {}


def test_with_no_tool_calls_left_allowed_tools_lose_the_tools_openai_runs() -> None:
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}, {"type": "function",
                                                                                          "name": "get"}]}
    body: dict[str, Any] = {"tools": [FN, {"type": "web_search"}], "tool_choice": allowed}
    assert ADAPTER.limit_hosted_calls(body, 0) is True
    assert body["tool_choice"] == {**allowed, "tools": [{"type": "function", "name": "get"}]}
    searches_only = {**allowed, "tools": [{"type": "web_search"}]}
    body = {"tools": [FN, {"type": "web_search"}], "tool_choice": searches_only}
    assert ADAPTER.limit_hosted_calls(body, 0) is True
    assert "tool_choice" not in body


def test_a_cut_stream_still_counts_the_calls_openai_ran() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    search = {"type": "web_search_call", "id": "ws", "status": "in_progress"}
    reader.feed(sse({"type": "response.output_item.added", "sequence_number": 0, "output_index": 0,
                     "item": search}, "response.output_item.added"))
    assert reader.answer().hosted_calls == 1


@pytest.mark.parametrize(
    ("fields", "limits"),
    [
        ({}, ()),
        ({"tools": [FN]}, ()),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, ()),  # not billed per call
        ({"tools": [{"type": "web_search"}]}, (None,)),
        ({"tools": [{"type": "web_search_preview_2025_03_11"}], "max_tool_calls": 4}, (4,)),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}, {"type": "web_search"}],
          "max_tool_calls": 2}, (2,)),  # one limit over every call of OpenAI's tools
    ],
)
def test_search_limits(fields: dict[str, Any], limits: tuple[int | None, ...]) -> None:
    assert parse({"model": "gpt-4o", "input": "hi", **fields}).search_limits == limits
    assert ADAPTER.search_limits(fields) == limits


def test_search_limits_read_a_limit_that_is_no_count_as_no_limit() -> None:
    """The pure reading, for a body `parse_request` did not check: no count is no limit."""
    assert ADAPTER.search_limits({"tools": [{"type": "web_search"}], "max_tool_calls": True}) == (None,)


@pytest.mark.parametrize("value", ["3", 50.0, 1e2, 2.5, -1, True, float(2**64), 2**53 + 1, [3]])
@pytest.mark.parametrize("tools", [[{"type": "web_search"}], [FN], None])
def test_a_max_tool_calls_that_is_no_integer_is_refused(tools: list[Any] | None, value: Any) -> None:
    """The budget and the tool-call cap lower `max_tool_calls` and reserve for what it allows: one they could
    not read (50.0 among them, which an API may read as 50) would reach the API unlowered."""
    body: dict[str, Any] = {"model": "gpt-4o", "input": "hi", "max_tool_calls": value}
    if tools is not None:
        body["tools"] = tools
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == "max_tool_calls"


def test_searches_the_answer_ran_are_counted_in_its_usage() -> None:
    files = {"id": "fs_1", "type": "file_search_call", "status": "completed", "queries": ["q"], "results": None}
    answer = ADAPTER.parse_answer(response(WEB, WEB, files, message_item("ok")))
    assert answer.usage is not None
    assert (answer.usage.web_search_requests, answer.usage.file_search_requests) == (2, 1)
    assert answer.hosted_calls == 3
    without_usage = ADAPTER.parse_answer({**response(WEB, message_item("ok")), "usage": None})
    assert without_usage.usage is None  # no usage: the reservation, searches included, is charged


@pytest.mark.parametrize(("sent", "tier"), [({}, None), ({"service_tier": "priority"}, "priority"),
                                            ({"service_tier": "flex"}, "flex"), ({"service_tier": 1}, None)])
def test_the_service_tier_asked_for_and_answered_streamed_too(sent: dict[str, Any], tier: str | None) -> None:
    assert parse({"model": "gpt-4o", "input": "hi", **sent}).service_tier == tier
    assert ADAPTER.parse_answer({**response_body("ok"), **sent}).service_tier == tier
    raws = response_stream(["o", "k"])
    final = orjson.loads(raws[-1].split(b"data: ", 1)[1])
    final["response"].update(sent)
    raws[-1] = b"event: " + final["type"].encode() + b"\ndata: " + orjson.dumps(final) + b"\n\n"
    reader, _ = relay(raws)
    assert reader.answer().service_tier == tier


@pytest.mark.parametrize(("fields", "unbounded"), [
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "compaction"),
    ({"input": [USER, {"type": "compaction_trigger"}]}, "compaction"),
    ({}, None),
])
def test_what_a_budget_cannot_bound(fields: dict[str, Any], unbounded: str | None) -> None:
    """A compaction inside the response has no output limit tollgate can hold: `Call.unbounded` (refused
    under a budget)."""
    call = parse(body_of(**fields))
    if unbounded is None:
        assert call.unbounded == ()
    else:
        assert len(call.unbounded) == 1 and unbounded in call.unbounded[0]


@pytest.mark.parametrize(("items", "stored"), [
    ([USER, REASONING, fc("a"), fc_out("a", "r")], ("rs_1",)),
    ([USER, {**REASONING, "encrypted_content": "gAAAA"}], ()),  # carried in the body
    ([USER, {**REASONING, "content": [{"type": "reasoning_text", "text": "t"}]}], ()),
    ([USER, REASONING, {**REASONING, "id": "rs_2"}], ("rs_1", "rs_2")),
    ([USER, {"type": "reasoning", "summary": []}], ("",)),  # no id: never seen, so never held
    ([USER], ()),
])
def test_reasoning_read_from_storage_by_id(items: list[Any], stored: tuple[str, ...]) -> None:
    """Input the body does not carry (`Call.stored_reasoning`: held at what the gateway saw it cost, else
    refused under a budget), and the reasoning ids of an answer, which an agent may send back so."""
    assert parse(body_of(input=items)).stored_reasoning == stored
    assert parse(body_of(input=items)).unbounded == ()


def test_an_answer_names_its_reasoning_items() -> None:
    assert ADAPTER.parse_answer(response(REASONING_OUT, message_item("ok"))).reasoning == ("rs_1",)
    assert ADAPTER.parse_answer(response(message_item("ok"))).reasoning == ()


def test_commentary_before_calls_is_not_the_answers_text() -> None:
    """A `phase: commentary` message (what the model says before its calls) is relayed, not judged."""
    commentary = {**message_item("I'll look.", "msg_c"), "phase": "commentary"}
    final = {**message_item("Done.", "msg_f"), "phase": "final_answer"}
    assert ADAPTER.parse_answer(response(commentary, call_item("get"))).text == ""
    assert ADAPTER.parse_answer(response(commentary, final)).text == "Done."
    raws = response_stream([], calls=[("get", "{}", "call_1")])
    added = {"type": "response.output_item.added", "output_index": 0, "item": {**commentary, "content": []}}
    delta = {"type": "response.output_text.delta", "item_id": "msg_c", "output_index": 0, "content_index": 0,
             "delta": "I'll look.", "logprobs": []}
    raws[2:2] = [b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in (added, delta)]
    reader, _ = relay(raws)
    assert reader.answer().text == ""
    assert [c.name for c in reader.answer().tool_calls] == ["get"]


@pytest.mark.parametrize("kind", ["response.created", "response.in_progress", "response.queued"])
def test_an_event_before_the_final_one_carrying_output_is_malformed(kind: str) -> None:
    """The SDK starts its snapshot from the response these events carry: an item there skips every judgement."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    item = {"type": "function_call", "id": "fc", "call_id": "c", "name": "delete_everything", "arguments": "{}"}
    with pytest.raises(ValueError, match=f"{kind} carries output"):
        reader.feed(sse({"type": kind, "sequence_number": 0, "response": {"id": "r", "output": [item]}}, kind))


def test_a_created_event_without_output_is_read() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    reader.feed(sse({"type": "response.created", "sequence_number": 0, "response": {"id": "r", "output": []}},
                    "response.created"))
    assert reader.created == {"id": "r", "output": []}


def test_text_done_is_the_answer_text_s_output_text_done() -> None:
    """The SDK parses `text_format` at `response.output_text.done`; commentary (`phase: commentary`) is
    not the answer and its end is not the text's."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    item = {"type": "message", "id": "msg_c", "role": "assistant", "phase": "commentary", "content": []}
    reader.feed(sse({"type": "response.output_item.added", "output_index": 0, "item": item, "sequence_number": 0}))
    reader.feed(sse({"type": "response.output_text.done", "item_id": "msg_c", "output_index": 0, "content_index": 0,
                     "text": "thinking aloud", "sequence_number": 1}))
    assert not reader.text_done
    reader.feed(sse({"type": "response.output_text.done", "item_id": "msg_a", "output_index": 1, "content_index": 0,
                     "text": "{}", "sequence_number": 2}))
    assert reader.text_done
