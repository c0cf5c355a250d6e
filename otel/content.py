"""Opt-in content capture: compact JSON strings in the semconv v1.41 shapes.

`gen_ai.input.messages`, `gen_ai.system_instructions`, `gen_ai.tool.definitions` come from the wire body
(`call.raw`), read by the dialect registered for `call.protocol`; `gen_ai.output.messages` comes from
the neutral `Answer`. MCP steps have `gen_ai.tool.call.arguments` / `.result` instead.

Content goes on spans as JSON *strings*, not OTLP maps: the convention allows it, util-genai does it,
and Jaeger would stringify maps anyway (semconv note section 2.1). These functions are pure and
only ever called when capture is on; callers must pass every string through `Redactor.redact` before
it is set on a span (`StepSpan.capture_input` / `capture_output` do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

from gateway.call import Answer, Call
from otel import _content_anthropic, _content_openai, _content_responses
from otel._content_common import Message, Part, compact, json_or_text, without_none

# fmt: off
__all__ = [
    "input_messages", "output_messages", "system_instructions", "tool_call_arguments", "tool_call_result",
    "tool_definitions"
]
# fmt: on


class _Dialect(NamedTuple):
    input_messages: Callable[[Mapping[str, Any]], list[Message] | None]
    system_instructions: Callable[[Mapping[str, Any]], list[Part] | None]
    tool_definitions: Callable[[Mapping[str, Any], bool], list[Part] | None]


_DIALECTS: Final[Mapping[str, _Dialect]] = {
    "openai": _Dialect(
        _content_openai.input_messages, _content_openai.system_instructions, _content_openai.tool_definitions
    ),
    "anthropic": _Dialect(
        _content_anthropic.input_messages,
        _content_anthropic.system_instructions,
        _content_anthropic.tool_definitions,
    ),
    "openai_responses": _Dialect(
        _content_responses.input_messages,
        _content_responses.system_instructions,
        _content_responses.tool_definitions,
    ),
}

# Output-message `finish_reason` uses the schema's enum (stop, length, content_filter, tool_call,
# error); provider values map onto it, unknown values pass through (any string is allowed).
_FINISH_REASONS: Final[Mapping[str, str]] = {
    "stop": "stop",
    "completed": "stop",
    "max_output_tokens": "length",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "content_filter": "content_filter",
    "refusal": "content_filter",
    "tool_calls": "tool_call",
    "function_call": "tool_call",
    "tool_use": "tool_call",
    "error": "error",
}


def _dump(value: Any) -> str | None:
    return compact(value) if value else None


def input_messages(call: Call) -> str | None:
    """`gen_ai.input.messages`: the chat history sent, in order; None for protocols without one."""
    dialect = _DIALECTS.get(call.protocol)
    return _dump(dialect.input_messages(call.raw)) if dialect is not None else None


def system_instructions(call: Call) -> str | None:
    """`gen_ai.system_instructions`: instructions passed apart from the history (Anthropic `system`)."""
    dialect = _DIALECTS.get(call.protocol)
    return _dump(dialect.system_instructions(call.raw)) if dialect is not None else None


def tool_definitions(call: Call, *, detailed: bool = False) -> str | None:
    """`gen_ai.tool.definitions`: `type` and `name` of each offered tool; `description` and
    `parameters` only when `detailed` (the convention does not recommend them by default)."""
    dialect = _DIALECTS.get(call.protocol)
    return _dump(dialect.tool_definitions(call.raw, detailed)) if dialect is not None else None


def _choices(answer: Answer) -> list[tuple[str, str, int]]:
    """Every choice's text, refusal and number of tool calls, in choice order. The calls are every
    choice's in choice order; `choice_calls` says how many are each choice's (when it does not account
    for all of them, the first choice has them all). A choice after the first that refused is in neither
    `other_texts` nor `choice_calls`: `refusals` says where it goes."""
    texts = (answer.text, *answer.other_texts)
    counts = [len(names) for names in answer.choice_calls]
    if len(counts) != len(texts) or sum(counts) != len(answer.tool_calls):
        counts = [len(answer.tool_calls)] + [0] * (len(texts) - 1)
    answered = zip(texts, counts, strict=True)
    choices = []
    for index, refusal in enumerate(answer.refusals or ("",)):
        text, count = ("", 0) if index and refusal else next(answered, ("", 0))
        choices.append((text, refusal, count))
    choices.extend((text, "", count) for text, count in answered)
    return choices


def output_messages(answer: Answer) -> str:
    """`gen_ai.output.messages`: one assistant message per choice (OpenAI's `n`), in choice order as
    `gen_ai.response.finish_reasons` are: its text, its refusal and its tool calls."""
    choices = _choices(answer)
    reasons = answer.finish_reasons if len(answer.finish_reasons) == len(choices) else answer.finish_reasons[:1]
    messages, start = [], 0
    for index, (text, refusal, count) in enumerate(choices):
        calls = answer.tool_calls[start : start + count]
        start += count
        parts: list[Part] = [{"type": "text", "content": text}] if text else []
        if refusal:  # a generic part, as in `gen_ai.input.messages` (`_content_openai`)
            parts.append({"type": "refusal", "content": refusal})
        parts.extend(
            without_none(
                type="tool_call", id=call.id or None, name=call.name, arguments=json_or_text(call.arguments)
            )
            for call in calls
        )
        if index < len(reasons):
            finish = _FINISH_REASONS.get(reasons[index], reasons[index])
        else:
            finish = "tool_call" if calls else "stop"
        messages.append({"role": "assistant", "parts": parts, "finish_reason": finish})
    return compact(messages)


def tool_call_arguments(call: Call) -> str | None:
    """`gen_ai.tool.call.arguments` of an MCP `tools/call` step (compact JSON when the arguments are
    JSON, else the text as sent)."""
    if call.tool_call is None:
        return None
    arguments = json_or_text(call.tool_call.arguments)
    return arguments if isinstance(arguments, str) else compact(arguments)


def tool_call_result(answer: Answer) -> str | None:
    """`gen_ai.tool.call.result` of an MCP `tools/call` step: the result text the server returned."""
    return answer.tool_result.content if answer.tool_result is not None else None
