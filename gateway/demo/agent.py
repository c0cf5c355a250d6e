"""The demo's sample agent: a plain aiohttp client, as an agent's own code would talk to tollgate.

It speaks the OpenAI Chat Completions wire to the gateway's `/v1/chat/completions` and MCP JSON-RPC
to the gateway's `/mcp/<server>`; the only tollgate-specific things it sends are its agent key (as
the bearer token) and its run id (`x-tollgate-run-id`). `run_loop` is the classic agent loop: ask the
model, run the tools it proposes over MCP, feed the results back, until the model answers in text or
the gateway refuses. Every event is narrated through `say`. Transport failures (the gateway or a
server unreachable, an answer that is not JSON) raise `DemoError`; refusals are results, not errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gateway.demo.toolserver import PROTOCOL_VERSION
from gateway.frozen_init import fast_init

__all__ = ["DemoError", "LoopEnd", "SampleAgent", "openai_tools"]


class DemoError(Exception):
    """The tour could not run or did not show what it should; the message says what happened."""


@fast_init
@dataclass(frozen=True, slots=True)
class LoopEnd:
    """How `run_loop` ended: `code` is the gateway's error code (None: the model answered), `answer`
    the final text, `status` the HTTP status of the last model call."""

    status: int
    code: str | None
    message: str
    answer: str | None = None


def openai_tools(mcp_tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """MCP `tools/list` entries as OpenAI function tools (what an agent offers its model)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("inputSchema") or {"type": "object"}}}
            for t in mcp_tools]


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SampleAgent:
    """One agent identity and one run. `say` receives one narration line per event."""

    def __init__(self, session: aiohttp.ClientSession, *, proxy_url: str, key: str, run_id: str,
                 server: str, model: str, say: Callable[[str], None]) -> None:
        self._session = session
        self._proxy_url = proxy_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {key}", "x-tollgate-run-id": run_id}
        self._mcp_headers = {"Content-Type": "application/json",
                             "Accept": "application/json, text/event-stream"}
        self._server = server
        self._model = model
        self._rpc_id = 0
        self.say = say
        self.run_id = run_id

    async def _post(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[int, Any]:
        url = self._proxy_url + path
        try:
            async with self._session.post(url, data=orjson.dumps(body),
                                          headers={**self._headers, **headers}) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DemoError(f"POST {url} failed: {exc!r}") from exc
        if status == 202 and not raw:
            return status, None
        try:
            return status, orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise DemoError(f"POST {url} answered {status}, not with JSON: {raw[:200]!r}") from exc

    async def rpc(self, method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One JSON-RPC request to the gateway's `/mcp/<server>`; the JSON-RPC response message."""
        self._rpc_id += 1
        message = {"jsonrpc": "2.0", "id": self._rpc_id, "method": method, "params": dict(params or {})}
        _, answer = await self._post(f"/mcp/{self._server}", message, self._mcp_headers)
        if not isinstance(answer, dict) or ("result" not in answer and "error" not in answer):
            raise DemoError(f"MCP {method}: not a JSON-RPC response: {_short(answer, 200)}")
        return answer

    async def connect(self) -> list[dict[str, Any]]:
        """MCP handshake through tollgate, then `tools/list`: the tools this agent may see."""
        init = await self.rpc("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                             "clientInfo": {"name": "tollgate-demo-agent", "version": "1.0"}})
        if "error" in init:
            raise DemoError(f"MCP initialize was refused: {init['error']}")
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        await self._post(f"/mcp/{self._server}", initialized, self._mcp_headers)
        listed = await self.rpc("tools/list")
        tools = list(listed.get("result", {}).get("tools", []))
        self.say(f"mcp    tools/list via tollgate: {', '.join(t['name'] for t in tools) or '(none)'}")
        return tools

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any]
    ) -> tuple[str | None, dict[str, Any] | None]:
        """MCP `tools/call` through tollgate: (text result, None) or (None, the JSON-RPC error)."""
        answer = await self.rpc("tools/call", {"name": name, "arguments": dict(arguments)})
        if "error" in answer:
            error = answer["error"]
            code = (error.get("data") or {}).get("code")
            self.say(f"mcp    tools/call {name} REFUSED by tollgate: JSON-RPC {error.get('code')} {code}")
            return None, error
        content = answer["result"].get("content") or []
        text = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        self.say(f"mcp    tools/call {name} -> {_short(text, 48)!r}")
        return text, None

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                   max_tokens: int | None) -> tuple[int, dict[str, Any]]:
        """One Chat Completions call through tollgate: (status, JSON body)."""
        body: dict[str, Any] = {"model": self._model, "messages": messages}
        if tools:
            body["tools"] = tools
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        status, answer = await self._post("/v1/chat/completions", body, {"Content-Type": "application/json"})
        if not isinstance(answer, dict):
            raise DemoError(f"chat completion answered {status} without a JSON object")
        return status, answer

    async def run_loop(self, system: str, task: str, tools: list[dict[str, Any]], *, max_turns: int,
                       max_tokens: int | None = None) -> LoopEnd:
        """Ask, run proposed tools over MCP, repeat; ends on a text answer, a refusal or `max_turns`."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                          {"role": "user", "content": task}]
        for _ in range(max_turns):
            status, body = await self.chat(messages, tools, max_tokens)
            if status != 200:
                error = body.get("error")
                error = error if isinstance(error, dict) else {}
                code, message = str(error.get("code") or f"http_{status}"), str(error.get("message", ""))
                self.say(f"model  REFUSED by tollgate: HTTP {status} {code}: {_short(message, 90)}")
                return LoopEnd(status, code, message)
            try:
                message_out: dict[str, Any] = body["choices"][0]["message"]
                calls = [(c["id"], c["function"]["name"],
                          orjson.loads(c["function"].get("arguments") or "{}"))
                         for c in message_out.get("tool_calls") or []]
            except (KeyError, IndexError, TypeError, orjson.JSONDecodeError) as exc:
                raise DemoError(f"the model's answer is not a chat completion: {_short(body, 200)}") from exc
            messages.append(message_out)
            if not calls:
                answer = str(message_out.get("content") or "")
                self.say(f"model  answers: {_short(answer)!r}")
                return LoopEnd(status, None, "", answer)
            for call_id, name, arguments in calls:
                self.say(f"model  proposes {name}({_short(arguments, 50)})")
                text, refusal = await self.call_tool(name, arguments)
                result = text if refusal is None else f"error: {refusal.get('message')}"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return LoopEnd(200, None, f"gave up after {max_turns} turns")
