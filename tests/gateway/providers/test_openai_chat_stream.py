"""gateway/providers/openai_chat.py, streaming half: OpenAIStreamReader accumulates chunks, hides usage."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from gateway.call import Answer, ToolCall, Usage
from gateway.providers.openai_chat import OpenAIChat
from gateway.providers.sse import SseEvent, SseParser, format_event

ADAPTER = OpenAIChat()
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def sse(data: Any) -> SseEvent:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    [event] = SseParser().feed(format_event(payload))
    return event


def chunk(choices: list[dict[str, Any]] | None, **extra: Any) -> dict[str, Any]:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o"}
    return {**base, "choices": choices, **extra}


def delta(index: int = 0, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "finish_reason": finish}


def tc(index: int, cid: str | None = None, name: str | None = None, args: str | None = "") -> dict[str, Any]:
    fn = {"arguments": args, **({"name": name} if name else {})}
    return {"index": index, **({"id": cid, "type": "function"} if cid else {}), "function": fn}


TEXT = [
    chunk([delta(role="assistant", content="")]), chunk([delta(content="Hel")]), chunk([delta(content="lo")]),
    chunk([delta(finish="stop")]), chunk([], usage=USAGE), "[DONE]",
]
TOOLS = [
    chunk([delta(role="assistant", content=None, tool_calls=[tc(0, "call_a", "get", '{"q"')])]),
    chunk([delta(tool_calls=[tc(0, args=":1}"), tc(1, "call_b", "f", "{}")])]),
    chunk([delta(finish="tool_calls")]), "[DONE]",
]
SPLIT_NAME = [  # a name in pieces; an id repeated later; arguments null
    chunk([delta(tool_calls=[tc(0, "call_x", "look", None)])]),
    chunk([delta(tool_calls=[tc(0, "call_y", "_up", '{"a":')])]),
    chunk([delta(tool_calls=[tc(0, args="2}")])]), chunk([delta(finish="tool_calls")], usage=USAGE),
]
TWO = [  # n=2: the text of choice 0, the others' apart; every choice's characters count
    chunk([delta(0, content="ab"), delta(1, content="xyz")]),
    chunk([delta(1, "length"), delta(0, "stop")], usage=USAGE),
]
NULL_CHOICES = [chunk([delta(content="ok", finish="stop")]), chunk(None, usage=USAGE), "[DONE]"]
TEXT_ANSWER = Answer("c1", "gpt-4o", "Hello", (), ("stop",), Usage(10, 5))
CUT_TOOLS = Answer("c1", "gpt-4o", "", (ToolCall("call_a", "get", '{"q"'),))
SPLIT_ANSWER = Answer(
    "c1", "gpt-4o", "", (ToolCall("call_x", "look_up", '{"a":2}'),), ("tool_calls",), Usage(10, 5)
)
TWO_ANSWER = Answer("c1", "gpt-4o", "ab", (), ("stop", "length"), Usage(10, 5), other_texts=("xyz",),
                    choice_calls=((), ()))
NULL_ANSWER = Answer("c1", "gpt-4o", "ok", (), ("stop",), Usage(10, 5))
TOOLS_ANSWER = Answer(
    "c1", "gpt-4o", "", (ToolCall("call_a", "get", '{"q":1}'), ToolCall("call_b", "f", "{}")), ("tool_calls",)
)


@pytest.mark.parametrize(
    ("events", "hide", "relayed", "answer", "chars", "holding", "complete"),
    [
        (TEXT, True, [1, 1, 1, 1, 0, 1], TEXT_ANSWER, 5, False, True),  # usage tollgate asked for: hidden
        (TEXT, False, [1, 1, 1, 1, 1, 1], TEXT_ANSWER, 5, False, True),
        (TEXT[:3], True, [1, 1, 1], Answer("c1", "gpt-4o", "Hello"), 5, False, False),  # cut short
        (TOOLS, True, [1, 1, 1, 1], TOOLS_ANSWER, 9, True, True),
        (TOOLS[:1], True, [1], CUT_TOOLS, 4, True, False),
        (SPLIT_NAME, True, [1, 1, 1, 1], SPLIT_ANSWER, 7, True, True),  # usage beside choices: relayed
        (TWO, True, [1, 1], TWO_ANSWER, 5, False, True),
        (NULL_CHOICES, True, [1, 0, 1], NULL_ANSWER, 2, False, True),
    ],
)
def test_stream_reader(
    events: list[Any], hide: bool, relayed: list[int], answer: Answer, chars: int, holding: bool,
    complete: bool,
) -> None:
    reader = ADAPTER.stream_reader(hide_usage=hide, choices=2 if events is TWO else 1)  # TWO answers n=2
    steps = [reader.feed(sse(e)) for e in events]
    assert [s.out for s in steps] == [sse(e).raw if r else b"" for e, r in zip(events, relayed, strict=True)]
    assert [s.done for s in steps] == [e == "[DONE]" for e in events]
    assert reader.answer() == answer
    assert (reader.output_chars, reader.holding, reader.complete) == (chars, holding, complete)


@pytest.mark.parametrize("events", [TEXT, TOOLS, SPLIT_NAME, TWO])
def test_fixtures_are_real_chunks(events: list[Any]) -> None:
    for event in events:
        if event != "[DONE]":
            ChatCompletionChunk.model_validate(event)


@pytest.mark.parametrize(("events", "text"), [(TEXT, "Hello"), (TOOLS, None)])
def test_relayed_bytes_still_assemble_in_the_sdk(events: list[Any], text: str | None) -> None:
    reader = ADAPTER.stream_reader(hide_usage=True)
    relayed = b"".join(reader.feed(sse(e)).out for e in events)
    state = ChatCompletionStreamState()
    for event in SseParser().feed(relayed):
        if event.data != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(event.data))
    final = state.get_final_completion()
    assert final.usage is None  # hidden from an agent that did not ask for it
    message = final.choices[0].message
    assert message.content == text
    calls = [c for c in message.tool_calls or [] if c.type == "function"]
    got = [(c.id, c.function.name, c.function.arguments) for c in calls]
    assert got == [(c.id, c.name, c.arguments) for c in reader.answer().tool_calls]


def test_delta_is_the_first_choice_text_of_the_last_event() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False, choices=2)
    deltas = [(reader.feed(sse(e)), reader.delta)[1] for e in [*TWO, *TEXT]]
    assert deltas == ["ab", "", "", "Hel", "lo", "", "", ""]


def test_first_id_and_model_are_kept() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    events = [{"id": "", "model": None}, {"id": "c1", "model": "m1"}, {"id": "c2", "model": "m2"}]
    for event in events:
        reader.feed(sse(event))
    assert (reader.answer().response_id, reader.answer().model) == ("c1", "m1")


@pytest.mark.parametrize(
    ("data", "message"),
    [("{nope", "not valid JSON"), ("[1]", "not a JSON object"), ('"text"', "not a JSON object")],
)
def test_malformed_events_are_refused(data: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ADAPTER.stream_reader(hide_usage=False).feed(sse(data))


@pytest.mark.parametrize("raw", [b": keep-alive\n\n", b"event: ping\n\n", b"data:\n\n"])
def test_events_without_data_are_relayed(raw: bytes) -> None:
    [event] = SseParser().feed(raw)
    reader = ADAPTER.stream_reader(hide_usage=True)
    step = reader.feed(event)
    assert (step.out, step.done, reader.complete) == (raw, False, False)
    assert reader.answer() == Answer()


def test_a_streamed_custom_tool_call_is_read_by_its_name_and_input() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    first = {"index": 0, "id": "c1", "type": "custom", "custom": {"name": "code_", "input": "print("}}
    reader.feed(sse(chunk([{"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None}])))
    rest = {"index": 0, "custom": {"name": "exec", "input": "1)"}}
    reader.feed(sse(chunk([{"index": 0, "delta": {"tool_calls": [rest]}, "finish_reason": "tool_calls"}])))
    [call] = reader.answer().tool_calls
    assert (call.id, call.name, call.arguments) == ("c1", "code_exec", "print(1)")


def test_a_choice_that_refused_after_openai_s_empty_first_content_has_no_text_to_judge() -> None:
    """OpenAI starts every choice with `"content": ""`: a choice that then refused was judged as the
    text "" (a spurious re-ask), while the same answer not streamed skips it."""
    reader = ADAPTER.stream_reader(hide_usage=False, choices=2)
    for data in (chunk([delta(0, role="assistant", content=""), delta(1, role="assistant", content="")]),
                 chunk([delta(0, content="abc"), delta(1, refusal="I can't help with that.")]),
                 chunk([delta(0, "stop"), delta(1, "stop")])):
        reader.feed(sse(data))
    answer = reader.answer()
    assert (answer.text, answer.other_texts, answer.choice_calls) == ("abc", (), ())
    assert answer.refusals == ("", "I can't help with that.")  # which choice refused: in line with the reasons


def test_refusals_are_per_choice_in_choice_order() -> None:
    """`refusals` names every choice's refusal instead of an answer (`finish_reasons` are per choice too);
    a refusal next to content is an answer, and an answer without any refusal has none."""
    reader = ADAPTER.stream_reader(hide_usage=False, choices=3)
    for data in (chunk([delta(0, refusal="no"), delta(1, content="b"), delta(1, refusal="."),
                        delta(2, refusal="n"), delta(2, refusal="ope")]),
                 chunk([delta(2, "stop"), delta(0, "stop"), delta(1, "length")])):
        reader.feed(sse(data))
    answer = reader.answer()
    assert (answer.refused, answer.refusals, answer.finish_reasons) == (True, ("no", "", "nope"), ("stop", "length", "stop"))
    assert (answer.other_texts, answer.choice_calls) == (("b",), ((), ()))
    assert ADAPTER.stream_reader(hide_usage=False, choices=2).answer().refusals == ()


def test_a_choice_cut_before_its_finish_reason_keeps_the_others_in_their_places() -> None:
    """n=3, the stream cut while choice 0 still generated: its finish reason is "error" (as OpenTelemetry's
    OpenAI instrumentation reports one), so choice 1 and 2 keep their own, and `finish_reasons[:1]` is
    choice 0's (no refusal read from another choice). A stream cut before any choice finished has none."""
    reader = ADAPTER.stream_reader(hide_usage=False, choices=3)
    for data in (chunk([delta(0, content="a"), delta(1, refusal="no"), delta(2, content="c")]),
                 chunk([delta(1, "refusal"), delta(2, "length")])):
        reader.feed(sse(data))
    answer = reader.answer()
    assert answer.finish_reasons == ("error", "refusal", "length")
    cut = ADAPTER.stream_reader(hide_usage=False, choices=2)
    cut.feed(sse(chunk([delta(0, content="a"), delta(1, content="b")])))
    assert cut.answer().finish_reasons == ()


def test_text_done_is_the_first_finish_reason() -> None:
    """The SDK's `chat.completions.stream` parses `response_format` at a choice's finish reason."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    reader.feed(sse(TEXT[0]))
    reader.feed(sse(TEXT[1]))
    assert not reader.text_done
    reader.feed(sse(TEXT[3]))
    assert reader.text_done
