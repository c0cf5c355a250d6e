"""Review probes for the session 6ae3c5d..HEAD (failing tests are the evidence of a defect)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, openai_stream, tool_call
from tests.gateway.test_stream_probe import GPT, MSG, PRICING, assert_settled, oa


async def test_stream_cut_after_done_is_not_a_failure(gateway_factory: GatewayFactory) -> None:
    """relay.py: 'nothing after the final event counts'. The upstream sends a complete answer with a
    tool call, its usage and [DONE], then drops the connection (no chunked terminator). The agent must
    get the tool call, and the step be settled from the usage, not failed and charged in full."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = openai_stream([], usage=(5, 2), tool_calls=[tool_call("search_kb", '{"q": 1}')])
    h.fake.queue(Reply(chunks=[*chunks, b": trailing\n\n"], cut_after=len(chunks)))
    tools = [{"type": "function", "function": {"name": "search_kb", "parameters": {"type": "object"}}}]
    async with oa(h, "cut-after-done") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                 stream=True)
        names: list[str] = []
        error: Exception | None = None
        try:
            async for chunk in stream:
                for choice in chunk.choices:
                    for tc in choice.delta.tool_calls or ():
                        if tc.function and tc.function.name:
                            names.append(tc.function.name)
        except Exception as exc:  # noqa: BLE001
            error = exc
    assert error is None and names == ["search_kb"], (names, error)
    assert_settled(await h.run("cut-after-done"), 5, 2)


# -- custom guards (importable as tollgate_review_guards:Class) -----------------------------------------

import sys
import types

from gateway.call import Answer
from guards.base import Decision, StepContext

REVIEW_MOD = "tollgate_review_guards"


class RejectAfter:
    name = "reject_after"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.reject(self.name, "bad_answer", "this answer is refused")


@pytest.fixture
def review_guards(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(REVIEW_MOD)
    for cls in (RejectAfter,):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, REVIEW_MOD, module)
    return module


def web_search_item(i: int) -> dict[str, Any]:
    return {"id": f"ws_{i}", "type": "web_search_call", "status": "completed",
            "action": {"type": "search", "query": "q"}}


async def test_hosted_calls_count_when_a_guard_rejects_the_answer(
        gateway_factory: GatewayFactory, review_guards: types.ModuleType) -> None:
    """pipeline.guard_after: a guard's reject raises before `apply_effects`, after JUDGED was set, so
    neither the caps guard's `tool_calls` Add nor count_unjudged_hosted counts the web searches the
    provider already ran. caps.tool_calls: 1 and an answer with 2 hosted calls must stop the run at its cap
    (an `Add` past its limit stops the run and adds nothing, as when no guard rejects)."""
    from tests.fakes.responses import message_item
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 1},
                                                  "guards": [{"use": f"{REVIEW_MOD}:RejectAfter"}]}})
    body = {"id": "resp_1", "object": "response", "created_at": 1700000000, "status": "completed",
            "model": GPT, "output": [web_search_item(1), web_search_item(2), message_item("found")],
            "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}
    h.fake.queue(Reply(body=body))
    req = {"model": GPT, "input": "search", "tools": [{"type": "web_search"}]}
    async with h.session.post(f"{h.url}/v1/responses", json=req, headers={"x-tollgate-run-id": "hosted-rej"}) as r:
        status = r.status
        await r.read()
    assert status == 400
    run = await h.run("hosted-rej")
    assert (run["status"], run["stop_reason"]) == ("stopped", "tool_call_cap"), run


async def test_provider_key_echoed_in_a_stream_error_event_is_scrubbed(gateway_factory: GatewayFactory) -> None:
    """README: 'an upstream answer that echoes the key tollgate sent (in an error message ...) reaches the
    agent with the key replaced'. OpenAI reports mid-stream failures as `data: {"error": ...}`; relay_stream
    writes upstream events unchanged, so an echoed key reaches the agent."""
    h = await gateway_factory()
    key = h.config.providers["openai"].api_key
    assert key and len(key) >= 8
    err = b'data: {"error": {"message": "Incorrect API key provided: ' + key.encode() + b'", "type": "x"}}\n\n'
    first = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"role":"assistant","content":"par"},"finish_reason":null}]}\n\n'
    h.fake.queue(Reply(chunks=[first, err]))
    body = {"model": GPT, "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
    async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                              headers={"x-tollgate-run-id": "key-in-event"}) as resp:
        raw = await resp.read()
    assert key.encode() not in raw, raw


class RejectToolResult:
    """Rejects an MCP tool's result (after it ran): `Decision.reject` from `after`."""

    name = "reject_result"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        if answer.tool_result is not None:
            return Decision.reject(self.name, "bad_result", "this tool result is refused")
        return Decision.allow(self.name)


