"""gateway/providers/responses_wire.py: dropping call items of disallowed tools from OpenAI Responses answers,
whole bodies and held stream events, with output indices kept contiguous (checked with the `openai` SDK)."""

from __future__ import annotations

import copy
from typing import Annotated, Any, get_args

import httpx2
import orjson
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import Field, TypeAdapter

from gateway.providers.openai_responses import item_type
from gateway.providers.responses_wire import drop_in_body, drop_in_stream
from gateway.providers.sse import SseParser, format_event
from gateway.providers.tool_wire import drop_calls, drop_stream_calls

# the SDK's stream event union, discriminated by `type` as its PropertyInfo says
EVENT = TypeAdapter[ResponseStreamEvent](
    Annotated[get_args(ResponseStreamEvent)[0], Field(discriminator="type")]
)
USAGE = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
         "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 0}}


def msg(text: str, item_id: str = "msg_1") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def fc(name: str, arguments: str = "{}") -> dict[str, Any]:
    return {"id": f"fc_{name}", "type": "function_call", "status": "completed", "name": name,
            "arguments": arguments, "call_id": f"call_{name}"}


def custom(name: str, text: str = "*** patch") -> dict[str, Any]:
    return {"id": f"ctc_{name}", "type": "custom_tool_call", "status": "completed", "name": name,
            "input": text, "call_id": f"call_{name}"}


WEB = {"id": "ws_1", "type": "web_search_call", "status": "completed",
       "action": {"type": "search", "query": "q"}}
REASONING = {"id": "rs_1", "type": "reasoning", "summary": []}
CUT = {"reason": "max_output_tokens"}


def response(*output: dict[str, Any], status: str = "completed", **extra: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1700000000, "status": status,
            "model": "gpt-4o-mini", "output": list(output), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "usage": USAGE, **extra}


# -- bodies --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "names", "left", "after"),
    [
        (response(msg("Look."), fc("a"), fc("b")), {"a"}, True, response(msg("Look."), fc("b"))),
        (response(msg("Look."), fc("a"), fc("b")), {"b"}, True, response(msg("Look."), fc("a"))),
        (response(msg("Look."), fc("a"), fc("b")), {"a", "b"}, True, response(msg("Look."))),
        (response(fc("a"), fc("b")), {"a"}, True, response(fc("b"))),
        (response(fc("a"), fc("b")), {"a", "b"}, False, response()),
        (response(fc("a")), {"a"}, False, response()),
        (response(msg(""), fc("a")), {"a"}, False, response(msg(""))),  # an empty message says nothing
        (response(fc("a"), msg("after")), {"a"}, True, response(msg("after"))),
        (response(custom("c"), fc("a")), {"c"}, True, response(fc("a"))),
        (response(custom("c")), {"c"}, False, response()),
        # reasoning and hosted tools' records alone are no answer: the agent gets nothing to act on
        (response(REASONING, fc("a")), {"a"}, False, response(REASONING)),
        (response(WEB, fc("a")), {"a"}, False, response(WEB)),
        # hosted tools run upstream before any answer: their items are never judged after
        (response(WEB, msg("ok")), {"web_search_preview", "web_search_call"}, True, response(WEB, msg("ok"))),
        (response(fc("a"), fc("b")), {"x"}, True, response(fc("a"), fc("b"))),
        (response(fc("a"), fc("a", '{"again":1}')), {"a"}, False, response()),
        (response(msg("hi")), {"a"}, True, response(msg("hi"))),
        (response(msg("")), {"a"}, False, response(msg(""))),
        (response(), {"a"}, False, response()),
        (response(msg("cut"), fc("a"), status="incomplete", incomplete_details=CUT), {"a"}, True,
         response(msg("cut"), status="incomplete", incomplete_details=CUT)),
    ],
)
def test_drop_in_body(before: dict[str, Any], names: set[str], left: bool, after: dict[str, Any]) -> None:
    Response.model_validate(before)  # a real response
    body = copy.deepcopy(before)
    assert drop_in_body(body, frozenset(names)) is left
    assert body == after
    Response.model_validate(body)  # still one the SDK accepts
    registered = copy.deepcopy(before)
    assert drop_calls("openai_responses", registered, frozenset(names)) is left
    assert registered == after


@pytest.mark.parametrize(
    "odd",
    [{"type": ["function_call"], "name": "a", "call_id": "c"}, {"type": "function_call", "name": ["a"]},
     {"type": None, "name": "a"}, "a", None],
)
def test_drop_in_body_keeps_items_it_cannot_read(odd: Any) -> None:
    body = {"output": [odd, fc("a")]}
    left = drop_in_body(body, frozenset({"a"}))
    assert body == {"output": [odd]}  # the odd item is left, as it came
    assert left is (item_type(odd) == "function_call")  # only a readable call is an answer


