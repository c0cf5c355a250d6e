"""OpenAI Chat Completions wire protocol (`POST /v1/chat/completions`), I/O-free."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage, digest
from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge, error_code
from gateway.providers.base import StreamStep
from gateway.providers.common import (
    content_text,
    input_parts,
    opt_int,
    opt_number,
    opt_strings,
    refusal_of,
    request_basics,
    required_count,
    stop_text,
    token_count,
    usage_detail,
)
from gateway.providers.openai_functions import (
    LEGACY,
    call_fields,
    call_spec,
    forced_function,
    functions,
    proposed,
    tool_spec,
)
from gateway.providers.sse import SseEvent, format_event

DONE = b"data: [DONE]\n\n"
MAX_CHOICES = 128  # OpenAI's bound on `n`; each choice is reserved, so a wild `n` is a 400, not a stop


def aligned_reasons(reasons: list[str]) -> tuple[str, ...]:
    """`Answer.finish_reasons` from each choice's, in choice order ("": none), as
    `gen_ai.response.finish_reasons` lists them: a choice that ended without one (a stream cut before it
    finished) is "error", as OpenTelemetry's OpenAI instrumentation reports it, so that the others keep
    their places; none known at all: ()."""
    return tuple(r or "error" for r in reasons) if any(reasons) else ()


def _tools(raw_tools: list[Any]) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(raw_tools):
        spec = tool_spec(tool)
        if spec is None or not isinstance(spec.get("name"), str):
            raise InvalidRequest(f"tools[{index}] must be {{type: function, function: {{name, ...}}}} or "
                                 "{type: custom, custom: {name, ...}}", param="tools")
        if tool.get("type") == "custom":
            continue  # free-text input, not JSON arguments: nothing for `outputs.judge` to validate
        params = spec.get("parameters")
        specs.append(ToolSpec(spec["name"], spec.get("description"), params if isinstance(params, Mapping) else None))
    return tuple(specs)


def _tool_choice(value: Any) -> str | None:
    """The tool a `tool_choice` forces by name (a function or a custom tool), or None."""
    if value is None:  # absent from most requests: no Mapping ABC test for it
        return None
    if isinstance(value, Mapping):
        if value.get("type") == "allowed_tools" and isinstance(value.get("allowed_tools"), Mapping):
            return None  # a subset of the tools, filtered by the allow-list (`gateway.providers.tool_wire`)
        spec = tool_spec(value)
        if spec is not None and isinstance(spec.get("name"), str):
            return str(spec["name"])
        raise InvalidRequest("tool_choice must name a function or a custom tool, or be allowed_tools",
                             param="tool_choice")
    if value is None or value in ("auto", "none", "required"):
        return None
    raise InvalidRequest("tool_choice must be auto, none, required, allowed_tools or name a tool",
                         param="tool_choice")


def _forced(body: Mapping[str, Any]) -> str | None:
    """The tool a request forces, by `tool_choice` or the legacy `function_call` (one name at most: the
    allow-list judges the one that is forced, so two different names are refused)."""
    tool, function = _tool_choice(body.get("tool_choice")), forced_function(body.get("function_call"))
    if tool is not None and function is not None and tool != function:
        raise InvalidRequest("tool_choice and function_call force different tools", param="function_call")
    return tool or function


def _latest_results(messages: list[Any]) -> tuple[ToolResult, ...]:
    """Tool results of the latest round: the `role: tool` (legacy: `role: function`) messages after the
    last assistant message."""
    results: list[ToolResult] = []
    for message in reversed(messages):
        if type(message) is not dict and not isinstance(message, Mapping):  # the type test first: ~5x cheaper
            raise InvalidRequest("each message must be an object", param="messages")
        role = message.get("role")
        if role == "tool":
            results.append(ToolResult(str(message.get("tool_call_id", "")), content_text(message.get("content"))))
        elif role == "function":
            results.append(ToolResult(str(message.get("name", "")), content_text(message.get("content"))))
        elif role == "assistant":
            break
    results.reverse()
    return tuple(results)


class OpenAIChat:
    protocol = "openai"
    operation = "chat"
    provider_type = "openai"
    upstream_path = "/chat/completions"

    def parse_request(self, body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
        model, messages, raw_tools, stream = request_basics(body, limits, lambda role: isinstance(role, str), "must be an object with a role")
        legacy = functions(body.get("functions"))
        if len(raw_tools) + len(legacy) > limits.max_tools:
            raise RequestTooLarge(f"{len(raw_tools) + len(legacy)} tools exceed the limit of {limits.max_tools}")
        # both may be sent, and upstreams differ in which they honour: the larger one is the worst case
        limits_sent = [opt_int(body, key, minimum=1) for key in ("max_completion_tokens", "max_tokens")]
        max_tokens = max((v for v in limits_sent if v is not None), default=None)
        params = RequestParams(
            temperature=opt_number(body, "temperature"),
            top_p=opt_number(body, "top_p"),
            frequency_penalty=opt_number(body, "frequency_penalty"),
            presence_penalty=opt_number(body, "presence_penalty"),
            stop_sequences=opt_strings(body.get("stop")),
            seed=opt_int(body, "seed", minimum=-(2**63)),
            choice_count=opt_int(body, "n", minimum=1, maximum=MAX_CHOICES),
        )
        images, unbounded = input_parts(body, raw)  # a PDF is billed per page: bounded like images
        return Call(
            protocol="openai",
            operation="chat",
            model=model,
            stream=stream,
            max_tokens=max_tokens,
            input_bytes=len(raw),
            input_images=images,
            referenced_documents=unbounded,
            tools=_tools(raw_tools) + legacy,
            tool_choice=_forced(body),
            tool_results=_latest_results(messages),
            params=params,
            request_hash=digest(raw),
            raw=body,
            service_tier=service_tier(body),
            audio_output=_speaks(body),
            unbounded=_stored_audio(messages),
        )

    def parse_answer(self, body: Mapping[str, Any]) -> Answer:
        text = ""
        others: list[str] = []
        calls: list[ToolCall] = []
        reasons: list[str] = []
        refusals: list[str] = []  # every choice's refusal instead of an answer, "" for one that answered
        by_choice: list[tuple[str, ...]] = []
        for index, choice in enumerate(body.get("choices") or ()):
            message = choice.get("message") or {}
            before = len(calls)
            for tc in message.get("tool_calls") or ():
                name, arguments = call_fields(tc)
                calls.append(ToolCall(str(tc.get("id", "")), name, arguments))
            legacy = proposed(message)
            if legacy is not None:
                calls.append(ToolCall("", *legacy))
            names = tuple(c.name for c in calls[before:])
            content = message.get("content")
            refusals.append("" if content else refusal_of(message))  # a refusal next to content is an answer
            if index == 0:
                text = content or ""
                by_choice.append(names)
            elif not refusals[-1]:  # a refusal has no text to judge
                others.append(content if isinstance(content, str) else "")
                by_choice.append(names)
            reasons.append(str(choice.get("finish_reason") or ""))
        return Answer(
            response_id=body.get("id"),
            model=body.get("model"),
            text=text if isinstance(text, str) else "",
            tool_calls=tuple(calls),
            finish_reasons=aligned_reasons(reasons),
            usage=usage_from(body.get("usage")),
            other_texts=tuple(others),
            choice_calls=tuple(by_choice) if len(by_choice) > 1 else (),  # one choice: `tool_calls` says it
            service_tier=service_tier(body),
            system_fingerprint=_fingerprint(body),
            refused=bool(refusals and refusals[0]),  # a refusal instead of an answer
            refusals=tuple(refusals) if any(refusals) else (),
        )

    def stream_reader(self, *, hide_usage: bool, choices: int = 1) -> OpenAIStreamReader:
        return OpenAIStreamReader(hide_usage, choices)

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps({"error": openai_error(error)})

    def error_event(self, error: GatewayError, reader: Any = None) -> bytes:
        return format_event(orjson.dumps({"error": openai_error(error)}))

    def stop_answer(self, call: Call, reason: str, detail: str) -> bytes:
        return orjson.dumps(
            {
                "id": f"chatcmpl-tollgate-{int(time.time() * 1000)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": stop_text(reason, detail)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    def stop_stream(self, call: Call, reason: str, detail: str) -> bytes:
        chunk = {
            "id": f"chatcmpl-tollgate-{int(time.time() * 1000)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": call.model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": stop_text(reason, detail)},
                    "finish_reason": "stop",
                }
            ],
        }
        return format_event(orjson.dumps(chunk)) + DONE

    def stream_stop_tail(self, call: Call, reader: Any, reason: str, detail: str) -> bytes:
        return self.stop_stream(call, reason, detail)

    def max_tokens_field(self, body: Mapping[str, Any]) -> str | None:
        for key in ("max_completion_tokens", "max_tokens"):
            if body.get(key) is not None:
                return key
        return None

    def set_max_tokens(self, body: dict[str, Any], value: int, *, prefer_completion_field: bool) -> None:
        """Every output-limit field the agent sent is held to `value` (whichever one the upstream honours;
        one the agent set lower stays lower)."""
        sent = {key: body[key] for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None}
        if not sent:
            body["max_completion_tokens" if prefer_completion_field else "max_tokens"] = value
        for field, limit in sent.items():
            body[field] = min(int(limit), value)

    def limit_hosted_calls(self, body: dict[str, Any], limit: int) -> bool:
        return False  # Chat Completions offers no tools the provider runs itself

    def search_limits(self, body: Mapping[str, Any]) -> tuple[int | None, ...]:
        return ()

    def unpriced_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        return ()

    def search_sizes(self, body: Mapping[str, Any]) -> tuple[int, ...]:
        return ()

    def unreserved_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        return ()

    def ask_usage(self, body: dict[str, Any]) -> bool:
        """Ask for the usage chunk; True when the agent had not asked for it (then it is hidden)."""
        options = body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage") is True:
            return False
        body["stream_options"] = {**(options if isinstance(options, Mapping) else {}), "include_usage": True}
        return True

    def with_instruction(self, body: Mapping[str, Any], answer_text: str, instruction: str) -> dict[str, Any]:
        messages = list(body.get("messages") or [])
        messages.append({"role": "assistant", "content": answer_text})
        messages.append({"role": "user", "content": instruction})
        return {**body, "messages": messages}


def openai_error(error: GatewayError) -> dict[str, Any]:
    """The `error` object of OpenAI's APIs (Chat Completions and Responses)."""
    return {"message": error.message, "type": error.openai_type, "param": error.param, "code": error_code(error)}