@pytest.fixture
def mcp_files() -> Any:
    from tests.fakes import mcp_server
    server = mcp_server.start()  # SSE answers (the SDK's default)
    yield server
    server.stop()


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_reject_of_an_mcp_result_reaches_the_client(
        gateway_factory: GatewayFactory, review_guards: types.ModuleType, mcp_files: Any, mode: str) -> None:
    """mcp_calls._apply now raises InvalidRequest for a guard's reject; inside `judge` (the result
    transform) only Stopped is caught. On an SSE answer, mcp_transport.relay swallows the GatewayError once
    the stream started: the client's request gets no JSON-RPC response at all (the SDK waits or errors
    vaguely) and the step is recorded as if it answered. The client must get a JSON-RPC error."""
    from mcp import MCPError

    from tests.gateway.test_mcp import TOOLS, mcp_client
    review_guards.RejectToolResult = RejectToolResult
    h = await gateway_factory(mcp_servers={"files": {"url": mcp_files.url}},
                              agents={"bot": {"tools": TOOLS, "guards": [{"use": f"{REVIEW_MOD}:RejectToolResult"}]}})
    async with mcp_client(h, mode=mode, run=f"mcp-rej-{mode}") as client:
        with pytest.raises(MCPError) as info:
            await asyncio.wait_for(client.call_tool("read_file", {"path": "a.txt"}), 10)
    run = await h.run(f"mcp-rej-{mode}")
    step = run["steps"][-1]
    assert "refused" in str(info.value), (info.value, {k: step.get(k) for k in ("decision", "status", "error_type", "stop_reason")})


async def test_a_refused_call_leaves_no_request_content_in_the_ledger(gateway_factory: GatewayFactory) -> None:
    """observe_forward.refused_call (new) writes `error.redacted` (= the message: no summary is given) into
    the ledger's `detail`. A tool schema tollgate cannot check is refused with the schema error, which
    quotes the agent's schema text. README: the ledger holds 'a hash of the inputs (never content)'."""
    h = await gateway_factory()
    secret = "CONTENT-abc123-private"
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": secret}}}]
    async with h.session.post(f"{h.url}/v1/chat/completions", json={"model": GPT, "messages": MSG, "tools": tools},
                              headers={"x-tollgate-run-id": "ledger-content"}) as resp:
        assert resp.status == 400, await resp.text()
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = ledger.rows("ledger-content")
    assert rows, "no ledger row"
    assert all(secret not in str(r) for r in rows), [r.get("detail") for r in rows]


async def test_a_lone_step_reads_its_run_once_before_the_call(gateway_factory: GatewayFactory) -> None:
    """Hot path (perf): with `loop.stall_steps` (the README's sample policy) every model call now reads
    the run twice before going upstream (`guard_before` snapshot + `_rejudge` re-read under the run lock),
    even when no other step of the run is in flight: one extra store round trip per request (a Redis
    HGETALL + steps, or a SQLite parse), though nothing could have moved the history in this process."""
    h = await gateway_factory(agents={"default": {"loop": {"window": 6, "max_distinct": 3, "stall_steps": 3},
                                                  "budget": {"tokens": 100000}}})
    store = h.gateway.store
    real = store.get
    calls: list[str] = []

    async def spy(run_id: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(run_id)
        return await real(run_id, *args, **kwargs)

    store.get = spy  # type: ignore[method-assign]
    for i in range(2):  # the first step creates the run; the second is the steady state
        calls.clear()
        body = {"model": GPT, "messages": [*MSG, {"role": "user", "content": str(i)}]}
        async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                                  headers={"x-tollgate-run-id": "lone"}) as resp:
            assert resp.status == 200, await resp.text()
    assert len(calls) == 1, f"{len(calls)} run reads for one sequential step"


async def test_n2_stream_ending_before_the_second_choice_starts_is_not_complete(gateway_factory: GatewayFactory) -> None:
    """openai_chat.OpenAIStreamReader: 'n>1 complete only when every choice finished' counts only the
    choices it has seen. With n=2, an upstream that streams choice 0 to its finish_reason and is cut before
    any chunk of choice 1 (its body ending cleanly, no [DONE]) reads as complete: the agent gets half the answer without an error event."""
    from tests.gateway.test_stream_probe import oa_delta
    h = await gateway_factory()
    chunks = [oa_delta({"role": "assistant", "content": ""}), oa_delta({"content": "one"}), oa_delta({}, "stop")]
    h.fake.queue(Reply(chunks=chunks))  # ends cleanly (the body's end), no [DONE], choice 1 never began
    body = {"model": GPT, "messages": MSG, "stream": True, "n": 2}
    async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                              headers={"x-tollgate-run-id": "n2-cut"}) as resp:
        raw = await resp.read()
    assert b'"error"' in raw, raw
