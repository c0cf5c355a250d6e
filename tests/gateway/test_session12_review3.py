"""Review of 947629b (commentary messages relayed unjudged; compaction reserved at the model's whole limit):
each test failed on that commit for the defect its docstring states, and passes since its fix."""

from __future__ import annotations

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, openai_compaction
from tests.gateway.test_reasoning_probe import MODEL, SCHEMA, WEATHER, commentary_stream


async def test_commentary_left_alone_by_a_dropped_call_is_held_to_text_format(
        gateway_factory: GatewayFactory) -> None:
    """Defect: a streamed answer [reasoning, commentary "I'll check the weather.", function_call] whose call
    the allow-list drops (`tools.on_violation: drop`) reaches an agent that asked for a JSON `text.format`
    as a completed response whose only message is the commentary, with no check of its text. The
    commentary deltas are no longer fed to the stream's checkers, the answer counts as calls-only when the
    checkers' `finish` is skipped, and after the drop nothing judges the text again. Why: with the call
    gone the commentary is the response's only output; the SDK reads it as `output_text` (the Agents SDK as
    the final output) and gets "I'll check the weather." where it asked for a schema: a nonconforming
    final answer. Before this commit its first character failed the checker and the stream was cut; the
    non-streamed path re-judges the answer after the drop and re-asks. Expected: what is left after the
    drop is held to the text constraints (the stream ends with `output_nonconforming`), as non-streamed."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0},
                                                  "tools": {"allow": ["search"], "on_violation": "drop"}}})
    h.fake.queue(Reply(chunks=commentary_stream()))
    request = {"model": MODEL, "stream": True, "input": "Weather in Oslo? Answer as JSON.",
               "text": {"format": SCHEMA}, "tools": [WEATHER]}
    async with h.session.post(f"{h.url}/v1/responses", json=request,
                              headers={"x-tollgate-run-id": "drop-stream"}) as resp:
        status, text = resp.status, await resp.text()
    relayed_final = status == 200 and "output_nonconforming" not in text and '"get_weather"' not in text
    assert not relayed_final, f"the commentary alone reached the agent as its answer: {text[-600:]}"


async def test_a_gpt5_pro_compaction_is_reserved_at_its_272000_token_limit(gateway_factory: GatewayFactory) -> None:
    """Defect: `LARGER_LIMITS` puts the whole gpt-5 family at 128,000 output tokens (`"gpt-5*"`), but
    gpt-5-pro's published output limit is 272,000 (OpenAI's model page: 400,000 context, 272,000 max
    output). A compaction of gpt-5-pro, which takes no output limit, is reserved at 128,000 and forwarded
    under a 200,000-token budget, and may bill up to 272,000 output tokens (here 250,000): settled far above
    the budget. Why: the budget is a hard cap; the commit's point was to reserve a compaction at the
    model's whole limit. Expected: gpt-5-pro (and its snapshots) listed before `gpt-5*` at 272,000, so the
    compaction is refused (403 budget_exhausted) when the budget cannot pay it, and nothing is overspent."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 200_000}}})
    h.fake.queue(Reply(body=openai_compaction(input_tokens=300, output_tokens=250_000)))
    body = {"model": "gpt-5-pro", "input": [{"role": "user", "content": "hi"}]}
    async with h.session.post(f"{h.url}/v1/responses/compact", json=body,
                              headers={"x-tollgate-run-id": "compact-pro"}) as resp:
        status = resp.status
        await resp.read()
    view = await h.settled("compact-pro") if status == 200 else await h.run("compact-pro")
    spent = view["input_tokens"] + view["output_tokens"]
    assert spent <= 200_000, f"a 200,000-token budget settled at {spent} tokens"
