"""Tool allow-lists on model calls through a running gateway, with the official SDKs."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import GatewayFactory
from tests.fakes.responses import call_item, response_body, response_stream
from tests.fakes.upstream import (
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)

MSG = [{"role": "user", "content": "do it"}]
OA_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("search_kb", "delete_db", "files/read_x")]
AN_TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("search_kb", "delete_db")]


def policy(on_violation: str = "reject") -> dict[str, Any]:
    return {"default": {"tools": {"allow": ["search_kb", "files/read_*"], "on_violation": on_violation}}}


def oa(url: str, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


async def test_disallowed_tools_never_reach_the_upstream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy())
    async with oa(h.url, "offer") as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS)  # type: ignore[arg-type]
    sent = [t["function"]["name"] for t in h.fake.seen[-1].json["tools"]]
    assert sent == ["search_kb", "files/read_x"]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG, tools=AN_TOOLS)  # type: ignore[arg-type]
    assert [t["name"] for t in h.fake.seen[-1].json["tools"]] == ["search_kb"]


@pytest.mark.parametrize(("allow", "kept"), [(["search_kb"], False), (["search_kb", "mcp"], True)])
async def test_anthropic_mcp_servers_only_when_mcp_is_allowed(gateway_factory: GatewayFactory, allow: list[str],
                                                              kept: bool) -> None:
    """The MCP connector's servers are called by Anthropic itself: offered only when `mcp` is allowed."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": allow}}})
    servers = [{"type": "url", "url": "https://mcp.example.com/sse", "name": "anything"}]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG,  # type: ignore[arg-type]
                                 extra_body={"mcp_servers": servers})
    assert ("mcp_servers" in h.fake.seen[-1].json) is kept


async def test_forced_disallowed_tool_choice_is_403_without_upstream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy())
    async with oa(h.url, "force") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS,  # type: ignore[arg-type]
                                            tool_choice={"type": "function", "function": {"name": "delete_db"}})
    assert info.value.body["code"] == "tool_not_allowed"  # type: ignore[index]
    assert h.fake.seen == []
    assert (await h.run("force"))["status"] == "active"  # the agent asked: not a model violation


async def test_a_required_call_with_no_allowed_tool_is_403_without_upstream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy())
    async with oa(h.url, "required") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS[1:2],  # type: ignore[call-overload]
                                            tool_choice="required")
    assert info.value.body["code"] == "tool_not_allowed"  # type: ignore[index]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-run-id": "required"}) as ac:
        with pytest.raises(anthropic.PermissionDeniedError):
            await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG,  # type: ignore[call-overload]
                                     tools=AN_TOOLS[1:], tool_choice={"type": "any"})
    assert h.fake.seen == []
    assert (await h.run("required"))["status"] == "active"


async def test_reject_stops_the_run(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("reject"))
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("delete_db", "{}")])))
    async with oa(h.url, "rej") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS)  # type: ignore[arg-type]
        assert info.value.body["code"] == "tool_not_allowed"  # type: ignore[index]
        with pytest.raises(openai.PermissionDeniedError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    run = await h.run("rej")
    assert (run["status"], run["stop_reason"]) == ("stopped", "tool_not_allowed")


async def test_drop_cleans_the_answer_and_keeps_allowed_calls(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("drop"))
    calls = [tool_call("delete_db", "{}", "a"), tool_call("search_kb", '{"q": 1}', "b")]
    h.fake.queue(Reply(body=openai_completion("", tool_calls=calls)))
    async with oa(h.url, "drop") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS)  # type: ignore[arg-type]
    names = [tc.function.name for tc in result.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert names == ["search_kb"]
    assert (await h.run("drop"))["tool_calls"] == 1


async def test_drop_with_nothing_left_reasks_once_then_rejects(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("drop"))
    bad = Reply(body=openai_completion("", tool_calls=[tool_call("delete_db", "{}")]))
    h.fake.queue(bad, Reply(body=openai_completion("done without it")))
    async with oa(h.url, "d1") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS)  # type: ignore[arg-type]
    assert result.choices[0].message.content == "done without it"
    assert "not available" in h.fake.seen[1].json["messages"][-1]["content"]
    h.fake.queue(bad, bad)
    async with oa(h.url, "d2") as c:
        with pytest.raises(openai.PermissionDeniedError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS)  # type: ignore[arg-type]
    assert (await h.run("d2"))["stop_reason"] == "tool_not_allowed"


