"""Stage `forward`: the only place that does network I/O.

One pooled HTTP/1.1 client per process (`gateway.http1`). Timeouts are per phase: connect, time to
the response headers (`first_byte`), and the idle gap between body chunks. There is no total timeout,
which would cut a long healthy stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from functools import lru_cache
from typing import Protocol
from urllib.parse import unquote, urlsplit

from multidict import CIMultiDict

from gateway.call import Answer
from gateway.config import Timeouts
from gateway.errors import InvalidRequest
from gateway.http1 import MAX_ANSWER_BYTES, Http1Pool
from gateway.http1_wire import Sending

MIN_SECRET = 8
REDACTED = b"[redacted by tollgate]"

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "expect",  # the client's 100-continue handshake is with us; the upstream gets the whole body
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)


@lru_cache(maxsize=1024)
def _own(name: str) -> bool:
    """A hop-by-hop or `x-tollgate-*` field: never forwarded (cached: names repeat on every step)."""
    lower = name.lower()
    return lower in HOP_BY_HOP or lower.startswith("x-tollgate-")


def forwardable(headers: Mapping[str, str], *, drop: frozenset[str] = frozenset()) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, those named in `Connection`, and `drop` (lower-case names)."""
    getall = getattr(headers, "getall", None)  # repeated `Connection` fields form one list (RFC 9110)
    fields = getall("connection", ()) if getall is not None else [v for k, v in headers.items()
                                                                  if k.lower() == "connection"]
    skip = drop | {h.strip().lower() for value in fields for h in value.split(",")} if fields else drop
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if _own(key) or (skip and key.lower() in skip):
            continue
        out.add(key, value)
    return out


def answer_headers(
    upstream: Mapping[str, str], *ours: Mapping[str, str], secret: str | None = None
) -> CIMultiDict[str]:
    """The headers of an answer relayed to the agent: the upstream's `forwardable` ones, every repeated
    field kept, then ours in order, each replacing a field of the same name whatever its case. A field
    whose value holds `secret` (the provider key, echoed by a debugging upstream) is left out."""
    out = forwardable(upstream)
    if secret is not None and len(secret) >= MIN_SECRET and any(secret in value for value in out.values()):
        out = CIMultiDict((name, value) for name, value in out.items() if secret not in value)
    for headers in ours:
        out.update(headers)
    return out


def secret_bytes(secret: str | None) -> bytes | None:
    """What `scrub` searches for: the secret's bytes, or None for a secret shorter than `MIN_SECRET`
    (it would match ordinary text, and no provider issues such keys)."""
    return secret.encode() if secret is not None and len(secret) >= MIN_SECRET else None


def scrub(data: bytes, secret: bytes | None) -> bytes:
    """`data` with every copy of `secret` (`secret_bytes` of the provider key tollgate sent, which an
    upstream may echo in an error message or event) replaced: the agent never sees it (DESIGN section 3)."""
    return data.replace(secret, REDACTED) if secret is not None and secret in data else data


def scrub_text(text: str, secret: str | None) -> str:
    """`scrub` for text tollgate itself reports (a span attribute, a metric label, an error code)."""
    if secret is None or len(secret) < MIN_SECRET or secret not in text:
        return text
    return text.replace(secret, REDACTED.decode())


def scrub_answer(answer: Answer, secret: str | None) -> Answer:
    """`answer` with `secret` replaced in what telemetry reports of it: its id, model, system fingerprint,
    service tier, finish reasons and the provider's error code (an upstream may echo the key tollgate sent
    in any of them). The same object when none holds it: the check is a few substring searches a step."""
    if secret is None or len(secret) < MIN_SECRET:
        return answer
    fields = (answer.response_id, answer.model, answer.system_fingerprint, answer.service_tier,
              answer.provider_error, *answer.finish_reasons)
    if not any(field is not None and secret in field for field in fields):
        return answer

    def clean(value: str | None) -> str | None:
        return None if value is None else scrub_text(value, secret)

    return dataclasses.replace(
        answer, response_id=clean(answer.response_id), model=clean(answer.model),
        system_fingerprint=clean(answer.system_fingerprint), service_tier=clean(answer.service_tier),
        provider_error=clean(answer.provider_error),
        finish_reasons=tuple(scrub_text(reason, secret) for reason in answer.finish_reasons))


