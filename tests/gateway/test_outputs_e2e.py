"""Grammar-constrained outputs through a running gateway with the official SDKs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anthropic
import openai
import orjson
import pytest

from grammars.schema import SchemaCheck
from grammars.spec import Violation
from tests.conftest import GatewayFactory
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import (
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)
from tests.grammars.samples import EXPONENTIAL, exponential_answer

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
RF = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "2+2?"}]
PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}


def client(url: str, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


async def test_invalid_then_valid_reasks_once_from_original(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory()
    h.fake.queue(Reply(body=openai_completion("four")), Reply(body=openai_completion('{"answer": 4}')))
    async with client(h.url, "g1") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # type: ignore[arg-type]
    assert orjson.loads(result.choices[0].message.content or "") == {"answer": 4}
    assert len(h.fake.seen) == 2
    first, second = h.fake.seen[0].json, h.fake.seen[1].json
    assert second["messages"][: len(MSG)] == MSG == first["messages"]
    assert second["messages"][-2] == {"role": "assistant", "content": "four"}
    assert "did not conform" in second["messages"][-1]["content"]
    assert len(second["messages"]) == len(MSG) + 2  # one instruction, never stacked


async def test_always_invalid_is_422_after_retries_and_charged(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(pricing=PRICING, agents={"default": {"output": {"retries": 2},
                                                                   "budget": {"usd": 1.0}}})
    h.fake.default = Reply(body=openai_completion("nope", prompt_tokens=10, completion_tokens=5))
    async with client(h.url, "g2") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # type: ignore[arg-type]
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
    assert len(h.fake.seen) == 3
    bodies = [s.json for s in h.fake.seen]
    assert all(len(b["messages"]) == len(MSG) + 2 for b in bodies[1:])
    run = await h.run("g2")
    assert run["llm_calls"] == 3
    assert run["spent_usd"] == pytest.approx(3 * (10 + 10) / 1e6)
    assert run["reserved_usd"] == 0
    [step] = run["steps"]  # its three attempts add up to what the run was charged
    assert (step["attempts"], step["reasks"]) == (3, 2)
    assert step["cost_usd"] == pytest.approx(run["spent_usd"])
    assert (step["input_tokens"], step["output_tokens"]) == (run["input_tokens"], run["output_tokens"]) == (30, 15)


async def test_a_catastrophic_schema_pattern_never_stalls_the_gateway(gateway_factory: GatewayFactory) -> None:
    """The agent's schema carries `^(a+)+$` and the model writes 40 `a`s and a `!`: Python's `re` would
    stall the whole process for hours. The answer is judged at once, and other requests go on."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    h.fake.default = Reply(body=openai_completion(orjson.dumps({"a": "a" * 40 + "!"}).decode()))
    async with client(h.url, "redos") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await asyncio.wait_for(
                c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=rf),  # type: ignore[arg-type]
                timeout=10)
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
    assert "does not match '^(a+)+$'" in info.value.body["message"]  # type: ignore[index]


async def test_agent_grammar_and_header_grammar(gateway_factory: GatewayFactory, tmp_path: Any) -> None:
    (tmp_path / "grammars").mkdir()
    (tmp_path / "grammars" / "colour.choice").write_text("red\ngreen\nblue\n")
    h = await gateway_factory(agents={"default": {"output": {"grammar": "colour", "retries": 1}}})
    h.fake.queue(Reply(body=openai_completion("purple")), Reply(body=openai_completion("green")))
    async with client(h.url, "g3") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert result.choices[0].message.content == "green"
    async with client(h.url, "g4") as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                            extra_headers={"x-tollgate-grammar": "no-such-grammar"})
    assert "unknown grammar" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("dialect", "expect"),
    [
        ("openai", "response_format"),
        ("vllm", "structured_outputs"),
        ("vllm-legacy", "guided_regex"),
        ("llamacpp", "grammar"),
        ("sglang", "regex"),
    ],
)
async def test_native_params_per_dialect(gateway_factory: GatewayFactory, fake: Any, dialect: str,
                                         expect: str) -> None:
    _, url = fake
    h = await gateway_factory(providers={"local": {"type": "openai", "base_url": f"{url}/v1",
                                                   "structured_outputs": dialect}},
                              models={"*": "local"})
    h.fake.default = Reply(body=openai_completion("12-34"))
    async with client(h.url, f"n-{dialect}") as c:
        await c.chat.completions.create(model="m", messages=MSG, extra_headers={"x-tollgate-grammar": r"regex:[0-9]{2}-[0-9]{2}"})
    sent = h.fake.seen[-1].json
    if expect == "response_format":
        assert "response_format" not in sent  # OpenAI cannot express a regex natively: validated only
    else:
        assert expect in sent