@pytest.mark.parametrize("on_violation", ["reject", "drop"])
async def test_streamed_text_then_disallowed_call_no_byte_leaks(gateway_factory: GatewayFactory,
                                                                on_violation: str) -> None:
    h = await gateway_factory(agents=policy(on_violation))
    h.fake.queue(Reply(chunks=openai_stream(["Let me ", "clean up."],
                                            tool_calls=[tool_call("delete_db", '{"all": true}', "z")])))
    async with h.session.post(f"{h.url}/v1/chat/completions", headers={"x-tollgate-run-id": f"s-{on_violation}"},
                              json={"model": "gpt-4o-mini", "messages": MSG, "tools": OA_TOOLS, "stream": True}) as r:
        body = await r.read()
    assert b"Let me " in body and b"clean up." in body
    assert b'"tool_calls"' not in body and b'"all"' not in body  # no byte of the call itself
    if on_violation == "reject":
        assert b"tool_not_allowed" in body
    else:
        assert body.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"stop"' in body


async def test_openai_sdk_stream_drop_keeps_allowed_call(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("drop"))
    calls = [tool_call("delete_db", "{}", "a"), tool_call("search_kb", '{"q":1}', "b")]
    h.fake.queue(Reply(chunks=openai_stream([], tool_calls=calls)))
    async with (
        oa(h.url, "sdk-s") as c,
        c.chat.completions.stream(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS) as stream,  # type: ignore[arg-type]
    ):
        final = await stream.get_final_completion()
    assert [t.function.name for t in final.choices[0].message.tool_calls or []] == ["search_kb"]


async def test_a_streamed_name_split_across_chunks_is_dropped_whole(gateway_factory: GatewayFactory) -> None:
    """An OpenAI-compatible server that splits `delete_db` into `delete_` + `db`: the agent sees no
    piece of the refused call, and the allowed one arrives whole."""
    h = await gateway_factory(agents=policy("drop"))
    chunks = openai_stream([], tool_calls=[tool_call("delete_db", "{}", "a"), tool_call("search_kb", "{}", "b")])
    first = orjson.loads(chunks[1].removeprefix(b"data: "))
    call = first["choices"][0]["delta"]["tool_calls"][0]
    call["function"]["name"] = "delete_"
    rest = {**first, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "db", "arguments": ""}}]}}]}
    split = [chunks[0], b"data: " + orjson.dumps(first) + b"\n\n", b"data: " + orjson.dumps(rest) + b"\n\n",
             *chunks[2:]]
    h.fake.queue(Reply(chunks=split))
    async with (
        oa(h.url, "split") as c,
        c.chat.completions.stream(model="gpt-4o-mini", messages=MSG, tools=OA_TOOLS) as stream,  # type: ignore[arg-type]
    ):
        final = await stream.get_final_completion()
    assert [t.function.name for t in final.choices[0].message.tool_calls or []] == ["search_kb"]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_reject_and_drop(gateway_factory: GatewayFactory, stream: bool) -> None:
    uses = [{"id": "t1", "name": "delete_db", "input": {}}, {"id": "t2", "name": "search_kb", "input": {"q": 1}}]
    h = await gateway_factory(agents=policy("drop"))
    reply = Reply(chunks=anthropic_stream(["hi"], tool_uses=uses)) if stream else Reply(body=anthropic_message("hi", tool_uses=uses))
    h.fake.queue(reply)
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        if stream:
            async with ac.messages.stream(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,
                                          tools=AN_TOOLS) as s:  # type: ignore[arg-type]
                msg = await s.get_final_message()
        else:
            msg = await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,
                                           tools=AN_TOOLS)  # type: ignore[arg-type]
    names = [b.name for b in msg.content if b.type == "tool_use"]
    assert names == ["search_kb"]
    h2 = await gateway_factory(agents=policy("reject"))
    h2.fake.queue(Reply(body=anthropic_message("", tool_uses=uses[:1])))
    async with anthropic.AsyncAnthropic(base_url=h2.url, api_key="k", max_retries=0) as ac:
        with pytest.raises(anthropic.PermissionDeniedError) as info:
            await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG, tools=AN_TOOLS)  # type: ignore[arg-type]
    assert info.value.body["error"]["code"] == "tool_not_allowed"  # type: ignore[index]