def service_tier(body: Mapping[str, Any]) -> str | None:
    """The `service_tier` of a request (the tier asked for) or an answer (the tier billed), when it names
    one; anything else is None (the request is reserved at the standard rate, the answer settled at the
    reserved one: `gateway.pricing`)."""
    tier = body.get("service_tier")
    return tier if isinstance(tier, str) and tier else None


def _fingerprint(body: Mapping[str, Any]) -> str | None:
    """An answer's (or a chunk's) `system_fingerprint`, when it names one."""
    fingerprint = body.get("system_fingerprint")
    return fingerprint if isinstance(fingerprint, str) and fingerprint else None


def _stored_audio(messages: list[Any]) -> tuple[str, ...]:
    """Assistant messages naming a spoken answer stored upstream (`audio: {"id": ...}`), as `Call.unbounded`
    (refused under a budget): OpenAI puts its audio back in the context, billed as input audio tokens the
    body does not carry. Read from the messages themselves: a key lookup per message costs less than a
    byte search of a large body (and any spelling of the key is read)."""
    named = []
    for i, m in enumerate(messages):  # `type(m) is dict` first: an ABC isinstance costs ~5x more per message
        audio = m.get("audio") if type(m) is dict or isinstance(m, Mapping) else None
        if audio is not None and isinstance(audio, Mapping) and audio.get("id"):
            named.append(i)
    if not named:
        return ()
    return ((f"messages {named[:10]} name spoken answers stored upstream (audio.id), billed as input audio "
             "tollgate cannot see; send their transcript as the message's content instead"),)


