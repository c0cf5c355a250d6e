"""Anthropic batch objects through the gateway (pure, no I/O). Batch APIs are forwarded like other `/v1`
paths (`gateway.forward`; creating one is refused for a guarded agent, `gateway.unguarded`), but
Anthropic's batch objects carry an absolute `results_url` on the provider's origin, which the SDK fetches
as it is: the agent would call the provider directly, with its tollgate credential and around the
gateway. Those URLs are rewritten to the gateway's own origin, whose path tollgate forwards.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import orjson

__all__ = ["rewrites_urls", "with_gateway_urls"]

_URL_FIELDS: Final = ("results_url",)


def rewrites_urls(path: str) -> bool:
    """Answers of this canonical path may carry provider URLs the agent would fetch directly."""
    return path == "/v1/messages/batches" or path.startswith("/v1/messages/batches/")


def with_gateway_urls(data: bytes, provider_base: str, origin: str) -> bytes:
    """`data` (a JSON batch object, or a list page of them under `data`) with every `results_url` moved to
    the gateway's origin: one under the configured provider base keeps what follows it, any other absolute
    URL of a batch's results (the provider's canonical origin behind a relay, another spelling of its
    host) keeps its path. Bytes that are not such JSON, or hold no such URL, come back as they are (never
    re-serialized when nothing changed)."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(body, dict):
        return data
    page = body.get("data")
    items: list[Any] = page if isinstance(page, list) else [body]
    prefix = provider_base.rstrip("/") + "/"
    changed = False
    for item in items:
        changed = _move(item, prefix, origin.rstrip("/") + "/") or changed
    return orjson.dumps(body) if changed else data


def _move(item: Any, prefix: str, to: str) -> bool:
    if not isinstance(item, dict):
        return False
    changed = False
    for name in _URL_FIELDS:
        value = item.get(name)
        if not isinstance(value, str):
            continue
        if value.startswith(prefix):
            item[name] = to + value.removeprefix(prefix)
            changed = True
            continue
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and rewrites_urls(parts.path):
            item[name] = to + urlunsplit(("", "", parts.path, parts.query, "")).lstrip("/")
            changed = True
    return changed