async def test_vllm_client_gets_guarantee_from_any_upstream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory()
    h.fake.queue(Reply(body=openai_completion("maybe")), Reply(body=openai_completion("yes")))
    async with client(h.url, "v") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                                 extra_body={"guided_choice": ["yes", "no"]})
    assert result.choices[0].message.content == "yes"
    assert "guided_choice" not in h.fake.seen[0].json  # vLLM-only fields never reach OpenAI


@pytest.mark.parametrize(
    ("strict", "relayed"),
    [
        # strict: OpenAI fixes the output to the schema, key order included, so the schema's own grammar
        # cuts the stream: the chunk that broke it never reaches the client
        (True, ['{"ans', 'wer": ']),
        # not strict: keys may come in any order, so the schema is checked when the answer is complete;
        # the stream's end waits for that verdict, and the SDK raises
        (False, ['{"ans', 'wer": ', '"four"', "}"]),
    ],
)
async def test_stream_cut_at_the_breaking_chunk(gateway_factory: GatewayFactory, strict: bool,
                                                relayed: list[str]) -> None:
    h = await gateway_factory()
    h.fake.queue(Reply(chunks=openai_stream(['{"ans', 'wer": ', '"four"', "}"])))
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": strict}}
    async with client(h.url, "st") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=rf,  # type: ignore[arg-type]
                                                 stream=True)
        got: list[str] = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(chunk.choices[0].delta.content)
    assert got == relayed
    assert "output" in str(info.value.message) or "constraint" in str(info.value.message)


