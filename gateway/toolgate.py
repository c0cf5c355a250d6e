"""Tool allow-lists on model calls: shape the offered tools, judge the proposed calls (pure).

The model only sees allowed tools. A `tool_choice` that forces a disallowed tool, or requires a call
when no offered tool is allowed, is refused before the upstream is called (403 `tool_not_allowed`; the
agent asked, so the run is not stopped). A
proposed call of a disallowed tool is a violation: `on_violation: reject` stops the run; `drop`
removes the call from the answer, and when nothing else is left the model is re-asked once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gateway.call import Answer, Call, ToolCall
from gateway.errors import ToolNotAllowed
from gateway.frozen_init import fast_init
from gateway.providers.tool_wire import filter_request_tools, offers_tools
from gateway.tools import ToolPolicy, refusal_detail

TOOL_NOT_ALLOWED = "tool_not_allowed"


@fast_init
@dataclass(frozen=True, slots=True)
class ToolVerdict:
    denied: tuple[ToolCall, ...]
    action: str  # "reject" | "drop"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(c.name for c in self.denied)

    @property
    def detail(self) -> str:
        return "; ".join(refusal_detail(name) for name in sorted(self.names))

    @property
    def instruction(self) -> str:
        listed = ", ".join(sorted(self.names))
        return (
            f"The tool(s) {listed} are not available to you and were not called. "
            "Answer without them, using only the tools offered."
        )


def shape_tools(policy: ToolPolicy, call: Call, body: dict[str, Any]) -> bool:
    """Filter the offered tools; refuse a forced disallowed tool, and a choice that requires some call
    when no offered tool is left. True when the body changed."""
    if not policy.restricted:
        return False
    if call.tool_choice is not None and not policy.allowed(call.tool_choice):
        raise ToolNotAllowed(f"tool_choice forces a tool outside the allow-list: {refusal_detail(call.tool_choice)}")
    forced = _requires_a_call(body.get("tool_choice"))
    offered = forced and offers_tools(call.protocol, body)
    changed = filter_request_tools(call.protocol, body, policy.allowed)
    if offered and not offers_tools(call.protocol, body):
        # sent on without tools the model would answer in text to an agent that asked for a call
        raise ToolNotAllowed("tool_choice requires a tool call, and the allow-list leaves none of the offered "
                             "tools")
    return changed


def _requires_a_call(choice: Any) -> bool:
    """OpenAI's `required` (Chat Completions, Responses), Anthropic's `{"type": "any"}`."""
    return choice == "required" or (isinstance(choice, dict) and choice.get("type") == "any")


def judge_tools(policy: ToolPolicy, answer: Answer) -> ToolVerdict | None:
    """The answer's calls of disallowed tools, with what the policy does about them."""
    if not policy.restricted or not answer.tool_calls:
        return None
    denied = tuple(c for c in answer.tool_calls if not policy.allowed(c.name))
    if not denied:
        return None
    return ToolVerdict(denied, policy.on_violation)


def without(answer: Answer, names: frozenset[str]) -> Answer:
    """The answer as the agent receives it after dropping the calls of `names`."""
    return replace(answer, tool_calls=tuple(c for c in answer.tool_calls if c.name not in names),
                   choice_calls=tuple(tuple(n for n in made if n not in names) for made in answer.choice_calls))


def answers_something(answer: Answer) -> bool:
    """Whether an answer still says or calls anything (text or a call): thinking, reasoning and the
    records of tools the provider ran are no answer on their own. One that does not, after its
    disallowed calls were dropped, is re-asked once."""
    return bool(answer.text or answer.tool_calls)
