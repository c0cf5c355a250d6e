"""Hostile probes of routing, providers and the forwarded (non-chat) `/v1/...` paths, driven by the
official `openai` and `anthropic` SDKs against a running gateway (fake upstreams on loopback).

The contract: DESIGN section 3 (routing by `provider/model` or the `models:` table, provider keys and
`passthrough_auth`), section 4 (errors in the called API's wire format, never a retried 5xx for what
retrying cannot change) and the README's "Runs, identity, decisions" (forwarded paths, spellings a
lenient upstream accepts, calls refused for an agent whose guards they would go around).

Every test here failed on the code it was written against; each docstring says what is promised and
what happened instead.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import anthropic
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

import gateway.app
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import FakeProvider, Reply, anthropic_message

AGENT_KEY = "sk-agent-own-key-4b7d1e9a"
BLANKS = "".join(map(chr, range(33)))
Handler = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


class Upstream:
    """A scripted upstream that records every request as it arrived (raw request target included)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []  # method, raw path, headers, body
        self.server: TestServer | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers), body))
        return await self.handler(request, body)

    async def start(self) -> Upstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[[Handler], Awaitable[Upstream]]]:
    started: list[Upstream] = []

    async def make(handler: Handler) -> Upstream:
        up = await Upstream(handler).start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.close()


def lenient(raw_path: str) -> str:
    """The path a lenient upstream serves (README: "any spelling a lenient upstream would accept
    (doubled or trailing slashes, case, `;` parameters, encoded slashes or blanks)"): decoded, each
    segment without its `;parameters` and surrounding blanks, then dot segments resolved (RFC 3986),
    as Tomcat-style servers do."""
    out: list[str] = []
    for segment in unquote(raw_path.partition("?")[0]).split("/"):
        segment = segment.partition(";")[0].strip(BLANKS)
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment.lower())
    return "/" + "/".join(out)


async def run_view(h: Harness, run_id: str) -> dict[str, Any]:
    async with h.session.get(f"{h.admin_url}/admin/runs/{run_id}") as resp:
        if resp.status == 404:
            return {"llm_calls": 0, "spent_usd": 0.0}
        assert resp.status == 200, await resp.text()
        return await resp.json()  # type: ignore[no-any-return]


# -- the model list ------------------------------------------------------------------------------------


async def test_the_model_list_of_a_passthrough_provider_is_asked_with_the_agents_key(
        gateway_factory: GatewayFactory, upstreams: Callable[[Handler], Awaitable[Upstream]]) -> None:
    """DESIGN section 3: provider keys are never taken from the agent "unless a provider sets
    `passthrough_auth: true`" (then the agent's own credentials are the provider's), and section 5:
    "`GET /v1/models` merges the lists of every provider". Model calls to a passthrough provider carry
    the agent's key. Observed: `list_models` (gateway/forward.py) builds its own headers from
    `provider.api_key` alone, so a passthrough provider (no `api_key`) is asked with no credentials at
    all; a real provider answers 401, the provider is skipped, and `client.models.list()` gets a 502
    `upstream_unavailable` ("no provider answered the model list"), which the SDK even retries."""

    async def provider(request: web.Request, body: bytes) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {AGENT_KEY}":
            return web.json_response({"error": {"message": "no key", "type": "invalid_request_error",
                                                "code": "invalid_api_key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model",
                                                              "created": 1, "owned_by": "openai"}]})

    up = await upstreams(provider)
    h = await gateway_factory(providers={"openai": {"type": "openai", "base_url": f"{up.url}/v1",
                                                    "passthrough_auth": True}},
                              models={"gpt-*": "openai"})
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key=AGENT_KEY, max_retries=0) as client:
        page = await client.models.list()
    assert [m.id for m in page.data] == ["gpt-4o-mini"]


