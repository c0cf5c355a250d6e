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
from gateway.http1_wire import Decoder

DECODED: Final = frozenset({"gzip", "deflate", "identity"})


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
    """Decodes one request body, chunk by chunk, never producing much more than the room left: the
    response decoder (`http1_wire.Decoder`), its failures in the caller's terms.

    `feed(chunk, room)` returns the decoded bytes of `chunk`, at most `room + 1` of them (one more than
    fits tells the caller the limit is passed; what is left of the chunk is not decoded). `finish()`
    returns what is left and raises UndecodableBody when the body ended inside a compressed stream."""

    __slots__ = ("_coding", "_decoder")

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._decoder = Decoder(coding, strict=True)

    def feed(self, chunk: bytes, room: int) -> bytes:
        try:
            return self._decoder.decode(chunk, room + 1)
        except zlib.error as exc:
            raise UndecodableBody(f"request body cannot be decoded: it is not valid {self._coding} ({exc})") from None

    def finish(self) -> bytes:
        try:
            return self._decoder.finish()
        except zlib.error:
            raise UndecodableBody(f"request body cannot be decoded: its {self._coding} stream ends before its end "
                                  "(a truncated body)") from None
