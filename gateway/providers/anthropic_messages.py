"""Anthropic Messages wire protocol (`POST /v1/messages`), I/O-free."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, digest
from gateway.config import Limits
from gateway.errors import BudgetHeld, GatewayError, InvalidRequest, error_code
from gateway.providers.anthropic_billing import (
    answer_tier,
    speed_tier,
    unbounded_params,
    unbounded_reasons,
    usage_from,
)
from gateway.providers.anthropic_tools import (
    FETCH_CONTENT_TOKENS,
    SERVER_TOOLS,
    check_limits,
    count,
    input_overhead,
    offers_server_tools,
    search_limits,
    search_sizes,
    tool_call,
    tool_specs,
    type_starts,
    unpriced_tools,
    unreserved_tools,
    with_max_uses,
)
from gateway.providers.base import StreamStep
from gateway.providers.common import (
    content_text,
    input_parts,
    may_contain,
    opt_int,
    opt_number,
    opt_strings,
    request_basics,
    stop_text,
    token_count,
)
from gateway.providers.sse import SseEvent, format_event

__all__ = ["FETCH_CONTENT_TOKENS", "THINKING_MIN_TOKENS", "AnthropicMessages", "AnthropicStreamReader", "usage_from"]


def _tool_choice(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("tool_choice.type must be auto, any, tool or none", param="tool_choice")
    if value["type"] == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice of type tool needs a name", param="tool_choice")
        return name
    return None


def _latest_results(messages: list[Any]) -> tuple[ToolResult, ...]:
    """`tool_result` blocks of the last user message."""
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list):
            return ()
        return tuple(
            ToolResult(str(b.get("tool_use_id", "")), content_text(b.get("content")), bool(b.get("is_error")))
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "tool_result"
        )
    return ()


# content blocks of tools Anthropic runs itself (web search, code execution, its MCP connector):
# counted for `caps.tool_calls`, never judged (they ran before the answer came back)
HOSTED_BLOCKS = frozenset({"server_tool_use", "mcp_tool_use"})


def provider_ran(kind: Any) -> bool:
    """A block of a tool Anthropic runs (its call or its result): text before it was a preamble, and the
    answer the output constraints hold is the text after the last one."""
    return kind in HOSTED_BLOCKS or (isinstance(kind, str) and kind.endswith("_tool_result"))


THINKING_MIN_TOKENS = 1024
"""The smallest `thinking.budget_tokens` Anthropic takes; `max_tokens` must be larger."""


class AnthropicMessages:
    protocol = "anthropic"
    operation = "chat"
    provider_type = "anthropic"
    upstream_path = "/v1/messages"

    def parse_request(self, body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
        model, messages, raw_tools, stream = request_basics(body, limits, lambda role: role in ("user", "assistant"), "role must be user or assistant")
        stop = body.get("stop_sequences")  # a list in Anthropic's API (a bare string is not one)
        check_limits(body)
        images, documents = input_parts(body, raw)  # a PDF is billed per page: bounded like images
        unbounded = unbounded_params(body)
        params = RequestParams(
            temperature=opt_number(body, "temperature"),
            top_p=opt_number(body, "top_p"),
            top_k=opt_number(body, "top_k"),
            stop_sequences=opt_strings(stop) if isinstance(stop, list) else None,
        )
        return Call(
            protocol="anthropic",
            operation="chat",
            model=model,
            stream=stream,
            max_tokens=opt_int(body, "max_tokens", minimum=1),
            input_bytes=len(raw),
            input_images=images,
            referenced_documents=documents,
            tools=tool_specs(raw_tools),
            tool_choice=_tool_choice(body.get("tool_choice")),
            tool_results=_latest_results(messages),
            params=params,
            request_hash=digest(raw),
            raw=body,
            prefill=_prefill(messages),
            search_limits=search_limits(body),
            search_sizes=search_sizes(body),
            cache_writes=may_contain(raw, b"cache_control"),  # Anthropic writes its cache only where marked
            provider_tools=offers_server_tools(body),
            # what Anthropic bills beyond the body (tool overheads, fast mode), and what no budget can bound
            input_overhead=input_overhead(body),
            unpriced_tools=unpriced_tools(body),
            unreserved_tools=unreserved_tools(body),
            unbounded=unbounded_reasons(unbounded),
            unbounded_params=unbounded,
            service_tier=speed_tier(body),
        )

    def parse_answer(self, body: Mapping[str, Any]) -> Answer:
        after_tool = False
        texts: list[str] = []
        calls: list[ToolCall] = []
        hosted = 0
        for block in body.get("content") or ():
            if block.get("type") == "text":
                texts.append(str(block.get("text") or ""))
            elif block.get("type") == "tool_use":
                calls.append(tool_call(block, orjson.dumps(block.get("input") or {}).decode()))
            elif provider_ran(block.get("type")):
                hosted += block.get("type") in HOSTED_BLOCKS
                texts.clear()
                after_tool = True
        reason = body.get("stop_reason")
        return Answer(
            response_id=body.get("id"),
            model=body.get("model"),
            text="".join(texts),
            tool_calls=tuple(calls),
            finish_reasons=(str(reason),) if reason else (),
            usage=usage_from(body.get("usage"), body.get("model")),
            hosted_calls=hosted,
            after_provider_tool=after_tool,
            service_tier=answer_tier(body.get("usage")),
        )

    def stream_reader(self, *, hide_usage: bool, choices: int = 1) -> AnthropicStreamReader:
        return AnthropicStreamReader()

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps({"type": "error", "error": _error(error)})

    def error_event(self, error: GatewayError, reader: Any = None) -> bytes:
        return format_event(orjson.dumps({"type": "error", "error": _error(error)}), "error")

    def stop_answer(self, call: Call, reason: str, detail: str) -> bytes:
        return orjson.dumps(
            {
                "id": f"msg_tollgate_{int(time.time() * 1000)}",
                "type": "message",
                "role": "assistant",
                "model": call.model,
                "content": [{"type": "text", "text": stop_text(reason, detail)}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }
        )

    def stop_stream(self, call: Call, reason: str, detail: str) -> bytes:
        start = {
            "type": "message_start",
            "message": {
                "id": f"msg_tollgate_{int(time.time() * 1000)}",
                "type": "message",
                "role": "assistant",
                "model": call.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            },
        }
        return self.stop_tail(reason, detail, start=start)

    def stop_tail(self, reason: str, detail: str, *, start: Mapping[str, Any] | None = None, index: int = 0) -> bytes:
        """Events that append a text block saying why, then end the message."""
        parts = [format_event(orjson.dumps(start), "message_start")] if start else []
        parts += [
            format_event(
                orjson.dumps({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
                "content_block_start",
            ),
            format_event(
                orjson.dumps(
                    {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": stop_text(reason, detail)}}
                ),
                "content_block_delta",
            ),
            format_event(orjson.dumps({"type": "content_block_stop", "index": index}), "content_block_stop"),
            format_event(
                orjson.dumps(
                    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 0}}
                ),
                "message_delta",
            ),
            format_event(b'{"type":"message_stop"}', "message_stop"),
        ]
        return b"".join(parts)

    def stream_stop_tail(self, call: Call, reader: Any, reason: str, detail: str) -> bytes:
        """Stop events after part of the message was relayed: close it with a text block saying why."""
        if getattr(reader, "started", False):
            return self.stop_tail(reason, detail, index=getattr(reader, "next_index", 0))
        return self.stop_stream(call, reason, detail)

    def max_tokens_field(self, body: Mapping[str, Any]) -> str | None:
        return "max_tokens" if body.get("max_tokens") is not None else None

    def set_max_tokens(self, body: dict[str, Any], value: int, *, prefer_completion_field: bool) -> None:
        """`max_tokens` set to `value`. Extended thinking must stay below it (Anthropic refuses
        `budget_tokens` >= `max_tokens`): a thinking budget it reaches is lowered to `value` - 1. Raises
        BudgetHeld, changing nothing, when that leaves less than the smallest thinking budget Anthropic
        takes (`THINKING_MIN_TOKENS`): the call cannot be sent as asked for what the budget pays."""
        thinking = body.get("thinking")
        if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
            wanted = count(thinking.get("budget_tokens"))  # not a count: the API refuses it, not the clamp
            if wanted is not None and wanted >= value:
                if value <= THINKING_MIN_TOKENS:
                    raise BudgetHeld(f"the budget left pays {value} output tokens, too few for extended "
                                     f"thinking (max_tokens must exceed a thinking budget of at least "
                                     f"{THINKING_MIN_TOKENS}); the run goes on: send this step without thinking")
                body["thinking"] = {**thinking, "budget_tokens": value - 1}  # a copy: the agent's body shares it
        body["max_tokens"] = value

    def limit_hosted_calls(self, body: dict[str, Any], limit: int) -> bool:
        """Each server tool that takes a `max_uses` (web search, web fetch, advisor) uses at most `limit`,
        and a web fetch without a content limit is given `FETCH_CONTENT_TOKENS`; with none left (`limit` <= 0) no tool Anthropic runs is offered, nor its MCP connector. Lists are
        replaced, not edited: the agent's original body shares them."""
        tools = body.get("tools")
        if limit <= 0:
            changed = body.pop("mcp_servers", None) is not None
            if isinstance(tools, list):
                kept = [t for t in tools if not type_starts(t, SERVER_TOOLS)]
                if len(kept) != len(tools):
                    changed = True
                    body["tools"] = kept
                    choice = body.get("tool_choice")
                    named = choice.get("name") if isinstance(choice, Mapping) and choice.get("type") == "tool" else None
                    if not kept or (named is not None and named not in {t.get("name") for t in kept}):
                        body.pop("tool_choice", None)  # it forced a tool no longer offered: the API refuses
                    if not kept:
                        body.pop("tools")
            return changed
        if not isinstance(tools, list):
            return False
        limited = [with_max_uses(tool, limit) for tool in tools]
        if all(new is old for new, old in zip(limited, tools, strict=True)):
            return False
        body["tools"] = limited
        return True

    def search_limits(self, body: Mapping[str, Any]) -> tuple[int | None, ...]:
        """The uses allowed of each server tool whose results are billed as input (`anthropic_tools`)."""
        return search_limits(body)

    def search_sizes(self, body: Mapping[str, Any]) -> tuple[int, ...]:
        """The input one use of each of those tools may add (`anthropic_tools`)."""
        return search_sizes(body)

    def unpriced_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        """`Call.unpriced_tools` of a body (as the allow-list left it): Anthropic's code execution."""
        return unpriced_tools(body)

    def unreserved_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        """`Call.unreserved_tools` of a body (as the allow-list left it): Anthropic's advisor, its MCP
        connector."""
        return unreserved_tools(body)

    def ask_usage(self, body: dict[str, Any]) -> bool:
        return False  # Anthropic streams always carry usage (message_start and message_delta)

    def with_instruction(self, body: Mapping[str, Any], answer_text: str, instruction: str) -> dict[str, Any]:
        messages = list(body.get("messages") or [])
        prefill = _prefill(messages)
        last = messages.pop() if prefill else None
        # roles alternate: the prefill and its continuation are one assistant turn; the re-ask ends with
        # the prefill again, so what comes back continues it as the agent expects
        messages.append({"role": "assistant", "content": (prefill + answer_text) or "(empty)"})
        messages.append({"role": "user", "content": instruction})
        if last is not None:
            messages.append(last)
        return {**body, "messages": messages}