async def test_a_streamed_choice_the_request_did_not_ask_for_is_never_relayed(gateway_factory: GatewayFactory) -> None:
    """Without `n` one choice is judged as it streams: an upstream that adds a second one is malformed,
    and the stream ends with an error before that choice's text reaches the agent."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'choice:["yes","no"]', "retries": 0}}})

    def chunk(index: int, content: str) -> bytes:
        data = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
                "choices": [{"index": index, "delta": {"role": "assistant", "content": content},
                             "finish_reason": None}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    h.fake.queue(Reply(chunks=[chunk(0, "yes"), chunk(1, "DROP TABLE users"), *openai_stream([])]))
    texts: list[str] = []
    async with client(h.url, "extra-choice") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
        with pytest.raises(openai.APIError) as info:
            async for part in stream:
                texts.extend(choice.delta.content or "" for choice in part.choices)
    assert "DROP TABLE users" not in texts
    assert "beyond the 1 asked for" in str(info.value.message)
    run = await h.settled("extra-choice")
    assert run["reserved_usd"] == 0


async def test_stream_buffer_mode_reasks(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"stream_check": "buffer", "retries": 1}}})
    h.fake.queue(Reply(chunks=openai_stream(["not json"])), Reply(chunks=openai_stream(['{"answer":', " 4}"])))
    async with client(h.url, "buf") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                                 stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert orjson.loads(text) == {"answer": 4}
    assert len(h.fake.seen) == 2


async def test_stream_buffer_mode_reasks_tool_arguments_without_a_text_grammar(gateway_factory: GatewayFactory) -> None:
    """`stream_check: buffer` holds a stream that only offers tools too: a call whose arguments break
    its tool's schema is re-asked (LangChain's default structured output, a forced tool, streamed)."""
    h = await gateway_factory(agents={"default": {"output": {"stream_check": "buffer", "retries": 1}}})
    tools = [{"type": "function", "function": {"name": "get", "parameters": SCHEMA}}]
    h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("get", '{"answer": "x"}')])),
                 Reply(chunks=openai_stream([], tool_calls=[tool_call("get", '{"answer": 1}')])))
    async with client(h.url, "buf-tools") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                 stream=True)
        args = "".join([tc.function.arguments or "" async for ch in stream if ch.choices
                        for tc in ch.choices[0].delta.tool_calls or () if tc.function])
    assert orjson.loads(args) == {"answer": 1}
    assert len(h.fake.seen) == 2 and "invalid arguments" in h.fake.seen[1].json["messages"][-1]["content"]


async def test_anthropic_structured_outputs_are_validated_and_reasked(gateway_factory: GatewayFactory) -> None:
    """Anthropic's own structured outputs (`output_config.format`, the beta's `output_format`) are the
    request's constraint: forwarded as sent, the answer validated and re-asked, a stream cut."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    fmt = {"type": "json_schema", "schema": SCHEMA}
    h.fake.queue(Reply(body=anthropic_message('{"answer": "x"}')), Reply(body=anthropic_message('{"answer": 4}')))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        result = await ac.messages.create(model="claude-sonnet-4-5", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                          extra_body={"output_config": {"format": fmt}})
        assert result.content[0].text == '{"answer": 4}'  # type: ignore[union-attr]
        assert [s.json["output_config"] for s in h.fake.seen] == [{"format": fmt}] * 2
        h.fake.queue(Reply(chunks=anthropic_stream(['{"answer": "', 'x"}'])))
        with pytest.raises(anthropic.APIStatusError) as info:
            async with ac.messages.stream(model="claude-sonnet-4-5", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                          extra_body={"output_format": fmt}) as stream:
                async for _ in stream:
                    pass
        assert info.value.body["error"]["code"] == "output_nonconforming"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as bad:
            await ac.messages.create(model="claude-sonnet-4-5", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                     extra_body={"output_config": {"format": {"type": "regex"}}})
        assert "output_config.format.type" in bad.value.message


REFUSAL = "I can't help with that."


def refusing_completion() -> dict[str, Any]:
    body = openai_completion("")
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "refusal": REFUSAL}
    return body


def refusing_stream() -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1700000000, "model": "gpt-4o-mini",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    return [chunk({"role": "assistant", "content": None, "refusal": ""}), chunk({"refusal": "I can't "}),
            chunk({"refusal": "help with that."}), chunk({}, "stop"), b"data: [DONE]\n\n"]


