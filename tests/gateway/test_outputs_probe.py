"""Hostile probes of grammar-constrained outputs through a running gateway (official SDKs, loopback
fakes). Tests that expose a bug assert the contract behaviour; the others are regression tests."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import orjson
import pydantic
import pytest
from aiohttp import ClientSession

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

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
RF = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "2+2?"}]
CLAUDE = "claude-3-5-haiku-latest"


def client(url: str, run: str, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, **headers})


def aclient(url: str, run: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0,
                                    default_headers={"x-tollgate-run-id": run})


def choices_completion(*texts: str) -> dict[str, Any]:
    body = openai_completion(texts[0])
    body["choices"] = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop",
                        "logprobs": None} for i, t in enumerate(texts)]
    return body


def stream_chunks(events: list[dict[str, Any]]) -> list[bytes]:
    out = []
    for choices in events:
        data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000,
                "model": "gpt-4o-mini", **choices}
        out.append(b"data: " + orjson.dumps(data) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


async def read_stream_text(stream: Any) -> tuple[dict[int, str], Exception | None]:
    texts: dict[int, str] = {}
    error: Exception | None = None
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    except openai.APIError as exc:
        error = exc
    return texts, error


# --------------------------------------------------------------------------------------------- n > 1


async def test_n2_every_choice_is_validated_not_only_the_first(gateway_factory: GatewayFactory) -> None:
    """`n: 2` asks for two answers; both reach the agent, so both must conform. The second one here
    breaks the schema: it must be re-asked (and then 422), never returned."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    h.fake.default = Reply(body=choices_completion('{"answer": 4}', "four, obviously"))
    async with client(h.url, "n2") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF, n=2)  # type: ignore[arg-type]
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]


async def test_n2_stream_second_choice_is_checked_too(gateway_factory: GatewayFactory) -> None:
    """Streamed `n: 2`: the bytes of choice 1 that break the schema must not reach the client (the
    choices interleave, so the stream is checked whole, as with `stream_check: buffer`)."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                     {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": '{"answer": 4}'}, "finish_reason": None}]},
        {"choices": [{"index": 1, "delta": {"content": "I think it is four"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"},
                     {"index": 1, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}},
    ]
    h.fake.queue(Reply(chunks=stream_chunks(events)))
    async with client(h.url, "n2s") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                            n=2, stream=True)
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
    h.fake.queue(Reply(chunks=stream_chunks([{**e, "choices": [
        {**c, "delta": {"content": '{"answer": 5}'}} if c["delta"].get("content") == "I think it is four" else c
        for c in e["choices"]]} for e in events])))
    async with client(h.url, "n2s") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                                 n=2, stream=True)
        texts, error = await read_stream_text(stream)
    assert error is None and texts == {0: '{"answer": 4}', 1: '{"answer": 5}'}


# ------------------------------------------------------------------- key order vs. native constraint

TWO = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}


async def test_non_strict_response_format_stream_does_not_cut_reordered_keys(
        gateway_factory: GatewayFactory) -> None:
    """A `response_format` json_schema without `strict: true` does not make OpenAI constrain decoding
    (no key order is guaranteed). `{"b": "x", "a": 1}` is valid JSON Schema-wise: the stream must not
    be cut for its key order."""
    h = await gateway_factory()
    rf = {"type": "json_schema", "json_schema": {"name": "two", "schema": TWO}}  # strict absent
    h.fake.queue(Reply(chunks=openai_stream(['{"b": "x", ', '"a": 1}'])))
    async with client(h.url, "order") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=rf,  # type: ignore[arg-type]
                                                 stream=True)
        texts, error = await read_stream_text(stream)
    assert error is None, error
    assert orjson.loads(texts[0]) == {"b": "x", "a": 1}


async def test_non_strict_text_format_stream_does_not_cut_reordered_keys(gateway_factory: GatewayFactory) -> None:
    """Same for the Responses API's `text.format` with `strict: false`."""
    h = await gateway_factory()
    h.fake.queue(Reply(chunks=response_stream(['{"b": "x", ', '"a": 1}'])))
    async with client(h.url, "order-r") as c:
        with_error: Exception | None = None
        try:
            async with c.responses.stream(model="gpt-4o-mini", input="hi", text={"format": {  # type: ignore[arg-type]
                    "type": "json_schema", "name": "two", "schema": TWO, "strict": False}}) as rstream:
                async for _ in rstream:
                    pass
                final = await rstream.get_final_response()
        except openai.APIError as exc:
            with_error = exc
    assert with_error is None, with_error
    assert orjson.loads(final.output_text) == {"b": "x", "a": 1}


