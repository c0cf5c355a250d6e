"""The pure half of the upstream client: URLs, request heads, content decoding."""

from __future__ import annotations

import gzip
import zlib

import pytest

from gateway.errors import InvalidRequest, UpstreamUnavailable
from gateway.http1_wire import decoder_for, request_head, split_url


def test_header_splitting_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="not a valid header"):
        request_head("GET", "/", "h", {"X-A": "1\r\nX-Injected: 2"}, None)
    with pytest.raises(InvalidRequest, match="not a valid header"):
        request_head("GET", "/", "h", {"X-A\n": "1"}, None)
    with pytest.raises(InvalidRequest, match="not a valid header"):
        request_head("GET", "/", "h", {"Transfer-Encoding ": "chunked"}, None)


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        ({"X-A": "tab\tinside"}, None),  # a tab is allowed in a value
        ({"X-A": "caf\u00e9 \u2028 ok"}, None),  # non-ASCII (even non-printable) is not a control character
        ({"X-A": "ok", "X-B": "bell\x07"}, "X-B"),  # the offending one is named, not the first
        ({"X-A": "del\x7f"}, "X-A"),
        ({"": "v"}, ""),
        ({"X A": "v"}, "X A"),
        ({"Connection": "close\r\n"}, None),  # ours: never written, so never judged
        ({"X-A": "v"}, None),  # a name seen before (cached) is judged the same
        ({"X-A": "v\n"}, "X-A"),
    ],
)
def test_header_names_and_values_table(headers: dict[str, str], refused: str | None) -> None:
    if refused is None:
        head = request_head("GET", "/", "h", headers, None)
        for name, value in headers.items():
            assert (f"{name}: {value}\r\n".encode() in head) is (name != "Connection")
        return
    with pytest.raises(InvalidRequest, match=f"header {refused!r} is not a valid header"):
        request_head("GET", "/", "h", headers, None)


def test_head_owns_host_framing_and_encoding() -> None:
    head = request_head("POST", "/p", "up:1", {"Host": "evil", "Content-Length": "9", "X-K": "v"}, 3)
    assert head == b"POST /p HTTP/1.1\r\nHost: up:1\r\nX-K: v\r\nContent-Length: 3\r\nAccept-Encoding: identity\r\n\r\n"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h/v1/chat", (("h", 80, "http"), "/v1/chat", "h")),
        ("https://h:8443", (("h", 8443, "https"), "/", "h:8443")),
        ("http://[::1]:9/a?b=c d", (("::1", 9, "http"), "/a?b=c%20d", "[::1]:9")),
        ("http://h/caf\u00e9", (("h", 80, "http"), "/caf%C3%A9", "h")),
    ],
)
def test_split_url(url: str, expected: tuple[object, ...]) -> None:
    assert split_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [("ftp://h/x", "unsupported upstream URL scheme"), ("http://u:p@h/", "credentials"), ("http://h:99999/", "invalid port")],
)
def test_split_url_refuses(url: str, message: str) -> None:
    with pytest.raises(UpstreamUnavailable, match=message):
        split_url(url)


BODY = b"hello world " * 50


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("encoding", "data", "expected"),
    [
        ("gzip", gzip.compress(BODY), BODY),
        ("gzip", gzip.compress(BODY) + gzip.compress(b"|second member"), BODY + b"|second member"),
        ("deflate", zlib.compress(BODY), BODY),
        ("deflate", _raw_deflate(BODY), BODY),
        ("gzip", b"", b""),
    ],
    ids=["gzip", "gzip-members", "deflate-zlib", "deflate-raw", "empty"],
)
@pytest.mark.parametrize("size", [1, 3, 4096])
def test_decoding_in_any_chunking(encoding: str, data: bytes, expected: bytes, size: int) -> None:
    decoder = decoder_for(encoding)
    assert decoder is not None
    out = b"".join(decoder.decode(data[i : i + size]) for i in range(0, len(data), size))
    assert out + decoder.finish() == expected


def test_truncated_compressed_body_is_an_error() -> None:
    decoder = decoder_for("gzip")
    assert decoder is not None
    decoder.decode(gzip.compress(BODY)[:-12])
    with pytest.raises(zlib.error, match="truncated"):
        decoder.finish()


def test_identity_and_unknown_encodings() -> None:
    assert decoder_for("") is None and decoder_for("identity") is None
    with pytest.raises(UpstreamUnavailable, match="unsupported content-encoding 'br'"):
        decoder_for("br")



BOMB = b"\0" * 100_000


@pytest.mark.parametrize(
    ("encoding", "data", "size"),
    [
        ("gzip", gzip.compress(BOMB), len(BOMB)),
        ("gzip", gzip.compress(b"a" * 40) + gzip.compress(BOMB), 40 + len(BOMB)),
        ("deflate", zlib.compress(BOMB), len(BOMB)),
        ("deflate", _raw_deflate(BOMB), len(BOMB)),
    ],
    ids=["gzip", "gzip-members", "deflate-zlib", "deflate-raw"],
)
def test_a_decoding_limit_stops_the_output_there(encoding: str, data: bytes, size: int) -> None:
    """`limit` bounds what one call decodes (a compression bomb is not inflated whole); 0 is no bound."""
    bounded = decoder_for(encoding)
    assert bounded is not None
    assert len(bounded.decode(data, 1001)) == 1001
    assert len(bounded.decode(b"", 1001)) <= 1001  # what is left stays bounded too
    whole = decoder_for(encoding)
    assert whole is not None
    assert len(whole.decode(data, 0) + whole.finish()) == size
    exact = decoder_for(encoding)
    assert exact is not None
    assert len(exact.decode(data, size + 1) + exact.finish()) == size  # one over the size: nothing cut
