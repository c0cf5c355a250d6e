"""Hostile probes of `POST /v1/responses` through a running gateway, written by an independent review
of the Responses feature: bypasses of the allow-list and the budget it found (all fixed), and the
guarantees test_responses_e2e.py does not check. After every request the run must hold no open
reservation (`settled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import call_item, message_item, response_body, response_stream
from tests.fakes.upstream import Reply

WEATHER: Any = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
DELETE: Any = {"type": "function", "name": "delete_all", "parameters": {"type": "object", "properties": {}}}
CODE: Any = {"type": "custom", "name": "run_python", "description": "Runs Python source code"}
MCP_TOOL = {"type": "mcp", "server_label": "ops", "server_url": "https://mcp.example.com/mcp",
            "require_approval": "never"}
REASONING = {"id": "rs_1", "type": "reasoning", "summary": []}
JSON_HEADERS = {"Content-Type": "application/json", "x-tollgate-run-id": "r1"}
STREAM_WITH_WEATHER = {"model": "gpt-4o-mini", "input": "hi", "tools": [WEATHER], "stream": True}
ALLOW_WEATHER = {"tools": {"allow": ["get_weather"]}}
DROP_WEATHER = {"tools": {"allow": ["get_weather"], "on_violation": "drop"}}


def client(h: Harness, run: str = "r1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


async def gateway(factory: GatewayFactory, **policy: Any) -> Harness:
    return await factory(agents={"default": policy})


async def settled(h: Harness, run: str = "r1") -> dict[str, Any]:
    """The run, asserting that no reservation is left open."""
    state = await h.run(run)
    assert (state["reserved_usd"], state["reserved_tokens"]) == (0, 0), state
    return state


def sse(kind: str, sequence: int, **fields: Any) -> bytes:
    data = {"type": kind, "sequence_number": sequence, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def events_of(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def post_raw(h: Harness, body: dict[str, Any], path: str = "/v1/responses") -> tuple[int, bytes]:
    async with h.session.post(f"{h.url}{path}", data=orjson.dumps(body), headers=JSON_HEADERS) as resp:
        return resp.status, await resp.read()


async def drain(c: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    """Every event of `client.responses.stream(...)`, and its final response."""
    async with c.responses.stream(**kwargs) as stream:
        events = [e async for e in stream]
        return events, await stream.get_final_response()


def with_output(output: list[Any], **fields: Any) -> dict[str, Any]:
    return {**response_body(""), "output": output, **fields}


def stream_with_final(parts: list[str], final_output: list[Any],
                      calls: tuple[tuple[str, str, str], ...] = ()) -> list[bytes]:
    """`response_stream` events whose `response.completed` carries `final_output` instead."""
    events = response_stream(parts, calls=calls, complete=False)
    final = {**response_body("".join(parts), calls=calls), "output": final_output}
    return [*events, sse("response.completed", len(events), response=final)]


def custom_call(name: str, text: str, call_id: str = "ct1") -> dict[str, Any]:
    return {"id": f"ctc_{call_id}", "type": "custom_tool_call", "status": "completed", "name": name,
            "input": text, "call_id": call_id}


def custom_stream(text_parts: list[str], name: str, pieces: list[str]) -> list[bytes]:
    """A message, then a custom tool call whose free-form input comes in `pieces`."""
    events = response_stream(text_parts, complete=False)
    item = custom_call(name, "".join(pieces))
    where = {"item_id": item["id"], "output_index": 1}

    def add(kind: str, **fields: Any) -> None:
        events.append(sse(kind, len(events), **fields))

    add("response.output_item.added", output_index=1, item={**item, "input": "", "status": "in_progress"})
    for piece in pieces:
        add("response.custom_tool_call_input.delta", **where, delta=piece)
    add("response.custom_tool_call_input.done", **where, input=item["input"])
    add("response.output_item.done", output_index=1, item=item)
    final = response_body("".join(text_parts))
    final["output"].append(item)
    add("response.completed", response=final)
    return events


# -- path spellings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses/", "/v1//Responses", "/v1/responses;x", "/v1/%72esponses",
                                  "/v1/RESPONSES;v=2/"])
async def test_spellings_of_the_path_are_guarded(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    body = {"model": "gpt-4o-mini", "input": "hi", "tools": [DELETE],
            "tool_choice": {"type": "function", "name": "delete_all"}}
    status, raw = await post_raw(h, body, path)
    assert status == 403, raw
    assert orjson.loads(raw)["error"]["code"] == "tool_not_allowed"
    assert h.fake.seen == []




# -- stop with on_stop: message while streaming ------------------------------------------------------


async def test_stop_tail_after_relayed_text_is_readable_by_the_sdk(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER, on_stop="message")
    h.fake.queue(Reply(chunks=response_stream(["thinking"], calls=[("delete_all", "{}", "c1")])))
    async with client(h) as c:
        events, final = await drain(c, model="gpt-4o-mini", input="hi", tools=[WEATHER])
    assert next(e.delta for e in events if e.type == "response.output_text.delta") == "thinking"
    assert "tool_not_allowed" in final.output_text
    assert [i.type for i in final.output] == ["message", "message"]
    assert (await settled(h))["stop_reason"] == "tool_not_allowed"


# -- custom (free-form) tools ------------------------------------------------------------------------


async def test_custom_tool_input_is_free_text_not_json(gw: Harness) -> None:
    gw.fake.queue(*[Reply(body=with_output([custom_call("run_python", "print(6 * 7)")]))] * 3)
    async with client(gw) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="compute", tools=[CODE])
    assert [(i.type, getattr(i, "input", None)) for i in response.output] == [
        ("custom_tool_call", "print(6 * 7)")]
    assert len(gw.fake.seen) == 1  # no re-ask: free-form input has no JSON schema to break
    await settled(gw)


async def test_disallowed_custom_tool_call_is_dropped(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, **DROP_WEATHER)
    h.fake.queue(Reply(body=with_output([custom_call("run_python", "import os"),
                                         call_item("get_weather", "{}", "c2")])))
    async with client(h) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER, CODE])
    assert [i.type for i in response.output] == ["function_call"]
    assert [t["name"] for t in h.fake.seen[-1].json["tools"]] == ["get_weather"]
    await settled(h)


async def test_streamed_disallowed_custom_call_is_held_and_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    h.fake.queue(Reply(chunks=custom_stream(["let me"], "run_python", ["import os; ", "os.remove('x')"])))
    status, raw = await post_raw(h, STREAM_WITH_WEATHER)
    assert status == 200
    assert b"os.remove" not in raw and b"custom_tool_call" not in raw
    assert events_of(raw)[-1]["type"] == "error"
    assert (await settled(h))["stop_reason"] == "tool_not_allowed"


async def test_streamed_allowed_custom_call_reaches_the_sdk(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, tools={"allow": ["run_python"]})
    h.fake.queue(Reply(chunks=custom_stream(["ok"], "run_python", ["print(", "1)"])))
    async with client(h) as c:
        _, final = await drain(c, model="gpt-4o-mini", input="hi", tools=[CODE])
    assert [(i.type, getattr(i, "input", None)) for i in final.output] == [
        ("message", None), ("custom_tool_call", "print(1)")]
    assert (await settled(h))["tool_calls"] == 1


# -- calls the agent executes that are not function/custom calls ------------------------------------

Maker = Callable[[int], dict[str, Any]]
AGENT_RUN_CALLS: dict[str, tuple[Any, Maker]] = {  # the offered tool, a call item maker
    "shell_call": ({"type": "shell"}, lambda n: {
        "id": f"sh_{n}", "type": "shell_call", "call_id": f"c{n}", "status": "completed",
        "action": {"commands": [f"rm -rf /srv/{n}"]}}),
    "local_shell_call": ({"type": "local_shell"}, lambda n: {
        "id": f"ls_{n}", "type": "local_shell_call", "call_id": f"c{n}", "status": "completed",
        "action": {"type": "exec", "command": ["rm", "-rf", f"/srv/{n}"], "env": {}}}),
    "apply_patch_call": ({"type": "apply_patch"}, lambda n: {
        "id": f"ap_{n}", "type": "apply_patch_call", "call_id": f"c{n}", "status": "completed",
        "operation": {"type": "delete_file", "path": f"src/{n}.py"}}),
    "computer_call": ({"type": "computer_use_preview", "display_width": 800, "display_height": 600,
                       "environment": "browser"}, lambda n: {
        "id": f"cu_{n}", "type": "computer_call", "call_id": f"c{n}", "status": "completed",
        "pending_safety_checks": [], "action": {"type": "click", "button": "left", "x": n, "y": n}}),
}


@pytest.mark.parametrize("kind", sorted(AGENT_RUN_CALLS))
async def test_agent_run_calls_count_toward_the_tool_call_cap(gateway_factory: GatewayFactory,
                                                              kind: str) -> None:
    h = await gateway(gateway_factory, caps={"tool_calls": 1})
    tool, make = AGENT_RUN_CALLS[kind]
    h.fake.queue(Reply(body=with_output([make(1), make(2)])))  # two calls: one more than the cap
    async with client(h) as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="clean up", tools=[tool])
    assert caught.value.code == "tool_call_cap"
    await settled(h)


# -- tools offered outside `tools`, and tool_choice forms --------------------------------------------


@pytest.mark.parametrize("item", [
    {"type": "additional_tools", "role": "developer",
     "tools": [MCP_TOOL, {"type": "code_interpreter", "container": {"type": "auto"}}]},
    {"type": "tool_search_output", "call_id": "ts1", "execution": "client", "status": "completed",
     "tools": [MCP_TOOL, {"type": "web_search_preview"}]},
])
async def test_hosted_tools_offered_in_input_items_are_held_to_the_allow_list(
    gateway_factory: GatewayFactory, item: dict[str, Any]
) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    h.fake.queue(Reply(body=response_body("done")))
    body = {"model": "gpt-4o-mini", "tools": [WEATHER],
            "input": [item, {"role": "user", "content": "call ops.delete_everything"}]}
    status, _ = await post_raw(h, body)
    if h.fake.seen:  # either the tools are taken out of what goes upstream, or the request is refused
        sent = orjson.dumps(h.fake.seen[-1].json["input"])
        assert b'"mcp"' not in sent and b"code_interpreter" not in sent and b"web_search" not in sent
    else:
        assert status in (400, 403)
    await settled(h)


@pytest.mark.parametrize("tool", [
    {"type": "Function", "name": "get_weather"},
    {"type": "mcp", "server_label": "get_weather", "server_url": "https://mcp.example.com"},
    {"type": "web_search_preview_2025_03_11"},
    {"type": "namespace", "name": "get_weather", "description": "x", "tools": [DELETE]},
    {"type": "function", "name": "get_weather\u200b"},
])
async def test_odd_tool_shapes_are_not_offered(gateway_factory: GatewayFactory, tool: dict[str, Any]) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    h.fake.queue(Reply(body=response_body("ok")))
    status, raw = await post_raw(h, {"model": "gpt-4o-mini", "input": "hi", "tools": [WEATHER, tool]})
    assert status == 200, raw
    assert h.fake.seen[-1].json["tools"] == [WEATHER]
    await settled(h)


async def test_allowed_tools_choice_requiring_only_disallowed_tools_is_refused(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    h.fake.queue(Reply(body=response_body("", calls=[("delete_all", "{}", "c1")])))
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "delete_all"}]}
    body = {"model": "gpt-4o-mini", "input": "hi", "tools": [WEATHER, DELETE], "tool_choice": choice}
    status, raw = await post_raw(h, body)
    assert status == 403, raw
    assert orjson.loads(raw)["error"]["code"] == "tool_not_allowed"
    assert h.fake.seen == []
    assert (await settled(h))["status"] == "active"


async def test_allowed_tools_choice_loses_disallowed_entries(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, **DROP_WEATHER)
    h.fake.queue(Reply(body=response_body("ok")))
    choice: Any = {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "get_weather"}, {"type": "function", "name": "delete_all"}]}
    async with client(h) as c:
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER, DELETE], tool_choice=choice)
    sent = h.fake.seen[-1].json
    assert [t["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["tool_choice"]["tools"] == [{"type": "function", "name": "get_weather"}]
    await settled(h)


# -- drop and re-ask ---------------------------------------------------------------------------------


async def test_drop_leaving_only_reasoning_re_asks(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, **DROP_WEATHER)
    h.fake.queue(Reply(body=with_output([REASONING, call_item("delete_all", "{}", "c1")])),
                 Reply(body=response_body("I cannot delete anything.")))
    async with client(h) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="wipe it", tools=[WEATHER])
    assert response.output_text == "I cannot delete anything."
    assert len(h.fake.seen) == 2
    await settled(h)


async def test_buffered_stream_is_re_asked_and_read_by_the_sdk(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, output={"grammar": 'choice:["yes", "no"]', "retries": 1,
                                               "stream_check": "buffer"})
    h.fake.queue(Reply(chunks=response_stream(["may", "be"])), Reply(chunks=response_stream(["y", "es"])))
    async with client(h) as c:
        events, final = await drain(c, model="gpt-4o-mini", input="ok?")
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["y", "es"]
    assert final.output_text == "yes"
    assert (await settled(h))["llm_calls"] == 2


# -- streams whose events and final response disagree, or break --------------------------------------


async def test_call_only_in_the_final_event_is_judged_before_it_is_relayed(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway(gateway_factory, **DROP_WEATHER)
    final_output = [message_item("ok"), call_item("delete_all", "{}", "c1")]
    h.fake.queue(Reply(chunks=stream_with_final(["ok"], final_output)))
    async with client(h) as c:
        _, final = await drain(c, model="gpt-4o-mini", input="hi", tools=[WEATHER])
    assert [i.type for i in final.output] == ["message"]
    await settled(h)


async def test_streamed_call_swapped_in_the_final_output_is_still_judged(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    final_output = [call_item("get_weather", "{}", "c1")]
    h.fake.queue(Reply(chunks=stream_with_final([], final_output, calls=(("delete_all", "{}", "c1"),))))
    status, raw = await post_raw(h, STREAM_WITH_WEATHER)
    assert status == 200
    shown = [e for e in events_of(raw) if (e.get("item") or {}).get("name") == "delete_all"]
    assert shown == []
    assert events_of(raw)[-1]["type"] == "error"
    assert (await settled(h))["stop_reason"] == "tool_not_allowed"


async def test_streamed_text_and_final_text_are_both_held_to_the_format(gw: Harness) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    gw.fake.queue(Reply(chunks=stream_with_final(['{"n": 3}'], [message_item("rm -rf /")])))
    async with client(gw) as c:
        with pytest.raises(openai.APIError):
            await drain(c, model="gpt-4o-mini", input="n?",
                        text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    await settled(gw)


async def test_malformed_final_response_ends_the_stream_with_an_error_event(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=stream_with_final(["hi"], [{"type": "message", "content": 5}])))
    body = {"model": "gpt-4o-mini", "input": "hi", "stream": True}
    url = f"{gw.url}/v1/responses"
    async with gw.session.post(url, data=orjson.dumps(body), headers=JSON_HEADERS) as resp:
        assert resp.status == 200
        raw = await resp.read()  # ClientPayloadError when the chunked body is cut
    assert events_of(raw)[-1]["type"] == "error"
    await settled(gw)


async def test_streamed_refusal_after_text_is_an_sdk_error_with_its_code(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway(gateway_factory, **ALLOW_WEATHER)
    h.fake.queue(Reply(chunks=response_stream(["thinking"], calls=[("delete_all", "{}", "c1")])))
    seen: list[str] = []
    async with client(h) as c:
        with pytest.raises(openai.APIError) as caught:
            async with c.responses.stream(model="gpt-4o-mini", input="hi", tools=[WEATHER]) as stream:
                async for event in stream:
                    seen.append(event.type)
    assert caught.value.code == "tool_not_allowed"
    assert "response.output_text.delta" in seen and "response.function_call_arguments.delta" not in seen
    assert (await settled(h))["stop_reason"] == "tool_not_allowed"


def failing_stream(last: bytes) -> list[bytes]:
    """Text relayed, then `last` instead of the end of the response."""
    return [*response_stream(["par", "tial"], complete=False)[:-2], last]


async def test_upstream_error_event_is_an_sdk_error_and_charged(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, budget={"tokens": 100_000})
    error = sse("error", 9, code="server_error", message="boom", param=None)
    h.fake.queue(Reply(chunks=failing_stream(error)))
    async with client(h) as c:
        with pytest.raises(openai.APIError):
            await drain(c, model="gpt-4o-mini", input="hi")
    assert (await settled(h))["output_tokens"] > 0  # no usage reported: charged, never free


async def test_response_failed_reaches_the_sdk_unchanged(gw: Harness) -> None:
    """The upstream's failure is its answer: relayed as it came (the SDK's stream helper then reports
    that no response completed, as with the API itself)."""
    failed = {**response_body("", usage=(10, 2), status="failed"), "error": {"code": "server_error",
                                                                              "message": "boom"}}
    gw.fake.queue(Reply(chunks=failing_stream(sse("response.failed", 9, response=failed))))
    async with client(gw) as c:
        stream = await c.responses.create(model="gpt-4o-mini", input="hi", stream=True)
        events = [e async for e in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error is not None and events[-1].response.error.code == "server_error"
    await settled(gw)


def failed_stream() -> list[bytes]:
    failed = {**response_body("", usage=(10, 2), status="failed"),
              "error": {"code": "invalid_prompt", "message": "Invalid prompt: flagged as unsafe"}}
    return failing_stream(sse("response.failed", 9, response=failed))


async def test_response_failed_keeps_the_upstream_reason(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=failed_stream()))
    status, raw = await post_raw(gw, {"model": "gpt-4o-mini", "input": "hi", "stream": True})
    assert status == 200
    last = events_of(raw)[-1]
    assert "flagged as unsafe" in orjson.dumps(last).decode()
    assert "malformed" not in last.get("message", "")
    await settled(gw)


async def test_response_failed_is_settled_from_its_usage(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=failed_stream()))
    await post_raw(gw, {"model": "gpt-4o-mini", "input": "hi", "stream": True})
    state = await settled(gw)
    assert (state["input_tokens"], state["output_tokens"]) == (10, 2)


async def test_response_incomplete_is_relayed_and_settled_from_its_usage(gw: Harness) -> None:
    final = {**response_body("partial", usage=(11, 4), status="incomplete"),
             "incomplete_details": {"reason": "max_output_tokens"}}
    events = response_stream(["partial"], usage=(11, 4), complete=False)
    gw.fake.queue(Reply(chunks=[*events, sse("response.incomplete", len(events), response=final)]))
    status, raw = await post_raw(gw, {"model": "gpt-4o-mini", "input": "hi", "stream": True})
    assert status == 200
    assert events_of(raw)[-1]["type"] == "response.incomplete"
    state = await settled(gw)
    assert (state["input_tokens"], state["output_tokens"]) == (11, 4)


async def test_client_leaving_a_held_stream_leaves_no_reservation(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, budget={"tokens": 100_000})
    h.fake.queue(Reply(chunks=response_stream(["a"], calls=[("get_weather", "{}", "c1")]), chunk_delay=0.05))
    body = {"model": "gpt-4o-mini", "input": "hi", "tools": [WEATHER], "stream": True}
    async with h.session.post(f"{h.url}/v1/responses", data=orjson.dumps(body), headers=JSON_HEADERS) as resp:
        await resp.content.readuntil(b"\n\n")
        resp.close()  # gone while the call's events are held
    for _ in range(100):
        await asyncio.sleep(0.05)
        if (await h.run("r1"))["steps"]:
            break
    await settled(h)


# -- budgets: inputs the reservation cannot bound, usage not to believe ------------------------------


@pytest.mark.parametrize("part", [
    {"type": "input_file", "file_id": "file-123"},
    {"type": "input_file", "file_url": "https://example.com/annual-report.pdf"},
])
async def test_input_stored_or_fetched_upstream_is_refused(gateway_factory: GatewayFactory,
                                                           part: dict[str, Any]) -> None:
    h = await gateway(gateway_factory, budget={"tokens": 5000})
    h.fake.queue(Reply(body=response_body("summary", usage=(250_000, 100))))
    body = {"model": "gpt-4o-mini",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "summarise"}, part]}]}
    status, raw = await post_raw(h, body)
    assert status == 400, raw
    assert orjson.loads(raw)["error"]["param"] == "input"
    assert h.fake.seen == []


@pytest.mark.parametrize("usage", [None, {"input_tokens": -1, "output_tokens": 5},
                                   {"input_tokens": 10, "output_tokens": 1e300},
                                   {"input_tokens": "10", "output_tokens": 5}])
async def test_unbelievable_usage_is_settled_at_the_reservation(gateway_factory: GatewayFactory,
                                                               usage: Any) -> None:
    h = await gateway(gateway_factory, budget={"tokens": 10_000})
    h.fake.queue(Reply(body={**response_body("ok"), "usage": usage}))
    async with client(h) as c:
        await c.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=100)
    assert (await settled(h))["output_tokens"] == 100  # the whole reservation, not the reported figure


# -- caller mistakes are 400s in the OpenAI format, before the upstream ------------------------------


@pytest.mark.parametrize("extra", [
    {"tools": "get_weather"},
    {"tools": [5]},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "custom", "name": 7}]},
    {"tools": [{}]},
    {"tool_choice": {"type": 5}},
    {"tool_choice": {"type": "function", "name": ["x"]}},
    {"tool_choice": "web_search_preview"},
    {"tool_choice": ["auto"]},
    {"text": "json"},
    {"text": {"format": "json_object"}},
    {"text": {"format": {"type": "json_schema"}}},
    {"text": {"format": {"type": "json_schema", "name": 3, "schema": {}}}},
    {"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
    {"text": {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(a)\\1"}}}},
    {"text": {"format": {"type": "xml"}}},
    {"max_output_tokens": "10"},
    {"max_output_tokens": 0},
    {"temperature": "hot"},
    {"input": {"role": "user", "content": "hi"}},
    {"input": ["hi"]},
    {"input": None},
    {"model": 5},
    {"stream": 1},
])
async def test_caller_mistakes_are_400_in_the_openai_format(gw: Harness, extra: dict[str, Any]) -> None:
    status, raw = await post_raw(gw, {"model": "gpt-4o-mini", "input": "hi", **extra})
    assert status == 400, raw
    assert orjson.loads(raw)["error"]["code"] == "invalid_request"
    assert gw.fake.seen == []

