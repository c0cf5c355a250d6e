"""Probes of the MCP proxy against MCP features where a tool's result does not come back as the plain
response to `tools/call`: the Tasks utility (spec 2025-11-25, `params.task` + `tasks/result`) and the
Tasks extension of the 2026-07-28 era (SEP-2663, `io.modelcontextprotocol/tasks`: a `tools/call`
answered `resultType: "task"`, the result inlined by `tasks/get`), and SEP-2322 `input_required`.

Each test failed on the tollgate it was first written against (task handles and `tasks/*` relayed as
they came: results unjudged, writes run twice, caps miscounted); tollgate now creates no task.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web

from tests.conftest import GatewayFactory, Harness
from tests.fakes.scripted import ScriptedServer
from tests.gateway.test_mcp_probe import RAW_TOOLS, call, raw_server

MODERN = {"mcp-protocol-version": "2026-07-28"}
LEGACY = {"mcp-protocol-version": "2025-11-25"}
TASKS_EXT = "io.modelcontextprotocol/tasks"
CAPS_META = "io.modelcontextprotocol/clientCapabilities"
POLICY_REFUSED = -32003


class TaskServer(ScriptedServer):
    """A scripted MCP server (no sessions) that runs tools as tasks.

    2025-11-25 era: a `tools/call` with `params.task` is answered with a `CreateTaskResult`
    (`{"task": {...}}`); the tool runs at once and its result is fetched with `tasks/result`.
    2026-07-28 era (SEP-2663): a `tools/call` whose per-request capabilities declare the tasks
    extension is answered `resultType: "task"` (the task is durably created, and runs, before the
    answer); `tasks/get` inlines the completed result. A call that asks for no task runs plainly.
    Every started execution is counted in `executions`. `result_text`: what every tool returns."""

    def __init__(self, result_text: str | None = None, *, force_task: bool = False) -> None:
        self.result_text = result_text
        self.force_task = force_task  # answer every call with a task, asked for or not (a server at fault)
        self.executions: list[tuple[str, Any]] = []
        self.tasks: dict[str, dict[str, Any]] = {}
        self.received: list[dict[str, Any]] = []
        self._ids = itertools.count(1)

    def _run(self, name: str, arguments: Any) -> dict[str, Any]:
        self.executions.append((name, arguments))
        text = self.result_text if self.result_text is not None else f"{name} #{len(self.executions)}"
        return {"content": [{"type": "text", "text": text}], "isError": False}

    def result(self, method: str, params: dict[str, Any], modern: bool) -> dict[str, Any] | None:
        if method == "initialize":
            return {"protocolVersion": params.get("protocolVersion", "2025-11-25"),
                    "capabilities": {"tools": {}, "tasks": {"list": {}, "cancel": {},
                                                            "requests": {"tools": {"call": {}}}}},
                    "serverInfo": {"name": "tasks", "version": "0"}}
        if method == "tools/list":
            return {"tools": [{"name": n, "inputSchema": {"type": "object"}, "execution": {"taskSupport": "optional"}}
                              for n in ("read_file", "write_note", "delete_all")]}
        if method == "tools/call":
            name, arguments = str(params.get("name")), params.get("arguments")
            meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
            caps = meta.get(CAPS_META) if isinstance(meta.get(CAPS_META), dict) else {}
            wants_modern_task = modern and TASKS_EXT in (caps.get("extensions") or {})
            wants_legacy_task = not modern and isinstance(params.get("task"), dict)
            if not (wants_modern_task or wants_legacy_task or self.force_task):
                out = self._run(name, arguments)
                return {"resultType": "complete", **out} if modern else out
            task_id = f"task-{next(self._ids)}"
            outcome = self._run(name, arguments)  # the task is created and runs before the answer
            task = {"taskId": task_id, "status": "working", "createdAt": "2026-01-01T00:00:00Z",
                    "lastUpdatedAt": "2026-01-01T00:00:00Z"}
            self.tasks[task_id] = {**task, "status": "completed", "result": outcome}
            if modern:
                return {"resultType": "task", **task, "ttlMs": 60000, "pollIntervalMs": 10}
            return {"task": {**task, "ttl": 60000, "pollInterval": 10}}
        if method == "tasks/get":
            task = self.tasks.get(str(params.get("taskId")))
            if task is None:
                return None
            if modern:
                return {"resultType": "complete", **task, "ttlMs": 60000}
            return {k: v for k, v in task.items() if k != "result"}
        if method == "tasks/result":
            task = self.tasks.get(str(params.get("taskId")))
            if task is None:
                return None
            return {**task["result"], "_meta": {"io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}}}
        if method == "tasks/list":
            return {"tasks": [{k: v for k, v in t.items() if k != "result"} for t in self.tasks.values()]}
        return {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=405)
        body = orjson.loads(await request.read())
        self.received.append(body)
        if "id" not in body or "method" not in body:
            return web.Response(status=202)
        modern = request.headers.get("mcp-protocol-version") == "2026-07-28"
        result = self.result(body["method"], body.get("params") or {}, modern)
        if result is None:
            message: dict[str, Any] = {"jsonrpc": "2.0", "id": body["id"],
                                       "error": {"code": -32602, "message": "unknown task"}}
        else:
            message = {"jsonrpc": "2.0", "id": body["id"], "result": result}
        return web.Response(body=orjson.dumps(message), content_type="application/json")


@asynccontextmanager
async def task_server(**kw: Any) -> AsyncIterator[TaskServer]:
    server = await TaskServer(**kw).start()
    try:
        yield server
    finally:
        await server.close()


async def make_gateway(factory: GatewayFactory, url: str, agents: dict[str, Any]) -> Harness:
    return await factory(mcp_servers={"files": {"url": url, "headers": {"authorization": "Bearer server-key"}}},
                         agents=agents)


async def send(h: Harness, body: dict[str, Any], *, agent: str = "bot", run: str = "r1",
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict[str, Any]]:
    hdrs = {"x-tollgate-agent": agent, "x-tollgate-run-id": run, "content-type": "application/json",
            "accept": "application/json, text/event-stream", **(headers or {})}
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, dict(resp.headers), orjson.loads(await resp.read())


def modern_call(name: str, arguments: dict[str, Any], rpc_id: int) -> dict[str, Any]:
    """A 2026-07-28 `tools/call` whose per-request capabilities declare the tasks extension."""
    return call(name, arguments, rpc_id=rpc_id, _meta={CAPS_META: {"extensions": {TASKS_EXT: {}}}})


def legacy_call(name: str, arguments: dict[str, Any], rpc_id: int) -> dict[str, Any]:
    """A 2025-11-25 task-augmented `tools/call`."""
    return call(name, arguments, rpc_id=rpc_id, task={"ttl": 60000})


def request(method: str, rpc_id: int, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params}


def error_code(answer: dict[str, Any]) -> Any:
    return (answer.get("error") or {}).get("data", {}).get("code")


async def ledger_rows(h: Harness, run: str) -> list[dict[str, Any]]:
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    return [r for r in ledger.rows(run) if r["operation"].startswith("tools/call")]


WRITE_TOOLS = {"allow": ["files/read_file", "files/write_note"], "tiers": {"files/write_*": "write"}}


# -- SEP-2663: a `tools/call` answered with a task handle (`resultType: "task"`) ----------------------------


async def test_a_call_declaring_the_tasks_extension_runs_plainly_and_is_judged(
    gateway_factory: GatewayFactory,
) -> None:
    """No task is created through tollgate (`gateway.jsonrpc.untasked`): the 2026-07-28 tasks extension
    (SEP-2663) is taken off the call's declared capabilities, so the server runs the tool plainly and
    answers its result, which is counted, judged and recorded like any call. (First written against a
    tollgate that relayed the task handle: the write ran again on its identical retry, and a cap of 1
    let the tool run as often as the agent asked.)"""
    async with task_server() as srv:
        h = await make_gateway(gateway_factory, srv.url, {"bot": {"tools": WRITE_TOOLS, "caps": {"tool_calls": 2}}})
        status, _, first = await send(h, modern_call("write_note", {"text": "pay invoice 7"}, 1), headers=MODERN)
        assert status == 200 and first["result"]["resultType"] == "complete", first
        status, headers, second = await send(h, modern_call("write_note", {"text": "pay invoice 7"}, 2),
                                             headers=MODERN)
        assert headers.get("x-tollgate-idempotent-replay") == "true" and second["result"] == first["result"]
        assert len(srv.executions) == 1
        caps = srv.received[-1]["params"]["_meta"][CAPS_META]
        assert caps == {"extensions": {}}, caps  # what the server saw: no tasks extension
        await send(h, modern_call("read_file", {"path": "a"}, 3), headers=MODERN)
        _, _, over = await send(h, modern_call("read_file", {"path": "b"}, 4), headers=MODERN)
        assert error_code(over) == "tool_call_cap", over
        assert len(srv.executions) == 2


async def test_a_task_augmented_call_of_the_2025_era_is_refused(gateway_factory: GatewayFactory) -> None:
    async with task_server() as srv:
        h = await make_gateway(gateway_factory, srv.url, {"bot": {"tools": WRITE_TOOLS}})
        status, _, answer = await send(h, legacy_call("write_note", {"text": "x"}, 1), headers=LEGACY)
        assert status == 400 and 'without "task"' in answer["error"]["message"], answer
        assert srv.executions == []


async def test_a_task_answer_nobody_asked_for_is_an_error_and_never_runs_again(gateway_factory: GatewayFactory) -> None:
    """A server that answers a task anyway: the tool may be running and its result could never be
    judged, so the agent gets an error, the call counts, and a write is never run again."""
    async with task_server(force_task=True) as srv:
        h = await make_gateway(gateway_factory, srv.url, {"bot": {"tools": WRITE_TOOLS}})
        _, _, first = await send(h, call("write_note", {"text": "x"}, rpc_id=1), headers=MODERN)
        assert error_code(first) == "upstream_unavailable" and "answered with a task" in first["error"]["message"]
        _, _, second = await send(h, call("write_note", {"text": "x"}, rpc_id=2), headers=MODERN)
        assert error_code(second) == "duplicate_tool_call", second
        assert len(srv.executions) == 1
        # the repeat replays a refusal: its row names it (not a replayed result)
        assert [(r["decision"], r["reason"]) for r in await ledger_rows(h, "r1")] == [
            ("refused", "upstream_unavailable"), ("replayed", "duplicate_tool_call")]


# -- the task's result reaches the agent unjudged ---------------------------------------------------------


async def _plain_calls_stop_for_no_progress(h: Harness, headers: dict[str, str]) -> None:
    """Control: the same three calls without tasks. The third identical result stops the run."""
    answers = []
    for i, path in enumerate(("a", "b", "c")):
        _, _, answer = await send(h, call("read_file", {"path": path}, rpc_id=10 + i), run="plain", headers=headers)
        answers.append(answer)
    assert "result" in answers[1], answers[1]
    assert error_code(answers[2]) == "no_progress", answers[2]
    assert (await h.run("plain"))["stop_reason"] == "no_progress"


@pytest.mark.parametrize("era", ["2025-11-25 tasks/result", "2026-07-28 tasks/get"])
async def test_a_task_result_feeds_the_no_progress_guard_before_the_agent_sees_it(
    gateway_factory: GatewayFactory, era: str
) -> None:
    """README: MCP tool "Results feed the no-progress guard before the agent sees them", and
    "`loop.stall_steps` consecutive steps that bring back no new tool result (... MCP results)" stop the
    run with `no_progress`. With tasks the tool result comes back in `tasks/result` (2025-11-25: "The
    result structure matches the original request type (e.g., `CallToolResult` for `tools/call`)") or
    inlined in a completed task's `tasks/get` (SEP-2663), both relayed as is by `gateway/mcp.py::_post`
    ("Everything else is relayed as is"); the guard only ever saw the task handles, each new (a new
    taskId). Three calls bringing back the same result stop a run when called plainly (the control
    below) but never when run as tasks: the third identical result reaches the agent unjudged. (A
    tollgate that refused task augmentation instead would pass this test.)"""
    modern = era.startswith("2026")
    headers = MODERN if modern else LEGACY
    async with task_server(result_text="no matches") as srv:
        policy = {"tools": {"allow": ["files/read_file"]}, "loop": {"window": 20, "max_distinct": 1, "stall_steps": 2}}
        h = await make_gateway(gateway_factory, srv.url, {"bot": policy})
        await _plain_calls_stop_for_no_progress(h, headers)

        delivered: list[dict[str, Any]] = []
        for i, path in enumerate(("a", "b", "c")):
            body = (modern_call if modern else legacy_call)("read_file", {"path": path}, 20 + 2 * i)
            _, _, created = await send(h, body, headers=headers)
            if "error" in created:
                return  # tollgate refused the task-augmented call: nothing escapes judgement
            task = created["result"] if modern else created["result"].get("task")
            if not isinstance(task, dict) or "taskId" not in task:
                return  # tollgate had the call run plainly: judged as any call
            fetch = (request("tasks/get", 21 + 2 * i, taskId=task["taskId"]) if modern
                     else request("tasks/result", 21 + 2 * i, taskId=task["taskId"]))
            _, _, answer = await send(h, fetch, headers=headers)
            delivered.append(answer)
        run = await h.run("r1")
        texts = [orjson.dumps(a).decode() for a in delivered]
        assert "no matches" not in texts[2], (
            f"the third identical task result reached the agent unjudged (run {run['status']}, "
            f"stop_reason {run['stop_reason']}): {delivered[2]}")
        assert run["stop_reason"] == "no_progress", run


@pytest.mark.parametrize("method", ["tasks/list", "tasks/get", "tasks/result", "tasks/cancel"])
async def test_task_requests_are_refused(gateway_factory: GatewayFactory, method: str) -> None:
    """No task is created through tollgate, and one created otherwise would hand out a result no
    allow-list scoped (every agent reaches the server with its configured headers): `tasks/*` is
    refused. (First written against a tollgate that relayed `tasks/result` of a tool the asking agent's
    allow-list refuses.)"""
    async with task_server() as srv:
        h = await make_gateway(gateway_factory, srv.url, {"bot": {"tools": {"allow": ["files/read_file"]}}})
        status, _, answer = await send(h, request(method, 3, taskId="task-1"), headers=LEGACY)
        assert status == 400 and "runs no MCP tasks" in answer["error"]["message"], answer
        assert srv.received == []


# -- SEP-2322 input_required: the ledger ------------------------------------------------------------------


async def test_an_input_required_answer_is_not_an_executed_row_in_the_ledger(gateway_factory: GatewayFactory) -> None:
    """README: "A counted call whose tool did not run (... a SEP-2322 `input_required` answer) carries its
    count to an identical retry", and "Every step decision is a row of the ... `ledger`". The tool ran
    once (the retry with `requestState`), but the ledger has two `executed` rows for it:
    `observe_mcp._tool_decision` says `executed` for any outcome the server answered, and
    `mcp_calls._forward.judge` hands it the `input_required` response as `step.response`. An auditor
    counting executions from the ledger counts the tool twice."""
    async with raw_server(input_rounds=1) as srv:
        h = await gateway_factory(mcp_servers={"files": {"url": srv.url}}, agents={"bot": {"tools": RAW_TOOLS}})
        _, _, first = await send(h, call("write_note", {"text": "x"}, rpc_id=1), headers=MODERN)
        assert first["result"]["resultType"] == "input_required", first
        _, _, second = await send(h, call("write_note", {"text": "x"}, rpc_id=2, requestState="round-1"),
                                  headers=MODERN)
        assert second["result"]["content"][0]["text"] == "note 1", second
        assert srv.notes == 1
        rows = await ledger_rows(h, "r1")
        decisions = [r["decision"] for r in rows]
        assert decisions.count("executed") == 1, (
            f"the tool ran once but the ledger says {decisions}: the input_required answer is an 'executed' row")