class Scrubber:
    """`scrub` for a body relayed a chunk at a time: a copy of the secret split between chunks is replaced
    too. `feed` returns what may be sent now; it holds back only an end of the chunk that could begin the
    secret (fewer bytes than the secret; none for a chunk that ends otherwise, so an event's end is never
    delayed). `finish` returns what is held once the body ended. With no secret it passes chunks as they are."""

    __slots__ = ("_secret", "_tail")

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        secret = self._secret
        if secret is None:
            return chunk
        data = self._tail + chunk if self._tail else chunk
        if secret in data:
            data = data.replace(secret, REDACTED)
        held = _secret_start(data, secret)
        self._tail = data[len(data) - held:] if held else b""
        return data[:len(data) - held] if held else data

    def finish(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail


def _secret_start(data: bytes, secret: bytes) -> int:
    """The length of the longest end of `data` that is a beginning of `secret` (shorter than it)."""
    first = secret[:1]
    at = data.find(first, max(0, len(data) - len(secret) + 1))
    while at != -1:
        if secret.startswith(data[at:]):
            return len(data) - at
        at = data.find(first, at + 1)
    return 0


class UpstreamResponse(Protocol):
    """An open upstream response. Read it with `read()` or `chunks()`; always `release()` it. `read()`
    of a network transport refuses a body over `limits.max_answer_bytes` with `UpstreamUnavailable`
    (its connection closed); `chunks()` is not bounded as a whole (streams are bounded event by event)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None: ...


_BLANKS = "".join(map(chr, range(33)))  # controls and space, trimmed off path segments


def lenient_segment(segment: str) -> str:
    """A path segment as a lenient server reads it: without `;parameters` and surrounding whitespace or
    control characters (`..;v=1` and `.. ` are `..`)."""
    return segment.partition(";")[0].strip(_BLANKS)


def check_target(url: str) -> None:
    """Refuse a URL whose path has `.` or `..` segments, percent-encoded or not (decoded until stable,
    `\\` read as `/`), in any spelling a lenient server reads as one (`lenient_segment`). URLs are a
    configured base plus a path; the client would resolve the dot segments (`/v1/../../admin` is sent
    as `/admin`), and an upstream that decodes `%2F`, decodes twice or drops `;` parameters would too, so
    a request could leave the provider's base path with tollgate's provider key."""
    path = urlsplit(url).path
    if "." not in path and "%" not in path and "\\" not in path:
        return
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    if any(lenient_segment(segment) in (".", "..") for segment in path.replace("\\", "/").split("/")):
        raise InvalidRequest("the request path may not contain '.' or '..' segments")


class Transport(Protocol):
    """The seam under the pipeline: send a request, get an `UpstreamResponse` once headers are in.
    `Upstream` is the HTTP implementation; tests and in-process models provide others."""

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        sending: Sending | None = None,
    ) -> UpstreamResponse: ...


class Upstream:
    """The HTTP `Transport`: a pooled HTTP/1.1 client (`gateway.http1`), one per process."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool

    @classmethod
    def create(cls, *, limit: int = 256, max_answer_bytes: int = MAX_ANSWER_BYTES) -> Upstream:
        """Call from the running event loop (the app's startup). The client keeps no cookies: a proxy
        must not replay what one agent's upstream set for another. `max_answer_bytes`: the most a
        response's `read()` returns (`limits.max_answer_bytes`)."""
        return cls(Http1Pool(asyncio.get_running_loop(), limit=limit, max_answer_bytes=max_answer_bytes))

    async def close(self) -> None:
        await self._pool.close()

    def busy_connections(self) -> int:
        """Pooled connections currently carrying a request or response (0 when nothing is in flight)."""
        return self._pool.busy()

    def open_connections(self) -> int:
        """Open upstream connections: busy ones plus idle keep-alive ones (health checks, leak tests)."""
        return self._pool.open_count()

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        sending: Sending | None = None,
    ) -> UpstreamResponse:
        """Send the request and wait for the response headers. Raises InvalidRequest for a path that
        could leave the provider's base path (`check_target`)."""
        check_target(url)
        return await self._pool.open(method, url, headers, body, timeouts, sending)
