"""Which request body codings tollgate reads, and their decoder. Pure: no I/O.

tollgate decodes a request's `Content-Encoding` itself (the server runs with `auto_decompress=False`,
see `gateway.server.handler_args`) rather than leave it to aiohttp's parser. Why: aiohttp decodes
what arrives even after the handler answered (its lingering read of an unread body), so a compressed
bomb refused with a 413, or sent with an unknown key, still cost seconds of CPU on the event loop;
and it takes a truncated gzip body as whole. Here decoding stops at the body limit, an unfinished
stream is refused, and a refused body is drained as the bytes it is.

`gzip` (concatenated members too), `deflate` (zlib, or raw deflate as some clients send) and `identity`
are read; `chunked` is the only transfer coding (aiohttp's parser removes it). Anything else is
refused: forwarding such bytes without their coding would hand the upstream a corrupt body, and
judging them would read garbage.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Final

from gateway.errors import UndecodableBody

DECODED: Final = frozenset({"gzip", "deflate", "identity"})
_GZIP_WBITS: Final = 31
_ZLIB_WBITS: Final = 15
_RAW_WBITS: Final = -15


def refuse_unread_codings(headers: Mapping[str, str]) -> None:
    """Raise UndecodableBody (400) for a body coding tollgate does not read: a `Content-Encoding` other
    than one of `DECODED`, a list of codings, or a transfer coding other than `chunked`."""
    content = codings(headers, "content-encoding")
    if len(content) > 1 or any(c not in DECODED for c in content):
        raise UndecodableBody(
            f"Content-Encoding {', '.join(content)!r} is not supported: send one of gzip, deflate or none")
    transfer = codings(headers, "transfer-encoding")
    if transfer and transfer != ["chunked"]:
        raise UndecodableBody(f"Transfer-Encoding {', '.join(transfer)!r} is not supported: only chunked is")


def codings(headers: Mapping[str, str], name: str) -> list[str]:
    """The codings a header lists, lower case, every repeated field included (RFC 9110 lists)."""
    getall = getattr(headers, "getall", None)
    values = getall(name, ()) if getall is not None else [v for k, v in headers.items() if k.lower() == name]
    return [c.strip().lower() for value in values for c in value.split(",") if c.strip()]


def decoder_for(headers: Mapping[str, str]) -> BodyDecoder | None:
    """The decoder of a body's `Content-Encoding` (checked by `refuse_unread_codings`), None for none."""
    content = codings(headers, "content-encoding")
    if not content or content == ["identity"]:
        return None
    return BodyDecoder(content[0])


class BodyDecoder:
    """Decodes one request body, chunk by chunk, never producing much more than the room left.

    `feed(chunk, room)` returns the decoded bytes of `chunk`, at most `room + 1` of them (one more than
    fits tells the caller the limit is passed; what is left of the chunk is not decoded). `finish()`
    raises UndecodableBody when the body ended inside a compressed stream. Not thread-safe."""

    __slots__ = ("_fed", "_gzip", "_head", "_stream")

    def __init__(self, coding: str) -> None:
        self._gzip = coding == "gzip"
        self._stream = zlib.decompressobj(_GZIP_WBITS) if self._gzip else None
        self._head = b""  # deflate: its first two bytes tell zlib from raw deflate
        self._fed = False

    def feed(self, chunk: bytes, room: int) -> bytes:
        data = chunk
        self._fed = self._fed or bool(chunk)
        if self._stream is None:
            data = self._head + chunk
            if len(data) < 2:
                self._head = data
                return b""
            self._stream = zlib.decompressobj(_ZLIB_WBITS if _zlib_header(data) else _RAW_WBITS)
            self._head = b""
        out: list[bytes] = []
        try:
            while data and room >= 0:
                piece = self._stream.decompress(data, room + 1)
                out.append(piece)
                room -= len(piece)
                if not self._stream.eof:
                    data = self._stream.unconsumed_tail
                    continue
                data = self._stream.unused_data
                if data and not self._gzip:
                    raise UndecodableBody("request body cannot be decoded: data after the end of its deflate stream")
                if data and not data.strip(b"\0"):
                    break  # zero padding after the last member, which gzip(1) ignores too
                if data:  # another gzip member (RFC 1952 allows several, each its own stream)
                    self._stream = zlib.decompressobj(_GZIP_WBITS)
        except zlib.error as exc:
            raise UndecodableBody(f"request body cannot be decoded: it is not valid "
                                  f"{'gzip' if self._gzip else 'deflate'} ({exc})") from None
        return b"".join(out)

    def finish(self) -> None:
        if not self._fed:
            return  # an empty body holds no stream to finish
        if self._stream is None or not self._stream.eof:
            raise UndecodableBody(f"request body cannot be decoded: its {'gzip' if self._gzip else 'deflate'} "
                                  "stream ends before its end (a truncated body)")


def _zlib_header(data: bytes) -> bool:
    """Whether `data` starts with a zlib header (RFC 1950: method 8, check bits), not raw deflate."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
