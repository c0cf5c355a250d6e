"""Probes of Anthropic's own structured outputs (`output_config.format`) through tollgate: defects only.

Anthropic documents that a structured-outputs request Claude refuses is answered 200 with
`stop_reason: "refusal"`, the refusal taking precedence over the schema ("the output may not match your
schema"), and that a refused turn must be removed from the context before going on ("Attempting to
continue without resetting will result in continued refusals"). Tollgate holds the refusal to the schema:
it appends the refused turn and re-asks (billed, futile), then replaces Anthropic's answer with a 422 /
an `output_nonconforming` error event, so the agent (and the SDK's refusal handling) never sees it.
"""

from __future__ import annotations

import anthropic

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message, anthropic_stream

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
FMT = {"type": "json_schema", "schema": SCHEMA}
MSG = [{"role": "user", "content": "2+2?"}]
MODEL = "claude-sonnet-4-5"


async def test_refusal_is_relayed_not_reasked(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    body = anthropic_message("I can't help with that.", model=MODEL)
    body["stop_reason"] = "refusal"
    h.fake.default = Reply(body=body)
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        result = await ac.messages.create(model=MODEL, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                          extra_body={"output_config": {"format": FMT}})
    assert result.stop_reason == "refusal"
    assert len(h.fake.seen) == 1  # a refused turn re-sent as context is refused again (and billed)


async def test_streamed_refusal_is_relayed(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    # a streaming classifier stops the answer part-way: the JSON so far, then stop_reason refusal
    chunks = [c.replace(b'"stop_reason":"end_turn"', b'"stop_reason":"refusal"')
              for c in anthropic_stream(['{"answer": '], model=MODEL)]
    h.fake.queue(Reply(chunks=chunks))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as ac:
        async with ac.messages.stream(model=MODEL, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                      extra_body={"output_config": {"format": FMT}}) as stream:
            final = await stream.get_final_message()
    assert final.stop_reason == "refusal"