async def test_strict_response_format_reordered_keys_non_stream_passes(gateway_factory: GatewayFactory) -> None:
    """Regression: the final verdict is jsonschema's and ignores key order."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    rf = {"type": "json_schema", "json_schema": {"name": "two", "strict": True,
                                                 "schema": {**TWO, "additionalProperties": False}}}
    h.fake.queue(Reply(body=openai_completion('{"b": "x", "a": 1}')))
    async with client(h.url, "order-ns") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=rf)  # type: ignore[arg-type]
    assert orjson.loads(result.choices[0].message.content or "") == {"b": "x", "a": 1}


# --------------------------------------------------------------------------------- vLLM native fields


def vllm_gateway(gateway_factory: GatewayFactory, fake: Any, dialect: str, **extra: Any) -> Any:
    _, url = fake
    return gateway_factory(providers={"local": {"type": "openai", "base_url": f"{url}/v1",
                                                "structured_outputs": dialect}},
                           models={"*": "local"}, **extra)


async def test_vllm_dialect_translates_legacy_guided_fields(gateway_factory: GatewayFactory, fake: Any) -> None:
    """A `structured_outputs: vllm` provider is vLLM >= 0.12, which removed `guided_*`. A client that
    still sends `guided_choice` must get the constraint enforced natively, i.e. as
    `structured_outputs.choice`, not as a field the server ignores."""
    h = await vllm_gateway(gateway_factory, fake, "vllm")
    h.fake.default = Reply(body=openai_completion("yes"))
    async with client(h.url, "vllm-new") as c:
        await c.chat.completions.create(model="m", messages=MSG, extra_body={"guided_choice": ["yes", "no"]})
    sent = h.fake.seen[-1].json
    assert (sent.get("structured_outputs") or {}).get("choice") == ["yes", "no"], sent


async def test_vllm_legacy_dialect_translates_structured_outputs(gateway_factory: GatewayFactory,
                                                                 fake: Any) -> None:
    """The reverse: a `vllm-legacy` server silently ignores `structured_outputs`; the constraint must
    go out as `guided_regex`."""
    h = await vllm_gateway(gateway_factory, fake, "vllm-legacy")
    h.fake.default = Reply(body=openai_completion("12"))
    async with client(h.url, "vllm-old") as c:
        await c.chat.completions.create(model="m", messages=MSG,
                                        extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    sent = h.fake.seen[-1].json
    assert sent.get("guided_regex") == "[0-9]+", sent


async def test_vllm_dialect_agent_schema_goes_out_as_structured_outputs_json(
        gateway_factory: GatewayFactory, fake: Any) -> None:
    """Regression: the agent's schema reaches a vLLM server as `structured_outputs.json`, unchanged."""
    h = await vllm_gateway(gateway_factory, fake, "vllm",
                           agents={"default": {"output": {"grammar": "json_schema:" + orjson.dumps(TWO).decode()}}})
    h.fake.default = Reply(body=openai_completion('{"a": 1, "b": "x"}'))
    async with client(h.url, "vllm-json") as c:
        await c.chat.completions.create(model="m", messages=MSG)
    sent = h.fake.seen[-1].json
    assert sent["structured_outputs"] == {"json": TWO}
    assert "guided_json" not in sent and "response_format" not in sent


# ------------------------------------------------------------------------------ Anthropic and re-asks


