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
    whole = SseParser().feed(STREAM)
    # a CR at a chunk's end ends its event at once (the LF of a CRLF then opens the next event's bytes)
    assert [(e.event, e.data) for e in events] == [(e.event, e.data) for e in whole]
    assert b"".join(e.raw for e in events) == STREAM and parser.tail() == b""


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


MIXED = (
    b"data: lf-then-crlf\n\r\n"
    b"data: crlf-then-lf\r\n\n"
    b"data: lf-then-cr\n\r"
    b"data: cr-then-crlf\r\r\n"
    b'data: {"t": "a\xe2\x80\xa8b"}\n\n'  # U+2028 inside the data is not a line end
)


@pytest.mark.parametrize("size", [1, 2, 5, len(MIXED)])
def test_mixed_line_terminators_end_events_where_clients_see_them_end(size: int) -> None:
    parser = SseParser()
    events = [e for i in range(0, len(MIXED), size) for e in parser.feed(MIXED[i : i + size])]
    assert [e.data for e in events] == ["lf-then-crlf", "crlf-then-lf", "lf-then-cr", "cr-then-crlf",
                                        '{"t": "a\u2028b"}']
    assert b"".join(e.raw for e in events) == MIXED and parser.tail() == b""


def test_an_event_ending_in_a_cr_is_complete_at_once() -> None:
    parser = SseParser()
    assert [e.data for e in parser.feed(b"data: x\r\r")] == ["x"]  # ended, even if a LF may follow
    assert [(e.raw, e.data) for e in parser.feed(b"\ndata: y\r\n\r\n")] == [(b"\ndata: y\r\n\r\n", "y")]
    assert parser.tail() == b""
    cr_only = SseParser()
    assert [e.data for e in cr_only.feed(b"data: a\r\rdata: [DONE]\r\r")] == ["a", "[DONE]"]  # nothing held back


def test_id_and_retry_fields_are_read() -> None:
    events = SseParser().feed(b"id: e1\nretry: 250\ndata: x\n\nid: a\0b\nretry: soon\ndata: y\n\nid\ndata: z\n\n")
    assert [(e.id, e.retry) for e in events] == [("e1", 250), (None, None), ("", None)]
