"""JSON-RPC 2.0 as MCP's Streamable HTTP transport carries it (pure).

One POST carries one message: a request (`method` and `id`), a notification (`method`, no `id`) or a
response (`id` and exactly one of `result` / `error`). Batches (JSON arrays) were removed from MCP in
revision 2025-06-18 and are refused, as is anything else that is not exactly one well-formed message.
Errors tollgate itself answers carry the contract code (DESIGN section 4) in `error.data.code` and
start their message with it.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway import exact_json
from gateway.call import canonical_json
from gateway.errors import GatewayError, InvalidApiKey, InvalidRequest, RequestTimeout, RequestTooLarge
from gateway.frozen_init import fast_init
from gateway.providers.common import json_depth_ok

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
# Server-defined range. -32001 is avoided: SDKs use it for their own request timeouts, and a policy
# refusal must not look retryable. -32020 is MCP's header/body mismatch.
POLICY_REFUSED = -32003
HEADER_MISMATCH = -32020
UPSTREAM_FAILED = -32000

RequestId = str | int
IDEMPOTENCY_META_KEY = "tollgate/idempotency_key"
_B64 = re.compile(r"=\?base64\?(.*)\?=\Z")
NAME_BEARING = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}


class BadMessage(InvalidRequest):
    """A POST body that is not one well-formed JSON-RPC message. `rpc_code` is -32700 or -32600."""

    def __init__(self, message: str, rpc_code: int = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.rpc_code = rpc_code


class BadArguments(InvalidRequest):
    """`tools/call` arguments that break the tool's `inputSchema` (JSON-RPC -32602)."""


@fast_init
@dataclass(frozen=True, slots=True)
class Message:
    """One parsed message. `id` is None for notifications; `body` is the whole parsed object."""

    body: dict[str, Any]
    method: str | None
    id: RequestId | None
    params: dict[str, Any]

    @property
    def is_request(self) -> bool:
        return self.method is not None and "id" in self.body


def parse_message(raw: bytes, max_depth: int) -> Message:
    """Parse and check one message. Raises BadMessage (parse error, batch, or invalid shape)."""
    try:
        body = exact_json.loads(raw)  # an argument of 2**70 reaches the server as that integer
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"body is not valid JSON: {exc}", PARSE_ERROR) from None
    if isinstance(body, list):
        raise BadMessage("batch requests (JSON arrays) are not supported: send one message per POST")
    if not isinstance(body, dict):
        raise BadMessage("body must be one JSON-RPC message object")
    if not json_depth_ok(body, max_depth):
        raise BadMessage(f"message nests deeper than {max_depth} levels")
    if body.get("jsonrpc") != "2.0":
        raise BadMessage('"jsonrpc" must be "2.0"')
    rpc_id = body.get("id")
    if "id" in body and (isinstance(rpc_id, bool) or not isinstance(rpc_id, str | int)):
        raise BadMessage('"id" must be a string or an integer')
    if isinstance(rpc_id, int) and not -(2**63) <= rpc_id < 2**64:
        raise BadMessage('an integer "id" must fit in 64 bits')
    method = body.get("method")
    if "method" in body:
        if not isinstance(method, str) or not method:
            raise BadMessage('"method" must be a non-empty string')
        params = body.get("params", {})
        if not isinstance(params, dict):
            raise BadMessage('"params" must be an object')
        return Message(body, method, rpc_id, params)
    if "id" not in body or ("result" in body) == ("error" in body):
        raise BadMessage('a message needs "method", or "id" with exactly one of "result" and "error"')
    return Message(body, None, rpc_id, {})


