"""gateway/providers/openai_functions.py, and the legacy calls in the OpenAI adapter and tool wire."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.call import ToolCall, ToolSpec
from gateway.config import Limits
from gateway.errors import InvalidRequest, RequestTooLarge
from gateway.providers.openai_chat import OpenAIChat
from gateway.providers.openai_functions import forced_function, functions, proposed
from gateway.providers.sse import SseParser, format_event
from gateway.providers.tool_wire import drop_calls, drop_stream_calls, filter_request_tools

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ()),
        ([], ()),
        ([{"name": "f"}], (ToolSpec("f"),)),
        (
            [{"name": "f", "description": "d", "parameters": {"type": "object"}}],
            (ToolSpec("f", "d", {"type": "object"}),),
        ),
        ([{"name": "f", "parameters": "x"}], (ToolSpec("f"),)),
    ],
)
def test_functions(value: Any, expected: tuple[ToolSpec, ...]) -> None:
    assert functions(value) == expected


@pytest.mark.parametrize("value", [{"name": "f"}, "f", [{"description": "no name"}], [{"name": 3}], ["f"]])
def test_malformed_functions_are_invalid(value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        functions(value)
    assert info.value.param == "functions"


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), ("auto", None), ("none", None), ({"name": "f"}, "f")]
)
def test_forced_function(value: Any, expected: str | None) -> None:
    assert forced_function(value) == expected


@pytest.mark.parametrize("value", ["required", {"function": "f"}, {"name": 1}, 3])
def test_malformed_function_call_is_invalid(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        forced_function(value)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"function_call": {"name": "f", "arguments": "{}"}}, ("f", "{}")),
        ({"function_call": {"name": "f"}}, ("f", "")),
        ({"function_call": {"arguments": '{"a"'}}, ("", '{"a"')),  # a later stream piece
        ({"content": "x"}, None),
        ({"function_call": None}, None),
    ],
)
def test_proposed(message: dict[str, Any], expected: tuple[str, str] | None) -> None:
    assert proposed(message) == expected


def parse(**extra: Any) -> Any:
    body = {"model": "m", "messages": MSG, **extra}
    return OpenAIChat().parse_request(body, orjson.dumps(body), Limits(max_tools=2))


def test_the_adapter_offers_functions_as_tools_and_forces_by_function_call() -> None:
    call = parse(
        tools=[{"type": "function", "function": {"name": "t"}}],
        functions=[{"name": "f"}],
        function_call={"name": "f"},
    )
    assert [t.name for t in call.tools] == ["t", "f"]
    assert call.tool_choice == "f"
    with pytest.raises(RequestTooLarge):
        parse(
            tools=[{"type": "function", "function": {"name": "t"}}], functions=[{"name": "f"}, {"name": "g"}]
        )


def test_the_adapter_reads_a_legacy_call_in_an_answer_and_a_stream() -> None:
    message = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a":1}'}}
    answer = OpenAIChat().parse_answer(
        {"choices": [{"index": 0, "message": message, "finish_reason": "function_call"}]}
    )
    assert answer.tool_calls == (ToolCall("", "f", '{"a":1}'),)
    reader = OpenAIChat().stream_reader(hide_usage=False)
    events = [
        {"choices": [{"index": 0, "delta": {"function_call": {"name": "f", "arguments": ""}}}]},
        {"choices": [{"index": 0, "delta": {"function_call": {"arguments": "{}"}}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "function_call"}]},
    ]
    for event in SseParser().feed(b"".join(format_event(orjson.dumps(e)) for e in events)):
        reader.feed(event)
    assert reader.holding
    assert reader.answer().tool_calls == (ToolCall("", "f", "{}"),)


@pytest.mark.parametrize(
    ("offered", "kept"),
    [
        ([{"name": "ok"}, {"name": "no"}], [{"name": "ok"}]),
        ([{"name": "no"}], None),
        ([{"name": "ok"}], [{"name": "ok"}]),
    ],
)
def test_filter_request_tools_filters_functions(
    offered: list[dict[str, str]], kept: list[dict[str, str]] | None
) -> None:
    body: dict[str, Any] = {"functions": offered, "function_call": "auto"}
    changed = filter_request_tools("openai", body, lambda name: name == "ok")
    assert changed is (kept != offered)
    assert body.get("functions") == kept
    assert ("function_call" in body) is (kept is not None)


def test_drop_calls_removes_a_refused_legacy_call() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "function_call",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "no", "arguments": "{}"},
                },
            }
        ]
    }
    assert drop_calls("openai", body, frozenset({"no"})) is False  # nothing left: the step re-asks
    assert body["choices"][0] == {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": None},
    }
    kept = {"choices": [{"index": 0, "message": {"function_call": {"name": "ok", "arguments": "{}"}}}]}
    assert drop_calls("openai", kept, frozenset({"no"})) is True


def test_drop_stream_calls_removes_a_refused_legacy_call_by_its_whole_name() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return format_event(
            orjson.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        )

    raw = (
        chunk({"role": "assistant"})
        + chunk({"function_call": {"name": "de", "arguments": ""}})
        + chunk({"function_call": {"name": "lete", "arguments": "{}"}})
        + chunk({}, "function_call")
    )
    assert drop_stream_calls("openai", raw, frozenset({"delete"})) == chunk({"role": "assistant"}) + chunk(
        {}, "stop"
    )
    assert drop_stream_calls("openai", raw, frozenset({"de"})) == raw


def test_tool_choice_and_function_call_cannot_force_different_tools() -> None:
    forced = {"type": "function", "function": {"name": "t"}}
    assert parse(tool_choice=forced, function_call={"name": "t"}).tool_choice == "t"
    assert parse(tool_choice="auto", function_call={"name": "f"}).tool_choice == "f"
    with pytest.raises(InvalidRequest) as info:
        parse(tool_choice=forced, function_call={"name": "f"})
    assert info.value.param == "function_call"