async def test_the_anthropic_model_list_is_every_page(
        gateway_factory: GatewayFactory, upstreams: Callable[[Handler], Awaitable[Upstream]]) -> None:
    """DESIGN section 5: "`GET /v1/models` merges the lists of every provider". Anthropic's model list is
    paginated (`limit`, default 20; `has_more`, `last_id`, `after_id`), and the anthropic SDK's
    `client.models.list()` follows `has_more` / `after_id` to get all of it. Observed: `list_models`
    (gateway/forward.py) asks each provider once, without the agent's query string, and answers
    `{"object": "list", "data": [...]}` without `has_more`: every Anthropic model past the first page is
    missing, and the SDK cannot even page on (an `after_id` it sent is dropped)."""
    models = [{"id": f"claude-m{i}", "type": "model", "display_name": f"M{i}",
               "created_at": "2025-01-01T00:00:00Z"} for i in range(5)]

    async def provider(request: web.Request, body: bytes) -> web.Response:
        ids = [m["id"] for m in models]
        after = request.query.get("after_id")
        start = ids.index(after) + 1 if after in ids else 0
        limit = int(request.query.get("limit", "2"))  # a short default page, as Anthropic's 20
        page = models[start:start + limit]
        return web.json_response({"data": page, "has_more": start + limit < len(models),
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None})

    up = await upstreams(provider)
    h = await gateway_factory(providers={"anthropic": {"type": "anthropic", "base_url": up.url,
                                                       "api_key": "sk-ant-provider-key"}},
                              models={"claude-*": "anthropic"})
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as client:
        ids = [m.id async for m in client.models.list()]
    assert ids == [m["id"] for m in models]


async def test_the_model_list_answers_the_anthropic_sdk_in_anthropics_format(gateway_factory: GatewayFactory) -> None:
    """README: forwarded calls' "errors are in Anthropic's format ... for any call with an
    `anthropic-version` header"; DESIGN section 4: errors use the wire format of the API called
    (Anthropic `{"type": "error", "error": {...}}`). The anthropic SDK's `client.models.list()` sends
    `anthropic-version`, and `GET /v1/models/{id}` already answers it in Anthropic's format
    (`forward.wire_of`, whose test names `/v1/models` with that header as Anthropic's). Observed:
    `GET /v1/models` (`list_models`, gateway/forward.py, `adapter = gw.adapters["openai"]`) answers a
    wrong key with OpenAI's `{"error": {...}}` body."""
    h = await gateway_factory(agents={"alice": {"keys": [AGENT_KEY]}})
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="wrong-agent-key", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await client.models.list()
    body = caught.value.body
    assert isinstance(body, dict) and body.get("type") == "error", body
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert h.fake.seen == []


# -- which provider a forwarded call goes to -----------------------------------------------------------


class _NoLocalModel:
    """Stands in for an in-process model's transport (the `local` extra's model is not loaded)."""

    async def open(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the in-process model was called")


async def _local_first(gateway_factory: GatewayFactory, fake_url: str,
                       monkeypatch: pytest.MonkeyPatch) -> Harness:
    async def transports(config: Any) -> dict[str, Any]:
        return {"local": _NoLocalModel()}

    monkeypatch.setattr(gateway.app, "_local_transports", transports)
    return await gateway_factory(
        providers={"local": {"type": "outlines", "model": "models/tiny"},
                   "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"}},
        models={"local-*": "local", "gpt-*": "openai"})