async def test_a_refusal_is_relayed_not_reasked(gateway_factory: GatewayFactory) -> None:
    """A model's refusal (OpenAI's `refusal`, the Responses API's refusal part, Anthropic's `stop_reason:
    refusal`) is what the SDKs surface as such and what a re-ask cannot change: it reaches the agent as
    it came, once, streamed or not."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 2}}})
    h.fake.queue(Reply(body=refusing_completion()), Reply(chunks=refusing_stream()),
                 Reply(body={**response_body(""), "output": [{
                     "type": "message", "id": "msg_r", "status": "completed", "role": "assistant",
                     "content": [{"type": "refusal", "refusal": REFUSAL}]}]}),
                 Reply(body={**anthropic_message(""), "content": [], "stop_reason": "refusal"}))
    async with client(h.url, "refuse") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # type: ignore[arg-type]
        assert result.choices[0].message.refusal == REFUSAL
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                                 stream=True)
        streamed = "".join([ch.choices[0].delta.refusal or "" async for ch in stream if ch.choices])
        assert streamed == REFUSAL
        response = await c.responses.create(model="gpt-4o-mini", input="2+2?", text={"format": {
            "type": "json_schema", "name": "a", "schema": SCHEMA}})
        assert response.output[0].content[0].refusal == REFUSAL  # type: ignore[union-attr]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        message = await ac.messages.create(model="claude-sonnet-4-5", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                           extra_body={"output_config": {"format": {"type": "json_schema",
                                                                                    "schema": SCHEMA}}})
        assert message.stop_reason == "refusal"
    assert len(h.fake.seen) == 4  # none re-asked


async def test_invalid_tool_arguments_openai_and_anthropic(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    tools = [{"type": "function", "function": {"name": "get", "parameters": SCHEMA}}]
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("get", '{"answer": "x"}')])),
                 Reply(body=openai_completion("", tool_calls=[tool_call("get", '{"answer": 1}')])))
    async with client(h.url, "t1") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools)  # type: ignore[arg-type]
    assert result.choices[0].message.tool_calls[0].function.arguments == '{"answer": 1}'  # type: ignore[index,union-attr]
    assert "invalid arguments" in h.fake.seen[1].json["messages"][-1]["content"]
    h.fake.default = Reply(body=anthropic_message("", tool_uses=[{"id": "t", "name": "get", "input": {"answer": "x"}}]))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        with pytest.raises(anthropic.UnprocessableEntityError) as info:
            await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,
                                     tools=[{"name": "get", "input_schema": SCHEMA}])  # type: ignore[list-item]
    assert info.value.body["error"]["code"] == "output_nonconforming"  # type: ignore[index]


async def test_streamed_tool_arguments_are_checked_before_the_call_is_relayed(
        gateway_factory: GatewayFactory) -> None:
    """A streamed tool call is held until the answer is complete; arguments that break the tool's
    schema never reach the agent: the stream ends with `output_nonconforming` (Chat Completions,
    Messages, Responses), the run goes on, and valid arguments pass untouched."""
    h = await gateway_factory()
    tools = [{"type": "function", "function": {"name": "get", "parameters": SCHEMA}}]
    bad = openai_stream([], tool_calls=[tool_call("get", '{"answer": "x"}')])
    h.fake.queue(Reply(chunks=bad), Reply(chunks=openai_stream([], tool_calls=[tool_call("get", '{"answer": 1}')])))
    async with client(h.url, "st-tools") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                 stream=True)
        calls = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.tool_calls:
                    calls.append(chunk.choices[0].delta.tool_calls)
        assert calls == []  # no byte of the invalid call reached the agent
        assert "'get'" in info.value.message and "parameter schema" in info.value.message
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                 stream=True)
        args = "".join([tc.function.arguments or "" async for ch in stream if ch.choices
                        for tc in ch.choices[0].delta.tool_calls or () if tc.function])
    assert args == '{"answer": 1}'
    run = await h.run("st-tools")
    assert run["status"] == "active" and run["tool_calls"] == 1  # the refused call was never proposed

    h.fake.queue(Reply(chunks=anthropic_stream(["Let me look."], tool_uses=[{"id": "t", "name": "get",
                                                                            "input": {"answer": "x"}}])))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        seen: list[str] = []
        with pytest.raises(anthropic.APIError) as ainfo:
            async with ac.messages.stream(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                          tools=[{"name": "get", "input_schema": SCHEMA}]) as astream:  # type: ignore[list-item]
                async for event in astream:
                    seen.append(event.type)
    assert "parameter schema" in str(ainfo.value)
    assert "text" in seen and not any("tool" in kind or "input_json" in kind for kind in seen)

    h.fake.queue(Reply(chunks=response_stream([], calls=[("get", '{"answer": []}')])))
    async with client(h.url, "st-resp") as c:
        with pytest.raises(openai.APIError) as rinfo:
            async with c.responses.stream(model="gpt-4o-mini", input="2+2?", tools=[  # type: ignore[arg-type]
                    {"type": "function", "name": "get", "parameters": SCHEMA, "strict": False}]) as rstream:
                async for _ in rstream:
                    pass
    assert "parameter schema" in str(rinfo.value)


async def test_a_tool_schema_that_cannot_be_checked_is_refused_before_the_upstream(
        gateway_factory: GatewayFactory) -> None:
    """Its calls could never be validated; found at answer time the call would already be billed. A
    disallowed tool is removed before the upstream sees it, so its schema does not matter."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 100_000},
                                                  "tools": {"allow": ["get", "ok"]}}})
    look = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^(?=a)"}}}
    async with client(h.url, "schema") as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=[  # type: ignore[arg-type]
                {"type": "function", "function": {"name": "ok", "parameters": SCHEMA}},
                {"type": "function", "function": {"name": "get", "parameters": look}}], stream=True)
        assert caught.value.code == "invalid_request" and "'get'" in caught.value.message
        with pytest.raises(openai.BadRequestError):
            await c.responses.create(model="gpt-4o-mini", input="hi", tools=[  # type: ignore[list-item]
                {"type": "function", "name": "get", "parameters": look, "strict": False}])
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-run-id": "schema"}) as ac:
        with pytest.raises(anthropic.BadRequestError) as acaught:
            await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=50, messages=MSG,  # type: ignore[arg-type]
                                     tools=[{"name": "get", "input_schema": {"type": 7}}])  # type: ignore[list-item]
    assert acaught.value.body["error"]["code"] == "invalid_request"  # type: ignore[index]
    assert h.fake.seen == []
    async with h.session.get(f"{h.admin_url}/admin/runs/schema") as resp:
        assert resp.status == 404  # nothing reserved, no step recorded: the run never started
    h.fake.queue(Reply(body=openai_completion("fine")))
    async with client(h.url, "schema") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=[  # type: ignore[arg-type]
            {"type": "function", "function": {"name": "hidden", "parameters": look}}])
    assert result.choices[0].message.content == "fine"
    assert "tools" not in h.fake.seen[0].json  # the disallowed tool never went upstream