def decode_header_value(value: str) -> str:
    """Undo MCP's `=?base64?...?=` wrapping of header values that are not plain printable ASCII."""
    m = _B64.match(value)
    if m is None:
        return value
    try:
        return base64.b64decode(m.group(1), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return value  # not decodable: compared as is, so it mismatches


def error_message(
    rpc_id: RequestId | None, code: int, message: str, data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data:
        error["data"] = dict(data)
    return {"jsonrpc": "2.0", "id": rpc_id, "error": error}


def error_body(rpc_id: RequestId | None, code: int, message: str, data: Mapping[str, Any] | None = None) -> bytes:
    return orjson.dumps(error_message(rpc_id, code, message, data))


def gateway_error(rpc_id: RequestId | None, exc: GatewayError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON-RPC error message) for a tollgate error.

    Decisions about a well-formed request (policy refusals and stops, all 403 in DESIGN section 4,
    and arguments that break the schema) answer HTTP 200 with the JSON-RPC error: MCP clients read
    a 403 as an authorization problem, not as the decision it is. Transport-level problems (bad
    message, size, key, upstream) keep the error's own status; SDKs surface both as the JSON-RPC error.
    """
    name = exc.stop_reason or exc.code
    if exc.status == 403:
        return 200, error_message(rpc_id, POLICY_REFUSED, f"{name}: {exc.message}", {"code": name})
    if isinstance(exc, BadArguments):
        return 200, error_message(rpc_id, INVALID_PARAMS, f"invalid_arguments: {exc.message}",
                                  {"code": "invalid_arguments"})
    if isinstance(exc, BadMessage):
        code = exc.rpc_code
    elif isinstance(exc, InvalidRequest | RequestTooLarge | RequestTimeout | InvalidApiKey):
        code = INVALID_REQUEST
    else:
        code = UPSTREAM_FAILED
    data = {"code": name} if exc.param is None else {"code": name, "param": exc.param}
    return exc.status, error_message(rpc_id, code, f"{name}: {exc.message}", data)


HANDSHAKE_VERSIONS = frozenset({"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"})


def replayed(message: Mapping[str, Any], rpc_id: RequestId, protocol_version: str | None) -> bytes:
    """A recorded response re-addressed to another request, in that request's protocol era:
    results of 2026-07-28 and later carry `resultType`, handshake-era results do not."""
    out = {**message, "id": rpc_id}
    result = message.get("result")
    if isinstance(result, dict):
        if protocol_version is None or protocol_version in HANDSHAKE_VERSIONS:
            out["result"] = {k: v for k, v in result.items() if k != "resultType"}
        else:
            out["result"] = {"resultType": "complete", **result}
    return orjson.dumps(out)


# -- tools ---------------------------------------------------------------------------------------------


def filter_tools(
    message: dict[str, Any], allowed: Callable[[str], bool], seen: Callable[[str, Any], None], *, private: bool
) -> dict[str, Any] | None:
    """Drop the tools `allowed` refuses from a `tools/list` result; None when nothing changed.

    `seen(name, inputSchema)` is called for every kept tool. Entries without a string name are
    dropped (fail closed). Pagination fields are kept, so the client follows `nextCursor` itself and
    every page passes through here. `private`: the answer depends on who asks (an allow-list applies),
    so a 2026-07-28 `cacheScope: "public"` (shareable across callers) becomes `"private"`.
    """
    result = message.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
        return None
    kept: list[Any] = []
    for tool in result["tools"]:
        name = tool.get("name") if isinstance(tool, dict) else None
        if isinstance(name, str) and allowed(name):
            kept.append(tool)
            seen(name, tool.get("inputSchema"))
    public = private and result.get("cacheScope") == "public"
    if len(kept) == len(result["tools"]) and not public:
        return None
    return {**message, "result": {**result, "tools": kept, **({"cacheScope": "private"} if public else {})}}


def check_routing_headers(message: Message, method_headers: Sequence[str], name_headers: Sequence[str]) -> None:
    """MCP 2026-07-28 mirrors the method (`Mcp-Method`) and the tool, prompt or resource name
    (`Mcp-Name`) in headers. When present, every copy must agree with the body tollgate judged, so a
    server that routes by header cannot be sent somewhere else. Raises BadMessage (-32020)."""
    for method_header in method_headers:
        if method_header != message.method:
            raise BadMessage(f"the Mcp-Method header {method_header!r} does not match the body's method",
                             HEADER_MISMATCH)
    field = NAME_BEARING.get(message.method or "")
    if field is None:
        return
    for name_header in name_headers:
        if decode_header_value(name_header) != message.params.get(field):
            raise BadMessage(f"the Mcp-Name header does not match the body's params.{field}", HEADER_MISMATCH)


def result_content(result: Mapping[str, Any]) -> tuple[str, bool]:
    """(content for the no-progress guard, isError) of a `tools/call` result. `_meta` is left out:
    it carries server stamps that differ between otherwise equal results."""
    content = {k: v for k, v in result.items() if k not in ("_meta", "resultType")}
    return canonical_json(content).decode(), bool(result.get("isError"))


def is_final_result(result: Mapping[str, Any]) -> bool:
    """False for SEP-2322 `input_required` results: the client retries the call with more input."""
    return bool(result.get("resultType", "complete") == "complete")


# MCP tasks: a `tools/call` answered with a task handle runs the tool, and its result comes later through
# `tasks/*` requests, which tollgate could not judge (no-progress, recorded writes) nor scope to an agent.
# So no task is ever created through tollgate: a 2025-11-25 `params.task` is refused, the 2026-07-28
# extension (SEP-2663) is taken off the call's declared capabilities, and `tasks/*` requests are refused.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"


def untasked(message: Message) -> Message:
    """The `tools/call` refused when it asks for a task (2025-11-25 `params.task`; BadMessage), or without
    the tasks extension among its declared capabilities (SEP-2663): the server then runs it plainly."""
    if message.params.get("task") is not None:
        raise BadMessage("task-augmented tool calls are not relayed (their results would reach the agent "
                         'unjudged): call the tool without "task"')
    meta = message.params.get("_meta")
    caps = meta.get(CLIENT_CAPABILITIES) if isinstance(meta, dict) else None
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    if not isinstance(extensions, dict) or TASKS_EXTENSION not in extensions:
        return message
    assert isinstance(meta, dict) and isinstance(caps, dict)
    kept = {k: v for k, v in extensions.items() if k != TASKS_EXTENSION}
    params = {**message.params, "_meta": {**meta, CLIENT_CAPABILITIES: {**caps, "extensions": kept}}}
    return replace(message, body={**message.body, "params": params}, params=params)


TASK_ANSWER = "the MCP server answered with a task, whose result tollgate could not judge; the tool may be running"


def is_task_handle(result: Mapping[str, Any]) -> bool:
    """A `tools/call` answered with a task (SEP-2663 `resultType: task`, 2025-11-25 `{"task": {...}}`)."""
    return result.get("resultType") == "task" or isinstance(result.get("task"), Mapping)


# -- SSE -----------------------------------------------------------------------------------------------


def without_resumption(raw: bytes) -> bytes:
    """An SSE event without its `id` and `retry` fields: a client given no event id cannot resume the
    stream behind tollgate's back (a resumed stream would bring the response unjudged)."""
    if b"id" not in raw and b"retry" not in raw:
        return raw
    lines = raw.splitlines(keepends=True)
    kept = [ln for ln in lines if ln.partition(b":")[0].rstrip(b"\r\n") not in (b"id", b"retry")]
    return raw if len(kept) == len(lines) else b"".join(kept)


def replace_event_data(raw: bytes, data: bytes) -> bytes:
    """An SSE event with its `data` replaced; `event`, `id` and `retry` lines are kept."""
    lines = [ln for ln in raw.splitlines() if ln and not (ln == b"data" or ln.startswith(b"data:"))]
    return b"\n".join([*lines, b"data: " + data]) + b"\n\n"