async def test_forwarded_calls_are_not_sent_to_an_in_process_model(
        gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """README "Local constrained decoding": a `type: outlines` provider "speaks the OpenAI chat wire" and
    its models "answer Chat Completions only"; DESIGN section 2: other `/v1/...` paths are "forwarded to
    the provider". With a local model configured first and an HTTP OpenAI provider after it, the OpenAI
    SDK's `client.files.list()` has exactly one provider that can serve it. Observed: `forward_other`
    routes to `Router.default_for("openai")`, the first provider of type openai, which is the
    in-process one, and sends `GET local://outlines/files` through the HTTP client: 502
    `upstream_unavailable` "unsupported upstream URL scheme 'local'" (a status the SDK retries)."""
    h = await _local_first(gateway_factory, fake[1], monkeypatch)
    h.fake.queue(Reply(body={"object": "list", "data": [], "has_more": False}))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        page = await client.files.list()
    assert page.data == []
    assert [(s.method, s.path) for s in h.fake.seen] == [("GET", "/v1/files")]


async def test_a_forwarded_call_naming_an_in_process_model_is_not_a_5xx(
        gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN section 4: errors never use "a status that SDKs retry automatically (429, 408, 409, 5xx) for a
    decision that retrying cannot change"; a request a provider cannot serve is a 400 (the metered paths
    answer "model ... is not served by an OpenAI API provider over HTTP" with a 400). Observed: a
    moderation naming an in-process model (`model: "local-tiny"`, routed by the `models:` table to the
    `type: outlines` provider) is forwarded by `forward_other` to `local://outlines/moderations` through
    the HTTP client: 502 `upstream_unavailable`, retried by the SDK, for the caller's own input."""
    h = await _local_first(gateway_factory, fake[1], monkeypatch)
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.moderations.create(model="local-tiny", input="hello")
    assert 400 <= caught.value.status_code < 500, (caught.value.status_code, caught.value.body)


@pytest.mark.parametrize("model", ["groq/whisper-large-v3", "whisper-large-v3"])
async def test_a_multipart_call_is_routed_by_its_model(gateway_factory: GatewayFactory,
                                                       fake: tuple[FakeProvider, str], model: str) -> None:
    """DESIGN section 3: "`provider/model` names the provider explicitly (prefix stripped upstream);
    otherwise the `models:` table maps exact names or globs ... to providers", and `forward_other`'s own
    docstring: forwarded calls are "routed by the body's `model`". The OpenAI SDK sends audio
    transcriptions (and image edits) as `multipart/form-data`, whose `model` field names the model like a
    JSON body's. Observed: `forward_other` reads `model` only from a JSON body, so a transcription for
    `groq/whisper-large-v3` (or `whisper-large-v3`, mapped to groq by `whisper-*`) goes to the first
    OpenAI provider, with that provider's key, its `groq/` prefix unstripped."""
    fake_url = fake[1]
    h = await gateway_factory(
        providers={"openai": {"type": "openai", "base_url": f"{fake_url}/oa/v1", "api_key": "sk-provider-openai"},
                   "groq": {"type": "openai", "base_url": f"{fake_url}/groq/v1", "api_key": "sk-provider-groq"}},
        models={"gpt-*": "openai", "whisper-*": "groq"})
    h.fake.queue(Reply(body={"text": "hello"}))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        result = await client.audio.transcriptions.create(model=model, file=("a.wav", io.BytesIO(b"RIFF0000WAVE")))
    assert result.text == "hello"
    seen = h.fake.seen[-1]
    assert (seen.path, seen.headers.get("Authorization")) == ("/groq/v1/audio/transcriptions", "Bearer sk-provider-groq")
    assert b"groq/" not in seen.body


async def test_retrieving_a_listed_model_goes_to_the_provider_that_listed_it(
        gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]) -> None:
    """DESIGN section 3: the `models:` table maps model names to providers (`claude-*` to Anthropic), and
    section 5: "`GET /v1/models` merges the lists of every provider" (each entry names its `provider`).
    An OpenAI-wire client then retrieves one of those models by id (`client.models.retrieve(id)`, `GET
    /v1/models/{id}`). Observed: `forward_other` routes by a JSON body's `model` only, so the id in the
    path is ignored and `claude-3-5-haiku-latest` is asked of the OpenAI provider (with the OpenAI key),
    which does not serve it, instead of the Anthropic provider the table and the list name."""
    fake_url = fake[1]
    h = await gateway_factory(
        providers={"openai": {"type": "openai", "base_url": f"{fake_url}/oa/v1", "api_key": "sk-provider-openai"},
                   "anthropic": {"type": "anthropic", "base_url": f"{fake_url}/an", "api_key": "sk-ant-provider"}})
    h.fake.queue(Reply(body={"id": "claude-3-5-haiku-latest", "type": "model", "display_name": "Haiku",
                             "created_at": "2025-01-01T00:00:00Z"}))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        model = await client.models.retrieve("claude-3-5-haiku-latest")
    assert model.id == "claude-3-5-haiku-latest"
    seen = h.fake.seen[-1]
    assert (seen.path, seen.headers.get("x-api-key")) == ("/an/v1/models/claude-3-5-haiku-latest", "sk-ant-provider")


# -- spellings a lenient upstream resolves -------------------------------------------------------------


@pytest.mark.parametrize("target", ["/v1/threads/..;/messages", "/v1/threads/%2e%2e;v=1/messages",
                                    "/v1/threads/..%20/messages", "/v1/threads/..%09/messages"])
