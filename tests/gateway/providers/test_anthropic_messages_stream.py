"""gateway/providers/anthropic_messages.py, streaming half: the reader and the stop events it ends with."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.call import Answer, Call, ToolCall, Usage
from gateway.providers import anthropic_messages
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.sse import SseEvent, SseParser, format_event

ADAPTER = AnthropicMessages()
CALL = Call("anthropic", "chat", "claude-sonnet-4-5")
EVENT = TypeAdapter[RawMessageStreamEvent](RawMessageStreamEvent)
SAID = "tollgate stopped this run (loop_detected): same call"
END = ["content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def ev(data: dict[str, Any]) -> SseEvent:
    [event] = SseParser().feed(format_event(orjson.dumps(data), str(data["type"])))
    return event


def start(usage: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x"}
    message.update(content=[], stop_reason=None, stop_sequence=None, usage=usage)
    return {"type": "message_start", "message": message}


def block(index: int, kind: str = "text", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": kind, **({"text": ""} if kind == "text" else {"input": {}}), **fields}
    return {"type": "content_block_start", "index": index, "content_block": body}


def delta(index: int, value: str, kind: str = "text_delta") -> dict[str, Any]:
    key = "text" if kind == "text_delta" else "partial_json"
    return {"type": "content_block_delta", "index": index, "delta": {"type": kind, key: value}}


def stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def ending(reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
            **({"usage": usage} if usage is not None else {})}


FIRST = start({"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 2})
TEXT = [FIRST, block(0), delta(0, "Hel"), delta(0, "lo"), stop(0), {"type": "ping"},
        ending("end_turn", {"output_tokens": 7}), {"type": "message_stop"}]
LOOK = Answer("msg_1", "claude-x", "Look.", (ToolCall("toolu_1", "get", "{}"),))
TOOL = [FIRST, block(0), delta(0, "Look."), stop(0), block(1, "tool_use", id="toolu_1", name="get"),
        delta(1, '{"q":', "input_json_delta"), delta(1, "1}", "input_json_delta"), stop(1),
        block(2, "tool_use", id="toolu_2", name="f"), stop(2), ending("tool_use", {"output_tokens": 9}),
        {"type": "message_stop"}]
USAGE = Usage(input_tokens=12, output_tokens=7, cache_read_tokens=2)
CALLS = (ToolCall("toolu_1", "get", '{"q":1}'), ToolCall("toolu_2", "f", "{}"))


@pytest.mark.parametrize(
    ("events", "answer", "chars", "next_index", "holding", "complete"),
    [
        (TEXT, Answer("msg_1", "claude-x", "Hello", (), ("end_turn",), USAGE), 5, 1, False, True),
        # next_index counts the blocks relayed: from the first tool_use block on, events are held
        (TOOL, Answer("msg_1", "claude-x", "Look.", CALLS, ("tool_use",), Usage(12, 9, 2)), 12, 1, True,
         True),
        (TOOL[:5], LOOK, 5, 1, True, False),  # a tool_use block without input deltas: arguments {}
        (TEXT[:5], Answer("msg_1", "claude-x", "Hello"), 5, 1, False, False),  # no stop reason: no usage
        # message_start's output count is a placeholder: without message_delta's there is no usage
        # (the step settles at its reservation, never at 1 output token)
        ([FIRST, ending("end_turn", None)],
         Answer("msg_1", "claude-x", "", (), ("end_turn",)), 0, 0, False, False),
        ([FIRST, ending("end_turn", {"output_tokens": 7.0})],  # JSON may write a count as 7.0
         Answer("msg_1", "claude-x", "", (), ("end_turn",), Usage(12, 7, 2)), 0, 0, False, False),
        ([start({"input_tokens": 3}), ending("max_tokens", None), {"type": "message_stop"}],
         Answer("msg_1", "claude-x", "", (), ("max_tokens",)), 0, 0, False, True),  # never an output count
    ],
)
def test_stream_reader(
    events: list[dict[str, Any]], answer: Answer, chars: int, next_index: int, holding: bool, complete: bool
) -> None:
    reader = ADAPTER.stream_reader(hide_usage=True)  # Anthropic usage is always the agent's to see
    steps = [reader.feed(ev(e)) for e in events]
    assert [s.out for s in steps] == [ev(e).raw for e in events]
    assert [s.done for s in steps] == [e["type"] == "message_stop" for e in events]
    assert reader.answer() == answer
    assert (reader.output_chars, reader.next_index, reader.holding, reader.complete) == (
        chars, next_index, holding, complete
    )
    assert reader.started is True


@pytest.mark.parametrize("events", [TEXT, TOOL])
def test_fixtures_are_real_events(events: list[dict[str, Any]]) -> None:
    real = [e for e in events if e["type"] != "ping"]  # the SDK skips pings before validating
    assert [EVENT.validate_python(e).type for e in real] == [e["type"] for e in real]


def test_usage_merges_and_ignores_non_integers() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    usage = {"input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 4,
             "cache_creation": {"ephemeral_5m_input_tokens": 4}}
    later = {"output_tokens": 6, "cache_creation_input_tokens": None, "input_tokens": True}
    for event in [start(usage), ending("end_turn", later), ending(None, None)]:  # a reason, once set, stays
        reader.feed(ev(event))
    answer = reader.answer()
    assert (answer.usage, answer.finish_reasons) == (Usage(9, 6, cache_creation_tokens=4), ("end_turn",))


def test_delta_is_the_text_of_the_last_event() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    assert [(reader.feed(ev(e)), reader.delta)[1] for e in TOOL[:7]] == ["", "", "Look.", "", "", "", ""]


@pytest.mark.parametrize(
    "raw",
    [b": keep-alive\n\n", b"event: ping\ndata: [1]\n\n",
     b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n'],
)
def test_other_events_are_relayed_untouched(raw: bytes) -> None:
    [event] = SseParser().feed(raw)
    reader = ADAPTER.stream_reader(hide_usage=False)
    step = reader.feed(event)
    assert (step.out, step.done, reader.started, reader.complete) == (raw, False, False, False)
    # an error event is the provider's: its type is the answer's (the span's `error.type`)
    assert reader.answer() == (Answer(provider_error="overloaded_error") if b"overloaded" in raw else Answer())


def test_malformed_json_is_refused() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        ADAPTER.stream_reader(hide_usage=False).feed(SseParser().feed(b"data: {nope\n\n")[0])


def assemble(raw: bytes) -> Message:
    """The SDK's own stream accumulator (what `client.messages.stream()` builds) over `raw`."""
    snapshot = None
    for event in SseParser().feed(raw):
        parsed = EVENT.validate_json(event.data)
        assert event.event == parsed.type  # every event is named after its type
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs={})
    assert snapshot is not None
    return snapshot


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anthropic_messages, "time", SimpleNamespace(time=lambda: 1_700_000_000.25))


