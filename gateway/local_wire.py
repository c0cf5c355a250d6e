"""The OpenAI chat-completions wire of the local model (gateway/local.py), without torch: the request
parsed into a `Job` (what the model cannot honour is a 400), and the answer as an `UpstreamResponse`
(`LocalResponse`: one JSON body, or SSE chunks fed by the generation thread)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import InvalidRequest, UpstreamTimeout, UpstreamUnavailable
from gateway.frozen_init import fast_init
from grammars.requests import request_constraints
from grammars.spec import ConstraintSpec

_log = logging.getLogger(__name__)
SAMPLING_EPS = 1e-5  # the lowest temperature sampled at; a colder one decodes greedily


@fast_init
@dataclass(frozen=True, slots=True)
class Job:
    """One parsed request. `sampling` holds transformers' generate() flags."""

    model: str
    messages: list[dict[str, str]]
    spec: ConstraintSpec | None  # the constraint to decode with
    max_new: int | None = None  # None: the provider's max_new_tokens
    sampling: dict[str, Any] = field(default_factory=lambda: {"do_sample": False})
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class Result:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length


@dataclass(slots=True)
class LocalResponse:
    """`UpstreamResponse` of the local model: a complete JSON answer (`body`), or the SSE chunks of a
    generation in progress (`task` set, text deltas arriving on `queue`, None last). `release()`
    stops a generation nobody reads any more."""

    job: Job
    body: bytes = b""
    task: asyncio.Future[Result | None] | None = None
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    idle: float = 60.0
    status: int = 200

    @property
    def headers(self) -> Mapping[str, str]:
        return {"Content-Type": "text/event-stream" if self.task is not None else "application/json"}

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.task is None:
            yield self.body
            return
        head = _head(self.job.model, "chat.completion.chunk")
        yield _sse(head, [_delta({"role": "assistant", "content": ""}, None)])
        while True:
            try:
                async with asyncio.timeout(self.idle):
                    delta = await self.queue.get()
            except TimeoutError:
                self.cancel.set()
                raise UpstreamTimeout(f"local model produced nothing for {self.idle:g}s") from None
            if delta is None:
                break
            yield _sse(head, [_delta({"content": delta}, None)])
        result = outcome(self.task)
        yield _sse(head, [_delta({}, result.finish_reason)])
        if self.job.include_usage:
            yield _sse(head, [], usage=_usage(result))
        yield b"data: [DONE]\n\n"

    def release(self) -> None:
        self.cancel.set()


def answer_body(job: Job, result: Result) -> bytes:
    """A non-streamed chat.completion."""
    message = {"role": "assistant", "content": result.text}
    choice = {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
    return orjson.dumps({**_head(job.model, "chat.completion"), "choices": [choice], "usage": _usage(result)})


def outcome(task: asyncio.Future[Result | None], *, sent: bool = True) -> Result:
    """The finished generation's result; UpstreamUnavailable (502) when the worker thread failed
    (`sent`: after the model began to read the prompt, so the call is charged)."""
    try:
        result = task.result()
    except Exception as exc:  # whatever broke in torch: to the client, the upstream failed
        _log.error("the local model's worker thread failed", exc_info=exc)  # an operator's problem
        raise UpstreamUnavailable(f"local model failed: {type(exc).__name__}: {exc}", sent=sent) from exc
    if result is None:  # pragma: no cover - a refused request never gets here
        raise UpstreamUnavailable("local model produced no answer")
    return result


def parse_request(body: bytes | None) -> Job:
    """The request as a `Job`. Raises InvalidRequest (400), naming the field, for what the local model
    cannot honour (n > 1, a forced tool call, logprobs, non-text content) or a malformed value."""
    try:
        data = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        raise InvalidRequest("the body is not JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("messages: must be a non-empty list of objects", param="messages")
    _refuse(data.get("n") not in (None, 1), "n", "the local model answers one choice")
    _refuse(data.get("tool_choice") not in (None, "none", "auto"), "tool_choice", "the local model does not call tools")
    _refuse(bool(data.get("logprobs")), "logprobs", "the local model does not return logprobs")
    # the larger of the limits sent (an explicit null is none): what the budget reserved for (`openai_chat`)
    limits_sent: list[Any] = [data[key] for key in ("max_completion_tokens", "max_tokens") if data.get(key) is not None]
    _refuse(not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in limits_sent), "max_tokens",
            "must be >= 1")
    max_new: int | None = max(limits_sent, default=None)
    temperature, top_p, seed = data.get("temperature", 1.0), data.get("top_p", 1.0), data.get("seed")
    _refuse(not isinstance(temperature, int | float) or temperature < 0, "temperature", "must be >= 0")
    _refuse(not isinstance(top_p, int | float) or not 0 < top_p <= 1, "top_p", "must be in (0, 1]")
    _refuse(seed is not None and not isinstance(seed, int), "seed", "must be an integer")
    sampling: dict[str, Any] = {"do_sample": False}  # temperature 0: greedy
    # below SAMPLING_EPS, logits / temperature overflow to inf and torch's sampler fails; sampling that
    # cold is greedy decoding anyway (vLLM draws the same line)
    if temperature >= SAMPLING_EPS:
        sampling = {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}
    stop = data.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    _refuse(stop is not None and not isinstance(stop, str | list) or not all(isinstance(s, str) and s for s in stops),
            "stop", "must be a string or a list of strings")
    options = data.get("stream_options")
    return Job(str(data.get("model", "")), [_message(m) for m in messages], _constraint(data), max_new, sampling,
               seed, stops, data.get("stream") is True,
               isinstance(options, dict) and options.get("include_usage") is True)


def _constraint(data: dict[str, Any]) -> ConstraintSpec | None:
    """The constraint to decode with: `structured_outputs`, else `guided_*`, else `response_format`
    (the pipeline validates any other constraint of the step itself)."""
    guided = {k: v for k, v in data.items() if k.startswith("guided_")}
    for part in ({"structured_outputs": data.get("structured_outputs")}, guided,
                 {"response_format": data.get("response_format")}):
        specs = request_constraints(part)  # raises InvalidGrammar naming the field
        if specs:
            return specs[0]
    return None


def _message(m: dict[str, Any]) -> dict[str, str]:
    content = m.get("content")
    if isinstance(content, list):
        _refuse(not all(isinstance(p, dict) and p.get("type") == "text" for p in content), "messages",
                "the local model takes text content only")
        content = "".join(str(p.get("text", "")) for p in content)
    return {"role": str(m.get("role", "user")), "content": content if isinstance(content, str) else ""}


def _refuse(condition: bool, param: str, problem: str) -> None:
    if condition:
        raise InvalidRequest(f"{param}: {problem}", param=param)


def _head(model: str, kind: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def _delta(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}


def _usage(r: Result) -> dict[str, int]:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _sse(head: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return b"data: " + orjson.dumps({**head, "choices": choices, **extra}) + b"\n\n"
