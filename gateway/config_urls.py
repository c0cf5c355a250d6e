"""The URL and header checks of config values (`gateway.config`), so that what the runtime would refuse
or trip over on every request (`urlsplit(...).port` raising, a header it refuses as the client's fault)
is a config error naming its key instead.

Each check returns the value unchanged or raises ValueError. A message never quotes the value: a URL may
carry a password (`redis://:pw@host`), a header value a token.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # in a URL: any control character, tab included
# what a header value cannot carry (gateway.http1_wire refuses it): control characters but tab
_VALUE_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_NOT_TOKEN = re.compile(r"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")  # a header name is an RFC 9110 token
_BRACKETED = re.compile(r"\[([^\[\]]+)\](?::([^\[\]]*))?")  # `[IPv6]` or `[IPv6]:port`
# headers the HTTP client writes itself (gateway.http1_wire): a configured one would be dropped
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "accept-encoding"})


def _common(value: str) -> None:
    if value != value.strip():
        raise ValueError("has leading or trailing blanks")
    if _CONTROL.search(value):
        raise ValueError("has a control character (a line break, a tab, NUL, ...)")


def _split(value: str) -> SplitResult:
    try:
        return urlsplit(value)
    except ValueError:  # Python's message may quote the host: never the URL's text
        raise ValueError("has unbalanced [ ] or brackets around something that is not an IPv6 address") from None


def _check_authority(parts: SplitResult, example: str) -> None:
    """A host, bracketed when it is an IPv6 address, and a port of 1-65535 when one is given."""
    hostport = parts.netloc.rpartition("@")[2]
    if any(c.isspace() for c in hostport):
        raise ValueError("has a blank in its host")
    port = ""
    if "[" in hostport or "]" in hostport:
        match = _BRACKETED.fullmatch(hostport)
        if match is None:
            raise ValueError(f"has a malformed bracketed host: write an IPv6 address as {example}")
        try:
            ipaddress.IPv6Address(match.group(1))
        except ValueError:
            raise ValueError(f"has brackets around something that is not an IPv6 address ({example})") from None
        port = match.group(2) or ""
    else:
        host, colon, port = hostport.partition(":")
        if colon and ":" in port:
            raise ValueError(f"has an IPv6 address without brackets: write {example}")
        if not host:
            raise ValueError(f"has no host ({example.replace('[::1]', 'host')})")
    # the port's text is never quoted: `user:password/...` (an `@host` left out) reads as host `user`
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError("has a port that is not a number from 1 to 65535")


def http_url(value: str, *, base: bool, credentials: str) -> str:
    """An absolute http(s) URL with a host (and a valid port). `base`: paths are appended to it, so it
    has no query or fragment. `credentials`: where a credential belongs instead of the URL's userinfo,
    which the HTTP client refuses."""
    _common(value)
    if not re.match(r"^https?://", value, re.IGNORECASE):
        raise ValueError("must be an absolute http(s) URL")
    parts = _split(value)
    if "@" in parts.netloc:
        raise ValueError(f"must not carry credentials (user:password@): {credentials}")
    _check_authority(parts, "http://[::1]:8000/v1")
    if base and ("?" in value or "#" in value):
        raise ValueError("must not have a query or fragment: tollgate appends paths (/chat/completions, ...) to it")
    return value


# query parameters of a redis URL tollgate passes on: redis-py parses the typed ones itself; the rest are
# strings its connections take as such. Others would fail every store call (an unexpected keyword argument,
# or a string where an object is expected).
_REDIS_OPTIONS = frozenset({
    "db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "socket_read_size", "retry_on_timeout",
    "retry_on_error", "max_connections", "health_check_interval", "protocol", "username", "password",
    "client_name", "lib_name", "lib_version", "encoding", "encoding_errors", "ssl_keyfile", "ssl_certfile",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_password", "ssl_ciphers",
    "ssl_check_hostname", "ssl_min_version", "ssl_include_verify_flags", "ssl_exclude_verify_flags",
})
_POOL_OPTIONS = frozenset({"max_connections"})  # taken by the pool, not the connection


def redis_url(value: str) -> str:
    """What `redis.asyncio.ConnectionPool.from_url` takes and the run store can use: redis:// or rediss://
    with a host, a valid port and a database number as its path, or unix:// with a socket path; query
    parameters that redis-py reads and tollgate's connections accept."""
    _common(value)
    scheme = value.partition("://")[0].lower() if "://" in value else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    parts = _split(value)
    if scheme == "unix":
        if parts.netloc.rpartition("@")[2] or not parts.path:
            raise ValueError("must name the socket's path after three slashes: unix:///run/redis.sock")
    else:
        _check_authority(parts, f"{scheme}://[::1]:6379/0")
        if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]+", parts.path):
            raise ValueError(f"has a path that is not a database number ({scheme}://host:6379/0)")
    _check_redis_options(value, scheme, parts.query)
    return value


def _check_redis_options(value: str, scheme: str, query: str) -> None:
    import inspect

    # redis-py is loaded only for a config that has a state.url
    from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection, parse_url

    try:
        parse_url(value)
    except ValueError as exc:  # a query value of the wrong type: its message names the parameter only
        raise ValueError(f"has a query value redis-py cannot read ({str(exc).rstrip('.')})") from None
    connection = {"redis": Connection, "rediss": SSLConnection}.get(scheme, UnixDomainSocketConnection)
    taken: set[str] = set(_POOL_OPTIONS)
    for cls in connection.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            taken.update(inspect.signature(init).parameters)
    for name in parse_qs(query):  # the parameters redis-py passes on (one with an empty value it skips)
        if name not in _REDIS_OPTIONS or name not in taken:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise ValueError(f"has query parameter {shown!r}, which is no option of a {scheme}:// connection "
                             "tollgate passes on")


def header_value(value: str) -> str:
    """A value an HTTP request can carry: no CR, LF, NUL or other control character but tab."""
    if _VALUE_CONTROL.search(value):
        raise ValueError("has a control character (a line break, NUL, ...), which a header value cannot carry")
    return value


def headers_map(value: Any) -> Any:
    """Header names of a configured mapping (before its values are checked): RFC 9110 tokens, none
    given twice (names are case-insensitive), none the HTTP client writes itself."""
    if not isinstance(value, Mapping):
        return value  # its type error names it
    seen: set[str] = set()
    for name in value:
        if not isinstance(name, str):
            continue  # its type error names it
        if not name:
            raise ValueError("has an empty header name")
        bad = _NOT_TOKEN.search(name)
        if bad is not None:
            # only what comes before the offending character is shown: `Authorization: Bearer sk-...` as a
            # name shows `Authorization`, never the token
            char = bad.group()
            what = ("a colon" if char == ":" else "a blank" if char.isspace() and char.isprintable()
                    else "a control character" if not char.isprintable() else repr(char))
            raise ValueError(f"has header name {name[:bad.start()] + '...'!r} with {what} in it: a name is an "
                             "RFC 9110 token (letters, digits and !#$%&'*+-.^_`|~)")
        lower = name.lower()
        if lower in _OWN_HEADERS:
            raise ValueError(f"has header {name!r}, which tollgate writes itself: a configured one is dropped")
        if lower in seen:
            raise ValueError(f"has header {name!r} twice (header names are case-insensitive)")
        seen.add(lower)
    return value
