"""Incremental Server-Sent Events framing (pure). Keeps each event's original bytes for relaying."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.frozen_init import fast_init

# An event ends at an empty line: two line terminators in a row, each CRLF, LF or CR, mixed as they
# come (the SSE spec; SDK clients accept every mix, so a filter must cut events where they do)
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")


@fast_init
@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the event's bytes including its terminating blank line
    event: str | None
    data: str
    id: str | None = None  # its `id` field (the last one), when it has one
    retry: int | None = None  # its `retry` field (reconnection delay, ms), when valid


def _parse(raw: bytes) -> SseEvent:
    event: str | None = None
    event_id: str | None = None
    retry: int | None = None
    data: list[str] = []
    text = raw.decode("utf-8", "replace")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    # split on the terminators only: str.splitlines would also split inside data at U+2028 and the like
    for line in text.split("\n"):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:  # the SSE spec ignores an id holding NUL
            event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            retry = int(value)
    return SseEvent(raw, event, "\n".join(data), event_id, retry)


class SseParser:
    """Feed bytes as they arrive; get back every event completed so far (its original bytes kept)."""

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[SseEvent]:
        # the kept bytes hold no event end, so the search restarts just before where they stop (a
        # chunk of many events, or one event in many chunks, is framed in linear time)
        start = max(len(self._buf) - 3, 0)
        buf = self._buf + chunk if self._buf else chunk
        events: list[SseEvent] = []
        begin = 0
        if b"\r" not in buf:  # the usual framing: one search per event
            while (cut := buf.find(b"\n\n", start)) != -1:
                start = cut + 2
                events.append(_parse(buf[begin:start]))
                begin = start
        else:
            while (found := _EVENT_END.search(buf, start)) is not None:
                # a CR ending the buffer may be the first half of a CRLF still to come: the event has
                # ended either way (an empty line); that LF then starts the next event's bytes, where
                # an empty line is nothing (at worst an event without data, which readers pass on)
                end = found.end()
                events.append(_parse(buf[begin:end]))
                begin = start = end
        self._buf = buf[begin:]
        if len(self._buf) > self._max:
            raise ValueError("stream event exceeds the size limit")
        return events

    def tail(self) -> bytes:
        """Bytes of an unterminated last event (a truncated stream)."""
        return self._buf


def format_event(data: bytes, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"
