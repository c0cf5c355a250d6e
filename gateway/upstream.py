"""Stage `forward`: the only place that does network I/O.

One pooled `aiohttp.ClientSession` per process. Timeouts are per phase: connect, time to the response
headers (`first_byte`), and the idle gap between body chunks. There is no total timeout, which would
cut a long healthy stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlsplit

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import Timeouts
from gateway.errors import InvalidRequest, UpstreamTimeout, UpstreamUnavailable

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
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


def forwardable(headers: Mapping[str, str], *, drop: frozenset[str] = frozenset()) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, those named in `Connection`, and `drop` (lower-case names)."""
    skip = HOP_BY_HOP | drop if drop else HOP_BY_HOP
    connection = headers.get("connection")
    if connection:
        skip = skip | {h.strip().lower() for h in connection.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lower = key.lower()
        if lower in skip or lower.startswith("x-tollgate-"):
            continue
        out.add(key, value)
    return out


class UpstreamResponse(Protocol):
    """An open upstream response. Read it with `read()` or `chunks()`; always `release()` it."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None: ...


def check_target(url: str) -> None:
    """Refuse a URL whose path has `.` or `..` segments, percent-encoded or not (decoded until stable,
    `\\` read as `/`). URLs are a configured base plus a path; the client would resolve the dot
    segments (`/v1/../../admin` is sent as `/admin`), and an upstream that decodes `%2F` or decodes
    twice would too, so a request could leave the provider's base path with tollgate's provider key."""
    path = urlsplit(url).path
    if "." not in path and "%" not in path and "\\" not in path:
        return
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    if any(segment in (".", "..") for segment in path.replace("\\", "/").split("/")):
        raise InvalidRequest("the request path may not contain '.' or '..' segments")


@dataclass(slots=True)
class HttpResponse:
    """`UpstreamResponse` over an aiohttp client response."""

    status: int
    headers: CIMultiDictProxy[str]
    _resp: aiohttp.ClientResponse
    _idle: float

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._idle):
                return await self._resp.read()
        except TimeoutError:
            raise UpstreamTimeout(f"upstream sent no data for {self._idle:g}s") from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"upstream connection failed while reading: {type(exc).__name__}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        idle = self._idle
        while True:
            try:
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
            except TimeoutError:
                raise UpstreamTimeout(f"upstream stream idle for more than {idle:g}s") from None
            except aiohttp.ClientError as exc:
                raise UpstreamUnavailable(f"upstream stream broke: {type(exc).__name__}") from None
            if not chunk:
                return
            yield chunk

    def release(self) -> None:
        """Close the connection unless the body was fully read (then it returns to the pool)."""
        if not self._resp.closed:
            self._resp.close()


class Transport(Protocol):
    """The seam under the pipeline: send a request, get an `UpstreamResponse` once headers are in.
    `Upstream` is the HTTP implementation; tests and in-process models provide others."""

    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None, timeouts: Timeouts
    ) -> UpstreamResponse: ...


class Upstream:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    @classmethod
    def create(cls, *, limit: int = 256) -> Upstream:
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        # DummyCookieJar: a proxy must not keep cookies one agent's upstream set and replay them for another
        session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True,
                                        cookie_jar=aiohttp.DummyCookieJar())
        return cls(session)

    async def close(self) -> None:
        await self._session.close()

    def busy_connections(self) -> int:
        """Pooled connections currently carrying a request or response (0 when nothing is in flight)."""
        connector = self._session.connector
        return len(getattr(connector, "_acquired", ())) if connector is not None else 0

    def open_connections(self) -> int:
        """Open upstream connections: busy ones plus idle keep-alive ones whose socket is still open.

        For health checks and leak tests; aiohttp exposes the pool only through private fields."""
        connector = self._session.connector
        if connector is None or connector.closed:
            return 0
        idle = 0
        for pool in getattr(connector, "_conns", {}).values():
            idle += sum(1 for protocol, _ in pool if protocol.is_connected())
        return self.busy_connections() + idle

    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None, timeouts: Timeouts
    ) -> UpstreamResponse:
        """Send the request and wait for the response headers. Raises InvalidRequest for a path that
        could leave the provider's base path (`check_target`)."""
        check_target(url)
        try:
            async with asyncio.timeout(timeouts.first_byte):
                resp = await self._session.request(
                    method,
                    url,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, sock_read=None),
                )
        except TimeoutError:
            raise UpstreamTimeout(f"upstream did not answer within {timeouts.first_byte:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(f"cannot connect to upstream: {exc.os_error.strerror or exc}") from None
        except aiohttp.ServerTimeoutError:
            raise UpstreamTimeout(f"upstream connect timed out after {timeouts.connect:g}s") from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"upstream request failed: {type(exc).__name__}") from None
        return HttpResponse(resp.status, resp.headers, resp, timeouts.idle)
