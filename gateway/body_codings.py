"""Which request body codings tollgate can read. Pure: no I/O.

aiohttp's server decodes one `Content-Encoding` of `gzip`, `deflate`, `br` or `zstd` and the `chunked`
transfer coding; any other coding reaches the handler as the encoded bytes, and tollgate drops both
headers when it forwards a body (it sends what it read, framed anew). Forwarding such bytes without
their coding would hand the upstream a corrupt body (`x-gzip`, `gzip, deflate`, `Transfer-Encoding:
gzip, chunked`), and judging them would read garbage: they are refused instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.errors import UndecodableBody

DECODED = frozenset({"gzip", "deflate", "br", "zstd", "identity"})  # what the server decodes, or nothing


def refuse_unread_codings(headers: Mapping[str, str]) -> None:
    """Raise UndecodableBody (400) for a body coding the server left undecoded: a `Content-Encoding`
    other than one of `DECODED`, or a transfer coding other than `chunked`."""
    content = codings(headers, "content-encoding")
    if len(content) > 1 or any(c not in DECODED for c in content):
        raise UndecodableBody(
            f"Content-Encoding {', '.join(content)!r} is not supported: send one of gzip, deflate, br, zstd")
    transfer = codings(headers, "transfer-encoding")
    if transfer and transfer != ["chunked"]:
        raise UndecodableBody(f"Transfer-Encoding {', '.join(transfer)!r} is not supported: only chunked is")


def codings(headers: Mapping[str, str], name: str) -> list[str]:
    """The codings a header lists, lower case, every repeated field included (RFC 9110 lists)."""
    getall = getattr(headers, "getall", None)
    values = getall(name, ()) if getall is not None else [v for k, v in headers.items() if k.lower() == name]
    return [c.strip().lower() for value in values for c in value.split(",") if c.strip()]