async def test_openai_strict_makes_optional_properties_required_not_nullable(gateway_factory: GatewayFactory) -> None:
    """Strict mode gets every property required with its own schema (no null added), and answers are
    validated against the agent's schema itself: a null for the optional string `b` is refused, as it
    would be with `structured_outputs: none` (a relaxed copy used to let it reach the agent)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a"]}
    h = await gateway_factory(agents={"default": {"output": {"grammar": "json_schema:" + orjson.dumps(schema).decode(),
                                                             "retries": 0}}})
    h.fake.queue(Reply(body=openai_completion('{"a": 1, "b": null}')),
                 Reply(body=openai_completion('{"a": 1, "b": "x"}')))
    async with client(h.url, "strict") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
        assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert orjson.loads(result.choices[0].message.content or "") == {"a": 1, "b": "x"}
    sent = h.fake.seen[-1].json["response_format"]["json_schema"]
    assert sent["strict"] is True and sent["schema"]["required"] == ["a", "b"]
    assert sent["schema"]["properties"]["b"] == {"type": "string"}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_ambiguous_request_grammar_cannot_stall_the_gateway(gateway_factory: GatewayFactory,
                                                                     stream: bool) -> None:
    """A 23-byte grammar from one agent (`start: "x" | start start`) made the check of a 1,000-character
    answer take 27 s on the event loop, and every other request and the admin port waited. The check now
    gives up after its time: the agent gets a 400 saying why, and the gateway stays responsive."""
    h = await gateway_factory()
    answer = "x" * 1000
    h.fake.queue(Reply(chunks=openai_stream([answer[i:i + 20] for i in range(0, 1000, 20)])) if stream
                 else Reply(body=openai_completion(answer)))
    headers = {"x-tollgate-grammar": 'lark:start: "x" | start start'}
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with client(h.url, f"ambiguous-{stream}") as c:
        if stream:
            with pytest.raises(openai.APIError, match="ambiguous grammar"):
                async for _ in await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True,
                                                               extra_headers=headers):
                    pass
        else:
            with pytest.raises(openai.BadRequestError, match="ambiguous grammar"):
                await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, extra_headers=headers)
    assert loop.time() - started < 3  # 0.25 s of matcher time, not minutes
    async with h.session.get(f"{h.admin_url}/healthz") as resp:
        assert resp.status == 200
    run = await h.run(f"ambiguous-{stream}")
    assert run["reserved_usd"] == 0 and run["llm_calls"] == 1  # it went upstream: counted, nothing held


async def test_a_request_schema_over_max_schema_bytes_is_a_400_before_anything_is_compiled(
    gateway_factory: GatewayFactory,
) -> None:
    """A 6.9 MB `response_format` schema cost ~20 s of CPU to compile (1.7 s of it on the event loop),
    each distinct one again; a tool's parameters the same. Over `limits.max_schema_bytes` it is a 400
    `invalid_request` naming the limit, and nothing goes upstream."""
    h = await gateway_factory(limits={"max_schema_bytes": 4096})
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}
    async with client(h.url, "big-schema") as c:
        with pytest.raises(openai.BadRequestError, match="max_schema_bytes"):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": big}})
        with pytest.raises(openai.BadRequestError, match=r"parameter schemas.*max_schema_bytes"):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=[
                {"type": "function", "function": {"name": "f", "parameters": big}}])
        half = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(70)}}  # ~2 KB each
        with pytest.raises(openai.BadRequestError, match=r"together, more than limits.max_schema_bytes"):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=[  # the sum counts
                {"type": "function", "function": {"name": f"f{i}", "parameters": half}} for i in range(3)])
        assert h.fake.seen == []
        h.fake.queue(Reply(body=openai_completion('{"answer": 4}')))
        done = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # small
    assert done.choices[0].message.content == '{"answer": 4}'


async def test_a_re_ask_of_several_choices_quotes_the_one_that_broke_the_schema(gateway_factory: GatewayFactory) -> None:
    """With `n: 2` and only the second choice wrong, the re-ask used to quote the first (valid) one as
    "your previous answer" beside the second's error."""
    h = await gateway_factory()
    two = openai_completion('{"answer": 4}')
    two["choices"].append({"index": 1, "message": {"role": "assistant", "content": "four, I think"},
                           "finish_reason": "stop", "logprobs": None})
    fixed = openai_completion('{"answer": 4}')
    fixed["choices"].append({**fixed["choices"][0], "index": 1})
    h.fake.queue(Reply(body=two), Reply(body=fixed))
    async with client(h.url, "n2") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF, n=2)  # type: ignore[arg-type]
    assert [ch.message.content for ch in result.choices] == ['{"answer": 4}'] * 2
    assert h.fake.seen[1].json["messages"][-2] == {"role": "assistant", "content": "four, I think"}