async def test_a_tool_call_in_the_anthropic_stream_s_message_start_never_reaches_the_agent(
    gateway_factory: GatewayFactory,
) -> None:
    """Anthropic streams content in content blocks; the SDK starts its message from `message_start`, so a
    tool_use there would be the agent's without any judgement: such a stream is malformed."""
    h = await gateway_factory(agents=policy("reject"))
    chunks = anthropic_stream(["hi"])
    start = orjson.loads(chunks[0].split(b"data: ", 1)[1])
    start["message"]["content"] = [{"type": "tool_use", "id": "t9", "name": "delete_db", "input": {}}]
    chunks[0] = b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"
    h.fake.queue(Reply(chunks=chunks))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-run-id": "start-call"}) as ac:
        with pytest.raises(anthropic.APIError) as info:
            async with ac.messages.stream(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,
                                          tools=AN_TOOLS) as s:  # type: ignore[arg-type]
                await s.get_final_message()
    assert "message_start carries content" in str(info.value.message)
    run = await h.settled("start-call")
    assert run["tool_calls"] == 0 and run["reserved_usd"] == 0


async def test_a_function_call_in_a_responses_stream_s_created_event_never_reaches_the_agent(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents=policy("reject"))
    chunks = response_stream(["hi"])
    created = orjson.loads(chunks[0].split(b"data: ", 1)[1])
    created["response"]["output"] = [call_item("delete_db", "{}", "c9")]
    chunks[0] = b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h.url, "created-call") as c:
        stream = await c.responses.create(model="gpt-4o-mini", input="do it", stream=True,
                                          tools=[{"type": "function", "name": "delete_db", "parameters": {}}])
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
    assert "response.created carries output" in str(info.value.message)
    run = await h.settled("created-call")
    assert run["tool_calls"] == 0 and run["reserved_usd"] == 0


async def test_lookalike_tool_name_is_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("reject"))
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("search_\u043ab", "{}")])))
    async with oa(h.url, "look") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert "U+043A" in info.value.body["message"]  # type: ignore[index]
    assert orjson.loads(h.fake.seen[0].body)["messages"] == MSG


# -- OpenAI's legacy function calling is held to the same allow-list -----------------------------------

OA_FUNCTIONS = [{"name": n, "parameters": {"type": "object"}} for n in ("search_kb", "delete_db")]


def legacy_answer(name: str, arguments: str = "{}") -> dict[str, Any]:
    body = openai_completion("")
    body["choices"][0]["message"] = {"role": "assistant", "content": None,
                                     "function_call": {"name": name, "arguments": arguments}}
    body["choices"][0]["finish_reason"] = "function_call"
    return body


def legacy_stream(name: str) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

    return [chunk({"role": "assistant", "content": None}),
            chunk({"function_call": {"name": name[:3], "arguments": ""}}),
            chunk({"function_call": {"name": name[3:], "arguments": "{}"}}),
            chunk({}, "function_call"), b"data: [DONE]\n\n"]


async def test_legacy_functions_are_filtered_and_a_forced_one_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy())
    h.fake.queue(Reply(body=openai_completion("ok")))
    async with oa(h.url, "lf") as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS)  # type: ignore[arg-type]
        assert [f["name"] for f in h.fake.seen[-1].json["functions"]] == ["search_kb"]
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS,  # type: ignore[arg-type]
                                            function_call={"name": "delete_db"})
    assert info.value.body["code"] == "tool_not_allowed"  # type: ignore[index]
    assert len(h.fake.seen) == 1


async def test_a_proposed_legacy_call_of_a_refused_function_stops_the_run(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("reject"))
    h.fake.queue(Reply(body=legacy_answer("delete_db")))
    async with oa(h.url, "lr") as c:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS)  # type: ignore[arg-type]
    assert info.value.body["code"] == "tool_not_allowed"  # type: ignore[index]
    run = await h.run("lr")
    assert (run["status"], run["stop_reason"]) == ("stopped", "tool_not_allowed")


async def test_a_streamed_legacy_call_is_held_and_dropped(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=policy("drop"))
    h.fake.queue(Reply(chunks=legacy_stream("delete_db")))
    async with oa(h.url, "ls") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS,  # type: ignore[arg-type]
                                                 stream=True)
        chunks = []
        with pytest.raises(openai.APIError) as info:  # nothing else was left: no empty answer, a refusal
            async for chunk in stream:
                chunks.append(chunk)
    assert not any(ch.choices and ch.choices[0].delta.function_call for ch in chunks)
    assert "not in the agent's allow-list" in str(info.value)


