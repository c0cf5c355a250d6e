"""Paths other than the guarded model calls: canonical spellings, and the JSON 404 of unknown paths."""

from __future__ import annotations

import anthropic
import openai
import pytest
from aiohttp.test_utils import make_mocked_request
from yarl import URL

from gateway.forward import GUARDED_PATHS, canonical_path, wire_of
from tests.conftest import Harness


@pytest.mark.parametrize(
    ("path", "canonical"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1//Chat/completions;x/", "/v1/chat/completions"),
        ("/V1/messages/ ", "/v1/messages"),
        ("/v1/responses\t", "/v1/responses"),
        ("/v1/embeddings", "/v1/embeddings"),
        ("/", "/"),
    ],
)
def test_canonical_path(path: str, canonical: str) -> None:
    assert canonical_path(path) == canonical


@pytest.mark.parametrize(
    ("path", "headers", "wire"),
    [
        ("/v1/embeddings", {}, "openai"),
        ("/v1/messages/count_tokens", {}, "anthropic"),
        ("/v1/Messages//batches", {}, "anthropic"),
        ("/v1/models", {"anthropic-version": "2023-06-01"}, "anthropic"),  # the Anthropic SDK calls it
        ("/v1/files", {"anthropic-version": "2023-06-01"}, "anthropic"),
        ("/v1/files", {}, "openai"),
    ],
)
def test_wire_of_a_forwarded_call(path: str, headers: dict[str, str], wire: str) -> None:
    """Errors of forwarded calls are answered in the format of the API that was called (DESIGN section 4)."""
    assert wire_of(make_mocked_request("POST", path, headers=headers)) == wire


def test_guarded_paths_name_every_model_call_protocol() -> None:
    assert set(GUARDED_PATHS.values()) == {"openai", "anthropic", "openai_responses"}


@pytest.mark.parametrize("path", ["/", "/nope", "/mcp/a/b", "/v2/chat/completions"])
async def test_unknown_paths_are_a_json_404_with_the_run_id(gw: Harness, path: str) -> None:
    headers = {"baggage": "user=x,tollgate.run_id=r-404"}
    async with gw.session.post(f"{gw.url}{path}", json={}, headers=headers) as resp:
        assert resp.status == 404
        body = await resp.json()
        assert resp.headers["x-tollgate-run-id"] == "r-404"
    assert body["type"] == "error" and body["error"]["code"] == "not_found"
    assert path[:20] in body["error"]["message"]


@pytest.mark.parametrize("path", ["/%0a", "/v1/chat/completions%0A", "/v1/models/a%0ab", "/mcp%0d%0a"])
async def test_a_path_with_a_line_break_is_the_same_json_404(gw: Harness, path: str) -> None:
    """aiohttp's `.` does not match a newline: such a path missed the catch-all route and got aiohttp's
    plain-text 404 without the run id."""
    headers = {"x-tollgate-run-id": "r-nl"}
    async with gw.session.get(URL(f"{gw.url}{path}", encoded=True), headers=headers) as resp:
        assert resp.status == 404 and resp.content_type == "application/json"
        body = await resp.json()
        assert resp.headers["x-tollgate-run-id"] == "r-nl"
    assert body["error"]["code"] == "not_found"


async def test_both_sdks_read_the_404(gw: Harness) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/nope", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.list()
    assert caught.value.code == "not_found"
    async with anthropic.AsyncAnthropic(base_url=f"{gw.url}/nope", api_key="k", max_retries=0) as aclient:
        with pytest.raises(anthropic.NotFoundError) as acaught:
            await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}])
    assert "not_found" in str(acaught.value)


def test_a_stopped_run_refuses_every_passing_call_with_its_reason() -> None:
    from gateway.errors import Stopped
    from gateway.forward import refuse_stopped
    from gateway.store.base import RunState

    refuse_stopped(RunState("r", "bot"))
    with pytest.raises(Stopped) as info:
        refuse_stopped(RunState("r", "bot", status="stopped", stop_reason="llm_call_cap"))
    assert (info.value.reason, info.value.status) == ("llm_call_cap", 403)