async def test_a_regex_whose_lexer_one_answer_spent_still_checks_the_next_answer(gateway_factory: GatewayFactory) -> None:
    """`[ab]*a[ab]{40}` has an exponential automaton: a 30 KB answer spends llguidance's lexer states.
    That answer is the grammar's 400; it used to read as the answer's violation, and every later answer
    against the same regex was refused at char 0 until a restart."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    headers = {"x-tollgate-grammar": f"regex:{EXPONENTIAL}"}
    h.fake.queue(Reply(body=openai_completion(exponential_answer(30_000))),
                 Reply(body=openai_completion(exponential_answer(50))))
    async with client(h.url, "spent-lexer") as c:
        with pytest.raises(openai.BadRequestError, match="too complex to check the answer with"):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, extra_headers=headers)
        done = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, extra_headers=headers)
    assert done.choices[0].message.content == exponential_answer(50)
    assert (await h.run("spent-lexer"))["reserved_usd"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_long_answer_s_schema_verdict_is_reached_off_the_event_loop(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch, stream: bool,
) -> None:
    """A 200 KB answer's jsonschema verdict may take seconds within its keyword budget: it runs in a
    worker thread, streamed or not, and the verdict is the same."""
    threads: list[int] = []
    check = SchemaCheck.check

    def recorded(self: SchemaCheck, text: str) -> Violation | None:
        threads.append(threading.get_ident())
        return check(self, text)

    monkeypatch.setattr(SchemaCheck, "check", recorded)
    h = await gateway_factory()
    answer = orjson.dumps({"answer": 4, "pad": "x" * 200_000}).decode()
    h.fake.queue(Reply(chunks=openai_stream([answer[i:i + 4096] for i in range(0, len(answer), 4096)])) if stream
                 else Reply(body=openai_completion(answer)))
    async with client(h.url, f"long-{stream}") as c:
        if stream:
            parts = [chunk.choices[0].delta.content or "" async for chunk in await c.chat.completions.create(
                model="gpt-4o-mini", messages=MSG, response_format=RF, stream=True) if chunk.choices]
            assert "".join(parts) == answer
        else:
            done = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)
            assert done.choices[0].message.content == answer
    assert threads and threading.get_ident() not in threads


def two_choices(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    body = openai_completion("")
    body["choices"] = [{"index": i, "message": {"role": "assistant", **m}, "logprobs": None,
                        "finish_reason": "tool_calls" if m.get("tool_calls") else "stop"}
                       for i, m in enumerate((first, second))]
    return body


def two_choice_stream(first: dict[str, Any], second: dict[str, Any]) -> list[bytes]:
    events = []
    for index, delta in enumerate((first, second)):
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
                 "choices": [{"index": index, "delta": {"role": "assistant", **delta},
                              "finish_reason": "tool_calls" if delta.get("tool_calls") else "stop"}]}
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    usage = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini", "choices": [],
             "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
    return [*events, b"data: " + orjson.dumps(usage) + b"\n\n", b"data: [DONE]\n\n"]


@pytest.mark.parametrize("stream", [False, True])
async def test_with_two_choices_each_choice_s_own_calls_decide_whether_its_text_is_the_answer(
    gateway_factory: GatewayFactory, stream: bool,
) -> None:
    """`n: 2`: one choice's call made every other choice's empty text pass unjudged, and a choice's own
    preamble was judged as a final answer. Now a choice is exempt by its own calls only."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[a-z]+", "retries": 0}}})
    call = {"tool_calls": [tool_call("lookup", "{}", "call_1") | {"index": 0}]}
    preamble_and_call = {"content": "I'll check.", **call}
    reply = two_choice_stream if stream else two_choices
    h.fake.queue(Reply(chunks=reply(preamble_and_call, {"content": "fine"})) if stream
                 else Reply(body=reply(preamble_and_call, {"content": "fine"})),
                 Reply(chunks=reply(call, {"content": ""})) if stream else Reply(body=reply(call, {"content": ""})))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    async with client(h.url, f"two-{stream}") as c:
        if stream:
            chunks = [ch async for ch in await c.chat.completions.create(
                model="gpt-4o-mini", messages=MSG, tools=tools, n=2, stream=True)]  # type: ignore[arg-type]
            assert {choice.index for ch in chunks for choice in ch.choices} == {0, 1}
        else:
            done = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools, n=2)  # type: ignore[arg-type]
            assert [ch.message.content for ch in done.choices] == ["I'll check.", "fine"]
        with pytest.raises(openai.APIError, match="output_nonconforming|does not match|ended too early"):
            if stream:
                async for _ in await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                               n=2, stream=True):
                    pass
            else:
                await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools, n=2)  # type: ignore[arg-type]


