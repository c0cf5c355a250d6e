"""The demo's scripted model: an OpenAI Chat Completions server on loopback that answers from scripts.

The model is a pure function of the conversation it is sent, so it needs no per-run state: the
system message names a script with the tag `[script:NAME]`, and the turn is the number of assistant
messages already in the conversation. A `Script` maps that turn to a `Turn`: a text answer or one
tool call, with the completion tokens it claims. Usage is reported as a real provider would:
`prompt_tokens` is a quarter of the request's bytes (never more than its bytes, which is what the
gateway reserves) and `completion_tokens` never exceeds the request's `max_completion_tokens` /
`max_tokens`. Streaming is not scripted: `stream: true` gets a 400 in OpenAI's error format.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.frozen_init import fast_init

__all__ = ["SCRIPT_TAG", "Script", "ScriptedModel", "Turn"]

SCRIPT_TAG = re.compile(r"\[script:([a-z0-9_-]+)\]")


@fast_init
@dataclass(frozen=True, slots=True)
class Turn:
    """One scripted answer: `tool` set means a tool call with `arguments`, else the text `text`."""

    text: str = ""
    tool: str | None = None
    arguments: Mapping[str, Any] = field(default_factory=dict)
    output_tokens: int = 40


Script = Callable[[int], Turn]
"""Turn number (0-based) -> the model's answer for that turn."""


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _system_text(messages: list[Any]) -> str:
    for message in messages:
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _output_limit(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


class ScriptedModel:
    """The scripted provider. `scripts` maps script names to `Script`s; `calls` counts answers."""

    def __init__(self, scripts: Mapping[str, Script], *, model_ids: tuple[str, ...] = ("demo-model",)
                 ) -> None:
        self._scripts = dict(scripts)
        self._model_ids = model_ids
        self.calls = 0

    def app(self) -> web.Application:
        """The aiohttp app: `POST /v1/chat/completions` and `GET /v1/models`."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 1700000000, "owned_by": "tollgate-demo"}
                for m in self._model_ids]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "expected a chat completion request with messages", "invalid_request")
        if body.get("stream"):
            return _error(400, "the demo model does not stream", "stream_unsupported")
        messages: list[Any] = body["messages"]
        found = SCRIPT_TAG.search(_system_text(messages))
        script = self._scripts.get(found.group(1)) if found else None
        if script is None:
            return _error(400, "the system message names no known [script:NAME]", "unknown_script")
        turn_no = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        turn = script(turn_no)
        limit = _output_limit(body)
        completion = min(turn.output_tokens, limit) if limit is not None else turn.output_tokens
        self.calls += 1
        return web.Response(
            body=orjson.dumps(self._completion(body, turn, turn_no, max(1, len(raw) // 4), completion)),
            content_type="application/json",
        )

    def _completion(self, body: Mapping[str, Any], turn: Turn, turn_no: int, prompt: int,
                    completion: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None, "refusal": None}
        finish = "stop"
        if turn.tool is not None:
            finish = "tool_calls"
            message["tool_calls"] = [{
                "id": f"call_{self.calls:04d}", "type": "function",
                "function": {"name": turn.tool, "arguments": orjson.dumps(dict(turn.arguments)).decode()},
            }]
        return {
            "id": f"chatcmpl-demo-{self.calls:04d}",
            "object": "chat.completion",
            "created": 1700000000 + turn_no,
            "model": str(body.get("model") or self._model_ids[0]),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        }
