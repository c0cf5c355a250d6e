"""Hostile probes of README "Runs, identity, decisions" and DESIGN sections 2-4: who is calling and
which run, the run id every answer echoes, stops on a stopped run's other `/v1` calls, provider keys
kept from the agent, and the admin view of a run. Driven by the official `openai` and `anthropic` SDKs
against a running gateway (raw aiohttp only where no SDK can show the case: the MCP transport's
headers, the admin port). Fake upstreams on loopback only.

Every test here failed on the code it was written against; each docstring quotes the promise and says
what happened instead.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from gateway.config import ConfigError
from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, openai_stream

RUN = "x-tollgate-run-id"
STOP = "x-tollgate-stop-reason"
GPT = "gpt-4o-mini"
MSG = [{"role": "user", "content": "hello"}]
PROVIDER_KEY = "sk-provider-openai"  # tests/conftest.py: the key tollgate sends the fake OpenAI upstream


def oai(url: str, run: str | None = None, **headers: str) -> openai.AsyncOpenAI:
    default = {**({RUN: run} if run else {}), **headers}
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="agent-key", max_retries=0, default_headers=default)


# -- the run id every answer echoes ----------------------------------------------------------------------


async def test_an_mcp_401_echoes_the_run_id_the_request_named(gateway_factory: GatewayFactory) -> None:
    """README "Runs, identity, decisions": "Every answer echoes `x-tollgate-run-id`, errors included
    (one given before the agent is known, a 401 or the 404 of a path tollgate does not serve, echoes
    only a run id the request named)"; DESIGN 3: "Every response echoes `x-tollgate-run-id`", and MCP
    steps resolve identity "exactly as for model calls". The model-call paths do echo the named run id
    on a 401 (`echo_headers`). Observed: `POST /mcp/{server}` with an unknown agent key answers 401
    with no `x-tollgate-run-id` at all: `gateway/mcp.py:mcp_handler` only fills its response headers
    after `identify` succeeded, and its `except GatewayError` answers with the empty dict (the same for
    a 400 of `check_headers` and the 503 `shutting_down`)."""
    h = await gateway_factory(agents={"bot": {"keys": ["tg-bot-key-7f3a91"]}},
                              mcp_servers={"files": {"url": "http://127.0.0.1:9/mcp"}})
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with h.session.post(f"{h.url}/mcp/files", json=message,
                              headers={"Authorization": "Bearer not-a-key", RUN: "mcp-401",
                                       "Accept": "application/json, text/event-stream"}) as resp:
        assert resp.status == 401
        assert resp.headers.get(RUN) == "mcp-401", dict(resp.headers)
    # the same request on a model-call path echoes it
    async with oai(h.url, "mcp-401", Authorization="Bearer not-a-key") as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            await client.chat.completions.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
    assert refused.value.response.headers.get(RUN) == "mcp-401"


async def test_a_model_list_error_of_a_known_agent_echoes_its_standing_run(gateway_factory: GatewayFactory) -> None:
    """README "Runs, identity, decisions": "Run: `x-tollgate-run-id`, ..., else `<agent>:default`. Every
    answer echoes `x-tollgate-run-id`, errors included" (only an error "given before the agent is
    known" echoes just a named run id). Observed: a `GET /v1/models` whose `limit` is out of range (the
    anthropic SDK's `models.list(limit=5000)`) is a 400 without `x-tollgate-run-id`, although the agent
    was identified (`default`, run `default:default`): `gateway/model_list.py:list_models` answers
    every error of its `try` (identify and `_paging` alike) with `echo_headers`, never with the
    identity's `base_headers`."""
    h = await gateway_factory()
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="agent-key", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.models.list(limit=5000)
    assert refused.value.body["error"]["code"] == "invalid_request"  # type: ignore[index]
    assert refused.value.response.headers.get(RUN) == "default:default", dict(refused.value.response.headers)


# -- who is calling --------------------------------------------------------------------------------------


