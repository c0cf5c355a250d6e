"""The pure half of the upstream HTTP/1.1 client (`gateway.http1`): URLs to origins and request
targets, request heads, and response content decoding. No I/O."""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from functools import lru_cache
from urllib.parse import quote, urlsplit

from gateway.errors import InvalidRequest, UpstreamUnavailable

__all__ = ["Decoder", "Origin", "Sending", "decoder_for", "request_head", "split_url"]

Origin = tuple[str, int, str]  # host, port, scheme


class Sending:
    """Whether a request may have reached the upstream, for a caller that is cancelled while the
    transport is still opening (an exception says it itself: `UpstreamError.request_sent`). A transport
    that can tell sets `started` False when it begins and True right before its first byte is written;
    one that does not leaves it None, which means: assume it was sent."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started: bool | None = None

_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but tab: header splitting
_NOT_TOKEN = re.compile(r"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")  # a header name is an RFC 9110 token
_UNSAFE_TARGET = re.compile(r"[^A-Za-z0-9\-._~!$&'()*+,;=:@/?%]")
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "accept-encoding"})


@lru_cache(maxsize=1024)
def split_url(url: str) -> tuple[Origin, str, str]:
    """(origin, request target, Host header) of an absolute http(s) URL; the target is
    percent-encoded where the URL carried characters a request line may not."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise UpstreamUnavailable(f"invalid port in upstream URL {parts.netloc!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamUnavailable(f"unsupported upstream URL scheme {parts.scheme!r}")
    if "@" in parts.netloc:
        raise UpstreamUnavailable("credentials in an upstream URL are not supported; configure headers")
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    if _UNSAFE_TARGET.search(target):
        target = quote(target, safe="!$&'()*+,;=:@/?%~")
    https = parts.scheme == "https"
    return (parts.hostname, port or (443 if https else 80), parts.scheme), target, parts.netloc


@lru_cache(maxsize=1024)
def _forwarded(name: str) -> bool:
    """Whether `request_head` writes a header of this name (False: Host, framing and encoding are its
    own). Raises `InvalidRequest` for a name that is not a token. Cached: names repeat on every step."""
    if not name or _NOT_TOKEN.search(name):
        raise InvalidRequest(f"header {name!r} is not a valid header (control character or bad name)")
    return name.lower() not in _OWN_HEADERS


def request_head(
    method: str, target: str, host: str, headers: Mapping[str, str], length: int | None
) -> bytes:
    """The request line and headers. Host, framing and encoding headers are ours; a name or value
    with a control character (header splitting) is refused with `InvalidRequest`."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    values = []
    for name, value in headers.items():
        if _forwarded(name):
            values.append(value)
            lines.append(f"{name}: {value}\r\n")
    # one C-speed scan of every value: printable text has no control character; anything else (a tab,
    # which is allowed, or non-ASCII) is judged by the pattern
    if not " ".join(values).isprintable():
        for name, value in headers.items():
            if _forwarded(name) and _CTL.search(value):
                raise InvalidRequest(f"header {name!r} is not a valid header (control character or bad name)")
    if length is not None:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("Accept-Encoding: identity\r\n\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


_GZIP = 16 + zlib.MAX_WBITS


class Decoder:
    """gzip (every member; zero padding after the last is ignored), or deflate: zlib-wrapped, or raw as
    some servers send it. Response bodies (`gateway.http1`) and request bodies (`gateway.body_codings`)
    alike; raises zlib.error."""

    def __init__(self, encoding: str, *, strict: bool = False) -> None:
        """`strict`: data after a deflate stream is refused (a request body: tollgate forwards what it
        decodes); an answer's is ignored, as browsers and aiohttp's client do."""
        self._gzip = encoding != "deflate"
        self._strict = strict
        self._zlib = zlib.decompressobj(_GZIP) if self._gzip else None
        self._head = b""  # deflate: the first two bytes tell a zlib header from raw data
        self._fed = False

    def _start(self, data: bytes) -> tuple[zlib._Decompress | None, bytes]:
        if self._zlib is not None:
            return self._zlib, data
        data = self._head + data
        if len(data) < 2:
            self._head = data
            return None, b""
        zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
        return self._zlib, data

    def decode(self, data: bytes, limit: int = 0) -> bytes:
        """The bytes `data` decodes to. `limit` > 0: at most `limit` bytes come out, and input that would
        make more is left undecoded (a result of `limit` bytes may have been cut: a caller that bounds
        an answer passes its cap + 1 and refuses a longer result, before `finish`). 0: no bound."""
        self._fed = self._fed or bool(data)
        decoder, data = self._start(data)
        if decoder is None:
            return b""
        if decoder.unconsumed_tail and not decoder.eof:  # what an earlier bounded call left undecoded
            data = decoder.unconsumed_tail + data  # (at a member's end it is `unused_data` as well)
        out = decoder.decompress(data, limit)
        while decoder.eof and decoder.unused_data and not _padding(decoder.unused_data):
            if not self._gzip:
                if self._strict:
                    raise zlib.error("data after the end of the deflate stream")
                break
            left = limit - len(out) if limit else 0  # the next gzip member
            if limit and left <= 0:
                break  # the bound is reached: what is left would only be refused
            rest = decoder.unused_data
            decoder = self._zlib = zlib.decompressobj(_GZIP)
            out += decoder.decompress(rest, left)
        return out

    @property
    def pending(self) -> bool:
        """Input is left that a bounded `decode` did not decode yet: `decode(b"", limit)` goes on."""
        decoder = self._zlib
        if decoder is None:
            return False
        if decoder.eof:  # what follows the end is the next gzip member, or for deflate nothing to decode
            return self._gzip and bool(decoder.unused_data) and not _padding(decoder.unused_data)
        return bool(decoder.unconsumed_tail)

    def finish(self) -> bytes:
        decoder = self._zlib
        if decoder is None:
            if self._head:
                raise zlib.error("the compressed body is truncated")
            return b""
        out = decoder.flush()
        if self._fed and not decoder.eof:
            raise zlib.error("the compressed body is truncated")
        return out


def _padding(data: bytes) -> bool:
    """Zero bytes after the last gzip member, which gzip(1) ignores too."""
    return not data.strip(b"\0")


def decoder_for(encoding: str) -> Decoder | None:
    if encoding in ("", "identity"):
        return None
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise UpstreamUnavailable(f"upstream sent an unsupported content-encoding {encoding!r}")
    return Decoder(encoding)