def test_stop_stream_is_a_whole_message(clock: None) -> None:
    raw = ADAPTER.stop_stream(CALL, "loop_detected", "same call")
    assert [e.event for e in SseParser().feed(raw)] == ["message_start", *END]
    message = assemble(raw)
    assert (message.id, message.model, message.stop_reason) == (
        "msg_tollgate_1700000000250", "claude-sonnet-4-5", "end_turn"
    )
    assert [getattr(b, "text", None) for b in message.content] == [SAID]
    reader = ADAPTER.stream_reader(hide_usage=False)
    for event in SseParser().feed(raw):
        reader.feed(event)
    assert reader.complete
    expected = Answer("msg_tollgate_1700000000250", "claude-sonnet-4-5", SAID, (), ("end_turn",), Usage())
    assert reader.answer() == expected


@pytest.mark.parametrize("index", [0, 1, 3])
def test_stop_tail_closes_a_started_message(index: int) -> None:
    raw = ADAPTER.stop_tail("loop_detected", "same call", index=index)
    events = SseParser().feed(raw)
    assert [e.event for e in events] == END
    datas = [orjson.loads(e.data) for e in events]
    assert [d.get("index") for d in datas] == [index, index, index, None, None]
    assert datas[1]["delta"] == {"type": "text_delta", "text": SAID}
    assert datas[3]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


@pytest.mark.parametrize(
    ("relayed", "blocks"),
    [
        ([], [SAID]),  # nothing relayed yet: a whole message
        (TEXT[:1], [SAID]),
        (TEXT[:5], ["Hello", SAID]),
    ],
)
def test_stream_stop_tail_continues_what_was_relayed(
    relayed: list[dict[str, Any]], blocks: list[str]
) -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    sent = b"".join(reader.feed(ev(e)).out for e in relayed)
    tail = ADAPTER.stream_stop_tail(CALL, reader, "loop_detected", "same call")
    assert tail.startswith(b"event: message_start") is (not relayed)
    message = assemble(sent + tail)
    assert [getattr(b, "text", None) for b in message.content] == blocks
    assert message.stop_reason == "end_turn"


def test_stream_stop_tail_after_held_tool_blocks_follows_the_blocks_shown() -> None:
    """As the relay does: from the first tool_use block on, events are held; a stop then drops them,
    so the stop's text block takes the next index the agent has seen, or the SDK's accumulator fails."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    sent = b""
    for event in TOOL[:-2]:  # text block 0 relayed, tool blocks 1 and 2 held
        out = reader.feed(ev(event)).out
        if not reader.holding:
            sent += out
    tail = ADAPTER.stream_stop_tail(CALL, reader, "loop_detected", "same call")
    assert [orjson.loads(e.data).get("index") for e in SseParser().feed(tail)][:3] == [1, 1, 1]
    message = assemble(sent + tail)
    assert [getattr(b, "text", None) for b in message.content] == ["Look.", SAID]


def test_stream_stop_tail_with_a_reader_of_another_shape_sends_a_whole_message(clock: None) -> None:
    tail = ADAPTER.stream_stop_tail(CALL, object(), "loop_detected", "same call")
    assert tail == ADAPTER.stop_stream(CALL, "loop_detected", "same call")


def test_the_stream_counts_blocks_of_tools_anthropic_ran() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    for data in (
        {"type": "message_start", "message": {"id": "m", "model": "x", "usage": {"input_tokens": 1}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
        {"type": "message_stop"},
    ):
        reader.feed(ev(data))
    assert (reader.answer().hosted_calls, reader.holding) == (1, False)


def test_text_done_is_a_text_block_s_stop_and_a_provider_tool_clears_it() -> None:
    """The SDK parses a text block against `output_format` at its stop: from there the relay holds a
    judged stream. A thinking or tool block's stop is not the text's end; a tool Anthropic runs makes
    what came before a preamble (`restart`), whose end is no longer the answer's."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    reader.feed(ev(start({"input_tokens": 1, "output_tokens": 1})))
    reader.feed(ev({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}))
    reader.feed(ev({"type": "content_block_stop", "index": 0}))
    assert not reader.text_done
    reader.feed(ev({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}))
    reader.feed(ev({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "a"}}))
    assert not reader.text_done
    reader.feed(ev({"type": "content_block_stop", "index": 1}))
    assert reader.text_done
    reader.feed(ev({"type": "content_block_start", "index": 2, "content_block": {
        "type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}}))
    assert reader.restart and not reader.text_done
