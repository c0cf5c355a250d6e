"""Hostile probes of the README's "Structured outputs" and "Tools and MCP" sections (and DESIGN.md
sections 5-6) through a running gateway, driven by the official `openai` SDK and raw aiohttp against
loopback fakes.

Every test here fails on the code it was written against: each asserts the documented behaviour, and its
docstring quotes the promise and says what happened instead.
"""

from __future__ import annotations

import openai
import pydantic
import pytest

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, openai_completion, openai_stream, tool_call

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
         for n in ("search_kb", "delete_db")]


def client(url: str, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


def drop_policy(**extra: object) -> dict[str, object]:
    return {"default": {"tools": {"allow": ["search_kb"], "on_violation": "drop"}, **extra}}


class Answer(pydantic.BaseModel):
    answer: int


# -------------------------------------------------------------------- native structured outputs


async def test_an_agent_grammar_does_not_replace_the_requests_own_native_schema(
        gateway_factory: GatewayFactory) -> None:
    """README "Structured outputs": constraints come from the agent's `output.grammar` and "the request
    itself (`response_format`, ...)"; "They are passed natively when the provider's `structured_outputs`
    dialect can express them"; DESIGN section 5: "An agent's `output` grammar and a grammar the request
    brings both apply"; section 6, shape: "add native structured-output parameters".

    An agent whose grammar is `json_object` calls `chat.completions.parse(response_format=Answer)`: the
    SDK sends a strict `json_schema` response_format, which the `openai` dialect expresses as it is.
    What happens instead: tollgate overwrites the request's `response_format` with the agent grammar's
    native form, so OpenAI gets `{"type": "json_object"}` and the request's schema is no longer
    enforced by the upstream at all (only checked afterwards, so a model in plain JSON mode is re-asked
    or ends in a 422 where the strict schema would have held it). The weaker constraint replaced the
    stronger one the request had already put in native form."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "json_object"}}})
    h.fake.default = Reply(body=openai_completion('{"answer": 4}'))
    async with client(h.url, "native-kept") as c:
        result = await c.chat.completions.parse(model="gpt-4o-mini", messages=MSG, response_format=Answer)
    assert result.choices[0].message.parsed == Answer(answer=4)
    sent = h.fake.seen[-1].json["response_format"]
    assert sent["type"] == "json_schema", sent  # the request's strict schema, not the agent's json_object
    assert sent["json_schema"]["schema"]["required"] == ["answer"]


async def test_a_pattern_re2_runs_is_not_refused(gateway_factory: GatewayFactory) -> None:
    """README "Structured outputs": "A schema's `pattern`s run on RE2, in time linear in the answer ...;
    one RE2 cannot run (lookaround, backreferences, a repetition over 1000) is a 400 when the request
    arrives"; "the same holds for the parameter schemas of the allowed tools".

    `^\\p{Lu}\\p{Ll}+$` (Unicode letter classes, valid ECMA-262 and JSON Schema, and a pattern RE2 and
    llguidance both run) is refused with 400 `json_schema: invalid schema at properties/name/pattern:
    ... is not a 'regex'`: the schema is first checked against the metaschema's `format: regex` with
    Python's `re`, which has no `\\p{...}`. The same 400 hits a tool whose parameter schema uses such a
    pattern. Only what RE2 cannot run is promised to be refused."""
    h = await gateway_factory()
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": r"^\p{Lu}\p{Ll}+$"}},
              "required": ["name"]}
    h.fake.queue(Reply(body=openai_completion('{"name": "Émile"}')))
    async with client(h.url, "re2-unicode") as c:
        result = await c.chat.completions.create(
            model="gpt-4o-mini", messages=MSG,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert result.choices[0].message.content == '{"name": "Émile"}'


# ------------------------------------------------------------------------- on_violation: drop


async def test_a_held_stream_left_empty_by_drop_is_re_asked(gateway_factory: GatewayFactory) -> None:
    """README "Tools and MCP": "`drop` removes the call from the answer, and if nothing else is left
    (text or a call ...), re-asks the model once saying the tool is unavailable (still disallowed:
    reject)"; "`output.stream_check: buffer` ... holds the stream until it validates, so it can be
    re-asked too".

    A streamed answer whose only content is a call of a disallowed tool, held whole: the call was
    dropped and nothing was re-asked (one upstream request); the agent's stream was just a role chunk,
    `finish_reason: "stop"` and `[DONE]`, an empty assistant message."""
    h = await gateway_factory(agents=drop_policy(output={"stream_check": "buffer"}))
    h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("delete_db", "{}")])),
                 Reply(chunks=openai_stream(["done ", "without it"])))
    async with client(h.url, "drop-stream-buffer") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=TOOLS,  # type: ignore[arg-type]
                                                 stream=True)
        text = ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
    assert len(h.fake.seen) == 2, f"no re-ask; the agent got {text!r}"
    assert "not available" in str(h.fake.seen[1].json["messages"][-1]["content"])
    assert text == "done without it"


async def test_a_relayed_stream_left_empty_by_drop_ends_saying_why(gateway_factory: GatewayFactory) -> None:
    """README "Tools and MCP": a stream relayed as it arrives cannot be re-asked once it started; one the
    drop left empty ends with a `tool_not_allowed` error event, and the run goes on. Before, the agent got
    an empty assistant message (`finish_reason: "stop"`) and its turn ended with nothing to act on."""
    h = await gateway_factory(agents=drop_policy())
    h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("delete_db", "{}")])))
    async with client(h.url, "drop-stream-incremental") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=TOOLS,  # type: ignore[arg-type]
                                                 stream=True)
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                for choice in chunk.choices:
                    assert not choice.delta.tool_calls, "a dropped call reached the agent"
    assert "tool_not_allowed" in str(info.value.body) or "outside the allow-list" in str(info.value)
    assert len(h.fake.seen) == 1
    run = await h.settled("drop-stream-incremental")
    assert run["status"] == "active" and run["steps"][-1]["tool_calls"] == []  # dropped, the run goes on


async def test_the_drop_re_ask_does_not_use_up_the_grammar_retries(gateway_factory: GatewayFactory) -> None:
    """README "Structured outputs": "a nonconforming answer is re-asked up to `output.retries` times";
    README "Tools and MCP": `drop` with nothing left "re-asks the model once saying the tool is
    unavailable" (a re-ask of its own, for the tool, not one of the grammar's).

    With `retries: 1`: the first answer only calls a disallowed tool (dropped, re-asked), the re-asked
    answer `maybe` breaks the choice grammar. It should get its one re-ask (the third answer, `yes`,
    conforms). What happens instead: 422 `output_nonconforming` "after 1 re-asks" at once: the drop's
    re-ask was counted against `output.retries`, so the nonconforming answer was re-asked 0 times."""
    h = await gateway_factory(agents=drop_policy(output={"grammar": 'choice:["yes","no"]', "retries": 1}))
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("delete_db", "{}")])),
                 Reply(body=openai_completion("maybe")), Reply(body=openai_completion("yes")))
    async with client(h.url, "drop-retries") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=TOOLS)  # type: ignore[arg-type]
    assert result.choices[0].message.content == "yes"
    assert len(h.fake.seen) == 3
