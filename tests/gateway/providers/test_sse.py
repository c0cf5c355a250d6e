"""Server-Sent Events framing: events split anywhere, every separator, original bytes kept, bounded."""

from __future__ import annotations

import time

import pytest

from gateway.providers.sse import SseParser

STREAM = (
    b'data: {"a":1}\n\n'
    b"event: message_start\r\ndata: one\r\ndata: two\r\n\r\n"
    b": a comment\ndata:no-space\n\n"
    b"data: cr\r\r"
    b"data: [DONE]\n\n"
)


def test_events_with_every_separator() -> None:
    events = SseParser().feed(STREAM)
    assert [(e.event, e.data) for e in events] == [
        (None, '{"a":1}'), ("message_start", "one\ntwo"), (None, "no-space"), (None, "cr"), (None, "[DONE]"),
    ]
    assert b"".join(e.raw for e in events) == STREAM


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_split_anywhere_gives_the_same_events(size: int) -> None:
    parser = SseParser()
    events = [e for i in range(0, len(STREAM), size) for e in parser.feed(STREAM[i : i + size])]
    assert [e.raw for e in events] == [e.raw for e in SseParser().feed(STREAM)]
    assert parser.tail() == b""


def test_a_partial_event_waits_for_its_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: half") == []
    assert parser.tail() == b"data: half"
    assert [e.data for e in parser.feed(b"\n\n")] == ["half"]


def test_oversized_event_is_refused() -> None:
    with pytest.raises(ValueError, match="size limit"):
        SseParser(max_event_bytes=10).feed(b"data: " + b"x" * 20)


def test_a_large_chunk_is_framed_in_linear_time() -> None:
    # the upstream client hands over everything buffered at once (up to its high-water mark and more);
    # searching each separator from every event's start made this quadratic (minutes, not ms)
    chunk = b"".join(b'data: {"i": %d}\n\n' % i for i in range(200_000))
    started = time.perf_counter()
    events = SseParser().feed(chunk)
    assert len(events) == 200_000
    assert time.perf_counter() - started < 10  # ~0.6 s here; quadratic took minutes
