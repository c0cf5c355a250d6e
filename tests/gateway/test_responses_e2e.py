"""`POST /v1/responses` through a running gateway, with the official `openai` SDK: the Responses API
is a guarded model call like Chat Completions (budget, caps, allow-list, grammars, streams)."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
DELETE = {"type": "function", "name": "delete_all", "parameters": {"type": "object", "properties": {}}}


def client(h: Harness, run: str = "r1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


async def test_answer_is_relayed_budgeted_and_recorded(gw: Harness) -> None:
    gw.fake.queue(Reply(body=response_body("hello there", usage=(12, 7))))
    async with client(gw) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=50)
    assert response.output_text == "hello there"
    seen = gw.fake.seen[-1]
    assert seen.path == "/v1/responses"
    assert seen.headers["Authorization"] == "Bearer sk-provider-openai"
    run = await gw.run("r1")
    assert run["llm_calls"] == 1
    assert (run["input_tokens"], run["output_tokens"], run["reserved_tokens"]) == (12, 7, 0)


async def test_stream_is_relayed_and_settled(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=response_stream(["hel", "lo"], usage=(9, 3))))
    async with client(gw) as c, c.responses.stream(model="gpt-4o-mini", input="hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert deltas == ["hel", "lo"]
    assert final.output_text == "hello"
    run = await gw.run("r1")
    assert (run["input_tokens"], run["output_tokens"], run["reserved_tokens"]) == (9, 3, 0)


async def test_budget_stop_in_the_sdk_s_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 100}}})
    async with client(h) as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="x" * 500)  # more than the budget holds
    assert caught.value.code == "token_budget_exhausted"
    assert h.fake.seen == []


async def test_max_output_tokens_held_to_the_grant(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 400}}})
    h.fake.queue(Reply(body=response_body("ok")))
    async with client(h) as c:
        await c.responses.create(model="gpt-4o-mini", input="hi")
    sent = h.fake.seen[-1].json
    assert 0 < sent["max_output_tokens"] < 400


async def test_disallowed_tools_are_not_offered_and_not_relayed(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"], "on_violation": "drop"}}})
    h.fake.queue(Reply(body=response_body("", calls=[("delete_all", "{}", "c1"), ("get_weather", "{}", "c2")])))
    async with client(h) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="hi",
                                            tools=[WEATHER, DELETE, {"type": "web_search_preview"}])  # type: ignore[list-item]
    offered = h.fake.seen[-1].json["tools"]
    assert [t.get("name", t["type"]) for t in offered] == ["get_weather"]
    assert [item.name for item in response.output if item.type == "function_call"] == ["get_weather"]


async def test_disallowed_streamed_call_is_held_and_dropped(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"], "on_violation": "drop"}}})
    h.fake.queue(Reply(chunks=response_stream(["thinking"], calls=[("delete_all", "{}", "c1"),
                                                                  ("get_weather", '{"city":"Oslo"}', "c2")])))
    async with client(h) as c, c.responses.stream(model="gpt-4o-mini", input="hi",
                                                  tools=[WEATHER]) as stream:  # type: ignore[list-item]
        events = [e async for e in stream]
        final = await stream.get_final_response()
    names = [e.item.name for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert names == ["get_weather"]
    assert [i.name for i in final.output if i.type == "function_call"] == ["get_weather"]
    assert [i.type for i in final.output] == ["message", "function_call"]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]  # renumbered: the dropped call's slot is gone


async def test_disallowed_call_rejected_stops_the_run(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"]}}})
    h.fake.queue(Reply(body=response_body("", calls=[("delete_all", "{}", "c1")])))
    async with client(h) as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER])  # type: ignore[list-item]
    assert caught.value.code == "tool_not_allowed"


async def test_forced_disallowed_tool_is_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"]}}})
    async with client(h) as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search_preview"}],
                                     tool_choice={"type": "web_search_preview"})
    assert caught.value.code == "tool_not_allowed"
    assert h.fake.seen == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": []}, "input"),
        ({"stream": "yes"}, "stream"),
    ],
)
async def test_unbounded_requests_are_400(gw: Harness, extra: dict[str, Any], param: str) -> None:
    body = {"model": "gpt-4o-mini", "input": "hi", **extra}
    async with gw.session.post(f"{gw.url}/v1/responses", data=orjson.dumps(body),
                               headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert gw.fake.seen == []


async def test_schema_is_passed_natively_and_enforced(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": "choice:[\"yes\", \"no\"]", "retries": 1}}})
    h.fake.queue(Reply(body=response_body("maybe")), Reply(body=response_body("yes")))
    async with client(h) as c:
        response = await c.responses.create(model="gpt-4o-mini", input="ok?")
    assert response.output_text == "yes"
    second = h.fake.seen[-1].json
    assert second["input"][-2:] == [{"role": "assistant", "content": "maybe"}, second["input"][-1]]
    assert second["input"][-1]["role"] == "user"


async def test_text_format_schema_is_validated(gw: Harness) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    gw.fake.queue(Reply(body=response_body('{"n": "x"}')), Reply(body=response_body('{"n": 3}')))
    async with client(gw) as c:
        response = await c.responses.create(
            model="gpt-4o-mini", input="n?",
            text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert orjson.loads(response.output_text) == {"n": 3}
    assert gw.fake.seen[0].json["text"]["format"]["schema"] == schema  # the agent's own, forwarded


async def test_stop_message_is_a_response_the_sdk_reads(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}, "on_stop": "message"}})
    h.fake.queue(Reply(body=response_body("first")))
    async with client(h) as c:
        await c.responses.create(model="gpt-4o-mini", input="hi")
        stopped = await c.responses.create(model="gpt-4o-mini", input="again")
        async with c.responses.stream(model="gpt-4o-mini", input="again") as stream:
            final = await stream.get_final_response()
    assert "llm_call_cap" in stopped.output_text
    assert "llm_call_cap" in final.output_text
    assert len(h.fake.seen) == 1


async def test_calls_of_agent_run_hosted_tools_are_judged(gateway_factory: GatewayFactory) -> None:
    """`shell`, `local_shell`, `computer` and `apply_patch` calls run in the agent, like functions: a
    call of one the allow-list does not name is stopped, and the tool itself is never offered."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"]}}})
    shell = {"type": "local_shell_call", "id": "ls_1", "call_id": "c1", "status": "completed",
             "action": {"type": "exec", "command": ["rm", "-rf", "/"], "env": {}}}
    body = response_body("")
    body["output"] = [shell]
    h.fake.queue(Reply(body=body))
    async with client(h) as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER, {"type": "local_shell"}])  # type: ignore[list-item]
    assert caught.value.code == "tool_not_allowed"
    assert [t["type"] for t in h.fake.seen[-1].json["tools"]] == ["function"]
    assert "local_shell" in str(caught.value.message)


