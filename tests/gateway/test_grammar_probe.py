"""Hostile probes of the output-constraint feature (grammar probe round): native streams checked by the
schema's own grammar, numbers, re-asks and budgets. Every test here asserts the documented contract."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from tests.conftest import GatewayFactory
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply, openai_completion, openai_stream

MSG = [{"role": "user", "content": "rate it"}]


def client(url: str, run: str, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, **headers})


async def read_stream(stream: Any) -> tuple[str, Exception | None]:
    text, error = "", None
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
    except openai.APIError as exc:
        error = exc
    return text, error


def grammar(schema: dict[str, Any]) -> str:
    return "json_schema:" + orjson.dumps(schema).decode()


# ------------------------------------------------ native (exact) stream check vs. the schema's verdict

CONFIDENCE = {"type": "object", "properties": {"confidence": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["confidence"]}


@pytest.mark.parametrize(("schema", "parts"), [
    # Python's json.dumps(0.00001) is "1e-05": a bounded number in exponent notation
    (CONFIDENCE, ['{"confidence": 1', 'e-05}']),
    ({"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0}}, "required": ["ratio"]},
     ['{"ratio": 5', 'e-1}']),
    # JSON Schema: an integer is any number with a zero fractional part (4.0 is one)
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]},
     ['{"n": 4', '.0}']),
])
async def test_native_stream_never_cuts_what_the_schema_accepts(gateway_factory: GatewayFactory,
                                                                 schema: dict[str, Any], parts: list[str]) -> None:
    """README: streams are "cut at the first chunk that can no longer be valid (by the schema's own
    grammar, key order included, only where the upstream fixes it)". These answers keep the schema's key
    order and are valid (the same text non-streamed is returned as it is), yet the stream is cut."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": grammar(schema), "retries": 0}}})
    text = "".join(parts)
    h.fake.queue(Reply(body=openai_completion(text)), Reply(chunks=openai_stream(parts)))
    async with client(h.url, "num") as c:
        whole = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
        assert whole.choices[0].message.content == text  # the final verdict accepts it
        assert h.fake.seen[0].json["response_format"]["json_schema"]["strict"] is True  # native, exact
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
        got, error = await read_stream(stream)
    assert error is None, f"valid streamed answer cut: {error}"
    assert got == text




async def test_responses_strict_text_format_stream_not_cut_on_exponent(gateway_factory: GatewayFactory) -> None:
    """The same through the Responses API with the client's own `strict: true` schema (the path the
    OpenAI SDKs take): a valid `1e-05` is cut mid-stream, while the same text non-streamed passes."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    parts = ['{"confidence": 1', 'e-05}']
    h.fake.queue(Reply(body=response_body("".join(parts))), Reply(chunks=response_stream(parts)))
    fmt = {"type": "json_schema", "name": "c", "schema": {**CONFIDENCE, "additionalProperties": False},
           "strict": True}
    async with client(h.url, "resp-num") as c:
        whole = await c.responses.create(model="gpt-4o-mini", input="rate it", text={"format": fmt})  # type: ignore[arg-type]
        assert whole.output_text == "".join(parts)
        error: Exception | None = None
        text = ""
        try:
            async with c.responses.stream(model="gpt-4o-mini", input="rate it", text={"format": fmt}) as s:  # type: ignore[arg-type]
                async for event in s:
                    if event.type == "response.output_text.delta":
                        text += event.delta
        except openai.APIError as exc:
            error = exc
    assert error is None, f"valid streamed answer cut: {error}"
    assert text == "".join(parts)


# ------------------------------------------------------------------------------ malformed constraints

@pytest.mark.parametrize("source", ["[0-9]+\\", "\\"])
async def test_regex_with_a_dangling_backslash_is_a_400(gateway_factory: GatewayFactory, source: str) -> None:
    """A regex ending in a lone backslash is malformed (Python `re`, RE2 and Rust's regex all refuse
    it). Expected (README, Runs/errors): a bad request is "400 `invalid_request`", as for any constraint
    that does not compile (`grammars/requests.py`: "Malformed values raise InvalidGrammar"), before
    anything is reserved or sent. Actual: llguidance silently drops the trailing backslash, so the
    constraint compiles (a lone backslash becomes "the empty output only"), the call goes upstream and
    every retry is spent and charged before a 422 `output_nonconforming`."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 2}}})
    h.fake.default = Reply(body=openai_completion("12"))
    async with client(h.url, "bad-regex", **{"x-tollgate-grammar": "regex:" + source}) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert info.value.body["code"] == "invalid_request"  # type: ignore[index]
    assert h.fake.seen == []


async def test_decimal_multiple_of_is_not_refused(gateway_factory: GatewayFactory) -> None:
    """`multipleOf: 0.1` (prices in tenths; OpenAI strict mode supports the keyword, so tollgate sends it
    natively) and the answer `0.3`: JSON numbers are decimals and 0.3 / 0.1 = 3, so the answer is
    valid. Expected (README): "every answer is validated (JSON Schema ...)" and only "a nonconforming
    answer is re-asked". Actual: the float quotient 2.9999999999999996 makes the verdict "0.3 is not a
    multiple of 0.1": a 422 for a valid answer (after re-asks that all come back valid)."""
    schema = {"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.1}},
              "required": ["price"]}
    h = await gateway_factory(agents={"default": {"output": {"grammar": grammar(schema), "retries": 0}}})
    h.fake.default = Reply(body=openai_completion('{"price": 0.3}'))
    async with client(h.url, "mult") as c:
        result = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG)
    assert orjson.loads(result.choices[0].message.content or "") == {"price": 0.3}
