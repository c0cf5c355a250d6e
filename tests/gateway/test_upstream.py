"""gateway/upstream.py: its pure parts, `forwardable` (headers that may cross the proxy) and
`check_target` (no dot segments in upstream paths), and the cap `Upstream.create` sets on answers."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.call import Answer
from gateway.config import Limits, Timeouts
from gateway.errors import InvalidRequest, UpstreamUnavailable
from gateway.upstream import (
    HOP_BY_HOP,
    REDACTED,
    Scrubber,
    Upstream,
    answer_headers,
    check_target,
    forwardable,
    scrub,
    scrub_answer,
    scrub_text,
    secret_bytes,
)

Fields = list[tuple[str, str]]


def fwd(fields: Fields, drop: frozenset[str] = frozenset()) -> Fields:
    return list(forwardable(CIMultiDict(fields), drop=drop).items())


@pytest.mark.parametrize("name", sorted(HOP_BY_HOP))
def test_each_hop_by_hop_header_is_dropped(name: str) -> None:
    fields = [(name, "v"), ("X-Keep", "1")]
    assert fwd(fields) == [("X-Keep", "1")]
    assert fwd([(name.upper(), "v"), ("X-Keep", "1")]) == [("X-Keep", "1")]


def test_hop_by_hop_set() -> None:
    assert HOP_BY_HOP == {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
        "expect", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        "content-encoding", "accept-encoding",
    }


@pytest.mark.parametrize(
    ("fields", "drop", "expected"),
    [
        ([], frozenset(), []),
        # end-to-end headers pass with their spelling, value and order
        (
            [("Content-Type", "application/json"), ("Authorization", "Bearer k"), ("User-Agent", "sdk/1")],
            frozenset(),
            [("Content-Type", "application/json"), ("Authorization", "Bearer k"), ("User-Agent", "sdk/1")],
        ),
        # headers named in Connection are hop-by-hop too, whatever their case or spacing
        ([("Connection", "X-Custom"), ("x-custom", "1"), ("X-Other", "2")], frozenset(), [("X-Other", "2")]),
        (
            [("CONNECTION", " x-a ,X-B,, "), ("X-A", "1"), ("x-b", "2"), ("X-C", "3")],
            frozenset(),
            [("X-C", "3")],
        ),
        ([("Connection", "close"), ("X-A", "1")], frozenset(), [("X-A", "1")]),
        ([("Connection", ""), ("X-A", "1")], frozenset(), [("X-A", "1")]),
        # tollgate's own headers never cross, in any case
        (
            [("x-tollgate-run-id", "r"), ("X-Tollgate-Agent", "a"), ("X-TOLLGATE-GRAMMAR", "g"),
             ("X-A", "1")],
            frozenset(),
            [("X-A", "1")],
        ),
        (
            [("x-tollgate", "1"), ("x-tollgatex", "2")],
            frozenset(),
            [("x-tollgate", "1"), ("x-tollgatex", "2")],
        ),
        # the drop set (lower-case names) matches any case
        (
            [("Traceparent", "t"), ("BAGGAGE", "b"), ("tracestate", "s"), ("X-A", "1")],
            frozenset({"baggage", "traceparent", "tracestate"}),
            [("X-A", "1")],
        ),
        ([("Authorization", "Bearer k"), ("X-Api-Key", "k")], frozenset({"authorization", "x-api-key"}), []),
        ([("Authorization", "Bearer k")], frozenset({"x-api-key"}), [("Authorization", "Bearer k")]),
        # repeated end-to-end headers are all kept, in order
        (
            [("Set-Cookie", "a=1"), ("X-A", "1"), ("set-cookie", "b=2"), ("Set-Cookie", "c=3")],
            frozenset(),
            [("Set-Cookie", "a=1"), ("X-A", "1"), ("set-cookie", "b=2"), ("Set-Cookie", "c=3")],
        ),
        (
            [("Host", "h"), ("Content-Length", "3"), ("Accept-Encoding", "gzip"), ("Accept", "*/*")],
            frozenset(),
            [("Accept", "*/*")],
        ),
    ],
)
def test_forwardable(fields: Fields, drop: frozenset[str], expected: Fields) -> None:
    assert fwd(fields, drop) == expected


def test_forwardable_returns_a_case_insensitive_copy() -> None:
    source = CIMultiDict([("X-A", "1")])
    out = forwardable(source)
    assert out["x-a"] == "1"
    out["X-B"] = "2"
    assert "X-B" not in source


def test_every_connection_field_names_hop_by_hop_headers() -> None:
    """Repeated `Connection` fields are one list (RFC 9110 section 5.3), not only the first."""
    fields = [("Connection", "x-a"), ("Connection", "X-B, x-c"), ("X-A", "1"), ("X-B", "2"), ("x-c", "3"),
              ("X-D", "4")]
    assert fwd(fields, frozenset()) == [("X-D", "4")]


def test_forwardable_accepts_a_plain_mapping() -> None:
    headers = {"connection": "x-a", "x-a": "1", "Accept": "*/*", "x-tollgate-run-id": "r"}
    assert list(forwardable(headers).items()) == [("Accept", "*/*")]


# -- answer_headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("upstream", "ours", "expected"),
    [
        # repeated upstream fields all reach the agent
        ([("Vary", "Accept"), ("vary", "Origin"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")], [],
         [("Vary", "Accept"), ("vary", "Origin"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]),
        # ours replace theirs whatever the case, once: no second Content-Type line
        ([("content-type", "text/event-stream; charset=utf-8"), ("x-request-id", "r1")],
         [{"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}, {"x-tollgate-run-id": "run"}],
         [("Content-Type", "text/event-stream"), ("x-request-id", "r1"), ("Cache-Control", "no-cache"),
          ("x-tollgate-run-id", "run")]),
        # the upstream's hop-by-hop and x-tollgate-* fields never pass; ours in order, the last wins
        ([("Connection", "keep-alive"), ("Transfer-Encoding", "chunked"), ("X-Tollgate-Run-Id", "forged")],
         [{"x-tollgate-run-id": "a"}, {"X-Tollgate-Run-Id": "b"}],
         [("X-Tollgate-Run-Id", "b")]),
    ],
)
def test_answer_headers(upstream: Fields, ours: list[dict[str, str]], expected: Fields) -> None:
    assert list(answer_headers(CIMultiDict(upstream), *ours).items()) == expected


# -- check_target ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://up.test/v1/chat/completions",
        "http://up.test/v1/models/gpt-4.1",  # a dot inside a segment is fine
        "http://up.test/v1/files/file-abc.jsonl",
        "http://up.test/v1/files/...",  # three dots are a name, not a dot segment
        "http://up.test/v1/a%20b",
        "http://up.test/v1/x?next=../../admin",  # the query is not the path
        "http://up.test/v1/x#/../admin",
        "http://up.test",
    ],
)
def test_check_target_allows(url: str) -> None:
    check_target(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://up.test/v1/../admin",
        "http://up.test/v1/./models",
        "http://up.test/v1/..",
        "http://up.test/v1/%2e%2e/admin",
        "http://up.test/v1/%2E%2E/admin",
        "http://up.test/v1/.%2e/admin",
        "http://up.test/v1/..%2f..%2fadmin",
        "http://up.test/v1/%252e%252e/admin",  # encoded twice
        "http://up.test/v1/%25252e%25252e/admin",  # three times
        "http://up.test/v1/..\\admin",
        "http://up.test/v1/%5c..%5cadmin",
    ],
)
def test_check_target_refuses_dot_segments(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_target(url)
    assert info.value.status == 400
    assert info.value.message == "the request path may not contain '.' or '..' segments"


KEY = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    ("data", "secret", "expected"),
    [
        (b'{"error": "bad key ' + KEY.encode() + b'"}', KEY, b'{"error": "bad key [redacted by tollgate]"}'),
        (b"Bearer " + KEY.encode() + b" / " + KEY.encode(), KEY, b"Bearer [redacted by tollgate] / [redacted by tollgate]"),
        (b'{"error": "nothing of it"}', KEY, b'{"error": "nothing of it"}'),
        (b"k k k", "k", b"k k k"),  # too short to be a provider key: never searched
        (b"any", None, b"any"),  # passthrough auth: the agent's own key
    ],
)
def test_scrub(data: bytes, secret: str | None, expected: bytes) -> None:
    assert scrub(data, secret_bytes(secret)) == expected


def test_answer_headers_leave_out_fields_holding_the_secret() -> None:
    upstream = CIMultiDict([("X-Echo", f"Bearer {KEY}"), ("X-Request-Id", "r1"), ("X-Echo", "fine")])
    out = answer_headers(upstream, {"x-tollgate-run-id": "run"}, secret=KEY)
    assert list(out.items()) == [("X-Request-Id", "r1"), ("X-Echo", "fine"), ("x-tollgate-run-id", "run")]
    assert len(answer_headers(upstream, secret=None)) == 3


async def test_create_caps_what_read_returns() -> None:
    """`Upstream.create(max_answer_bytes=...)` (the app passes `limits.max_answer_bytes`) bounds every
    response's `read()`; a refused answer's connection is closed, not pooled."""
    sizes = [101, 100]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                body = b"x" * sizes.pop(0)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/models"
    timeouts = Timeouts(connect=1, first_byte=1, idle=1)
    upstream = Upstream.create(max_answer_bytes=100)
    try:
        resp = await upstream.open("GET", url, {}, None, timeouts)
        try:
            with pytest.raises(UpstreamUnavailable, match=r"max_answer_bytes \(100 bytes\)"):
                await resp.read()
        finally:
            resp.release()
        assert upstream.busy_connections() == 0 and upstream.open_connections() == 0
        resp = await upstream.open("GET", url, {}, None, timeouts)
        assert await resp.read() == b"x" * 100  # exactly the cap
        assert upstream.open_connections() == 1
    finally:
        await upstream.close()
        server.close()
        await server.wait_closed()


async def test_create_defaults_to_the_configs_default() -> None:
    upstream = Upstream.create()
    assert upstream._pool.max_answer_bytes == Limits().max_answer_bytes == 64 * 1024 * 1024
    await upstream.close()


KEY_BYTES = b"sk-provider-openai"


def scrubbed(chunks: list[bytes], secret: bytes | None = KEY_BYTES) -> list[bytes]:
    scrubber = Scrubber(secret)
    return [*(scrubber.feed(c) for c in chunks), scrubber.finish()]


@pytest.mark.parametrize(("chunks", "sent"), [
    ([b"plain", b" text"], [b"plain", b" text", b""]),
    ([b"key sk-provider-openai here"], [b"key " + REDACTED + b" here", b""]),
    ([b"key sk-prov", b"ider-openai here"], [b"key ", REDACTED + b" here", b""]),  # split: held, then whole
    ([b"ends s", b"k", b"-provider-openai"], [b"ends ", b"", REDACTED, b""]),
    ([b"ends sk-pro"], [b"ends ", b"sk-pro"]),  # the body ended: what was held is no key after all
    ([b"sk sk-provider-openaisk-provider-openai"], [b"sk " + REDACTED * 2, b""]),
    ([b"data: {}\n\n", b"data: {}\n\n"], [b"data: {}\n\n", b"data: {}\n\n", b""]),  # an event's end waits for nothing
])
def test_a_scrubber_replaces_the_key_across_chunks(chunks: list[bytes], sent: list[bytes]) -> None:
    assert scrubbed(chunks) == sent


def test_a_scrubber_without_a_secret_passes_chunks_as_they_are() -> None:
    chunk = b"sk-provider-openai"
    assert scrubbed([chunk], None) == [chunk, b""]
    assert scrubbed([chunk], None)[0] is chunk


@given(st.lists(st.sampled_from([b"sk-", b"provider", b"-openai", b"s", b"k", b"x", b"sk-provider-openai", b"\n"]),
                max_size=30), st.data())
def test_a_scrubbed_stream_is_the_scrubbed_body_however_it_is_cut(parts: list[bytes], data: st.DataObject) -> None:
    body = b"".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out = scrubbed(chunks)
    assert b"".join(out) == scrub(body, KEY_BYTES)
    assert all(KEY_BYTES not in part for part in out)


SECRET = "sk-provider-secret-123"


@pytest.mark.parametrize(("answer", "reported"), [
    (Answer(response_id="chatcmpl-1", model="gpt-4o", finish_reasons=("stop",)),
     Answer(response_id="chatcmpl-1", model="gpt-4o", finish_reasons=("stop",))),
    (Answer(response_id=SECRET, model=f"m-{SECRET}", system_fingerprint=SECRET, service_tier=SECRET,
            provider_error=SECRET, finish_reasons=("stop", SECRET), text=SECRET),
     Answer(response_id="[redacted by tollgate]", model="m-[redacted by tollgate]",
            system_fingerprint="[redacted by tollgate]", service_tier="[redacted by tollgate]",
            provider_error="[redacted by tollgate]", finish_reasons=("stop", "[redacted by tollgate]"),
            text=SECRET)),  # content is the content capture's to redact (otel.redact), not this
])
def test_scrub_answer_replaces_the_key_in_what_telemetry_reports(answer: Answer, reported: Answer) -> None:
    assert scrub_answer(answer, SECRET) == reported
    assert scrub_answer(answer, None) is answer and scrub_answer(answer, "short") is answer
    clean = Answer(model="gpt-4o")
    assert scrub_answer(clean, SECRET) is clean  # nothing to replace: no copy
    assert scrub_text(f"code {SECRET}", SECRET) == "code [redacted by tollgate]"