async def test_agent_run_hosted_calls_count_and_loop(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"loop": {"window": 3, "max_distinct": 1}}})
    shell = {"type": "shell_call", "id": "sh_1", "call_id": "c1", "status": "completed",
             "action": {"commands": ["ls"], "timeout_ms": 1000}}
    body = response_body("")
    body["output"] = [shell]
    h.fake.default = Reply(body=body)
    async with client(h, "loop") as c:
        for _ in range(2):
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "shell"}])  # type: ignore[list-item]
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "shell"}])  # type: ignore[list-item]
    assert caught.value.code == "loop_detected"
    assert (await h.run("loop"))["tool_calls"] >= 2


async def test_tool_calls_openai_ran_itself_count_toward_the_cap(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 2}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "x"}}
    body = response_body("found it")
    body["output"] = [search, search, *body["output"]]
    h.fake.default = Reply(body=body)
    async with client(h, "hosted") as c:
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
        assert (await h.run("hosted"))["tool_calls"] == 2
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert caught.value.code == "tool_call_cap"
    run = await h.run("hosted")
    assert (run["status"], run["stop_reason"], run["reserved_tokens"]) == ("stopped", "tool_call_cap", 0)


async def test_max_tool_calls_held_to_what_the_cap_leaves(gateway_factory: GatewayFactory) -> None:
    """Tools OpenAI runs cannot be stopped once asked for: a response may use no more than the cap leaves."""
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 5}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}
    body = response_body("ok")
    body["output"] = [search, search, *body["output"]]
    h.fake.queue(Reply(body=body), Reply(body=body), Reply(body=response_body("plain")))
    async with client(h, "left") as c:
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}],  # type: ignore[list-item]
                                 max_tool_calls=9)
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER])  # type: ignore[list-item]
    sent = [seen.json.get("max_tool_calls") for seen in h.fake.seen]
    assert sent == [5, 3, None]  # the cap, then what is left of it; no hosted tool offered: untouched