async def test_a_reask_the_budget_cannot_pay_ends_its_step_not_the_run(gateway_factory: GatewayFactory) -> None:
    """A re-ask is tollgate's request: its body carries the nonconforming answer and an instruction, so it
    may need more than the agent's own request did. One the token budget cannot pay ends the step with the
    answer's own verdict, 422 `output_nonconforming`; the run is not stopped (it was stopped with
    `token_budget_exhausted`, sticky), and the agent's next request, which the budget pays, goes on."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 2}, "budget": {"tokens": 600}}})
    long_prose = "no json here, " * 60  # sent back in the re-ask as the assistant's turn
    h.fake.queue(Reply(body=openai_completion(long_prose, prompt_tokens=10, completion_tokens=200)),
                 Reply(body=openai_completion('{"answer": 4}', prompt_tokens=10, completion_tokens=5)))
    async with client(h.url, "reask-budget") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                            max_tokens=16)
        assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
        assert "re-ask does not fit the run's limits" in info.value.message
        run = await h.run("reask-budget")
        assert (run["status"], run["stop_reason"], run["reserved_tokens"], run["llm_calls"]) == ("active", None, 0, 1)
        assert len(h.fake.seen) == 1  # the re-ask never went upstream
        answer = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,  # type: ignore[arg-type]
                                                 response_format=RF, max_tokens=16)  # type: ignore[arg-type]
    assert orjson.loads(answer.choices[0].message.content or "") == {"answer": 4}
