"""Incremental Server-Sent Events framing (pure). Keeps each event's original bytes for relaying."""

from __future__ import annotations

from dataclasses import dataclass

_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the event's bytes including its terminating blank line
    event: str | None
    data: str


def _parse(raw: bytes) -> SseEvent:
    event: str | None = None
    data: list[str] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    return SseEvent(raw, event, "\n".join(data))


class SseParser:
    """Feed bytes as they arrive; get back every event completed so far."""

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[SseEvent] = []
        start = 0
        # next position of each separator at or after `start` (-1: none left). Searched again only once
        # passed, so a chunk of many events is scanned in linear time, not once per event
        found = [buf.find(sep) for sep in _SEPARATORS]
        while True:
            cut, sep_len = -1, 0
            for k, sep in enumerate(_SEPARATORS):
                i = found[k]
                if 0 <= i < start:
                    i = found[k] = buf.find(sep, start)
                if i != -1 and (cut == -1 or i < cut):
                    cut, sep_len = i, len(sep)
            if cut == -1:
                break
            end = cut + sep_len
            events.append(_parse(buf[start:end]))
            start = end
        self._buf = buf[start:]
        if len(self._buf) > self._max:
            raise ValueError("stream event exceeds the size limit")
        return events

    def tail(self) -> bytes:
        """Bytes of an unterminated last event (a truncated stream)."""
        return self._buf


def format_event(data: bytes, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"