async def test_anthropic_prefill_answer_is_judged_with_its_prefill(gateway_factory: GatewayFactory) -> None:
    """Anthropic's documented way to get JSON: prefill the assistant turn with `{`. The model's text
    continues it; the document the agent assembles is prefill + continuation, which conforms."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "json_object", "retries": 0}}})
    h.fake.queue(Reply(body=anthropic_message('"answer": 4}')))
    async with aclient(h.url, "prefill") as ac:
        msg = await ac.messages.create(model=CLAUDE, max_tokens=50, messages=[
            {"role": "user", "content": "2+2? JSON please"}, {"role": "assistant", "content": "{"}])
    assert msg.content[0].text == '"answer": 4}'  # type: ignore[union-attr]


async def test_anthropic_reask_body_stays_valid(gateway_factory: GatewayFactory) -> None:
    """Regression: the Anthropic re-ask keeps `system` top-level, alternates user/assistant, never
    sends an empty assistant text, and the final 422 is in Anthropic's error format."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'choice:["yes","no"]', "retries": 1}}})
    h.fake.default = Reply(body=anthropic_message(""))
    async with aclient(h.url, "a-reask") as ac:
        with pytest.raises(anthropic.UnprocessableEntityError) as info:
            await ac.messages.create(model=CLAUDE, max_tokens=50, system="be terse", messages=[
                {"role": "user", "content": "ok?"}])
    assert info.value.body["error"]["code"] == "output_nonconforming"  # type: ignore[index]
    assert info.value.body["type"] == "error"  # type: ignore[index]
    second = h.fake.seen[1].json
    assert second["system"] == "be terse"
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["user", "assistant", "user"]
    assert second["messages"][1]["content"]  # Anthropic rejects empty text


# ------------------------------------------------------------------------------ x-tollgate-grammar


async def test_two_grammar_header_copies_are_not_silently_reduced_to_one(gateway_factory: GatewayFactory) -> None:
    """Two `x-tollgate-grammar` lines: either both constraints apply or the request is a 400. Here
    the answer satisfies the first copy and breaks the second: it must not come back as a 200."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    h.fake.default = Reply(body=openai_completion("abc"))
    async with ClientSession() as session, session.post(f"{h.url}/v1/chat/completions",
                            data=orjson.dumps({"model": "gpt-4o-mini", "messages": MSG}),
                            headers=[("content-type", "application/json"),
                                     ("x-tollgate-grammar", "regex:[a-z]+"),
                                     ("x-tollgate-grammar", "regex:[0-9]+")]) as resp:
        status = resp.status
        body = await resp.json()
    assert status in (400, 422), body


@pytest.mark.parametrize("value", ["regex:(?=a)b", "regex:(a)\\1", "json_schema:{", "choice:[]",
                                   "choice:[1]", "lark:start: (", "gbnf:root ::= (", "no-such-grammar",
                                   "json_schema:{\"type\": 7}",
                                   'json_schema:{"type":"string","pattern":"(?<=a)b"}'])
async def test_bad_grammar_header_is_400_before_upstream(gateway_factory: GatewayFactory, value: str) -> None:
    h = await gateway_factory()
    async with client(h.url, "badhdr", **{"x-tollgate-grammar": value}) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert info.value.code == "invalid_request"
    assert h.fake.seen == []


# ----------------------------------------------------------------------------------- SDK parse helpers


class Address(pydantic.BaseModel):
    city: str
    zip: str | None = None


class Person(pydantic.BaseModel):
    name: str
    role: str = pydantic.Field(json_schema_extra={"enum": ["admin", "user"]})
    home: Address
    nickname: str | None = None


async def test_sdk_parse_with_defs_and_nullable_optionals(gateway_factory: GatewayFactory) -> None:
    """`chat.completions.parse(response_format=Model)`: strict schema with `$defs`/`$ref` and
    optional fields the model fills with null; streamed through `.stream()` too."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    doc = {"name": "Zoë", "role": "admin", "home": {"city": "Köln", "zip": None}, "nickname": None}
    text = orjson.dumps(doc).decode()
    h.fake.queue(Reply(body=openai_completion(text)),
                 Reply(chunks=openai_stream([text[:7], text[7:20], text[20:]])))
    async with client(h.url, "parse") as c:
        result = await c.chat.completions.parse(model="gpt-4o-mini", messages=MSG, response_format=Person)
        assert result.choices[0].message.parsed == Person.model_validate(doc)
        async with c.chat.completions.stream(model="gpt-4o-mini", messages=MSG,
                                             response_format=Person) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
    assert final.choices[0].message.parsed == Person.model_validate(doc)
    sent = h.fake.seen[0].json["response_format"]
    assert sent["json_schema"]["strict"] is True and "$defs" in sent["json_schema"]["schema"]


