"""Hostile probes of reasoning agents on the Responses API under budgets: each test failed on the code it
was written against (bf90380) for the defect its docstring states, and passes since its fix."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.conftest import GatewayFactory
from tests.fakes.responses import call_item, message_item, response_body
from tests.fakes.upstream import Reply, openai_compaction

MODEL = "gpt-5-mini"
SCHEMA = {"type": "json_schema", "name": "verdict", "strict": True,
          "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                     "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def reasoning(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]}


def commentary_stream() -> list[bytes]:
    """A streamed gpt-5.x answer as OpenAI sends it: reasoning (summary streamed), a commentary preamble
    (`phase: "commentary"`), then a function call."""
    events: list[bytes] = []

    def ev(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **fields}
        events.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    rs = reasoning("rs_1")
    msg = {**message_item("I'll check the weather."), "phase": "commentary"}
    call = call_item("get_weather", '{"city":"Oslo"}', "c1")
    final = response_body("", model=MODEL, usage=(50, 200))
    final["output"] = [rs, msg, call]
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    ev("response.created", response=shell)
    ev("response.in_progress", response=shell)
    ev("response.output_item.added", output_index=0, item={**rs, "summary": []})
    ev("response.reasoning_summary_part.added", item_id="rs_1", output_index=0, summary_index=0,
       part={"type": "summary_text", "text": ""})
    ev("response.reasoning_summary_text.delta", item_id="rs_1", output_index=0, summary_index=0, delta="Look it up.")
    ev("response.reasoning_summary_text.done", item_id="rs_1", output_index=0, summary_index=0, text="Look it up.")
    ev("response.reasoning_summary_part.done", item_id="rs_1", output_index=0, summary_index=0,
       part=rs["summary"][0])
    ev("response.output_item.done", output_index=0, item=rs)
    where = {"item_id": msg["id"], "output_index": 1, "content_index": 0}
    ev("response.output_item.added", output_index=1, item={**msg, "status": "in_progress", "content": []})
    ev("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    for part in ("I'll check ", "the weather."):
        ev("response.output_text.delta", **where, delta=part, logprobs=[])
    ev("response.output_text.done", **where, text="I'll check the weather.", logprobs=[])
    ev("response.content_part.done", **where, part=msg["content"][0])
    ev("response.output_item.done", output_index=1, item=msg)
    ev("response.output_item.added", output_index=2, item={**call, "status": "in_progress", "arguments": ""})
    ev("response.function_call_arguments.delta", item_id=call["id"], output_index=2, delta=call["arguments"])
    ev("response.function_call_arguments.done", item_id=call["id"], output_index=2, arguments=call["arguments"])
    ev("response.output_item.done", output_index=2, item=call)
    ev("response.completed", response=final)
    return events


@pytest.mark.parametrize("stream", [False, True])
async def test_a_commentary_preamble_before_a_tool_call_is_not_held_to_text_format(
        gateway_factory: GatewayFactory, stream: bool) -> None:
    """Defect: the commentary message of a reasoning model (`phase: "commentary"`, which OpenAI labels
    intermediate commentary, not the final answer: gpt-5.3-codex and later say what they are about to do
    before a tool call) is judged against the request's `text.format` schema. An answer
    [reasoning, commentary "I'll check the weather.", function_call] of an agent asking for a JSON final
    answer (the Agents SDK's `output_type`) is re-asked until `output_nonconforming` (non-streamed: 2
    re-asks billed, then a 422) or cut at its first character (streamed), although it is a normal tool turn
    the SDK would run. Why it matters: every structured-output agent on these models is refused or made
    to pay for pointless re-asks on its tool turns. Expected: only the final-answer text (messages whose
    phase is `final_answer` or absent) is held to the text constraints; the turn is relayed as it came,
    with one upstream call."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}})
    if stream:
        h.fake.queue(Reply(chunks=commentary_stream()))
    else:
        body = response_body("", calls=[("get_weather", '{"city":"Oslo"}', "c1")], model=MODEL, usage=(50, 200))
        body["output"] = [reasoning("rs_1"), {**message_item("I'll check the weather."), "phase": "commentary"},
                          *body["output"]]
        h.fake.queue(Reply(body=body))
    request = {"model": MODEL, "stream": stream, "input": "Weather in Oslo? Answer as JSON.",
               "text": {"format": SCHEMA}, "reasoning": {"effort": "low", "summary": "auto"}, "tools": [WEATHER]}
    async with h.session.post(f"{h.url}/v1/responses", json=request,
                              headers={"x-tollgate-run-id": f"preamble-{stream}"}) as resp:
        status, text = resp.status, await resp.text()
    assert status == 200 and "output_nonconforming" not in text, text[-400:]
    assert len(h.fake.seen) == 1, "a tool turn is not re-asked"
    assert '"get_weather"' in text


async def test_a_compaction_is_reserved_at_the_model_s_real_output_limit(gateway_factory: GatewayFactory) -> None:
    """Defect: `/v1/responses/compact` takes no output limit, so the README reserves "the model's whole
    output limit"; for a model tollgate's table does not list (the whole gpt-5 family, whose real limit
    is 128,000 output tokens) it reserves the provider default, 32,768, and sends the upstream no limit at
    all. Raising the output limit is safe for model calls because tollgate sends it, but nothing holds a
    compaction to it: a compaction of gpt-5-mini under a 36,000-token budget is forwarded with 32,768
    held and may bill up to 128,000 output tokens, here 60,000, settled far above the budget. Why it
    matters: the budget is a hard cap and compaction runs by itself inside SDK sessions. Expected: the
    budget is never overspent: the compaction's reservation covers the most the model can emit (or the
    step is refused when the budget cannot pay it)."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 36_000}}})
    h.fake.queue(Reply(body=openai_compaction(input_tokens=300, output_tokens=60_000)))
    body = {"model": MODEL, "input": [{"role": "user", "content": "hi"}]}
    async with h.session.post(f"{h.url}/v1/responses/compact", json=body,
                              headers={"x-tollgate-run-id": "compact-limit"}) as resp:
        status = resp.status
        await resp.read()
    view = await h.settled("compact-limit") if status == 200 else await h.run("compact-limit")
    spent = view["input_tokens"] + view["output_tokens"]
    assert spent <= 36_000, f"a 36,000-token budget settled at {spent} tokens"
