"""OpenAI Responses wire protocol (`POST /v1/responses`), I/O-free.

What tollgate cannot bound is refused with a 400 rather than forwarded unguarded: a request that
continues state stored upstream (`previous_response_id`, `conversation`, `item_reference` inputs, a
stored `prompt`) has an input the gateway never sees, so its reservation could be exceeded, and a
`background` response is billed after the answer returned, so it could never be settled. Agents
send the whole input instead, as the OpenAI Agents SDK does by default.

Tools are named for the allow-list by `name` (function and custom tools) or by `type` for the tools
OpenAI runs itself (`web_search_preview`, `file_search`, `code_interpreter`, `mcp`, ...): those
run upstream before any answer, so they are only ever offered when allowed, never judged after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson

from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage, digest
from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.providers.base import StreamStep
from gateway.providers.common import (
    MAX_TOKEN_COUNT,
    content_text,
    input_parts,
    may_contain,
    opt_int,
    opt_number,
    refusal_of,
    require_model,
    required_count,
    token_count,
    usage_detail,
)
from gateway.providers.openai_chat import openai_error, service_tier
from gateway.providers.responses_stop import response_shell, stop_events, stop_item, stream_event
from gateway.providers.responses_tools import (
    AGENT_CALLS,
    CALL_ITEMS,
    call_name,
    item_type,
    limit_hosted_calls,
    offered_tools,
    offers_preview_search,
    search_limits,
    tool_name,
    unpriced_tools,
    unreserved_tools,
)
from gateway.providers.sse import SseEvent, format_event

# request fields whose input or cost tollgate cannot see, and why (each a 400 when set)
UNBOUNDED: dict[str, str] = {
    "previous_response_id": "continues a response stored upstream, whose input tollgate cannot see or bound",
    "conversation": "continues a conversation stored upstream, whose input tollgate cannot see or bound",
    "prompt": "uses a prompt stored upstream, whose input tollgate cannot see or bound",
    "background": "runs after the answer returns, so its cost could not be settled",
}
# the call items of tools OpenAI runs itself: counted for `caps.tool_calls`, never judged (they ran)
HOSTED_CALL_ITEMS = frozenset({"web_search_call", "file_search_call", "code_interpreter_call",
                               "image_generation_call", "mcp_call", "tool_search_call"})
_OUTPUT_ITEMS = frozenset(f"{kind}_output" for kind in AGENT_CALLS)
_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _tools(raw: Any, limits: Limits) -> tuple[ToolSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    if len(raw) > limits.max_tools:
        raise RequestTooLarge(f"{len(raw)} tools exceed the limit of {limits.max_tools}")
    specs: list[ToolSpec] = []
    for index, tool in enumerate(raw):
        name = tool_name(tool)
        if not name or (item_type(tool) in ("function", "custom") and not isinstance(tool.get("name"), str)):
            raise InvalidRequest(f"tools[{index}] must be an object with a type (and a name for functions)",
                                 param="tools")
        if item_type(tool) == "custom":
            continue  # free-text input, not JSON arguments: nothing for `outputs.judge` to validate
        params = tool.get("parameters")
        description = tool.get("description")
        specs.append(ToolSpec(name, description if isinstance(description, str) else None,
                              params if isinstance(params, Mapping) else None))
    return tuple(specs)


def _tool_choice(value: Any) -> str | None:
    if value is None or value in ("auto", "none", "required"):
        return None
    if isinstance(value, Mapping):
        kind = item_type(value)
        if kind in ("function", "custom"):
            if isinstance(value.get("name"), str):
                return str(value["name"])
        elif kind == "allowed_tools":
            return None  # a subset of `tools`, which the allow-list has already filtered
        elif kind:
            return tool_name(value)
    raise InvalidRequest("tool_choice must be auto, none, required or name a tool", param="tool_choice")


def _input(body: Mapping[str, Any], limits: Limits) -> list[Any]:
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' is required: a string or a non-empty array of items", param="input")
    if len(value) > limits.max_messages:
        raise RequestTooLarge(f"{len(value)} input items exceed the limit of {limits.max_messages}")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping) or not isinstance(item.get("type", ""), str):
            raise InvalidRequest(f"input[{index}] must be an object whose type is a string", param="input")
        if item.get("type") == "item_reference" or ("type" not in item and "role" not in item):
            raise InvalidRequest(f"input[{index}] refers to an item stored upstream, whose content tollgate "
                                 "cannot see or bound; send the item itself", param="input")
        if any(_stored_file(part) for key in ("content", "output") for part in _parts_of(item.get(key))):
            raise InvalidRequest(f"input[{index}] has a file stored or fetched upstream (file_id, file_url), "
                                 "whose size tollgate cannot bound; send its file_data", param="input")
    return value


def _unbounded(body: Mapping[str, Any], items: list[Any], raw: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a budget cannot bound in this request: reasons (`Call.unbounded`: refused under one), for a
    compaction inside the response, whose output `max_output_tokens` is not known to bound; and the ids of
    reasoning items whose content OpenAI fetches from storage by id (`Call.stored_reasoning`: bounded only
    when an answer of the run relayed them, `guards.reasoning`). One byte test, then at most one walk of the
    input."""
    reasons = []
    stored: list[str] = []
    trigger = False
    if may_contain(raw, b"reasoning", b"compaction_trigger"):
        for item in items:
            kind = item.get("type")  # every item is an object (`_input`)
            if kind == "reasoning" and not item.get("encrypted_content") and not item.get("content"):
                item_id = item.get("id")
                stored.append(item_id if isinstance(item_id, str) else "")  # no id: never seen, never held
            trigger = trigger or kind == "compaction_trigger"
    if trigger or any(item_type(rule) == "compaction" for rule in _parts_of(body.get("context_management"))):
        reasons.append("a compaction inside the response (context_management, a compaction_trigger item) "
                       "has no output limit tollgate can hold; compact through /v1/responses/compact, which "
                       "tollgate reserves")
    return tuple(reasons), tuple(stored)


