"""Review of f567882..HEAD (hosted MCP under a budget, reasoning items held from the run's history, the
Anthropic thread refusal, `tool_choice` required with no allowed tool). Each test failed on the code it was
written against (a759b11) for the defect its docstring states, and passes since its fix."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply

MODEL = "gpt-5-mini"
CLAUDE = "claude-sonnet-4-5"
FN = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
SECRET_FN = {"type": "function", "name": "delete_db", "parameters": {"type": "object", "properties": {}}}


async def post(h: Harness, run: str, body: dict[str, Any], path: str = "/v1/responses",
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with h.session.post(f"{h.url}{path}", json=body,
                              headers={"x-tollgate-run-id": run, **(headers or {})}) as resp:
        return resp.status, await resp.json()


async def test_required_tool_choice_with_an_allowed_tool_in_additional_tools_is_not_refused(
        gateway_factory: GatewayFactory) -> None:
    """Defect (a759b11, `toolgate.shape_tools`): "requiring a call when the allow-list leaves none of the
    offered tools" is decided on the request's `tools` field alone (`offered = bool(body.get("tools"))`,
    then `not body.get("tools")` after filtering). The README says the Responses API offers tools "in
    `tools` or in an input item's tool list" (`additional_tools`, `tool_search_output`), and tollgate keeps
    an allowed tool listed there. A request whose `tools` holds only a disallowed function while an
    `additional_tools` input item offers the allowed `lookup` still offers an allowed tool, so a required
    call can be made, yet it is now a 403 `tool_not_allowed` (before this commit it was forwarded).

    Why it matters: a legitimate agent (tools loaded per item, tool search) is refused for a call it may
    make. Expected: forwarded, `lookup` still offered in its input item."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["lookup"]}}})
    h.fake.queue(Reply(body=response_body("ok", model=MODEL, usage=(20, 3))))
    body = {"model": MODEL, "max_output_tokens": 50, "tools": [SECRET_FN], "tool_choice": "required",
            "input": [{"type": "additional_tools", "role": "developer", "tools": [FN]},
                      {"role": "user", "content": "look it up"}]}
    status, answer = await post(h, "additional", body)
    assert status == 200, answer
    sent = h.fake.seen[-1].json
    assert sent["input"][0]["tools"] == [FN]


class RejectOnLandedHistory:
    """A custom guard: refuses a step, naming the request field at fault, once the run's `landed` history
    holds an entry (another step of the run landed it)."""

    name = "landed"

    def before(self, ctx: Any) -> Any:
        from guards.base import Decision
        if ctx.history("landed"):
            return Decision.reject(self.name, "landed", "another step landed first", param="metadata")
        return Decision.allow(self.name)

    def after(self, ctx: Any, answer: Any) -> Any:
        from guards.base import Decision
        return Decision.allow(self.name)


async def test_a_reject_on_re_judgement_keeps_its_param(gateway_factory: GatewayFactory) -> None:
    """Defect (932ecd0): `Decision.reject` gained `param`, and docs/custom-guards.md now promises "a 400
    `invalid_request` with `detail` (and `param`, the request field at fault, when given)". `guard_before`,
    `guard_after` and the MCP path pass it on, but `pipeline._rejudge` (the second judgement `no_progress`
    makes, after the reservation, when another step of the run landed history meanwhile) still raises
    `InvalidRequest(again.stop.detail)`: the same guard's same refusal loses its `param` depending on
    timing. Here another step's history lands while the reservation is written (`store.reserve` wrapped to
    land it, as a concurrent step's answer would); the custom guard allowed the first judgement and refuses
    the second with `param="metadata"`.

    Why it matters: a client that reads `param` (the anthropic SDK's thread runner keys on the error's
    details for `thread`; OpenAI SDK users read `error.param`) gets a different error for the same refusal.
    Expected: the 400 carries `param: "metadata"`."""
    from guards.base import Push
    h = await gateway_factory(agents={"default": {
        "loop": {"window": 6, "max_distinct": 3, "stall_steps": 3},
        "guards": [{"use": f"{__name__}:RejectOnLandedHistory", "options": {}}]}})
    gw = h.gateway
    real = gw.store.reserve

    async def reserve_while_another_step_lands(run_id: str, *args: Any, **kwargs: Any) -> Any:
        await gw.write_effects(run_id, "default", (Push("landed", ("x",), 10),))
        return await real(run_id, *args, **kwargs)

    gw.store.reserve = reserve_while_another_step_lands  # type: ignore[method-assign]
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    status, answer = await post(h, "rejudge", body, path="/v1/chat/completions")
    assert status == 400, answer
    assert answer["error"]["message"] == "another step landed first"
    assert answer["error"]["param"] == "metadata", answer
    assert not h.fake.seen


