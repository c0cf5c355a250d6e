"""`tests.fakes.raw_http`: requests read whole off a stream, one after another."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.raw_http import read_request


async def test_requests_are_read_whole_in_turn_and_a_closed_stream_says_so() -> None:
    reader = asyncio.StreamReader()
    first = b"POST /a HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc"
    second = b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
    reader.feed_data(first + second)
    reader.feed_eof()
    assert await read_request(reader) == first
    assert await read_request(reader) == second
    with pytest.raises(asyncio.IncompleteReadError):
        await read_request(reader)