def _parts_of(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _stored_file(part: Any) -> bool:
    """A document part whose content lives upstream (any number of tokens); images are bounded."""
    return item_type(part) == "input_file" and bool(part.get("file_id") or part.get("file_url"))


def _latest_results(items: list[Any]) -> tuple[ToolResult, ...]:
    """Tool outputs of the latest round: the output items after the model's last message."""
    results: list[ToolResult] = []
    for item in reversed(items):
        kind = item_type(item)
        if kind in _OUTPUT_ITEMS:
            results.append(ToolResult(str(item.get("call_id", "")), content_text(item.get("output"))))
        elif kind not in CALL_ITEMS:
            break
    results.reverse()
    return tuple(results)


def _call(item: Mapping[str, Any]) -> ToolCall:
    kind = item_type(item)
    if kind == "function_call":
        arguments: Any = item.get("arguments")
    elif kind == "custom_tool_call":
        arguments = item.get("input")
    else:  # the agent-run tools' action(s), as a JSON object: loop detection compares calls by it
        fields = {k: item[k] for k in ("action", "actions", "operation") if item.get(k) is not None}
        arguments = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS).decode()
    return ToolCall(str(item.get("call_id", "")), call_name(item), str(arguments or ""))


def _message_text(item: Mapping[str, Any]) -> str:
    parts = item.get("content") or ()
    texts = (p.get("text") for p in parts if isinstance(p, Mapping) and p.get("type") == "output_text")
    return "".join(str(text or "") for text in texts)