async def test_a_store_false_answer_writes_no_reasoning_history(gateway_factory: GatewayFactory) -> None:
    """Defect (e9023fa, hot path): `BudgetGuard.after` pushes a history entry for every Responses answer
    with reasoning items, whatever the request. With `store: false` OpenAI persists nothing: the items can
    never be read back by id (OpenAI answers "Items are not persisted when `store` is set to false"), so
    the entry can never hold anything. That is exactly the configuration the README recommends for the
    Agents SDK (`ModelSettings(store=False, response_include=["reasoning.encrypted_content"])`): each of
    its answers now costs an extra run-store write on the answer's path before the agent gets it (a Redis
    round trip whose Lua script decodes and re-encodes the run's whole 1,000-entry list), moves the run's
    history marks (so concurrent steps under `no_progress` re-read the run), and grows every later
    snapshot read of the run. Before e9023fa an answer without tool calls wrote nothing in `guard_after`.

    Expected: an answer to a `store: false` request writes no `reasoning` entry."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}})
    answer = response_body("Sunny.", model=MODEL, usage=(40, 300))
    answer["output"].insert(0, {"id": "rs_nostore", "type": "reasoning", "summary": [],
                                "encrypted_content": "gAAAA-opaque"})
    h.fake.queue(Reply(body=answer))
    body = {"model": MODEL, "max_output_tokens": 500, "store": False, "include": ["reasoning.encrypted_content"],
            "input": [{"role": "user", "content": "Weather in Oslo?"}]}
    status, got = await post(h, "nostore", body)
    assert status == 200, got
    state = await h.gateway.store.get("nostore", steps=False, reservations=False)
    assert state is not None
    assert "reasoning" not in state.lists, state.lists


class RejectToolCallWithParam:
    """A custom guard: refuses every MCP `tools/call` before it is sent, naming the field at fault."""

    name = "reject_call"

    def before(self, ctx: Any) -> Any:
        from guards.base import Decision
        if ctx.call.operation == "execute_tool":
            return Decision.reject(self.name, "bad_arguments", "this call's path is refused", param="arguments")
        return Decision.allow(self.name)

    def after(self, ctx: Any, answer: Any) -> Any:
        from guards.base import Decision
        return Decision.allow(self.name)


@pytest.fixture
def mcp_files() -> Any:
    from tests.fakes import mcp_server
    server = mcp_server.start()
    yield server
    server.stop()


async def test_a_reject_of_an_mcp_tool_call_carries_its_param(gateway_factory: GatewayFactory,
                                                              mcp_files: Any) -> None:
    """Defect (932ecd0): `mcp_calls._apply` now raises `InvalidRequest(detail, param=verdict.stop.param)`
    for a guard's reject on a `tools/call`, and docs/custom-guards.md says a reject is "a 400
    `invalid_request` with `detail` (and `param`, the request field at fault, when given) ... on an MCP
    `tools/call`, the call is not sent". But `jsonrpc.gateway_error` builds the JSON-RPC error from
    `exc.message` and `{"code": ...}` only: the `param` is dropped, so the MCP change is dead code and an
    MCP client can never learn which field was at fault.

    Expected: the JSON-RPC error of the refused call names the param (in its `data`)."""
    import asyncio

    from mcp import MCPError

    from tests.gateway.test_mcp import TOOLS, mcp_client
    h = await gateway_factory(mcp_servers={"files": {"url": mcp_files.url}},
                              agents={"bot": {"tools": TOOLS,
                                              "guards": [{"use": f"{__name__}:RejectToolCallWithParam"}]}})
    async with mcp_client(h, run="mcp-param") as client:
        with pytest.raises(MCPError) as info:
            await asyncio.wait_for(client.call_tool("read_file", {"path": "a.txt"}), 10)
    assert "refused" in str(info.value)
    assert (info.value.data or {}).get("param") == "arguments", (info.value.code, info.value.data)
