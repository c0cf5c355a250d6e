"""gateway/toolgate.py: tool allow-lists on model calls (shape the offered tools, judge proposed calls)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from gateway.call import Answer, Call, ToolCall, Usage
from gateway.config import Limits, Tools
from gateway.errors import Stopped, ToolNotAllowed
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.openai_chat import OpenAIChat
from gateway.toolgate import TOOL_NOT_ALLOWED, ToolVerdict, judge_tools, shape_tools, without
from gateway.tools import ToolPolicy

MSG = [{"role": "user", "content": "hi"}]
ALLOW = ("search", "files/read_*")


def policy(allow: tuple[str, ...] | None = ALLOW, on_violation: str = "reject") -> ToolPolicy:
    return ToolPolicy(Tools.model_validate({"allow": allow, "on_violation": on_violation}))


def openai_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def anthropic_tool(name: str) -> dict[str, Any]:
    return {"name": name, "input_schema": {"type": "object"}}


def openai_body(names: list[str], **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": MSG, "tools": [openai_tool(n) for n in names], **extra}


def anthropic_body(names: list[str], **extra: Any) -> dict[str, Any]:
    return {"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": MSG,
            "tools": [anthropic_tool(n) for n in names], **extra}


def parse(protocol: str, body: dict[str, Any]) -> Call:
    adapter = OpenAIChat() if protocol == "openai" else AnthropicMessages()
    return adapter.parse_request(body, orjson.dumps(body), Limits())


def body_for(protocol: str, names: list[str], **extra: Any) -> dict[str, Any]:
    return openai_body(names, **extra) if protocol == "openai" else anthropic_body(names, **extra)


def offered(protocol: str, body: dict[str, Any]) -> list[str] | None:
    if "tools" not in body:
        return None
    if protocol == "openai":
        return [t["function"]["name"] for t in body["tools"]]
    return [t["name"] for t in body["tools"]]


# -- shape_tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize(
    ("names", "changed", "kept"),
    [
        (["search", "files/read_a"], False, ["search", "files/read_a"]),  # all allowed: untouched
        (["search", "delete", "files/read_a", "files/write_a"], True, ["search", "files/read_a"]),
        (["delete", "Search", "search "], True, None),  # none left: `tools` removed
        ([], False, []),
    ],
)
def test_shape_tools_filters_offered_tools(protocol: str, names: list[str], changed: bool,
                                           kept: list[str] | None) -> None:
    body = body_for(protocol, names)
    assert shape_tools(policy(), parse(protocol, body), body) is changed
    assert offered(protocol, body) == kept


@pytest.mark.parametrize(
    ("protocol", "extra"),
    [
        ("openai", {"tool_choice": "auto", "parallel_tool_calls": False}),
        ("anthropic", {"tool_choice": {"type": "auto"}}),
    ],
)
def test_no_tool_left_removes_tool_choice_too(protocol: str, extra: dict[str, Any]) -> None:
    body = body_for(protocol, ["delete"], **extra)
    assert shape_tools(policy(), parse(protocol, body), body) is True
    assert set(body) & {"tools", "tool_choice", "parallel_tool_calls"} == set()


@pytest.mark.parametrize(("protocol", "choice"), [("openai", "required"), ("anthropic", {"type": "any"})])
def test_a_choice_requiring_a_call_with_no_tool_left_is_refused(protocol: str, choice: Any) -> None:
    """Sent on without tools, the model would answer in text to an agent that asked for a call."""
    body = body_for(protocol, ["delete", "drop"], tool_choice=choice)
    with pytest.raises(ToolNotAllowed, match="requires a tool call"):
        shape_tools(policy(), parse(protocol, body), body)
    kept = body_for(protocol, ["delete", "search"], tool_choice=choice)
    assert shape_tools(policy(), parse(protocol, kept), kept) is True  # a tool is left: it may be called
    assert offered(protocol, kept) == ["search"]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_unrestricted_policy_changes_nothing(protocol: str) -> None:
    forced = ({"type": "function", "function": {"name": "delete"}} if protocol == "openai"
              else {"type": "tool", "name": "delete"})
    body = body_for(protocol, ["delete", "anything"], tool_choice=forced)
    before = copy.deepcopy(body)
    assert shape_tools(policy(allow=None), parse(protocol, body), body) is False
    assert body == before


@pytest.mark.parametrize(
    ("protocol", "tool_choice", "allowed"),
    [
        ("openai", {"type": "function", "function": {"name": "delete"}}, False),
        ("openai", {"type": "function", "function": {"name": "files/write_a"}}, False),
        ("openai", {"type": "function", "function": {"name": "files/read_a"}}, True),  # glob
        ("openai", {"type": "function", "function": {"name": "search"}}, True),
        ("openai", "required", True),  # not a forced name
        ("anthropic", {"type": "tool", "name": "delete"}, False),
        ("anthropic", {"type": "tool", "name": "search"}, True),
        ("anthropic", {"type": "any"}, True),
    ],
)
def test_forced_tool_choice(protocol: str, tool_choice: Any, allowed: bool) -> None:
    body = body_for(protocol, ["search", "delete"], tool_choice=tool_choice)
    call = parse(protocol, body)
    if allowed:
        assert shape_tools(policy(), call, body) is True
        assert offered(protocol, body) == ["search"]
        return
    before = copy.deepcopy(body)
    with pytest.raises(ToolNotAllowed) as info:
        shape_tools(policy(), call, body)
    error = info.value
    assert isinstance(error, Stopped)
    assert (error.status, error.stop_reason, error.reason) == (403, TOOL_NOT_ALLOWED, "tool_not_allowed")
    assert error.message.startswith("tool_choice forces a tool outside the allow-list: tool ")
    assert body == before  # refused before anything was shaped


def test_forced_lookalike_is_refused_with_the_odd_character_named() -> None:
    body = openai_body(["search"], tool_choice={"type": "function", "function": {"name": "s\u0435arch"}})
    with pytest.raises(ToolNotAllowed) as info:
        shape_tools(policy(), parse("openai", body), body)
    assert "U+0435 CYRILLIC SMALL LETTER IE at index 1" in info.value.message


# -- judge_tools -------------------------------------------------------------------------------------


def tc(name: str, i: int = 0) -> ToolCall:
    return ToolCall(f"call_{i}", name, '{"q": 1}')


def answer(*names: str) -> Answer:
    calls = tuple(tc(n, i) for i, n in enumerate(names))
    return Answer(response_id="r1", model="m", text="t", tool_calls=calls, finish_reasons=("tool_calls",),
                  usage=Usage(1, 2))


@pytest.mark.parametrize(
    ("allow", "on_violation", "names", "denied"),
    [
        (None, "reject", ("delete", "anything"), None),  # unrestricted
        (ALLOW, "reject", (), None),  # no calls
        (ALLOW, "reject", ("search", "files/read_a"), None),  # all allowed
        (ALLOW, "reject", ("search", "delete"), ("delete",)),
        (ALLOW, "drop", ("search", "delete"), ("delete",)),
        (ALLOW, "drop", ("delete", "search", "files/rm", "delete"), ("delete", "files/rm", "delete")),
        ((), "reject", ("search",), ("search",)),  # an empty allow-list denies everything
    ],
)
def test_judge_tools(allow: tuple[str, ...] | None, on_violation: str, names: tuple[str, ...],
                     denied: tuple[str, ...] | None) -> None:
    verdict = judge_tools(policy(allow, on_violation), answer(*names))
    if denied is None:
        assert verdict is None
        return
    assert verdict is not None
    assert tuple(c.name for c in verdict.denied) == denied
    assert verdict.action == on_violation
    expected_calls = tuple(c for c in answer(*names).tool_calls if c.name in denied)
    assert verdict.denied == expected_calls  # the calls themselves, ids and arguments included


def test_verdict_texts() -> None:
    verdict = ToolVerdict((tc("zeta", 0), tc("alpha", 1), tc("zeta", 2)), "drop")
    assert verdict.names == frozenset({"zeta", "alpha"})
    assert verdict.detail == (
        "tool 'alpha' is not in the agent's allow-list; tool 'zeta' is not in the agent's allow-list"
    )
    assert verdict.instruction == (
        "The tool(s) alpha, zeta are not available to you and were not called. "
        "Answer without them, using only the tools offered."
    )


# -- without -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "dropped", "left"),
    [
        (("search", "delete"), frozenset({"delete"}), ("search",)),
        (("delete", "search", "delete"), frozenset({"delete"}), ("search",)),
        (("a", "b", "c"), frozenset({"a", "c"}), ("b",)),
        (("delete",), frozenset({"delete"}), ()),
        (("search",), frozenset(), ("search",)),
        (("search",), frozenset({"other"}), ("search",)),
    ],
)
def test_without(names: tuple[str, ...], dropped: frozenset[str], left: tuple[str, ...]) -> None:
    original = answer(*names)
    result = without(original, dropped)
    assert tuple(c.name for c in result.tool_calls) == left
    assert [c.id for c in result.tool_calls] == [c.id for c in original.tool_calls if c.name not in dropped]
    # everything else is kept as it was, and the original answer is unchanged
    assert (result.response_id, result.model, result.text, result.finish_reasons, result.usage) == (
        "r1", "m", "t", ("tool_calls",), Usage(1, 2))
    assert original == answer(*names)
