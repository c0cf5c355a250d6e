"""Scriptable fake model providers (OpenAI-compatible and Anthropic) on loopback.

A test queues `Reply`s; each request pops the next one (or gets the default). Every request is
recorded (method, path, headers, body) so tests can assert what the gateway sent upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer


@asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """`handler` answering every method and path on a loopback server; yields its base URL (no
    trailing slash). For a test's own scripted upstream; `FakeProvider` is the general one."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def sse_response(request: web.Request, chunks: Iterable[bytes]) -> web.StreamResponse:
    """An event stream of `chunks`, each written as it is, then ended."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # JSON-serialisable, or bytes sent as they are
    chunks: Sequence[bytes] | None = None  # an SSE stream, written chunk by chunk
    delay: float = 0.0  # before the headers
    chunk_delay: float = 0.0  # between chunks
    cut_after: int | None = None  # drop the connection after this many chunks
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


def openai_completion(text: str = "Hello!", *, model: str = "gpt-4o-mini", tool_calls: list[dict[str, Any]] | None = None,
                      prompt_tokens: int = 10, completion_tokens: int = 5, finish: str = "stop") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
        message["content"] = None if not text else text
        finish = "tool_calls"
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def tool_call(name: str, arguments: str = "{}", call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def openai_stream(parts: Sequence[str], *, model: str = "gpt-4o-mini", usage: tuple[int, int] | None = (10, 5),
                  tool_calls: list[dict[str, Any]] | None = None, done: bool = True) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}) for p in parts]
    for index, tc in enumerate(tool_calls or ()):
        fn = tc["function"]
        out.append(chunk({"tool_calls": [{"index": index, "id": tc["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))
        out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}))
    out.append(chunk({}, "tool_calls" if tool_calls else "stop"))
    if usage is not None:
        data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000, "model": model,
                "choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                         "total_tokens": sum(usage)}}
        out.append(b"data: " + orjson.dumps(data) + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def openai_embedding(count: int = 1, *, model: str = "text-embedding-3-small", prompt_tokens: int = 8,
                     dims: int = 3) -> dict[str, Any]:
    """A `POST /v1/embeddings` answer: `count` vectors; embeddings bill their input only."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": [0.125] * dims} for i in range(count)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def openai_text_completion(text: str = "Hello!", *, model: str = "gpt-3.5-turbo-instruct", prompt_tokens: int = 10,
                           completion_tokens: int = 5) -> dict[str, Any]:
    """A legacy `POST /v1/completions` answer."""
    return {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def openai_text_stream(parts: Sequence[str], *, model: str = "gpt-3.5-turbo-instruct",
                       usage: tuple[int, int] | None = (10, 5), done: bool = True) -> list[bytes]:
    """A streamed legacy completion: text chunks, the usage chunk (`stream_options.include_usage`), [DONE]."""
    def chunk(text: str, finish: str | None = None) -> bytes:
        data = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    out = [chunk(p) for p in parts] + [chunk("", "stop")]
    if usage is not None:
        data = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": model,
                "choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                         "total_tokens": sum(usage)}}
        out.append(b"data: " + orjson.dumps(data) + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def openai_compaction(*, input_tokens: int = 40, output_tokens: int = 12) -> dict[str, Any]:
    """A `POST /v1/responses/compact` answer: the user messages, then one compaction item."""
    return {"id": "cmp_fake", "object": "response.compaction", "created_at": 1700000000,
            "output": [{"id": "msg_1", "type": "message", "role": "user", "status": "completed",
                        "content": [{"type": "input_text", "text": "hi"}]},
                       {"id": "cmp_1", "type": "compaction", "encrypted_content": "opaque"}],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "total_tokens": input_tokens + output_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def anthropic_message(text: str = "Hello!", *, model: str = "claude-3-5-haiku-latest",
                      tool_uses: list[dict[str, Any]] | None = None, input_tokens: int = 10,
                      output_tokens: int = 5) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", **t} for t in tool_uses or ()]
    return {
        "id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": "tool_use" if tool_uses else "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def anthropic_stream(parts: Sequence[str], *, model: str = "claude-3-5-haiku-latest",
                     tool_uses: list[dict[str, Any]] | None = None, usage: tuple[int, int] = (10, 5),
                     complete: bool = True) -> list[bytes]:
    def ev(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    out = [ev("message_start", {"type": "message_start", "message": {
        "id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": usage[0], "output_tokens": 1}}})]
    out.append(ev("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}))
    out += [ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": p}}) for p in parts]
    out.append(ev("content_block_stop", {"type": "content_block_stop", "index": 0}))
    for i, t in enumerate(tool_uses or (), start=1):
        out.append(ev("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
            "type": "tool_use", "id": t["id"], "name": t["name"], "input": {}}}))
        out.append(ev("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
            "type": "input_json_delta", "partial_json": orjson.dumps(t.get("input", {})).decode()}}))
        out.append(ev("content_block_stop", {"type": "content_block_stop", "index": i}))
    if complete:
        out.append(ev("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": "tool_use" if tool_uses else "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": usage[1]}}))
        out.append(ev("message_stop", {"type": "message_stop"}))
    return out


class FakeProvider:
    """One fake upstream serving both wire protocols (paths decide)."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.seen: list[Seen] = []
        self.default: Reply | None = None
        self.disconnects = 0
        self.in_flight = 0
        self.models: list[dict[str, Any]] = [{"id": "gpt-4o-mini", "object": "model", "owned_by": "fake"}]
        self._arrived = asyncio.Event()

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.method, request.path, dict(request.headers), b""))
        return web.json_response({"object": "list", "data": self.models})

    def _next(self, path: str) -> Reply:
        if self.replies:
            return self.replies.pop(0)
        if self.default is not None:
            return self.default
        if path.endswith("/messages"):
            return Reply(body=anthropic_message())
        return Reply(body=openai_completion())

    async def wait_seen(self, count: int) -> None:
        """Until `count` requests have arrived (bound it with `asyncio.wait_for`)."""
        while len(self.seen) < count:
            self._arrived.clear()
            await self._arrived.wait()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, dict(request.headers), body))
        self._arrived.set()
        reply = self._next(request.path)
        self.in_flight += 1
        try:
            if reply.delay:
                await asyncio.sleep(reply.delay)
            if reply.chunks is None:
                payload = reply.body if isinstance(reply.body, bytes) else orjson.dumps(reply.body)
                return web.Response(status=reply.status, body=payload,
                                    headers={"Content-Type": "application/json", **reply.headers})
            resp = web.StreamResponse(status=reply.status, headers={"Content-Type": "text/event-stream",
                                                                     **reply.headers})
            await resp.prepare(request)
            try:
                for index, chunk in enumerate(reply.chunks):
                    if reply.cut_after is not None and index >= reply.cut_after:
                        assert request.transport is not None
                        request.transport.close()
                        return resp
                    await resp.write(chunk)
                    if reply.chunk_delay:
                        await asyncio.sleep(reply.chunk_delay)
                await resp.write_eof()
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnects += 1
                raise
            return resp
        finally:
            self.in_flight -= 1
