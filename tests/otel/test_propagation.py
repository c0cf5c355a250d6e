"""W3C trace context in and out: agent headers (any casing, plain dicts and aiohttp's multidicts),
upstream headers, MCP `_meta`."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.trace import get_current_span

from otel.propagation import context_from_headers, extract_meta_context, inject_meta_context

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
VALUE = f"00-{TRACE}-{PARENT}-01"


def _plain(name: str) -> Mapping[str, str]:
    return {"Content-Type": "application/json", name: VALUE}


def _proxy(name: str) -> Mapping[str, str]:
    return CIMultiDictProxy(CIMultiDict([("Content-Type", "application/json"), (name, VALUE)]))


@pytest.mark.parametrize("make", [_plain, _proxy], ids=["dict", "multidict"])
@pytest.mark.parametrize("name", ["traceparent", "Traceparent", "TRACEPARENT"])
def test_agent_context_in_any_casing(make, name: str) -> None:  # type: ignore[no-untyped-def]
    ctx = context_from_headers(make(name))
    assert ctx is not None
    span_context = get_current_span(ctx).get_span_context()
    assert f"{span_context.trace_id:032x}" == TRACE and f"{span_context.span_id:016x}" == PARENT
    assert span_context.is_remote and span_context.trace_flags.sampled


@pytest.mark.parametrize(
    "headers",
    [{}, {"Content-Type": "x"}, CIMultiDictProxy(CIMultiDict([("X", "1")])), {"traceparent": "garbage"},
     CIMultiDictProxy(CIMultiDict([("traceparent", f"00-{'0' * 32}-{PARENT}-01")]))],
    ids=["empty", "absent", "multidict-absent", "invalid", "zero-trace-id"],
)
def test_no_or_invalid_context_is_none(headers: Mapping[str, str]) -> None:
    assert context_from_headers(headers) is None


def test_meta_round_trip() -> None:
    ctx = context_from_headers({"traceparent": VALUE})
    meta: dict[str, object] = {}
    inject_meta_context(meta, ctx)
    assert meta["traceparent"] == VALUE
    back = extract_meta_context(meta)
    assert back is not None and get_current_span(back).get_span_context().trace_id == int(TRACE, 16)
