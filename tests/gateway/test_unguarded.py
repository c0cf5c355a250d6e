"""`gateway.unguarded`: which forwarded calls are billed outside a run's steps, and which agents may make
them; plus the refusals through a running gateway with the official `openai` SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.config import Agent
from gateway.forward import canonical_path
from gateway.unguarded import BYPASSES, FREE, bypass_for, forbidden, refusal
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply


@pytest.mark.parametrize(("method", "path", "billed", "model_calls"), [
    ("POST", "/v1/batches", True, True),
    ("POST", "/v1/messages/batches", True, True),
    ("POST", "/v1/threads/runs", True, True),
    ("POST", "/v1/threads/thread_1/runs", True, True),
    ("POST", "/v1/threads/thread_1/runs/run_1/submit_tool_outputs", True, True),
    ("POST", "/v1/evals/eval_1/runs", True, True),
    ("POST", "/v1/realtime/client_secrets", True, True),
    ("GET", "/v1/realtime", True, True),
    ("POST", "/v1/complete", True, True),
    ("POST", "/v1/images/generations", True, False),
    ("POST", "/v1/audio/transcriptions", True, False),
    ("POST", "/v1/videos/video_1/remix", True, False),
    ("POST", "/v1/fine_tuning/jobs", True, False),
    ("POST", "/v1/containers", True, False),
    # free, or reading what exists: forwarded for everyone
    ("GET", "/v1/batches", False, False),
    ("GET", "/v1/threads/thread_1/runs", False, False),
    ("POST", "/v1/threads/thread_1/runs/run_1/cancel", False, False),
    ("POST", "/v1/threads/thread_1/messages", False, False),
    ("GET", "/v1/images/generations", False, False),
    ("POST", "/v1/files", False, False),
    ("POST", "/v1/messages/count_tokens", False, False),
    ("POST", "/v1/fine_tuning/jobs/ftjob_1/cancel", False, False),
    ("POST", "/v1/threads", False, False),
])
def test_which_calls_are_billed_outside_the_runs_steps(method: str, path: str, billed: bool, model_calls: bool) -> None:
    bypass = bypass_for(method, path)
    assert (bypass is not None) is billed
    assert bypass is None or bypass.model_calls is model_calls


def test_every_registered_path_is_canonical() -> None:
    """The registries are matched against `canonical_path`, so a key it would never produce is dead."""
    for pattern in (*BYPASSES, *FREE):
        assert canonical_path(pattern) == pattern


GUARDED = Agent.model_validate({"tools": {"allow": ["search"]}})
UNGUARDED = Agent.model_validate({})


@pytest.mark.parametrize(("method", "path", "refused"), [
    ("POST", "/v1/decisions", True),  # unknown: may run model calls, so any guard refuses it
    ("PUT", "/v1/agents/sessions/s_1", True),
    ("PATCH", "/v1/something/new", True),
    ("POST", "/v1/files", False),  # known free
    ("POST", "/v1/threads/thread_1/messages", False),
    ("POST", "/v1/messages/count_tokens", False),
    ("POST", "/v1/threads/runs", True),  # billed wins over the free `/v1/threads/*`
    ("GET", "/v1/decisions/d_1", False),  # reads and deletions create nothing
    ("DELETE", "/v1/files/file_1", False),
    ("POST", "/v1/images/generations", False),  # billed, but only a budget forbids it
    ("POST", "/v1/vector_stores/vs_1/search", False),
])
def test_writes_to_paths_known_neither_billed_nor_free_fail_closed(method: str, path: str, refused: bool) -> None:
    refusal_ = forbidden(method, path, GUARDED)
    assert (refusal_ is not None) is refused
    assert refusal_ is None or "tools.allow" in refusal_.message
    assert forbidden(method, path, UNGUARDED) is None  # an agent without guards has nothing to go around
    if refused and bypass_for(method, path) is None:
        assert refusal_ is not None and "does not know what this call runs or bills" in refusal_.message


def test_a_budget_refuses_vector_store_search_and_says_what_to_use_instead() -> None:
    refused = forbidden("POST", "/v1/vector_stores/vs_1/search", Agent.model_validate({"budget": {"usd": 2.0}}))
    assert refused is not None and "file_search tool of /v1/responses" in refused.message


def test_spellings_of_a_billed_path_are_that_path() -> None:
    assert bypass_for("POST", canonical_path("/v1//Images/generations/")) is BYPASSES["/v1/images/generations"]


@pytest.mark.parametrize(("policy", "model_calls_named", "media_named"), [
    ({}, None, None),
    ({"budget": {"usd": 1.0}}, "budget", "budget"),
    ({"budget": {"tokens": 1000}}, "budget", "budget"),
    ({"caps": {"llm_calls": 3}}, "caps", None),
    ({"tools": {"allow": ["search"]}}, "tools.allow", None),
    ({"output": {"grammar": "regex:[a-z]+"}}, "output.grammar", None),
    ({"loop": {"window": 6, "max_distinct": 3}}, "loop", None),
])
def test_an_agent_may_not_make_a_call_that_goes_around_its_guards(
    policy: dict[str, Any], model_calls_named: str | None, media_named: str | None
) -> None:
    agent = Agent.model_validate(policy)
    for path, named in (("/v1/batches", model_calls_named), ("/v1/images/generations", media_named)):
        bypass = bypass_for("POST", path)
        assert bypass is not None
        refused = refusal(bypass, agent)
        if named is None:
            assert refused is None
        else:
            assert refused is not None and refused.status == 400 and named in refused.message


@pytest.mark.filterwarnings("ignore:The Assistants API is deprecated:DeprecationWarning")
async def test_billed_calls_are_refused_for_a_budgeted_agent_and_forwarded_for_others(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents={"capped": {"keys": ["k-capped"], "budget": {"usd": 1.0}},
                                      "looped": {"keys": ["k-looped"], "loop": {"window": 6, "max_distinct": 3}},
                                      "free": {"keys": ["k-free"]}})
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k-capped", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as images:
            await client.images.generate(model="gpt-image-1", prompt="a lighthouse")
        with pytest.raises(openai.BadRequestError) as speech:
            await client.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input="hello")
        with pytest.raises(openai.BadRequestError) as transcription:
            await client.audio.transcriptions.create(model="gpt-4o-transcribe", file=("a.wav", b"RIFF...."))
        with pytest.raises(openai.BadRequestError) as tuning:
            await client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file="file-1")
        with pytest.raises(openai.BadRequestError) as run:
            await client.beta.threads.runs.create(thread_id="thread_1", assistant_id="asst_1")
        with pytest.raises(openai.BadRequestError) as secret:
            await client.realtime.client_secrets.create()
    for refused in (images, speech, transcription, tuning, run, secret):
        assert refused.value.status_code == 400 and "budget" in refused.value.message
    assert "images are billed" in images.value.message
    assert h.fake.seen == []  # nothing reached the provider
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k-looped", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as looped:
            await client.beta.threads.runs.create(thread_id="thread_1", assistant_id="asst_1")
        assert "loop" in looped.value.message and h.fake.seen == []
        h.fake.queue(Reply(body={"created": 1, "data": [{"url": "https://img.example/1.png"}]}))
        image = await client.images.generate(model="gpt-image-1", prompt="a lighthouse")  # only the budget forbids
    assert image.data is not None and image.data[0].url == "https://img.example/1.png"
    h.fake.queue(Reply(body={"id": "run_1", "object": "thread.run", "status": "queued"}))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k-free", max_retries=0) as client:
        created = await client.beta.threads.runs.with_raw_response.create(thread_id="thread_1", assistant_id="asst_1")
    assert created.http_response.status_code == 200 and h.fake.seen[-1].path == "/v1/threads/thread_1/runs"


async def test_anthropic_legacy_completions_are_refused_in_anthropics_format(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"capped": {"keys": ["k-capped"], "caps": {"llm_calls": 5}}})
    body = {"model": "claude-2.1", "prompt": "\n\nHuman: hi\n\nAssistant:", "max_tokens_to_sample": 10}
    headers = {"x-api-key": "k-capped", "anthropic-version": "2023-06-01"}
    async with h.session.post(f"{h.url}/v1/complete", json=body, headers=headers) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "caps" in error["error"]["message"] and h.fake.seen == []
