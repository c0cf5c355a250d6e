"""What a web browser may not do to the admin port. Pure functions over a request's headers.

Without `admin.token` the admin port's only boundary is loopback, and a browser on the same machine
crosses it: a page can send a simple cross-site POST (no preflight) to reset a run, and a page whose
name resolves to 127.0.0.1 (DNS rebinding) can read every run. So a state-changing request a browser
marks as coming from another site is refused, and a connection that arrived on a loopback address
must name a loopback host.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from functools import lru_cache
from urllib.parse import urlsplit

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SAME_SITE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values a page of another site never sends


def cross_site_refusal(method: str, headers: Mapping[str, str]) -> str | None:
    """Why a state-changing request is refused as sent by a page of another site, or None. Clients
    that are not browsers (the CLI, curl, scripts) send neither `Origin` nor `Sec-Fetch-Site`."""
    if method.upper() in SAFE_METHODS:
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in _SAME_SITE:
        return f"a browser request from another site ({site.strip()}) cannot change runs"
    origin = headers.get("origin")
    if origin is not None:
        host = headers.get("host", "")
        parts = urlsplit(origin.strip())
        if origin.strip() == "null" or parts.netloc.lower() != host.strip().lower():
            return "a browser request from another origin cannot change runs"
    return None


def host_refusal(host_header: str | None, local_address: str | None) -> str | None:
    """Why a request that arrived on a loopback address is refused for the host it names, or None.
    A request on another address is not judged here (the port is exposed on purpose, see the
    startup warning; `admin.token` guards it)."""
    if local_address is None or not _is_loopback_ip(local_address):
        return None
    name = _hostname(host_header or "")
    if name is None or not _loopback_name(name):
        return "the admin port answers only requests addressed to a loopback host name"
    return None


def _hostname(host: str) -> str | None:
    """The host name of a `Host` header value (port and IPv6 brackets removed), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, _port = host.partition(":")
    return name.rstrip(".") or None


def _is_loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _loopback_name(name: str) -> bool:
    return (_is_loopback_ip(name) or name == "localhost" or name.endswith(".localhost")
            or name in _own_names())


@lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    # Debian maps the machine's own name to 127.0.1.1: a local client may address it so
    names = {socket.gethostname().lower()}
    names.add(socket.getfqdn().lower())
    return frozenset(n for n in names if n)
