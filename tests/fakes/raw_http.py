"""Reading HTTP/1.1 requests off a raw asyncio stream, for loopback upstreams that script their answers
byte by byte (resets, truncations, odd framing) where an aiohttp app would not let them."""

from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request, head and `Content-Length` body, as it came. Raises IncompleteReadError when the
    connection ends before a whole request (at its start: the client closed an idle connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)