async def test_a_configured_agent_is_selectable_by_the_agent_header(gateway_factory: GatewayFactory) -> None:
    """DESIGN 3: "Without agent keys configured, the agent is named by the `x-tollgate-agent` header or
    is `default`"; "the agent's policy applies"; DESIGN 5: the config is "parsed once into frozen, typed
    objects" and `check-config` reports what is wrong with it. Observed: a config naming an agent
    `support bot` (no keys) is accepted (no ConfigError, `check-config` passes), but the header that is
    the only way to select that agent is refused: `x-tollgate-agent: support bot` is a 400
    `invalid_request` ("use 1-64 of A-Z a-z 0-9 . _ -", `gateway/identity.py:Identifier.identify`'s
    `_AGENT`), so the configured policy can never apply. Either the config must refuse the name (naming
    `agents.support bot`) or the header must select it; `gateway/config.py:Config` checks no agent name."""
    try:
        h = await gateway_factory(agents={"support bot": {"caps": {"llm_calls": 5}}})
    except ConfigError as exc:  # refusing the name at load is an acceptable fix
        assert "support bot" in str(exc)
        return
    async with oai(h.url, "sb-1", **{"x-tollgate-agent": "support bot"}) as client:
        await client.chat.completions.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
    assert (await h.run("sb-1"))["agent"] == "support bot"


# -- a stopped run's other /v1 calls ------------------------------------------------------------------------


