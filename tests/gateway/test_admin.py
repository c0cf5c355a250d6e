"""The admin API's listing of runs: pages of `GET /admin/runs`, their `next` cursor, bad parameters."""

from __future__ import annotations

import base64
import io
import re
from typing import Any
from urllib.parse import quote

import pytest

from gateway.admin import RUNS_PAGE, decode_cursor, encode_cursor
from gateway.errors import InvalidRequest
from gateway.store.base import RunsCursor
from tests.conftest import GatewayFactory, Harness

NOW = 1_000.0


async def listing(h: Harness, query: str = "") -> tuple[int, dict[str, Any]]:
    async with h.session.get(f"{h.admin_url}/admin/runs{query}") as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_runs_come_in_pages_that_the_next_cursor_links(gateway_factory: GatewayFactory, backend: str) -> None:
    """`?limit` sizes the pages, `next` is there exactly while runs follow, and the pages together hold
    every run once, least recently updated first."""
    state = {"backend": backend, "path": "st.db"} if backend == "sqlite" else {"backend": backend}
    h = await gateway_factory(state=state)
    for i in (3, 0, 4, 1, 2):
        await h.gateway.store.record_step(f"page-{i}", "bot", {"n": i}, NOW + i)
    pages: list[list[str]] = []
    query = "?limit=2"
    while True:
        status, body = await listing(h, query)
        assert status == 200, body
        pages.append([r["run_id"] for r in body["runs"]])
        if "next" not in body:
            assert set(body) == {"runs"}
            break
        query = f"?limit=2&cursor={quote(body['next'], safe='')}"
    assert pages == [["page-0", "page-1"], ["page-2", "page-3"], ["page-4"]]
    status, body = await listing(h)  # the default page holds them all: no cursor
    assert status == 200 and set(body) == {"runs"}
    assert [r["run_id"] for r in body["runs"]] == [f"page-{i}" for i in range(5)]
    assert body["runs"][0]["steps"] == [{"n": 0}]


@pytest.mark.parametrize("query", ["?limit=0", "?limit=-1", f"?limit={RUNS_PAGE + 1}", "?limit=x", "?limit=",
                                   "?limit=1.5"])
async def test_a_bad_limit_is_a_400_that_says_what_is_allowed(gw: Harness, query: str) -> None:
    status, body = await listing(gw, query)
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert f"limit must be an integer from 1 to {RUNS_PAGE}" == body["error"]["message"]


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize("cursor", [
    "", "%%%", "not a cursor", b64("[1]"), b64('["x", "r"]'), b64('[NaN, "r"]'), b64('[1e999, "r"]'),
    b64('[true, "r"]'), b64('[1, 2]'), b64('{"a": 1, "b": 2}'), b64("[1" + "0" * 400 + ', "r"]'),
    b64("[" * 4000 + "]" * 4000), b64("ab"), b64('[1, "\\udcff"]'),
])
async def test_a_bad_cursor_is_a_400_not_a_crash(gw: Harness, cursor: str) -> None:
    status, body = await listing(gw, f"?cursor={quote(cursor, safe='')}")
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert "cursor" in body["error"]["message"]


@pytest.mark.parametrize("position", [
    (0.0, ""), (1_700_000_000.123456, "run-1"), (0.1 + 0.2, "ünï/💥 ?&=#"), (-5.5, "a" * 300),
])
def test_a_cursor_is_url_safe_text_that_gives_back_the_exact_position(position: RunsCursor) -> None:
    text = encode_cursor(position)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", text), text
    assert decode_cursor(text) == position


def test_decode_cursor_raises_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        decode_cursor(b64('["1.5", "r"]'))  # a number written as text is not a position


async def test_unknown_admin_paths_and_methods_answer_json(gw: Harness) -> None:
    async with gw.session.get(f"{gw.admin_url}/admin/nothing-here") as resp:
        assert resp.status == 404 and resp.content_type == "application/json"
        assert (await resp.json())["error"]["code"] == "not_found"
    for path in ("/admin/runs", "/healthz", "/readyz"):  # the open probes too (they skipped the mapping)
        async with gw.session.delete(f"{gw.admin_url}{path}") as resp:
            assert resp.status == 405 and resp.content_type == "application/json", path
            assert (await resp.json())["error"]["code"] == "method_not_allowed" and "GET" in resp.headers["Allow"]


async def test_an_admin_body_over_the_size_limit_is_a_json_413(gw: Harness) -> None:
    """aiohttp refuses a body over its `client_max_size` (1 MiB) in plain text; the admin API answers JSON."""
    body = b'{"decision": "deny", "by": "' + b"x" * (2 << 20) + b'"}'
    async with gw.session.post(f"{gw.admin_url}/admin/approvals/nope", data=io.BytesIO(body),
                               headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert error["code"] == "request_too_large" and "1048576" in error["message"]