async def test_sdk_parse_invalid_enum_is_reasked(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    bad = {"name": "a", "role": "root", "home": {"city": "x", "zip": None}, "nickname": None}
    good = {**bad, "role": "user"}
    h.fake.queue(Reply(body=openai_completion(orjson.dumps(bad).decode())),
                 Reply(body=openai_completion(orjson.dumps(good).decode())))
    async with client(h.url, "parse2") as c:
        result = await c.chat.completions.parse(model="gpt-4o-mini", messages=MSG, response_format=Person)
    assert result.choices[0].message.parsed == Person.model_validate(good)
    assert "'root' is not one of" in h.fake.seen[1].json["messages"][-1]["content"]


async def test_responses_parse_and_reask(gateway_factory: GatewayFactory) -> None:
    """`responses.parse(text_format=Model)`; the re-ask keeps the input and appends one instruction."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    good = {"city": "Paris", "zip": None}
    h.fake.queue(Reply(body=response_body("```json\n" + orjson.dumps(good).decode() + "\n```")),
                 Reply(body=response_body(orjson.dumps(good).decode())))
    async with client(h.url, "rparse") as c:
        result = await c.responses.parse(model="gpt-4o-mini", input="where?", instructions="be brief",
                                         text_format=Address)
    assert result.output_parsed == Address.model_validate(good)
    second = h.fake.seen[1].json
    assert second["instructions"] == "be brief"
    assert second["input"][0] == {"role": "user", "content": "where?"}
    assert [i["role"] for i in second["input"]] == ["user", "assistant", "user"]
    assert second["text"]["format"]["type"] == "json_schema"


# --------------------------------------------------------------------------------- json_object & co


async def test_json_object_mode_fenced_answer_reasked_then_422(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    h.fake.default = Reply(body=openai_completion('```json\n{"a": 1}\n```'))
    async with client(h.url, "jo") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                            response_format={"type": "json_object"})
    assert len(h.fake.seen) == 2
    assert h.fake.seen[1].json["response_format"] == {"type": "json_object"}


async def test_json_object_trailing_whitespace_passes_stream_and_not(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    h.fake.queue(Reply(body=openai_completion('\n {"a": 1}\n\n')),
                 Reply(chunks=openai_stream(["\n", ' {"a"', ": 1}", "\n", "\n \t"])))
    async with client(h.url, "jo-ws") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                                 response_format={"type": "json_object"})
        assert result.choices[0].message.content == '\n {"a": 1}\n\n'
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                                 response_format={"type": "json_object"}, stream=True)
        texts, error = await read_stream_text(stream)
    assert error is None and texts[0] == '\n {"a": 1}\n\n \t'


async def test_retries_zero_means_one_attempt(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    h.fake.default = Reply(body=openai_completion("nope"))
    async with client(h.url, "r0") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # type: ignore[arg-type]
    assert len(h.fake.seen) == 1
    run = await h.run("r0")
    assert run["llm_calls"] == 1


async def test_truncated_json_finish_length_is_nonconforming(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    h.fake.queue(Reply(body=openai_completion('{"answer": ', finish="length")))
    async with client(h.url, "len") as c:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF, max_tokens=5)  # type: ignore[arg-type]
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]


async def test_agent_grammar_and_request_grammar_both_apply(gateway_factory: GatewayFactory) -> None:
    """The agent wants `{"answer": int}`, the request wants a choice: no answer can satisfy both, so
    it is re-asked and then a 422 (not a 200 satisfying only one of them)."""
    h = await gateway_factory(agents={"default": {"output": {
        "grammar": "json_schema:" + orjson.dumps(SCHEMA).decode(), "retries": 1}}})
    h.fake.queue(Reply(body=openai_completion('{"answer": 4}')), Reply(body=openai_completion("yes")))
    async with client(h.url, "both") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert len(h.fake.seen) == 2
    first = h.fake.seen[0].json
    assert "guided_choice" not in first  # vLLM-only field never reaches OpenAI
    assert first["response_format"]["json_schema"]["strict"] is True


async def test_choice_prefixes_stream(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'choice:["yes","yes!"]', "retries": 0}}})
    h.fake.queue(Reply(chunks=openai_stream(["y", "es"])), Reply(chunks=openai_stream(["yes", "!"])),
                 Reply(chunks=openai_stream(["yes", "!!"])))
    async with client(h.url, "choice") as c:
        got = []
        for _ in range(3):
            stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
            got.append(await read_stream_text(stream))
    assert got[0] == ({0: "yes"}, None) and got[1] == ({0: "yes!"}, None)
    assert got[2][0] == {0: "yes"} and got[2][1] is not None


async def test_stream_multibyte_split_across_network_chunks(gateway_factory: GatewayFactory) -> None:
    """A stream whose raw bytes split a UTF-8 sequence (and a JSON surrogate-pair escape) across TCP
    writes: the checker sees whole characters; the valid answer goes through unchanged."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'regex:[^\\x00-\\x7f]+ ok', "retries": 0}}})
    raw = b"".join(openai_stream(["\u00e9\U0001F600", " ok"]))
    pieces = [raw[i:i + 7] for i in range(0, len(raw), 7)]
    h.fake.queue(Reply(chunks=pieces))
    async with client(h.url, "utf8") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
        texts, error = await read_stream_text(stream)
    assert error is None and texts[0] == "\u00e9\U0001F600 ok"


async def test_stream_breaking_event_never_reaches_client_anthropic(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+", "retries": 0}}})
    h.fake.queue(Reply(chunks=anthropic_stream(["12", "3x4", "5"])))
    async with aclient(h.url, "a-cut") as ac:
        texts: list[str] = []
        with pytest.raises(anthropic.APIError) as info:
            async with ac.messages.stream(model=CLAUDE, max_tokens=50, messages=MSG) as stream:  # type: ignore[arg-type]
                async for text in stream.text_stream:
                    texts.append(text)
    assert texts == ["12"]
    assert "constraint" in str(info.value)


async def test_tool_only_answer_not_held_to_text_grammar(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+", "retries": 0}}})
    tools = [{"type": "function", "function": {"name": "get", "parameters": SCHEMA}}]
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("get", '{"answer": 1}')])),
                 Reply(chunks=openai_stream([], tool_calls=[tool_call("get", '{"answer": 1}')])))
    async with client(h.url, "toolonly") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools)  # type: ignore[arg-type]
        assert result.choices[0].message.tool_calls
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, tools=tools, stream=True)  # type: ignore[arg-type]
        calls = [tc async for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert calls




@pytest.mark.parametrize(("grammar", "parts"), [
    ("regex:[0-9]+x", ["12", "3"]),  # ends too early: only the final verdict knows
    ('json_schema:{"type":"object","properties":{"e":{"type":"string","format":"email"}},"required":["e"]}',
     ['{"e": ', '"not-an-email"}']),  # formats are left to the final verdict while streaming
    ("json_schema:" + orjson.dumps(SCHEMA).decode(), ['{"answer', '": 4']),  # truncated JSON
])
async def test_final_verdict_failure_reaches_the_openai_sdk(gateway_factory: GatewayFactory, grammar: str,
                                                            parts: list[str]) -> None:
    """A stream whose every chunk is a valid prefix but whose complete text breaks the constraint must
    end with `output_nonconforming` where the client sees it. The OpenAI SDKs stop reading at
    `data: [DONE]`: an error event written after it is never seen, and the agent takes the broken
    answer (finish_reason "stop") as good."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": grammar, "retries": 0}}})
    h.fake.queue(Reply(chunks=openai_stream(parts)))
    async with client(h.url, "final") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
        texts, error = await read_stream_text(stream)
    assert error is not None, f"the SDK got {texts!r} and no error"
    assert "constraint" in str(error)


async def test_final_verdict_failure_is_before_done_on_the_wire(gateway_factory: GatewayFactory) -> None:
    """The same on the wire: nothing follows `data: [DONE]`, the terminator of an OpenAI stream."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+x", "retries": 0}}})
    h.fake.queue(Reply(chunks=openai_stream(["12", "3"])))
    async with ClientSession() as session, session.post(f"{h.url}/v1/chat/completions",
                            json={"model": "gpt-4o-mini", "messages": MSG, "stream": True}) as resp:
        raw = await resp.read()
    assert b"output_nonconforming" in raw
    before, _done, after = raw.partition(b"data: [DONE]")
    assert b"output_nonconforming" in before and not after.strip(), raw[-300:]


