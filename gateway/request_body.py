"""Reading a request body: bounded in size after decoding, and in the time between its bytes.

The one place the proxy's handlers read a body (`read_body`). It decodes the `Content-Encoding`
itself (`gateway.body_codings`), so a compressed body stops being decoded at the limit.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.body_codings import decoder_for, refuse_unread_codings
from gateway.config import Limits
from gateway.errors import RequestTimeout, RequestTooLarge, UndecodableBody


async def read_body(request: web.Request, limits: Limits) -> bytes:
    """Read the body, refusing more than `max_body_bytes` without buffering past the limit.

    The limit applies to the decoded body (after any `Content-Encoding`), decoded chunk by chunk: a
    compression bomb stops at the limit. A body that cannot be decoded (bad chunked framing, a
    `Content-Encoding` it does not have, a truncated gzip stream) is a 400 in the caller's format; a
    body that stops arriving for `body_idle_s` is a 408 `request_timeout`. After either, the connection
    closes once answered. Past the limit (413), what is left is drained undecoded."""
    refuse_unread_codings(request.headers)
    limit = limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    decoder = decoder_for(request.headers)
    parts: list[bytes] = []
    size = 0
    content = request.content
    while True:
        try:
            if content.is_eof():  # all of it is buffered (the common case): reading cannot wait
                chunk = await content.readany()
            else:
                async with asyncio.timeout(limits.body_idle_s):
                    chunk = await content.readany()
        except TimeoutError:
            content.feed_eof()  # read no more: aiohttp would otherwise linger on it after the answer
            raise RequestTimeout(f"no byte of the request body for {limits.body_idle_s:g} s") from None
        except web.RequestPayloadError as exc:
            content.feed_eof()  # aiohttp would read the broken body again after the answer, and log it
            cause = exc.__cause__ or exc
            detail = getattr(cause, "message", None) or type(cause).__name__
            raise UndecodableBody(f"request body cannot be decoded: {detail}") from None
        if not chunk:
            break
        if decoder is not None:
            try:
                chunk = decoder.feed(chunk, limit - size)
            except UndecodableBody:
                content.feed_eof()
                raise
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    if decoder is not None and (tail := decoder.finish()):
        if size + len(tail) > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(tail)
    return b"".join(parts)
