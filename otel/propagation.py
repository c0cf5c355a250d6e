"""W3C trace context in and out: HTTP headers (agent -> tollgate -> model provider) and MCP
`params._meta` (mcp.md, v1.41: `traceparent`, `tracestate`, `baggage` in the request's `_meta`).

Propagators are used directly, never the global one; nothing here reads the ambient context.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanContext, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "context_from_headers", "extract_meta_context", "headers_for", "inject_headers", "inject_meta_context"
]

_META_KEYS: Final = frozenset(("traceparent", "tracestate", "baggage"))


class _CaseInsensitiveGetter(Getter[Mapping[str, str]]):
    """Header lookup for plain dicts as well as aiohttp's CIMultiDict."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = next((v for k, v in carrier.items() if k.lower() == key), None)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The agent's trace context from W3C `traceparent` / `tracestate`; None when absent or invalid."""
    if isinstance(headers, (CIMultiDict, CIMultiDictProxy)):
        if "traceparent" not in headers:  # case-insensitive, in C: the common case costs one lookup
            return None
    elif not any(k.lower() == "traceparent" for k in headers):
        return None
    ctx = TraceContextTextMapPropagator().extract(headers, context=Context(), getter=_CaseInsensitiveGetter())
    return ctx if get_current_span(ctx).get_span_context().is_valid else None


def inject_headers(ctx: Context | None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) headers to send upstream for `ctx` (a step span's context);
    empty when there is nothing valid to propagate. Baggage is deliberately not forwarded to model
    providers (it may carry the agent's run ids and other internals)."""
    return headers_for(get_current_span(ctx).get_span_context()) if ctx is not None else {}


def headers_for(span_context: SpanContext) -> dict[str, str]:
    """`inject_headers` for a span context itself (no `Context` to build): the W3C headers exactly
    as `TraceContextTextMapPropagator.inject` writes them; empty for an invalid context."""
    if not span_context.is_valid:
        return {}
    flags = span_context.trace_flags
    headers = {"traceparent": f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"}
    if span_context.trace_state:
        headers["tracestate"] = span_context.trace_state.to_header()
    return headers


def extract_meta_context(meta: Mapping[str, Any] | None) -> Context | None:
    """Trace context (and baggage) an MCP client put in `params._meta` (`traceparent`, `tracestate`,
    `baggage`, per mcp.md); None when there is no valid one."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("traceparent"), str):
        return None
    carrier = {k: v for k, v in meta.items() if k in _META_KEYS and isinstance(v, str)}
    ctx = TraceContextTextMapPropagator().extract(carrier, context=Context())
    if not get_current_span(ctx).get_span_context().is_valid:
        return None
    return W3CBaggagePropagator().extract(carrier, context=ctx)


def inject_meta_context(meta: dict[str, Any], ctx: Context | None) -> None:
    """Write `ctx` (the MCP step span's context) into a request's `params._meta` dict, in place:
    `traceparent`, `tracestate` when set, `baggage` when the context carries any."""
    if ctx is None or not get_current_span(ctx).get_span_context().is_valid:
        return
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=ctx)
    W3CBaggagePropagator().inject(carrier, context=ctx)
    meta.update(carrier)