class OpenAIResponses:
    protocol = "openai_responses"
    operation = "chat"
    provider_type = "openai"
    upstream_path = "/responses"

    def parse_request(self, body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
        model = require_model(body)
        for key, why in UNBOUNDED.items():
            if body.get(key) not in (None, False):
                raise InvalidRequest(f"'{key}' {why}; send the whole input instead", param=key)
        items = _input(body, limits)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean", param="stream")
        # the budget and the tool-call cap lower `max_tool_calls` and reserve for what it allows: one they
        # cannot read (`50.0`, `1e2`) would reach the API unlowered, and it may read it as an integer
        opt_int(body, "max_tool_calls", minimum=0, maximum=MAX_TOKEN_COUNT)
        images, unbounded = input_parts(body, raw)  # a PDF is billed per page: bounded like images
        unbounded_reasons, stored_reasoning = _unbounded(body, items, raw)
        offered = offered_tools(body, raw)
        return Call(
            protocol="openai_responses",
            operation="chat",
            model=model,
            stream=bool(stream),
            max_tokens=opt_int(body, "max_output_tokens", minimum=1),
            input_bytes=len(raw),
            input_images=images,
            referenced_documents=unbounded,
            tools=_tools(body.get("tools"), limits),
            tool_choice=_tool_choice(body.get("tool_choice")),
            tool_results=_latest_results(items),
            params=RequestParams(temperature=opt_number(body, "temperature"),
                                 top_p=opt_number(body, "top_p")),
            request_hash=digest(raw),
            raw=body,
            search_limits=search_limits(body, offered),
            search_preview=offers_preview_search(offered),
            unpriced_tools=unpriced_tools(offered),
            unreserved_tools=unreserved_tools(offered),
            unbounded=unbounded_reasons,
            stored_reasoning=stored_reasoning,
            service_tier=service_tier(body),
        )

    def parse_answer(self, body: Mapping[str, Any]) -> Answer:
        return answer_from(body)

    def stream_reader(self, *, hide_usage: bool, choices: int = 1) -> ResponsesStreamReader:
        return ResponsesStreamReader()

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps({"error": openai_error(error)})

    def error_event(self, error: GatewayError, reader: Any = None) -> bytes:
        # `error` carries the object the SDK raises from (it raises on any event whose data has one); its
        # number follows the stream's events (a stream's numbers only grow)
        inner = openai_error(error)
        sequence = reader.next_sequence if isinstance(reader, ResponsesStreamReader) else 0
        data = {"type": "error", "code": inner["code"], "message": error.message, "param": error.param,
                "sequence_number": sequence, "error": inner}
        return format_event(orjson.dumps(data), "error")

    def stop_answer(self, call: Call, reason: str, detail: str) -> bytes:
        return orjson.dumps(response_shell(call, [stop_item(reason, detail)]))

    def stop_stream(self, call: Call, reason: str, detail: str) -> bytes:
        created = response_shell(call, [], status="in_progress")
        head = (stream_event("response.created", 0, response=created)
                + stream_event("response.in_progress", 1, response=created))
        return head + stop_events(reason, detail, index=0, sequence=2, response=created)

    def stream_stop_tail(self, call: Call, reader: Any, reason: str, detail: str) -> bytes:
        """Stop events after part of the response was relayed: add a message saying why, complete it."""
        if isinstance(reader, ResponsesStreamReader) and reader.started:
            created = {**(reader.created or response_shell(call, [])), "output": reader.shown_done}
            return stop_events(reason, detail, index=reader.shown_items, sequence=reader.next_sequence,
                               response=created)
        return self.stop_stream(call, reason, detail)

    def max_tokens_field(self, body: Mapping[str, Any]) -> str | None:
        return "max_output_tokens" if body.get("max_output_tokens") is not None else None

    def set_max_tokens(self, body: dict[str, Any], value: int, *, prefer_completion_field: bool) -> None:
        sent = body.get("max_output_tokens")
        body["max_output_tokens"] = value if sent is None else min(int(sent), value)

    def limit_hosted_calls(self, body: dict[str, Any], limit: int) -> bool:
        return limit_hosted_calls(body, limit)

    def unpriced_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        return unpriced_tools(offered_tools(body))

    def unreserved_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        return unreserved_tools(offered_tools(body))

    def search_sizes(self, body: Mapping[str, Any]) -> tuple[int, ...]:
        return ()  # each search adds SEARCH_INPUT_TOKENS

    def search_limits(self, body: Mapping[str, Any]) -> tuple[int | None, ...]:
        return search_limits(body, offered_tools(body))

    def ask_usage(self, body: dict[str, Any]) -> bool:
        return False  # the final event of a stream always carries the usage

    def with_instruction(self, body: Mapping[str, Any], answer_text: str, instruction: str) -> dict[str, Any]:
        value = body.get("input")
        items = [{"role": "user", "content": value}] if isinstance(value, str) else list(value or [])
        items.append({"role": "assistant", "content": answer_text or "(empty)"})
        items.append({"role": "user", "content": instruction})
        return {**body, "input": items}


def answer_from(body: Mapping[str, Any]) -> Answer:
    """The neutral answer of a response object: its messages' text and its call items."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    hosted = web_searches = file_searches = 0
    refused = False
    for item in body.get("output") or ():
        kind = item_type(item)
        if kind == "message":
            if item.get("phase") != "commentary":  # what the model says before its calls: not the answer
                texts.append(_message_text(item))
                parts = item.get("content")
                refused = refused or (isinstance(parts, list) and any(
                    isinstance(p, Mapping) and p.get("type") == "refusal" and refusal_of(p) for p in parts))
        elif kind == "reasoning":
            if isinstance(item.get("id"), str):
                reasoning.append(item["id"])
        elif kind in CALL_ITEMS:
            calls.append(_call(item))
        elif kind in HOSTED_CALL_ITEMS:
            hosted += 1
            web_searches += kind == "web_search_call"
            file_searches += kind == "file_search_call"
    status = body.get("status")
    usage = usage_from(body.get("usage"))
    if usage is not None and hosted:  # the usage object does not count them: the output items do
        usage = replace(usage, web_search_requests=web_searches, file_search_requests=file_searches)
    return Answer(
        response_id=body.get("id"),
        model=body.get("model"),
        text="".join(texts),
        tool_calls=tuple(calls),
        finish_reasons=(_finish(body),) if status else (),
        usage=usage,
        hosted_calls=hosted,
        service_tier=service_tier(body),  # a stream's final event carries the whole response, its tier too
        reasoning=tuple(reasoning),
        refused=refused and not "".join(texts),  # a refusal instead of an answer: no text beside it
        provider_error=_failure(body),
    )


def _failure(body: Mapping[str, Any]) -> str | None:
    """The error code of a response the provider failed (`status: failed`, `error.code`), else None."""
    if body.get("status") != "failed":
        return None
    error = body.get("error")
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, str) and code else "failed"


def _finish(body: Mapping[str, Any]) -> str:
    details = body.get("incomplete_details")
    if body.get("status") == "incomplete" and isinstance(details, Mapping) and details.get("reason"):
        return str(details["reason"])
    return str(body.get("status"))


def usage_from(usage: Any) -> Usage | None:
    if not isinstance(usage, Mapping):
        return None
    cached = usage.get("input_tokens_details")
    reasoning = usage.get("output_tokens_details")
    try:
        return Usage(
            input_tokens=required_count(usage.get("input_tokens")),
            output_tokens=required_count(usage.get("output_tokens")),
            cache_read_tokens=token_count(usage_detail(cached, "cached_tokens")),
            cache_creation_tokens=token_count(usage_detail(cached, "cache_write_tokens")),
            reasoning_tokens=token_count(usage_detail(reasoning, "reasoning_tokens")),
        )
    except ValueError:  # counts no provider reports: settled at the reservation, never believed
        return None


class ResponsesStreamReader:
    """Follows a streamed response. Text is relayed as it comes; from the first call item on, and
    always for the final event (`response.completed` / `.incomplete` / `.failed`, which repeats the
    whole output), events are held until the answer is judged. The answer joins what the events and
    the final response showed: a call in either is judged, text that differs between them is an
    upstream fault (`ValueError`, as every malformed event)."""

    def __init__(self) -> None:
        self._final: Answer | None = None
        self._text: list[str] = []
        self._calls: dict[int, ToolCall] = {}
        self._commentary: set[str] = set()  # message items of `phase: commentary`: not the answer's text
        self._chars = 0
        self._hosted = 0
        self.holding = False
        self.restart = False  # one message item holds the answer's text
        self.text_done = False  # an answer text's `output_text.done` came (`StreamReader`)
        self.complete = False
        self.delta = ""
        self.started = False  # an event reached the agent: a stop now completes what it has seen
        self.shown_items = 0  # output items added before the events were held
        self.shown_done: list[Any] = []  # those of them that are complete, as their done event had them
        self.next_sequence = 0
        self.created: dict[str, Any] | None = None  # the response `response.created` announced

    @property
    def output_chars(self) -> int:
        return self._chars

    def feed(self, event: SseEvent) -> StreamStep:
        self.delta = ""
        if not event.data:
            return StreamStep(event.raw, chunk=False)
        try:
            data = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            raise ValueError("an event's data is not valid JSON") from None
        if not isinstance(data, dict):
            raise ValueError("an event's data is not a JSON object")  # noqa: TRY004 - the relay's one error
        kind = item_type(data)
        sequence = data.get("sequence_number")
        if isinstance(sequence, int):
            self.next_sequence = max(self.next_sequence, sequence + 1)
        if kind == "error":
            raise ValueError(f"the upstream stream failed: {data.get('message') or data.get('code')}")
        if kind == "response.created" and isinstance(data.get("response"), dict):
            self.created = data["response"]
        if kind not in _FINAL and isinstance(data.get("response"), Mapping) and data["response"].get("output"):
            # output streams as output items (only the final event repeats it); the SDK starts its
            # snapshot from the response these events carry, so an item in it would reach the agent unjudged
            raise ValueError(f"{kind} carries output: a stream's output comes in output items")
        if kind in _FINAL:
            self._finish(data.get("response"))
            return self._relay(event, done=True)
        item = data.get("item")
        if kind == "response.output_item.added" and isinstance(item, Mapping):
            if item_type(item) in HOSTED_CALL_ITEMS:
                self._hosted += 1  # counted even if the stream is cut before its final event
            if item_type(item) in CALL_ITEMS:
                self.holding = True
            elif not self.holding:
                self.shown_items += 1
            if item.get("phase") == "commentary" and isinstance(item.get("id"), str):
                self._commentary.add(item["id"])
        elif kind == "response.output_item.done" and isinstance(item, Mapping):
            if item_type(item) in CALL_ITEMS:
                call = _call(item)
                self._calls[int(data.get("output_index") or 0)] = call
                self._chars += len(call.arguments)
            elif not self.holding:
                self.shown_done.append(item)
        elif kind == "response.output_text.done" and data.get("item_id") not in self._commentary:
            self.text_done = True
        elif kind == "response.output_text.delta":
            delta = data.get("delta")
            if isinstance(delta, str):
                self._chars += len(delta)
                if data.get("item_id") not in self._commentary:
                    self._text.append(delta)
                    self.delta = delta
        return self._relay(event)

    def _finish(self, response: Any) -> None:
        """The final event: the answer it completes (a failed response too: its usage is billed)."""
        if not isinstance(response, Mapping):
            raise ValueError("the final event carries no response object")  # noqa: TRY004 - see feed
        final = answer_from(response)
        streamed = "".join(self._text)
        if final.text and streamed and not final.text.startswith(streamed):
            raise ValueError("the final response's text differs from the text streamed before it")
        self.delta = final.text[len(streamed):]  # what no delta carried is checked with the final event
        self._chars += len(self.delta)
        self._final = final
        self.complete = True
        self.holding = True  # judged with the calls it lists, like any call event

    def _relay(self, event: SseEvent, *, done: bool = False) -> StreamStep:
        if not self.holding:
            self.started = True
        return StreamStep(event.raw, done=done)

    def answer(self) -> Answer:
        """What the events and the final response showed: the final text (or the streamed text), and
        every call either listed (each judged; the drop removes them from both)."""
        streamed = tuple(call for _, call in sorted(self._calls.items()))
        final = self._final
        if final is None:
            return Answer(text="".join(self._text), tool_calls=streamed, hosted_calls=self._hosted)
        extra = tuple(call for call in streamed if call not in final.tool_calls)
        text = final.text or "".join(self._text)
        # a final response showing only a refusal after text streamed: the text is the answer, judged
        return replace(final, text=text, tool_calls=final.tool_calls + extra,
                       hosted_calls=max(final.hosted_calls, self._hosted), refused=final.refused and not text)
