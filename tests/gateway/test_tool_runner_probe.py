"""The anthropic SDK's own agent loop (`client.beta.messages.tool_runner`) run through tollgate under its
guards. Each test here failed on the code it was written against (e2c07ea) for the defect its docstring
states, and passes since its fix."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message
from tests.gateway.anthropic_runner import (  # noqa: F401 - runner_clients: a fixture
    CLAUDE,
    PRICING,
    RAN,
    an,
    get_weather,
    runner_clients,
)


def compaction_answer(output_tokens: int) -> dict[str, Any]:
    """Anthropic's answer to a compaction request: the `compaction` block alone, `stop_reason: compaction`,
    the compaction's own tokens reported in `usage.iterations` (not in the top-level counts)."""
    return {"id": "msg_c", "type": "message", "role": "assistant", "model": CLAUDE,
            "content": [{"type": "compaction", "content": "summary of the weather talk", "encrypted_content": "e"}],
            "stop_reason": "compaction", "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0, "iterations": [
                {"type": "compaction", "input_tokens": 60, "output_tokens": output_tokens}]}}


async def test_tool_runner_compaction_request_goes_upstream_unbounded_and_overspends_the_budget(
    gateway_factory: GatewayFactory,
) -> None:
    """Defect: the tool runner's `compact_before_next_turn()` (anthropic SDK 2.16) sends a request with the
    top-level `compaction: {"type": "summarize"}` parameter: Anthropic summarizes the whole conversation in a
    sampling of its own and reports its tokens only in `usage.iterations` (a `compaction` entry, "not
    included in the top-level usage fields"). Under a USD budget tollgate forwards it, reserving only the
    request's `max_tokens` as for an ordinary answer, then charges the compaction's tokens on top: here a
    $0.01 budget ends at $0.02 spent. README refuses exactly this under any budget for the same sampling
    requested another way (a compaction edit in `context_management`: "whose output no limit tollgate
    sends bounds"), and reserves OpenAI's `/v1/responses/compact` at the model's whole output limit; the
    top-level parameter slips past both (`UNBOUNDED_FIELDS` does not know it). Why it matters: the budget is
    "never overspent" only if every call is held before it goes upstream; one call of the SDK's own
    compaction API spends an arbitrary multiple of what was reserved. Expected: under a budget the
    compaction request is either refused before it goes upstream (a 400 naming `compaction`, like the
    edit) or reserved at a bound it cannot exceed; either way the run never spends more than its budget."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 0.01}}})
    client = an(h, "compact")
    h.fake.queue(Reply(body=anthropic_message("", model=CLAUDE, tool_uses=[
                     {"id": "tu_1", "name": "get_weather", "input": {"city": "Oslo"}}])),
                 Reply(body=compaction_answer(4000)),
                 Reply(body=anthropic_message("Sunny in Oslo.", model=CLAUDE)))
    runner = client.beta.messages.tool_runner(model=CLAUDE, max_tokens=1000, tools=[get_weather],
                                              messages=[{"role": "user", "content": "Weather in Oslo?"}])
    seen = 0
    with pytest.raises(anthropic.APIStatusError):  # refused (400) or stopped (403): it must not run on
        async for _ in runner:
            seen += 1
            if seen == 1:
                runner.compact_before_next_turn()
    assert RAN == ["get_weather:Oslo"]
    view = await h.settled("compact", 1)
    assert view["spent_usd"] <= 0.01, view
    assert not any("compaction" in s.json for s in h.fake.seen if s.path.endswith("/messages"))
