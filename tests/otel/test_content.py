"""Content capture shapes (semconv v1.41 JSON schemas), from OpenAI and Anthropic bodies."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.call import Answer, ToolCall
from otel import content
from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, openai_completion
from tests.otel.samples import (
    ANTHROPIC_ANSWER,
    MCP_OK,
    OPENAI_ANSWER,
    OPENAI_BODY,
    anthropic_call,
    mcp_call,
    openai_call,
)


def loads(text: str | None) -> Any:
    assert text is not None
    assert ": " not in text and ", " not in text.replace("rainy, 57", "")  # compact separators
    return json.loads(text)


def test_openai_input_messages() -> None:
    assert loads(content.input_messages(openai_call())) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {
            "role": "user",
            "parts": [
                {"type": "text", "content": "Weather in Paris?"},
                {"type": "blob", "modality": "image", "mime_type": "image/png", "content": "iVBORw0K"},
            ],
        },
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_1",
                    "name": "get_weather",
                    "arguments": {"location": "Paris"},
                },
            ],
        },
        {
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": "call_1", "response": "rainy, 57°F"}],
        },
    ]


def test_openai_has_no_separate_system_instructions() -> None:
    assert content.system_instructions(openai_call()) is None


def test_openai_less_common_parts() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "name": "ops", "content": "Rules."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "file-1"}},
                    {"type": "mystery", "x": 1},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": "No."}],
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
                ],
            },
        ],
    }
    assert loads(content.input_messages(openai_call(body))) == [
        {"role": "developer", "name": "ops", "parts": [{"type": "text", "content": "Rules."}]},
        {
            "role": "user",
            "parts": [
                {"type": "uri", "modality": "image", "uri": "https://example.com/cat.png"},
                {"type": "blob", "modality": "audio", "mime_type": "audio/wav", "content": "UklGR"},
                {"type": "file", "modality": "document", "file_id": "file-1"},
                {"type": "mystery", "x": 1},
            ],
        },
        {
            "role": "assistant",
            "parts": [
                {"type": "refusal", "content": "No."},
                {"type": "tool_call", "id": "c", "name": "f", "arguments": "not json"},
            ],
        },
    ]


def test_anthropic_input_messages_and_system_instructions() -> None:
    call = anthropic_call()
    assert loads(content.system_instructions(call)) == [{"type": "text", "content": "You are terse."}]
    assert loads(content.input_messages(call)) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "parts": [
                {"type": "reasoning", "content": "Need the tool."},
                {
                    "type": "tool_call",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "arguments": {"location": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "parts": [
                {"type": "tool_call_response", "id": "toolu_1", "response": "rainy"},
                {"type": "blob", "modality": "image", "mime_type": "image/jpeg", "content": "/9j/4AAQ"},
            ],
        },
    ]


def test_anthropic_string_system_and_server_tools() -> None:
    body = {
        "model": "m",
        "max_tokens": 1,
        "system": "Plain.",
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "server_tool_use",
                        "id": "srv_1",
                        "name": "web_search",
                        "input": {"query": "otel"},
                    },
                    {
                        "type": "web_search_tool_result",
                        "tool_use_id": "srv_1",
                        "content": [{"type": "web_search_result"}],
                    },
                    {"type": "redacted_thinking", "data": "opaque"},
                ],
            },
        ],
    }
    call = anthropic_call(body)
    assert loads(content.system_instructions(call)) == [{"type": "text", "content": "Plain."}]
    assert loads(content.input_messages(call))[0]["parts"] == [
        {
            "type": "server_tool_call",
            "id": "srv_1",
            "name": "web_search",
            "server_tool_call": {"type": "web_search", "query": "otel"},
        },
        {
            "type": "server_tool_call_response",
            "id": "srv_1",
            "server_tool_call_response": {
                "type": "web_search_tool_result",
                "content": [{"type": "web_search_result"}],
            },
        },
        {"type": "reasoning", "content": ""},
    ]


def test_tool_definitions_type_and_name_by_default() -> None:
    assert loads(content.tool_definitions(openai_call())) == [{"type": "function", "name": "get_weather"}]
    assert loads(content.tool_definitions(anthropic_call())) == [
        {"type": "function", "name": "get_weather"},
        {"type": "web_search_20250305", "name": "web_search"},
    ]


def test_tool_definitions_detailed() -> None:
    assert loads(content.tool_definitions(openai_call(), detailed=True)) == [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        }
    ]
    detailed = loads(content.tool_definitions(anthropic_call(), detailed=True))
    assert detailed[0]["parameters"] == {"type": "object", "properties": {"location": {"type": "string"}}}
    assert detailed[1] == {"type": "web_search_20250305", "name": "web_search"}


def test_no_tools_no_definitions() -> None:
    body = {k: v for k, v in OPENAI_BODY.items() if k != "tools"}
    assert content.tool_definitions(openai_call(body)) is None
    assert content.tool_definitions(openai_call({**body, "functions": [{"name": "legacy"}]})) is not None


def test_output_messages() -> None:
    assert loads(content.output_messages(OPENAI_ANSWER)) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "It is rainy."}],
            "finish_reason": "stop",
        },
    ]
    assert loads(content.output_messages(ANTHROPIC_ANSWER)) == [
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "toolu_2",
                    "name": "get_weather",
                    "arguments": {"location": "Lyon"},
                }
            ],
            "finish_reason": "tool_call",
        }
    ]


def test_output_finish_reason_mapping() -> None:
    def finish(reasons: tuple[str, ...], **kw: Any) -> str:
        return str(loads(content.output_messages(Answer(finish_reasons=reasons, **kw)))[0]["finish_reason"])

    assert finish(("end_turn",)) == "stop"
    assert finish(("max_tokens",)) == "length"
    assert finish(("tool_calls",)) == "tool_call"
    assert finish(("refusal",)) == "content_filter"
    assert finish(("pause_turn",)) == "pause_turn"
    assert finish((), tool_calls=(ToolCall("1", "f", "{}"),)) == "tool_call"
    assert finish(()) == "stop"


def test_mcp_content() -> None:
    call = mcp_call()
    assert content.input_messages(call) is None
    assert content.tool_call_arguments(call) == '{"path":"/etc/motd"}'
    assert content.tool_call_arguments(mcp_call(arguments="raw text")) == "raw text"
    assert content.tool_call_arguments(replace(call, tool_call=None)) is None
    assert content.tool_call_result(MCP_OK) == "Welcome!"
    assert content.tool_call_result(Answer()) is None


def test_output_messages_are_one_per_choice() -> None:
    """semconv: one message per choice; with `n: 2` the second choice's text was missing."""
    answer = Answer(text="", tool_calls=(ToolCall("c1", "lookup", '{"q": 1}'),), finish_reasons=("tool_calls", "stop"),
                    other_texts=('{"a":1}',), choice_calls=(("lookup",), ()))
    assert loads(content.output_messages(answer)) == [
        {"role": "assistant", "finish_reason": "tool_call",
         "parts": [{"type": "tool_call", "id": "c1", "name": "lookup", "arguments": {"q": 1}}]},
        {"role": "assistant", "finish_reason": "stop", "parts": [{"type": "text", "content": '{"a":1}'}]},
    ]
    unaccounted = replace(answer, choice_calls=())  # the calls go with the first message
    assert [len(m["parts"]) for m in loads(content.output_messages(unaccounted))] == [1, 1]


