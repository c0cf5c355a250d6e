"""gateway/outputs.py: which constraints a step carries, and the per-agent plan cache."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest

from gateway.call import Answer, Call, ToolCall
from gateway.config import Limits
from gateway.errors import InvalidGrammar
from gateway.outputs import (
    CHECK_ON_LOOP_CHARS,
    OutputPlan,
    Resolver,
    apply_native,
    judge,
    off_loop_if_long,
    plan_outputs,
)
from gateway.providers.openai_chat import OpenAIChat
from gateway.providers.openai_responses import OpenAIResponses
from gateway.toolgate import without
from grammars.library import GrammarLibrary

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def call(**extra: Any) -> Call:
    body = {"model": "gpt-4o-mini", "messages": MSG, **extra}
    return OpenAIChat().parse_request(body, orjson.dumps(body), Limits())


async def plan(resolver: Resolver, c: Call, headers: dict[str, str] | None = None, grammar: str | None = "regex:[a-z]+",
               dialect: str = "openai") -> Any:
    return await plan_outputs(resolver, c, headers or {}, grammar, 2, "incremental", dialect)


async def test_steps_of_one_agent_share_one_plan() -> None:
    resolver = Resolver(GrammarLibrary.load())
    first, second = await plan(resolver, call()), await plan(resolver, call(temperature=0.5))
    assert first is second and first.kinds == ("regex",)


async def test_what_changes_a_plan_gets_its_own() -> None:
    resolver = Resolver(GrammarLibrary.load())
    base = await plan(resolver, call())
    others = [
        await plan(resolver, call(), headers={"x-tollgate-grammar": "regex:[0-9]+"}),
        await plan(resolver, call(), dialect="vllm"),
        await plan(resolver, call(), grammar="regex:[0-9]+"),
        await plan(resolver, call(guided_regex="[a-z]+")),
    ]
    assert all(p is not base for p in others)
    assert others[0].kinds == ("regex", "regex")
    assert others[1].native != base.native


async def test_constraints_from_the_body_are_planned_per_request() -> None:
    resolver = Resolver(GrammarLibrary.load())
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    first, second = await plan(resolver, call(response_format=rf)), await plan(resolver, call(response_format=rf))
    # the request's own native schema comes first: it is forwarded as sent, the agent's regex validated after
    assert first is not second and first.kinds == second.kinds == ("json_schema", "regex")


async def test_no_constraint_no_plan() -> None:
    assert await plan(Resolver(GrammarLibrary.load()), call(), grammar=None) is None


async def test_the_plan_cache_is_bounded() -> None:
    resolver = Resolver(GrammarLibrary.load(), size=4)
    for i in range(10):
        await plan(resolver, call(), headers={"x-tollgate-grammar": f"regex:[a-z]{{{i + 1}}}"})
    assert len(resolver.plans) == 4


def responses_call(**extra: Any) -> Call:
    body = {"model": "gpt-4o-mini", "input": "hi", **extra}
    return OpenAIResponses().parse_request(body, orjson.dumps(body), Limits())


async def test_responses_text_format_is_already_native_for_openai() -> None:
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}
    planned = await plan(Resolver(GrammarLibrary.load()), responses_call(text={"format": fmt}), grammar=None)
    assert planned.kinds == ("json_schema",) and planned.native is None


@pytest.mark.parametrize(("dialect", "native"), [("openai", True), ("vllm", False), ("none", False)])
async def test_responses_native_only_in_openai_s_form(dialect: str, native: bool) -> None:
    grammar = "json_schema:" + orjson.dumps(SCHEMA).decode()
    planned = await plan(Resolver(GrammarLibrary.load()), responses_call(), grammar=grammar, dialect=dialect)
    assert (planned.native is not None) is native


def test_apply_native_puts_a_schema_in_the_responses_text_format() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": SCHEMA}}
    planned = OutputPlan((), 1, "incremental", {"response_format": rf}, False, False)
    body: dict[str, Any] = {"input": "hi", "text": {"verbosity": "low"}}
    assert apply_native(planned, body, "openai_responses")
    assert body == {"input": "hi", "text": {"verbosity": "low", "format": {"type": "json_schema", "name": "a",
                                                                         "strict": True, "schema": SCHEMA}}}
    chat: dict[str, Any] = {"messages": MSG}
    assert apply_native(planned, chat, "openai")
    assert chat == {"messages": MSG, "response_format": rf}


@pytest.mark.parametrize(("text", "calls", "held"), [
    ("I'll look that up.", ("lookup",), False),  # a tool turn: its text is a preamble
    ("", ("lookup",), False),  # calls alone
    ("I'll look that up.", (), True),  # no call: the text is the answer
    ("", (), True),  # nothing at all is an answer too, and it is no match of [a-z]+
])
async def test_a_turn_that_calls_tools_is_not_held_to_the_text_constraints(
    text: str, calls: tuple[str, ...], held: bool,
) -> None:
    resolver = Resolver(GrammarLibrary.load())
    c = call(tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}])
    p = await plan(resolver, c, grammar="regex:[a-z]+")
    answer = Answer(text=text, tool_calls=tuple(ToolCall(f"c{i}", n, "{}") for i, n in enumerate(calls)))
    verdict = judge(p, c, answer)
    assert (verdict is not None) is held


async def test_a_bad_schema_is_reported_as_the_agent_wrote_it_not_as_rewritten_for_strict_mode() -> None:
    """OpenAI's strict mode makes optional properties nullable: the error used to quote the rewrite
    (`['nope', 'null']`), a type the agent never wrote."""
    resolver = Resolver(GrammarLibrary.load())
    schema = {"type": "object", "properties": {"a": {"type": "nope"}}}
    with pytest.raises(InvalidGrammar) as caught:
        await plan(resolver, call(guided_json=schema), grammar=None, dialect="openai")
    assert "'nope' is not valid" in caught.value.message and "null" not in caught.value.message


async def test_with_several_choices_a_text_is_held_whatever_another_choice_called() -> None:
    """An answer's tool calls are every choice's: with `n: 2`, prose in one choice beside a call in the
    other used to pass as a "preamble"."""
    resolver = Resolver(GrammarLibrary.load())
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    c = call(tools=tools, n=2)
    p = await plan(resolver, c, grammar="regex:[a-z]+")
    calls = (ToolCall("c1", "lookup", "{}"),)
    second_calls = Answer(text="I'll look that up.", tool_calls=calls, other_texts=("",),
                          choice_calls=((), ("lookup",)))
    assert judge(p, c, second_calls) is not None  # the first choice's prose is its final answer
    first_calls = Answer(text="I'll look that up.", tool_calls=calls, other_texts=("fine",),
                         choice_calls=(("lookup",), ()))
    assert judge(p, c, first_calls) is None  # its own preamble; the other choice conforms


async def test_with_several_choices_an_empty_choice_beside_another_s_call_is_still_judged() -> None:
    """An empty text was skipped whenever any choice called a tool: `choice_calls` says whose calls they are."""
    resolver = Resolver(GrammarLibrary.load())
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    c = call(tools=tools, n=2)
    p = await plan(resolver, c, grammar="regex:[a-z]+")
    calls = (ToolCall("c1", "lookup", "{}"),)
    verdict = judge(p, c, Answer(text="", tool_calls=calls, other_texts=("",), choice_calls=(("lookup",), ())))
    assert verdict is not None and verdict.answer_text == ""
    dropped = without(Answer(text="", tool_calls=calls, other_texts=("ok",), choice_calls=(("lookup",), ())),
                      frozenset({"lookup"}))
    assert dropped.choice_calls == ((), ()) and judge(p, c, dropped) is not None  # its calls were dropped


async def test_a_long_answer_is_checked_in_a_worker_thread_a_short_one_at_once() -> None:
    """A check may take seconds for a megabyte (within its bounds): the event loop must not wait for it."""
    here = threading.get_ident()
    long = "x" * (CHECK_ON_LOOP_CHARS + 1)
    assert await off_loop_if_long(Answer(text="x" * CHECK_ON_LOOP_CHARS), threading.get_ident) == here
    assert await off_loop_if_long(Answer(text=long), threading.get_ident) != here
    assert await off_loop_if_long(Answer(other_texts=("", long)), threading.get_ident) != here
    assert await off_loop_if_long(Answer(tool_calls=(ToolCall("c1", "f", long),)), threading.get_ident) != here