async def test_responses_stream_final_verdict_failure_is_seen(gateway_factory: GatewayFactory) -> None:
    """Regression: the Responses API holds its final event, so a broken complete text ends the stream
    with an error the SDK raises, and `response.completed` never reaches the agent."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+x", "retries": 0}}})
    h.fake.queue(Reply(chunks=response_stream(["12", "3"])))
    kinds: list[str] = []
    async with client(h.url, "r-final") as c:
        with pytest.raises(openai.APIError):
            async with c.responses.stream(model="gpt-4o-mini", input="hi") as rstream:
                async for event in rstream:
                    kinds.append(event.type)
    assert "response.completed" not in kinds


async def test_buffer_mode_anthropic_stream_reasks(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+", "stream_check": "buffer",
                                                             "retries": 1}}})
    h.fake.queue(Reply(chunks=anthropic_stream(["twelve"])), Reply(chunks=anthropic_stream(["1", "2"])))
    async with aclient(h.url, "a-buf") as ac:
        async with ac.messages.stream(model=CLAUDE, max_tokens=50, messages=MSG) as stream:  # type: ignore[arg-type]
            text = "".join([t async for t in stream.text_stream])
    assert text == "12"
    second = h.fake.seen[1].json
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == "twelve"


@pytest.mark.parametrize("dialect", ["openai", "vllm", "llamacpp"])
async def test_anthropic_provider_never_gets_openai_wire_fields(gateway_factory: GatewayFactory, fake: Any,
                                                                 dialect: str) -> None:
    """`structured_outputs` set on an Anthropic provider: either the config is refused or the
    Messages body goes out without OpenAI/vLLM fields (Anthropic rejects unknown fields with a 400)."""
    from gateway.errors import ConfigError

    _, url = fake
    try:
        h = await gateway_factory(
            providers={"anthropic": {"type": "anthropic", "base_url": url, "api_key": "x",
                                     "structured_outputs": dialect}},
            models={"claude-*": "anthropic"},
            agents={"default": {"output": {"grammar": "json_schema:" + orjson.dumps(SCHEMA).decode()}}})
    except (ConfigError, ValueError):
        return
    h.fake.default = Reply(body=anthropic_message('{"answer": 4}'))
    async with aclient(h.url, "a-dialect") as ac:
        await ac.messages.create(model=CLAUDE, max_tokens=50, messages=MSG)  # type: ignore[arg-type]
    sent = h.fake.seen[-1].json
    assert not {"response_format", "structured_outputs", "json_schema", "grammar", "guided_json"} & set(sent), sent