@pytest.mark.parametrize("body", [{}, {"output": None}, {"output": "x"}, {"output": {"0": fc("a")}}])
def test_drop_in_body_without_an_output_list(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    assert drop_in_body(body, frozenset({"a"})) is False
    assert body == before


# -- streams -------------------------------------------------------------------------------------------


class Stream:
    """Events of a streamed response, numbered in order; `item` adds the events of one output item."""

    def __init__(self) -> None:
        self.events: list[bytes] = []

    def ev(self, kind: str, **fields: Any) -> bytes:
        raw = format_event(orjson.dumps({"type": kind, "sequence_number": len(self.events), **fields}), kind)
        self.events.append(raw)
        return raw

    def head(self) -> list[bytes]:
        start = {**response(), "status": "in_progress", "usage": None}
        return [self.ev("response.created", response=start), self.ev("response.in_progress", response=start)]

    def item(self, item: dict[str, Any], index: int) -> list[bytes]:
        first = len(self.events)
        kind, where = item["type"], {"item_id": item["id"], "output_index": index}
        if kind == "message":
            part = item["content"][0]
            text, at = part["text"], {**where, "content_index": 0}
            self.ev("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                             "content": []})
            self.ev("response.content_part.added", **at, part={**part, "text": ""})
            self.ev("response.output_text.delta", **at, delta=text, logprobs=[])
            self.ev("response.output_text.done", **at, text=text, logprobs=[])
            self.ev("response.content_part.done", **at, part=part)
        elif kind == "function_call":
            self.ev("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                             "arguments": ""})
            self.ev("response.function_call_arguments.delta", **where, delta=item["arguments"])
            self.ev("response.function_call_arguments.done", **where, arguments=item["arguments"])
        elif kind == "custom_tool_call":
            self.ev("response.output_item.added", output_index=index, item={**item, "input": ""})
            self.ev("response.custom_tool_call_input.delta", **where, delta=item["input"])
            self.ev("response.custom_tool_call_input.done", **where, input=item["input"])
        else:  # web_search_call
            self.ev("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            self.ev("response.web_search_call.completed", **where)
        self.ev("response.output_item.done", output_index=index, item=item)
        return self.events[first:]

    def final(self, *output: dict[str, Any], kind: str = "response.completed", **extra: Any) -> bytes:
        return self.ev(kind, response=response(*output, **extra))


def renumbered(raws: list[bytes], index: int) -> list[bytes]:
    """The same events about one item, now at output `index` (sequence numbers and event names kept)."""
    out = []
    for event in (e for raw in raws for e in SseParser().feed(raw)):
        data = orjson.loads(event.data)
        out.append(format_event(orjson.dumps({**data, "output_index": index}), event.event))
    return out


def final_of(raw: bytes, *output: dict[str, Any], **extra: Any) -> bytes:
    """The final event `raw` with its response's output replaced."""
    [event] = SseParser().feed(raw)
    data = orjson.loads(event.data)
    data["response"] = {**data["response"], "output": list(output), **extra}
    return format_event(orjson.dumps(data), event.event)


def parsed(raw: bytes) -> list[tuple[str | None, Any]]:
    return [(e.event, orjson.loads(e.data)) for e in SseParser().feed(raw)]


S = Stream()
HEAD = S.head()
MSG = S.item(msg("Look."), 0)
A = S.item(fc("a", '{"q":1}'), 1)
C = S.item(custom("c"), 2)
B = S.item(fc("b"), 3)
END = S.final(msg("Look."), fc("a", '{"q":1}'), custom("c"), fc("b"))
FULL = [*HEAD, *MSG, *A, *C, *B, END]

CASES = [
    ({"x"}, FULL, ["a", "c", "b"]),  # nothing to drop: the same bytes
    ({"a"}, [*HEAD, *MSG, *renumbered(C, 1), *renumbered(B, 2),
             final_of(END, msg("Look."), custom("c"), fc("b"))], ["c", "b"]),
    ({"c"}, [*HEAD, *MSG, *A, *renumbered(B, 2), final_of(END, msg("Look."), fc("a", '{"q":1}'), fc("b"))],
     ["a", "b"]),
    ({"b"}, [*HEAD, *MSG, *A, *C, final_of(END, msg("Look."), fc("a", '{"q":1}'), custom("c"))], ["a", "c"]),
    ({"a", "b"}, [*HEAD, *MSG, *renumbered(C, 1), final_of(END, msg("Look."), custom("c"))], ["c"]),
    ({"a", "b", "c"}, [*HEAD, *MSG, final_of(END, msg("Look."))], []),
]


@pytest.mark.parametrize(("names", "expected", "calls"), CASES)
def test_drop_in_stream(names: set[str], expected: list[bytes], calls: list[str]) -> None:
    out = drop_in_stream(b"".join(FULL), frozenset(names))
    assert parsed(out) == parsed(b"".join(expected))
    assert out == b"".join(expected)  # events about other items are relayed byte-identical
    assert drop_stream_calls("openai_responses", b"".join(FULL), frozenset(names)) == out


@pytest.mark.parametrize(("names", "expected", "calls"), CASES)
def test_dropped_stream_is_still_a_stream_the_sdk_reads(names: set[str], expected: list[bytes],
                                                         calls: list[str]) -> None:
    out = drop_in_stream(b"".join(FULL), frozenset(names))
    events = parsed(out)
    for name, data in events:
        assert EVENT.validate_python(data).type == name
    indices = [data["output_index"] for _, data in events if data["type"] == "response.output_item.added"]
    assert indices == list(range(len(indices)))  # contiguous from 0
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, content=out, headers={"content-type": "text/event-stream"}))
    with OpenAI(api_key="k", base_url="http://tollgate.test/v1", max_retries=0,
                http_client=httpx2.Client(transport=transport)) as client, \
            client.responses.stream(model="gpt-4o-mini", input="hi") as stream:
        final = stream.until_done().get_final_response()
    assert final.output_text == "Look."
    assert [getattr(i, "name", None) for i in final.output] == [None, *calls]


@pytest.mark.parametrize(("names", "expected", "calls"), CASES)
def test_drop_in_held_events_only(names: set[str], expected: list[bytes], calls: list[str]) -> None:
    """The relay holds events from the first call item on; only those are edited."""
    held = FULL[len(HEAD) + len(MSG):]
    shown = len(HEAD) + len(MSG)
    assert drop_in_stream(b"".join(held), frozenset(names)) == b"".join(expected[shown:])


def test_drop_in_stream_with_text_between_calls() -> None:
    s = Stream()
    head, a, said, b = s.head(), s.item(fc("a"), 0), s.item(msg("Then."), 1), s.item(fc("b"), 2)
    end = s.final(fc("a"), msg("Then."), fc("b"))
    out = drop_in_stream(b"".join([*head, *a, *said, *b, end]), frozenset({"a"}))
    final = final_of(end, msg("Then."), fc("b"))
    assert out == b"".join([*head, *renumbered(said, 0), *renumbered(b, 1), final])


def test_drop_in_stream_leaves_hosted_tool_items() -> None:
    s = Stream()
    events = [*s.head(), *s.item(WEB, 0), *s.item(fc("a"), 1), *s.item(msg("ok", "msg_2"), 2)]
    end = s.final(WEB, fc("a"), msg("ok", "msg_2"))
    raw = b"".join([*events, end])
    assert drop_in_stream(raw, frozenset({"web_search_preview", "web_search_call"})) == raw
    out = parsed(drop_in_stream(raw, frozenset({"a"})))
    assert [d["item"]["type"] for _, d in out if d["type"] == "response.output_item.added"] == [
        "web_search_call", "message"]
    assert [i["type"] for i in out[-1][1]["response"]["output"]] == ["web_search_call", "message"]


def test_drop_in_stream_filters_an_incomplete_final_response() -> None:
    s = Stream()
    events = [*s.head(), *s.item(msg("cut"), 0), *s.item(fc("a"), 1)]
    end = s.final(msg("cut"), fc("a"), kind="response.incomplete", status="incomplete",
                  incomplete_details={"reason": "max_output_tokens"})
    out = parsed(drop_in_stream(b"".join([*events, end]), frozenset({"a"})))
    name, data = out[-1]
    assert (name, data["type"], data["response"]["status"]) == ("response.incomplete",) * 2 + ("incomplete",)
    assert data["response"]["output"] == [msg("cut")]
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_drop_in_stream_keeps_what_it_cannot_read() -> None:
    odd = [b": ping\n\n", b"event: x\ndata: {oops\n\n", b"data: [1]\n\n", b'data: "text"\n\n']
    raw = b"".join([odd[0], *A[:1], odd[1], *A[1:], odd[2], *B, odd[3]])
    expected = b"".join([odd[0], odd[1], odd[2], *renumbered(B, 2), odd[3]])
    assert drop_in_stream(raw, frozenset({"a"})) == expected
    assert drop_in_stream(b"".join(odd), frozenset({"a"})) == b"".join(odd)


def test_drop_in_stream_of_nothing() -> None:
    assert drop_in_stream(b"", frozenset({"a"})) == b""


@pytest.mark.parametrize("content", [5, "text", None, {"text": "x"}])
def test_drop_in_body_reads_odd_message_content_as_no_text(content: Any) -> None:
    body = {"output": [{"type": "message", "role": "assistant", "content": content}, fc("a")]}
    assert drop_in_body(body, frozenset({"a"})) is False