def test_a_refusing_choice_has_its_message_in_choice_order() -> None:
    """A choice after the first that refused is in neither `other_texts` nor `choice_calls` (nothing to
    judge); `refusals` puts its message back where the choice was, so message i is finish reason i's."""
    calls = (ToolCall("c1", "f", "{}"), ToolCall("c2", "g", "{}"))
    answer = Answer(text="", tool_calls=calls, finish_reasons=("content_filter", "stop", "tool_calls"),
                    other_texts=("",), choice_calls=(("f",), ("g",)), refused=True, refusals=("no", "nope", ""))
    assert loads(content.output_messages(answer)) == [
        {"role": "assistant", "finish_reason": "content_filter", "parts": [
            {"type": "refusal", "content": "no"}, {"type": "tool_call", "id": "c1", "name": "f", "arguments": {}}]},
        {"role": "assistant", "finish_reason": "stop", "parts": [{"type": "refusal", "content": "nope"}]},
        {"role": "assistant", "finish_reason": "tool_call", "parts": [
            {"type": "tool_call", "id": "c2", "name": "g", "arguments": {}}]},
    ]


# -- `n` choices, one refusing: through a running gateway with content capture on ---------------------

REFUSAL = "I can't help with that."


def refusing_completion() -> dict[str, Any]:
    """`n: 3`: choice 1 refuses (`message.refusal`, no content), choice 2 is cut (`length`)."""
    body = openai_completion("first")
    body["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": "first", "refusal": None}, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": None, "refusal": REFUSAL}, "finish_reason": "stop"},
        {"index": 2, "message": {"role": "assistant", "content": "third", "refusal": None}, "finish_reason": "length"},
    ]
    return body


def refusing_chunks() -> list[bytes]:
    """The same answer streamed (OpenAI starts every choice with `"content": ""`)."""
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": "chatcmpl-n", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
                "choices": choices, **extra}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def delta(index: int, finish: str | None = None, **fields: Any) -> dict[str, Any]:
        return {"index": index, "delta": fields, "finish_reason": finish}

    return [chunk([delta(i, role="assistant", content="") for i in range(3)]),
            chunk([delta(0, content="first"), delta(1, refusal=REFUSAL), delta(2, content="third")]),
            chunk([delta(0, "stop"), delta(1, "stop"), delta(2, "length")]),
            chunk([], usage={"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19}),
            b"data: [DONE]\n\n"]


ALIGNED = [
    {"role": "assistant", "parts": [{"type": "text", "content": "first"}], "finish_reason": "stop"},
    {"role": "assistant", "parts": [{"type": "refusal", "content": REFUSAL}], "finish_reason": "stop"},
    {"role": "assistant", "parts": [{"type": "text", "content": "third"}], "finish_reason": "length"},
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refusing_choice_keeps_finish_reasons_and_output_messages_aligned(
    gateway_factory: GatewayFactory, stream: bool
) -> None:
    """semconv: `gen_ai.response.finish_reasons` has one reason per choice, in choice order, and
    `gen_ai.output.messages` one message per choice with its own `finish_reason`. A choice that refused
    (`refusal` without content) was left out of the messages but not of the reasons: the second message
    was choice 2's, described by choice 1's reason (and the reasons then ignored for every later one)."""
    h = await gateway_factory(otel={"capture_content": True})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, capture_content=True, exporter=exporter)
    h.gateway.services.update(telemetry=telemetry)
    h.fake.queue(Reply(chunks=refusing_chunks()) if stream else Reply(body=refusing_completion()))
    try:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "2+2?"}], "n": 3, "stream": stream}
        async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                                  headers={"x-tollgate-run-id": f"refuse-{stream}"}) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        await h.settled(f"refuse-{stream}")
        assert telemetry.force_flush()
        [span] = [s for s in exporter.get_finished_spans() if s.name == "chat gpt-4o-mini"]
    finally:
        telemetry.shutdown()
    attributes = span.attributes or {}
    assert attributes["gen_ai.response.finish_reasons"] == ("stop", "stop", "length")
    assert loads(str(attributes["gen_ai.output.messages"])) == ALIGNED