async def test_the_model_list_of_a_stopped_run_is_refused_like_its_other_v1_calls(
        gateway_factory: GatewayFactory) -> None:
    """DESIGN 2: "`GET /v1/models` and other `/v1/...` paths (embeddings, ...): forwarded to the
    provider, traced"; README "Runs, identity, decisions": "Other `/v1/...` paths pass through to the
    provider, traced but not budgeted, and not at all for a stopped run (that refusal is a span and a
    ledger row with the stop's reason)"; DESIGN 4: "Stops carry `x-tollgate-stop-reason` and are sticky
    until reset". `GET /v1/models/{id}` of a stopped run is refused (403 `llm_call_cap`). Observed:
    `client.models.list()` of the same stopped run is a 200 with the merged list, no stop reason, no
    refusal recorded: `gateway/model_list.py:list_models` reads every provider's list without looking at
    the run (the stop check of `gateway/forward.py:forward_other` is never reached)."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    async with oai(h.url, "stopped-list") as client:
        await client.chat.completions.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
        with pytest.raises(openai.PermissionDeniedError) as one:
            await client.models.retrieve(GPT)
        assert one.value.response.headers.get(STOP) == "llm_call_cap"
        with pytest.raises(openai.PermissionDeniedError) as listed:
            await client.models.list()
    assert listed.value.response.headers.get(STOP) == "llm_call_cap"
    assert listed.value.body["code"] == "llm_call_cap"  # type: ignore[index]


# -- provider keys stay in tollgate ---------------------------------------------------------------------------


async def test_a_provider_key_echoed_in_a_non_streamed_answer_is_redacted_as_in_a_stream(
        gateway_factory: GatewayFactory) -> None:
    """README "Runs, identity, decisions": "Provider keys stay in tollgate: an upstream answer that echoes
    the key tollgate sent (in an error message, in a debugging header) reaches the agent with the key
    replaced by `[redacted by tollgate]`"; DESIGN 3: provider keys are "never taken from, nor shown to,
    the agent". A streamed 200 answer that echoes the key reaches the SDK redacted. Observed: the same
    echo in a non-streamed 200 answer reaches `client.chat.completions.create()` verbatim, the provider
    key in the message content: `gateway/proxy.py:run_step` scrubs only answers with a status >= 300
    (`gateway/relay.py:relay_stream` scrubs every event of a 200 stream)."""
    h = await gateway_factory()
    echoed = f"debug: upstream saw Authorization: Bearer {PROVIDER_KEY}"
    h.fake.queue(Reply(chunks=openai_stream([echoed])), Reply(body=openai_completion(echoed)))
    async with oai(h.url, "key-echo") as client:
        stream = await client.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        answer = await client.chat.completions.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
    assert PROVIDER_KEY not in streamed and "[redacted by tollgate]" in streamed
    text = answer.choices[0].message.content or ""
    assert PROVIDER_KEY not in text, text


async def test_a_provider_key_echoed_in_any_successful_answer_never_reaches_the_agent(
        gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]) -> None:
    """The same promise on every other path: embeddings and completions (metered, relayed a chunk at a
    time), a file's content (forwarded as it streams, the key split between chunks), and the merged
    model list. Observed: each reached the SDK with the key verbatim (only errors were scrubbed)."""
    h = await gateway_factory(providers={"openai": {  # one provider: the fake's model list echoes its key
        "type": "openai", "base_url": fake[1] + "/v1", "api_key": PROVIDER_KEY}}, models={"*": "openai"})
    echoed = f"debug: upstream saw Authorization: Bearer {PROVIDER_KEY}"
    embedding = {"object": "list", "model": "text-embedding-3-small",
                 "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                 "usage": {"prompt_tokens": 2, "total_tokens": 2}, "debug": echoed}
    completion = {"id": "c", "object": "text_completion", "created": 1, "model": "gpt-3.5-turbo-instruct",
                  "choices": [{"index": 0, "text": echoed, "finish_reason": "stop", "logprobs": None}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11}}
    half = len(PROVIDER_KEY) // 2
    content = [b"line one\nkey " + PROVIDER_KEY[:half].encode(), PROVIDER_KEY[half:].encode() + b" tail\n"]
    h.fake.queue(Reply(body=embedding), Reply(body=completion),
                 Reply(chunks=content, headers={"Content-Type": "application/octet-stream"}))
    h.fake.models = [{"id": "gpt-4o-mini", "object": "model", "owned_by": echoed}]
    async with oai(h.url, "key-echo-paths") as client:
        embedded = await client.embeddings.with_raw_response.create(model="openai/text-embedding-3-small", input="hi")
        completed = await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi")
        file = await client.files.content("file-1")
        models = await client.models.list()
    seen = [embedded.http_response.text, completed.choices[0].text, file.text,
            str([m.model_dump() for m in models.data])]
    for text in seen:
        assert PROVIDER_KEY not in text and "[redacted by tollgate]" in text, text
    assert file.text == "line one\nkey [redacted by tollgate] tail\n"


# -- the admin view of a run ------------------------------------------------------------------------------


async def test_the_admin_view_of_a_run_id_ending_in_a_slash_is_that_run(gateway_factory: GatewayFactory) -> None:
    """DESIGN 2: `GET /admin/runs/{run_id}` answers the run "as the admin API shows it", `"run_id"`
    first; the proxy accepts `tenant-a/` as a run id (it echoes it and keeps the run apart from
    `tenant-a`). Observed: `GET /admin/runs/tenant-a/` answers the view of the other run, `tenant-a`
    (its spend, its steps), and never the run asked for: `gateway/admin.py:create_admin_app` registers
    `/admin/runs/{run_id:.+}/` before `/admin/runs/{run_id:.+}`, so the final slash of the id is taken
    as a trailing slash of the path."""
    h = await gateway_factory()
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=10)), Reply(body=openai_completion(prompt_tokens=99)))
    for run in ("tenant-a", "tenant-a/"):
        async with oai(h.url, run) as client:
            raw = await client.chat.completions.with_raw_response.create(model=GPT, messages=MSG)  # type: ignore[arg-type]
        assert raw.headers[RUN] == run
    async with h.session.get(f"{h.admin_url}/admin/runs/tenant-a/") as resp:
        assert resp.status == 200
        view = await resp.json()
    assert (view["run_id"], view["input_tokens"]) == ("tenant-a/", 99), view