async def test_a_dot_segment_spelled_with_a_parameter_or_blank_is_no_way_around_the_guards(
        gateway_factory: GatewayFactory, upstreams: Callable[[Handler], Awaitable[Upstream]], target: str) -> None:
    """README: model calls are `POST /v1/messages` "in any spelling a lenient upstream would accept
    (doubled or trailing slashes, case, `;` parameters, encoded slashes or blanks)", guarded all the same;
    `gateway/upstream.py check_target` refuses `.`/`..` segments "percent-encoded or not" because an upstream
    would resolve them. An upstream that drops `;` parameters or trims blanks (as `canonical_path` assumes)
    reads `..;`, `..;v=1` and `..<blank>` as `..`, so `/v1/threads/..;/messages` is `/v1/messages`.
    Observed: `canonical_path` makes it `/v1/threads/../messages`, which matches the FREE pattern
    `/v1/threads/*/messages`; `check_target` sees the segment `..;` (not `..`) and lets it go: a budgeted,
    call-capped agent's Anthropic model call (max_tokens 100000 on a $0.01 budget) reaches the provider
    with tollgate's key, unreserved and uncounted."""

    async def provider(request: web.Request, body: bytes) -> web.Response:
        if request.method == "POST" and lenient(request.raw_path) == "/v1/messages":
            return web.json_response(anthropic_message("a long answer", input_tokens=2_000, output_tokens=100_000))
        return web.json_response({"type": "error", "error": {"type": "not_found_error", "message": "no"}},
                                 status=404)

    up = await upstreams(provider)
    h = await gateway_factory(
        providers={"anthropic": {"type": "anthropic", "base_url": up.url, "api_key": "sk-ant-provider-key"}},
        models={"claude-*": "anthropic"},
        agents={"default": {"budget": {"usd": 0.01}, "caps": {"llm_calls": 1}}})
    run = "probe-dotdot"
    body = {"model": "claude-3-5-haiku-latest", "max_tokens": 100_000, "messages": [{"role": "user", "content": "hi"}]}
    async with h.session.post(URL(f"{h.url}{target}", encoded=True), data=orjson.dumps(body),
                              headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                                       "x-tollgate-run-id": run}) as resp:
        await resp.read()
    served = [s for s in up.seen if s[0] == "POST" and lenient(s[1]) == "/v1/messages"]
    view = await run_view(h, run)
    # whatever the remedy (refused, or guarded as the model call it is), no model call runs unseen by the run
    assert len(served) == view["llm_calls"], (target, [s[1] for s in served], view)


async def test_a_dot_segment_spelled_with_a_parameter_never_leaves_the_base_path(
        gateway_factory: GatewayFactory, upstreams: Callable[[Handler], Awaitable[Upstream]]) -> None:
    """`gateway/upstream.py check_target`: a path with `.`/`..` segments is refused so "a request could
    [not] leave the provider's base path with tollgate's provider key" (tests/gateway/test_security.py
    `test_paths_cannot_leave_the_base_path` holds `..`, `%2e%2e`, `..%2f`, `\\`, double encoding). Observed:
    `GET /v1/files/..;/..;/..;/tenant-b/v1/files` is forwarded as is to a provider whose base is
    `/tenant-a/v1`; an upstream that drops `;` parameters (which `canonical_path` assumes exists) serves
    `/tenant-b/v1/files` with tenant A's key."""

    async def provider(request: web.Request, body: bytes) -> web.Response:
        return web.json_response({"object": "list", "data": [], "path": lenient(request.raw_path)})

    up = await upstreams(provider)
    h = await gateway_factory(
        providers={"openai": {"type": "openai", "base_url": f"{up.url}/tenant-a/v1", "api_key": "sk-tenant-a-key"}},
        models={"gpt-*": "openai"})
    async with h.session.get(URL(f"{h.url}/v1/files/..;/..;/..;/tenant-b/v1/files", encoded=True)) as resp:
        status = resp.status
        await resp.read()
    outside = [s[1] for s in up.seen if s[2].get("Authorization") == "Bearer sk-tenant-a-key"
               and not lenient(s[1]).startswith("/tenant-a/v1/")]
    assert outside == [], (status, outside)