def _prefill(messages: list[Any]) -> str:
    """The text of a last assistant message: Claude continues it, so the answer is that text plus what
    comes back."""
    last = messages[-1] if messages else None
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        return content_text(last.get("content"))
    return ""


def _error(error: GatewayError) -> dict[str, Any]:
    body: dict[str, Any] = {"type": error.anthropic_type, "message": error.message, "code": error_code(error)}
    if error.status == 400 and error.param == "thread":
        # Anthropic's own answer to a thread it cannot continue: the SDK's threaded loops (its tool runner)
        # then send the turn again unthreaded, with the whole conversation, which tollgate can bound
        body["details"] = {"error_code": "thread_unsupported_request", "unsupported": []}
    return body


_NESTED_USAGE = frozenset({"cache_creation", "server_tool_use", "iterations", "speed"})


class AnthropicStreamReader:
    """Accumulates a streamed message from its events; relays every event unchanged."""

    def __init__(self) -> None:
        self._id: str | None = None
        self._model: str | None = None
        self._text: list[str] = []
        self._blocks: dict[int, Mapping[str, Any]] = {}  # tool_use blocks by index
        self._inputs: dict[int, str] = {}  # their input JSON, as input_json_delta events bring it
        self._reason: str | None = None
        self._usage: dict[str, int] = {}
        self._final_usage = False  # message_delta reported the output tokens (message_start's are a placeholder)
        self._chars = 0
        self._hosted = 0
        self._start_inputs: dict[int, str] = {}  # tool_use input given whole in content_block_start
        # usage fields that are no count (cache_creation, server_tool_use, iterations, speed), as last reported
        self._nested: dict[str, Any] = {}
        self.next_index = 0  # the first content block index the agent has not been shown
        self.started = False  # message_start was relayed
        self.holding = False  # a tool_use block started: hold events until the answer is judged
        self.complete = False
        self.delta = ""  # answer text carried by the last event fed
        self.restart = False  # the last event began a tool Anthropic runs (`StreamReader`)
        self.text_done = False  # a text block stopped (`StreamReader`): the SDK parses its text there
        self._text_blocks: set[int] = set()
        self._after_tool = False
        self._error: str | None = None  # the type of an `error` event the provider ended the stream with

    @property
    def output_chars(self) -> int:
        return self._chars

    def feed(self, event: SseEvent) -> StreamStep:
        self.delta = ""
        self.restart = False
        try:
            data = orjson.loads(event.data) if event.data else None
        except orjson.JSONDecodeError:
            raise ValueError("an event's data is not valid JSON") from None
        if not isinstance(data, dict):
            return StreamStep(event.raw, chunk=False)
        kind = data.get("type")
        if kind == "message_start":
            message = data.get("message") or {}
            if message.get("content"):
                # Anthropic streams content in content blocks only; the SDK starts its message from this
                # one, so a block in it (a tool call) would reach the agent without being judged
                raise ValueError("message_start carries content: a stream's content comes in content blocks")
            self.started = True
            self._id, self._model = message.get("id"), message.get("model")
            self._merge_usage(message.get("usage"))
        elif kind == "content_block_start":
            index = int(data.get("index") or 0)
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                self.holding = True
                self._blocks[index] = block
                given = block.get("input")
                if given:  # the SDK keeps the start block's input unless input_json_delta events follow
                    self._start_inputs[index] = orjson.dumps(given).decode()
            elif block.get("type") == "text" and isinstance(block.get("text"), str) and block["text"]:
                text = block["text"]  # the SDK's answer starts with it: it is checked like a delta
                self._chars += len(text)
                self._text.append(text)
                self.delta += text
            elif provider_ran(block.get("type")):
                self._hosted += block.get("type") in HOSTED_BLOCKS
                self.restart = True  # what the checkers were fed (text, or the prefill alone) was no answer
                self.text_done = False
                self._after_tool = True
                self._text.clear()
            if block.get("type") == "text":
                self._text_blocks.add(index)
            if not self.holding:  # relayed now; held blocks may never reach the agent (a stop)
                self.next_index = max(self.next_index, index + 1)
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                text = str(delta.get("text") or "")
                self._chars += len(text)
                self._text.append(text)
                self.delta += text
            elif delta.get("type") == "input_json_delta":
                part = str(delta.get("partial_json") or "")
                self._chars += len(part)
                at = int(data.get("index") or 0)
                if at in self._blocks:
                    self._inputs[at] = self._inputs.get(at, "") + part
        elif kind == "content_block_stop":
            self.text_done = self.text_done or int(data.get("index") or 0) in self._text_blocks
        elif kind == "message_delta":
            reason = (data.get("delta") or {}).get("stop_reason")
            self._reason = reason or self._reason
            self._final_usage = self._merge_usage(data.get("usage")) or self._final_usage
        elif kind == "message_stop":
            self.complete = True
            return StreamStep(event.raw, done=True)
        elif kind == "error":  # relayed as it came (an overload mid-stream): the agent's SDK raises it
            error = data.get("error")
            code = error.get("type") if isinstance(error, dict) else None
            self._error = code if isinstance(code, str) and code else "error"
        # the SDK yields named events, but `ping` (skipped) and `error` (raised)
        return StreamStep(event.raw, chunk=event.event is not None and kind not in ("ping", "error"))

    def _merge_usage(self, usage: Any) -> bool:
        """Take the counts `usage` carries (JSON may write `7.0`); True when it had the output tokens."""
        if not isinstance(usage, Mapping):
            return False
        output = False
        for key, value in usage.items():
            if key in _NESTED_USAGE and value is not None:
                # how long cache writes last, searches run, sub-inferences billed, at which speed: priced apart
                self._nested[key] = value
                continue
            if value is None:
                continue
            try:
                self._usage[key] = token_count(value)
            except ValueError:
                continue  # not a count (a nested object such as server_tool_use, or garbage)
            output = output or key == "output_tokens"
        # only an output count this event carried, and believed, is final (not message_start's placeholder)
        return output

    def answer(self) -> Answer:
        calls = tuple(tool_call(block, self._inputs.get(i) or self._start_inputs.get(i, "{}"))
                      for i, block in sorted(self._blocks.items()))
        complete = self._reason is not None and self._final_usage
        return Answer(
            response_id=self._id,
            model=self._model,
            text="".join(self._text),
            tool_calls=calls,
            finish_reasons=(self._reason,) if self._reason else (),
            usage=usage_from({**self._usage, **self._nested}, self._model) if complete else None,
            hosted_calls=self._hosted,
            after_provider_tool=self._after_tool,
            service_tier=answer_tier(self._nested),
            provider_error=self._error,
        )