async def test_legacy_calls_count_against_the_tool_call_cap(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 1}}})
    h.fake.queue(Reply(body=legacy_answer("search_kb", '{"q": 1}')), Reply(body=legacy_answer("search_kb", '{"q": 2}')))
    async with oa(h.url, "lc") as c:
        first = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS)  # type: ignore[arg-type]
        assert first.choices[0].message.function_call.name == "search_kb"  # type: ignore[union-attr]
        with pytest.raises(openai.PermissionDeniedError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, functions=OA_FUNCTIONS)  # type: ignore[arg-type]
    assert info.value.body["code"] == "tool_call_cap"  # type: ignore[index]


# -- tool shapes without a `name`: Anthropic's toolsets; OpenAI's namespaces hold named functions -------------

MCP_SERVERS = [{"type": "url", "url": "https://mcp.example.com/mcp", "name": "gh"}]


@pytest.mark.parametrize(("agent", "kept"), [
    ({}, True),  # no tool policy: forwarded as sent
    ({"tools": {"allow": ["search_kb", "mcp"]}}, True),
    ({"tools": {"allow": ["search_kb"]}}, False),  # removed with its servers, the agent's own tool kept
])
async def test_anthropic_mcp_toolset_is_judged_as_the_mcp_connector(gateway_factory: GatewayFactory,
                                                                   agent: dict[str, Any], kept: bool) -> None:
    """The MCP connector's current shape (beta mcp-client-2025-11-20): a `tools` entry without a `name`."""
    h = await gateway_factory(agents={"default": agent})
    tools = [{"type": "mcp_toolset", "mcp_server_name": "gh"}, AN_TOOLS[0]]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        msg = await ac.beta.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG,  # type: ignore[arg-type]
                                            mcp_servers=MCP_SERVERS, tools=tools,  # type: ignore[arg-type]
                                            betas=["mcp-client-2025-11-20"])
    assert msg.content[0].type == "text"
    sent = h.fake.seen[-1]
    assert sent.headers["anthropic-beta"] == "mcp-client-2025-11-20"
    assert sent.json["tools"] == (tools if kept else tools[1:])
    assert ("mcp_servers" in sent.json) is kept


async def test_anthropic_computer_toolset_and_its_member_calls_are_judged_by_family(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["search_kb"], "on_violation": "drop"}}})
    uses = [{"id": "t1", "name": "left_click", "input": {"coordinate": [1, 2]}, "toolset_name": "computer"},
            {"id": "t2", "name": "search_kb", "input": {}}]
    h.fake.queue(Reply(body=anthropic_message("", tool_uses=uses)))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        msg = await ac.beta.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG,  # type: ignore[arg-type]
                                            tools=[{"type": "computer_toolset_20260801"}, AN_TOOLS[0]])  # type: ignore[list-item]
    assert h.fake.seen[-1].json["tools"] == AN_TOOLS[:1]
    assert [b.id for b in msg.content if b.type == "tool_use"] == ["t2"]


@pytest.mark.parametrize("allow", [["search_kb"], ["search_kb", "namespace"]])
async def test_responses_namespace_offers_and_calls_only_allowed_functions(gateway_factory: GatewayFactory,
                                                                         allow: list[str]) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": allow, "on_violation": "drop"}}})
    answer = response_body("", calls=[("delete_all", "{}", "c1"), ("search_kb", "{}", "c2")])
    for item in answer["output"]:
        item["namespace"] = "crm"
    h.fake.queue(Reply(body=answer))
    fn: list[Any] = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}}
                     for n in ("search_kb", "delete_all")]
    async with oa(h.url, "ns") as c:
        response = await c.responses.create(model="gpt-4o-mini", input="hi", tools=[
            {"type": "namespace", "name": "crm", "description": "CRM", "tools": fn}])
    [offered] = h.fake.seen[-1].json["tools"]
    assert (offered["name"], offered["tools"]) == ("crm", fn[:1])
    calls = [(i.name, i.namespace) for i in response.output if i.type == "function_call"]
    assert calls == [("search_kb", "crm")]