def _speaks(body: Mapping[str, Any]) -> bool:
    """The request lets the model answer in audio (`modalities` lists it): its output tokens may be audio."""
    modalities = body.get("modalities")
    return isinstance(modalities, list) and "audio" in modalities


def usage_from(usage: Any) -> Usage | None:
    """The neutral usage of a Chat Completions `usage` object, audio tokens included (counted in the
    totals, priced apart); None when absent or not believable."""
    if not isinstance(usage, Mapping):
        return None
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    try:
        return Usage(
            input_tokens=required_count(usage.get("prompt_tokens")),
            output_tokens=required_count(usage.get("completion_tokens")),
            cache_read_tokens=token_count(usage_detail(prompt_details, "cached_tokens")),
            reasoning_tokens=token_count(usage_detail(completion_details, "reasoning_tokens")),
            input_audio_tokens=token_count(usage_detail(prompt_details, "audio_tokens")),
            output_audio_tokens=token_count(usage_detail(completion_details, "audio_tokens")),
        )
    except ValueError:  # counts no provider reports: settled at the reservation, never believed
        return None


class OpenAIStreamReader:
    """Accumulates a streamed chat completion; relays every event unchanged except a usage chunk the
    agent did not ask for (tollgate asked for it to settle the budget)."""

    def __init__(self, hide_usage: bool, choices: int = 1) -> None:
        self._hide_usage = hide_usage
        self._choices = choices  # `n`: the answer is complete once that many choices finished
        self._id: str | None = None
        self._model: str | None = None
        self._text: list[str] = []
        self._others: dict[int, list[str]] = {}  # the text of the choices after the first (`n` > 1)
        self._calls: dict[tuple[int, int], list[str]] = {}
        self._reasons: dict[int, str] = {}
        self._unfinished: set[int] = set()  # choices seen without their finish_reason yet (`n` > 1)
        self._usage: Usage | None = None
        self._tier: str | None = None  # the tier the chunks report (each carries it; the last one counts)
        self._fingerprint: str | None = None  # the first chunk's `system_fingerprint`
        self._refusals: dict[int, list[str]] = {}  # the `refusal` each choice streamed
        self._chars = 0
        self.holding = False  # a tool call started: hold events until the answer is judged
        self.complete = False
        self.delta = ""  # answer text carried by the last event fed
        self.restart = False  # the provider runs no tool between parts of the answer's text here
        self.text_done = False  # a choice's finish reason came (`StreamReader`)

    @property
    def output_chars(self) -> int:
        return self._chars

    def feed(self, event: SseEvent) -> StreamStep:
        self.delta = ""
        data = event.data
        if data == "[DONE]":  # the SDK stops at it: no chunk
            self.complete = True
            return StreamStep(event.raw, done=True, chunk=False)
        if not data:
            return StreamStep(event.raw, chunk=False)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise ValueError("an event's data is not valid JSON") from None
        if not isinstance(chunk, dict):
            raise ValueError("an event's data is not a JSON object")
        self._id = self._id or chunk.get("id")
        self._model = self._model or chunk.get("model")
        self._tier = service_tier(chunk) or self._tier
        self._fingerprint = self._fingerprint or _fingerprint(chunk)
        choices = chunk.get("choices") or []
        for choice in choices:
            index = int(choice.get("index") or 0)
            if not 0 <= index < self._choices:
                # a choice the request did not ask for: relayed as it arrives, its text would reach the
                # agent unjudged (only `n` choices are checked), and no budget reserved for it
                raise ValueError(f"a choice with index {index}, beyond the {self._choices} asked for (`n`)")
            delta = choice.get("delta") or {}
            content = delta.get("content")
            refusal = refusal_of(delta)
            if refusal:
                self._chars += len(refusal)
                self._refusals.setdefault(index, []).append(refusal)
            if isinstance(content, str):
                self._chars += len(content)
                if index == 0:
                    self._text.append(content)
                    self.delta += content
                else:
                    self._others.setdefault(index, []).append(content)
            legacy = proposed(delta)
            if legacy is not None:
                self.holding = True
                slot = self._calls.setdefault((index, LEGACY), ["", "", ""])
                slot[1] += legacy[0]
                slot[2] += legacy[1]
                self._chars += len(legacy[1])
            for tc in delta.get("tool_calls") or ():
                self.holding = True
                slot = self._calls.setdefault((index, int(tc.get("index") or 0)), ["", "", ""])
                fn = call_spec(tc)
                slot[0] = slot[0] or str(tc.get("id") or "")
                slot[1] += str(fn.get("name") or "")
                args = fn.get("arguments", fn.get("input"))
                if isinstance(args, str):
                    slot[2] += args
                    self._chars += len(args)
            if choice.get("finish_reason"):
                self._reasons[index] = str(choice["finish_reason"])
                self._unfinished.discard(index)
                self.text_done = True
            elif index not in self._reasons:
                self._unfinished.add(index)
            # complete once every choice asked for has finished: a cut stream may have ended one of several
            self.complete = len(self._reasons) >= self._choices and not self._unfinished
        reported = chunk.get("usage")
        usage = usage_from(reported)
        if usage is not None or reported is not None:
            self._usage = usage  # a report not believed makes the usage unknown, not the previous one
            if self._hide_usage and not choices:
                return StreamStep(b"")
        return StreamStep(event.raw)

    def answer(self) -> Answer:
        calls = tuple(ToolCall(v[0], v[1], v[2]) for _, v in sorted(self._calls.items()))
        names: dict[int, list[str]] = {}
        for (index, _), slot in sorted(self._calls.items()):
            names.setdefault(index, []).append(slot[1])
        texts = ["".join(self._text), *("".join(self._others.get(i, ())) for i in range(1, self._choices))]
        # a refusal next to content is an answer; one without has no text to judge
        refusals = ["" if text else "".join(self._refusals.get(i, ())) for i, text in enumerate(texts)]
        # every choice asked for, one of calls alone too
        others = [i for i in range(1, self._choices) if not refusals[i]]
        return Answer(
            response_id=self._id,
            model=self._model,
            text=texts[0],
            tool_calls=calls,
            finish_reasons=aligned_reasons([self._reasons.get(i, "") for i in range(self._choices)]),
            usage=self._usage,
            other_texts=tuple(texts[i] for i in others),
            choice_calls=tuple(tuple(names.get(i, ())) for i in (0, *others)) if others else (),
            service_tier=self._tier,
            system_fingerprint=self._fingerprint,
            refused=bool(refusals[0]),
            refusals=tuple(refusals) if any(refusals) else (),
        )