async def test_with_the_cap_used_up_tools_openai_runs_are_not_offered(gateway_factory: GatewayFactory) -> None:
    """A run exactly at its tool-call cap goes on, but may not ask OpenAI for a call it could not stop."""
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 2}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}
    body = response_body("ok")
    body["output"] = [search, search, *body["output"]]
    h.fake.queue(Reply(body=body), Reply(body=response_body("plain")))
    async with client(h, "used") as c:
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
        await c.responses.create(model="gpt-4o-mini", input="hi", tools=[WEATHER, {"type": "web_search"}])  # type: ignore[list-item]
    second = h.fake.seen[-1].json
    assert [t["type"] for t in second["tools"]] == ["function"] and "max_tool_calls" not in second
    assert (await h.run("used"))["status"] == "active"


async def test_calls_openai_ran_for_a_re_asked_attempt_count_too(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 10},
                                                  "output": {"grammar": 'choice:["yes", "no"]', "retries": 1}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}
    first = response_body("maybe")
    first["output"] = [search, search, search, *first["output"]]
    h.fake.queue(Reply(body=first), Reply(body=response_body("yes")))
    async with client(h, "reasked") as c:
        answer = await c.responses.create(model="gpt-4o-mini", input="ok?", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert answer.output_text == "yes"
    assert (await h.run("reasked"))["tool_calls"] == 3  # the discarded attempt's searches ran, and count


async def test_calls_openai_ran_in_a_step_that_ended_in_an_error_count_too(gateway_factory: GatewayFactory) -> None:
    """The searches ran before the answer failed (still nonconforming after its re-asks): they count, and
    crossing the cap stops the run."""
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 4},
                                                  "output": {"grammar": 'choice:["yes", "no"]', "retries": 1}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}
    first, second = response_body("maybe"), response_body("perhaps")
    first["output"] = [search, search, *first["output"]]
    second["output"] = [search, *second["output"]]
    h.fake.queue(Reply(body=first), Reply(body=second))
    async with client(h, "failed") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.responses.create(model="gpt-4o-mini", input="ok?", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    run = await h.run("failed")
    assert (run["tool_calls"], run["status"]) == (3, "active")
    h.fake.queue(Reply(body=first), Reply(body=response_body("no")))
    async with client(h, "failed") as c:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await c.responses.create(model="gpt-4o-mini", input="ok?", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert caught.value.code == "tool_call_cap"


async def test_calls_openai_ran_in_a_stream_that_broke_count(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 10}}})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}
    events = response_stream(["Found"], complete=False)
    added = b"event: response.output_item.added\ndata: " + orjson.dumps(
        {"type": "response.output_item.added", "sequence_number": 90, "output_index": 1, "item": search}) + b"\n\n"
    h.fake.queue(Reply(chunks=[*events, added]))
    async with client(h, "broke") as c:
        with pytest.raises(openai.APIError):
            async with c.responses.stream(model="gpt-4o-mini", input="hi", tools=[{"type": "web_search"}]) as stream:  # type: ignore[list-item]
                async for _ in stream:
                    pass
    assert (await h.run("broke"))["tool_calls"] == 1
