"""Hostile probes of the run guards other than the budget: `caps.llm_calls`, `caps.tool_calls`,
`caps.seconds`, loop detection (`loop.window`, `loop.max_distinct`) and no-progress (`loop.stall_steps`).

Contract (DESIGN sections 4-5, README "How budgets are held" and "Tools and MCP"): stops are sticky until
reset, 403 with the documented code in the caller's wire format and `x-tollgate-stop-reason`; a tool call
counts once, when the model proposes it in an answer tollgate returns; loop detection judges the answer
that proposes the repeat, so the repeat never reaches the agent (streamed calls are held until judged).
Fakes on loopback only.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.responses import response_stream
from tests.fakes.upstream import (
    Reply,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)
from tests.redis_fixture import redis_server  # noqa: F401  (fixture, by name)

MSG = [{"role": "user", "content": "hello"}]
GPT = "gpt-4o-mini"
CLAUDE = "claude-3-5-haiku-latest"
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


def agent(**policy: Any) -> dict[str, Any]:
    return {"bot": policy}


async def post(h: Harness, body: dict[str, Any], run: str, path: str = CHAT,
               extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    hdrs = {"x-tollgate-run-id": run, "x-tollgate-agent": "bot", "content-type": "application/json",
            **(extra or {})}
    async with h.session.post(h.url + path, data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def reset(h: Harness, run: str) -> None:
    async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as resp:
        assert resp.status == 200, await resp.text()


def code_of(raw: bytes) -> str:
    return str(orjson.loads(raw)["error"]["code"])


def chat_calls(*calls: tuple[str, str]) -> Reply:
    return Reply(body=openai_completion("", tool_calls=[tool_call(n, a, f"c{i}") for i, (n, a) in enumerate(calls)]))


# -- loop detection: canonical arguments ---------------------------------------------------------------


@pytest.mark.parametrize("variants", [
    ['{"n": 1}', '{"n": 1.0}', '{"n": 1e0}'],
    ['{"limit": 10}', '{"limit": 10.0}', '{"limit": 1E1}'],
])
async def test_loop_sees_equal_json_numbers_as_one_call(gateway_factory: GatewayFactory,
                                                        variants: list[str]) -> None:
    """JSON has one number type: `1`, `1.0` and `1e0` are the same value (RFC 8785 canonical JSON writes
    all three as `1`; a JavaScript tool, JSON Schema `integer` and Python's `==` agree). The fingerprint is
    documented as 'name + canonical JSON arguments', so three proposals that differ only in how the model
    spelled the number are one call repeated: with window 3 / max_distinct 1 the third is a loop."""
    h = await gateway_factory(agents=agent(loop={"window": 3, "max_distinct": 1}))
    for args in variants:
        h.fake.queue(chat_calls(("page", args)))
    statuses = []
    for i in range(3):
        status, hdrs, _raw = await post(h, {"model": GPT, "messages": MSG + [{"role": "user", "content": str(i)}]},
                                       "num")
        statuses.append((status, hdrs.get("x-tollgate-stop-reason")))
    assert statuses == [(200, None), (200, None), (403, "loop_detected")], statuses


# -- loop detection under concurrency ---------------------------------------------------------------------


async def test_concurrent_answers_cannot_slip_a_loop_past_detection(gateway_factory: GatewayFactory) -> None:
    """window 3, max_distinct 1: at most 2 answers proposing the same call may reach the agent; the one
    that completes the window is withheld. Answers of overlapping steps of one run are judged against the
    history snapshot taken before each step went upstream, so all of them pass."""
    h = await gateway_factory(agents=agent(loop={"window": 3, "max_distinct": 1}))
    h.fake.default = Reply(body=openai_completion("", tool_calls=[tool_call("search", '{"q": "same"}')]),
                           delay=0.2)
    results = await asyncio.gather(*(
        post(h, {"model": GPT, "messages": MSG + [{"role": "user", "content": f"try {i}"}]}, "conc-loop")
        for i in range(6)))
    delivered = [r for r in results if r[0] == 200]
    assert len(delivered) <= 2, f"{len(delivered)} answers repeating one call reached the agent"
    view = await h.run("conc-loop")
    assert view["stop_reason"] == "loop_detected"


# -- no progress and re-asks ---------------------------------------------------------------------------


async def test_reasks_do_not_hide_a_byte_identical_repeat(gateway_factory: GatewayFactory) -> None:
    """stall_steps 2: an agent that sends the same request byte for byte again and again is stopped with
    `no_progress`. When each of its answers needs one grammar re-ask, the re-asked attempt (tollgate's own
    request, not the agent's) takes the place of 'the previous request' and counts as progress, so the
    agent's identical requests are never seen as repeats."""
    h = await gateway_factory(agents=agent(loop={"stall_steps": 2}, output={"grammar": "regex:(yes|no)",
                                                                            "retries": 1}))
    body = {"model": GPT, "messages": MSG}
    # control: without re-asks, the third identical request is stopped
    h.fake.default = Reply(body=openai_completion("yes"))
    control = [(await post(h, body, "plain"))[0] for _ in range(4)]
    assert control[:2] == [200, 200] and 403 in control
    # each step: a nonconforming first attempt, then a conforming re-ask
    h.fake.default = None
    outcomes = []
    for _ in range(5):
        h.fake.queue(Reply(body=openai_completion("maybe")), Reply(body=openai_completion("yes")))
        status, hdrs, _ = await post(h, body, "reasked")
        outcomes.append((status, hdrs.get("x-tollgate-stop-reason")))
        if status != 200:
            break
    assert (403, "no_progress") in outcomes, outcomes


# -- in-flight step and reset ------------------------------------------------------------------------------


async def test_reset_clears_the_loop_history_an_in_flight_step_is_judged_on(gateway_factory: GatewayFactory) -> None:
    """README: reset 'starts the run afresh: stop, spend, counters and loop history are cleared'. A step
    that was in flight during the reset must not stop the fresh run with `loop_detected` on the history
    the reset cleared (window 2 / max_distinct 1: after a reset, one call is no loop)."""
    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}))
    h.fake.queue(chat_calls(("search", '{"q": "x"}')))
    assert (await post(h, {"model": GPT, "messages": MSG}, "rst"))[0] == 200
    slow = chat_calls(("search", '{"q": "x"}'))
    slow.delay = 0.3
    h.fake.queue(slow)
    task = asyncio.create_task(post(h, {"model": GPT, "messages": MSG + [{"role": "user", "content": "again"}]},
                                    "rst"))
    await asyncio.wait_for(h.fake.wait_seen(2), 5)
    await reset(h, "rst")
    status, _, raw = await task
    view = await h.run("rst")
    assert view["status"] == "active", f"the fresh run was stopped by pre-reset history: {view['stop_detail']}"
    assert status == 200, raw


# -- no progress under concurrency -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "sqlite", "redis"])
async def test_concurrent_identical_requests_cannot_slip_past_no_progress(gateway_factory: GatewayFactory,
                                                                         request: pytest.FixtureRequest,
                                                                         backend: str) -> None:
    """stall_steps 2: of identical requests only the first is progress, the second is a stalled step and
    the third stops the run. Sent at once to one gateway, no more than two may reach the upstream,
    whatever the store."""
    run = f"np-conc-{uuid.uuid4().hex[:8]}"  # the Redis server is shared by the session
    state: dict[str, str] = {"backend": backend}
    if backend == "sqlite":
        state["path"] = "np.db"
    elif backend == "redis":
        state["url"] = request.getfixturevalue("redis_server").url
    h = await gateway_factory(agents=agent(loop={"stall_steps": 2}), state=state)
    h.fake.default = Reply(body=openai_completion("same"), delay=0.1)
    body = {"model": GPT, "messages": MSG}
    results = await asyncio.gather(*(post(h, body, run) for _ in range(6)))
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) <= 2 and len(h.fake.seen) <= 2, statuses
    assert {code_of(b) for s, _, b in results if s == 403} == {"no_progress"}
    view = await h.run(run)  # the steps refused after their reservation was written released it
    assert (view["status"], view["reserved_tokens"], view["llm_calls"]) == ("stopped", 0, len(h.fake.seen)), view


# -- parallel calls and the tool-call cap --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_calls_over_the_tool_cap_never_reach_the_agent(gateway_factory: GatewayFactory,
                                                                      stream: bool) -> None:
    h = await gateway_factory(agents=agent(caps={"tool_calls": 3}))
    calls = [tool_call("search", f'{{"q": "{i}"}}', f"c{i}") for i in range(5)]
    h.fake.queue(Reply(chunks=openai_stream(["ok"], tool_calls=calls)) if stream
                 else Reply(body=openai_completion("", tool_calls=calls)))
    status, hdrs, raw = await post(h, {"model": GPT, "messages": MSG, "stream": stream}, "par")
    assert b'"search"' not in raw and b"tool_calls\":[" not in raw.replace(b" ", b"")
    if not stream:
        assert status == 403 and hdrs["x-tollgate-stop-reason"] == "tool_call_cap"
    else:
        assert b"tool_call_cap" in raw
    view = await h.run("par")
    assert (view["status"], view["stop_reason"]) == ("stopped", "tool_call_cap")
    assert view["tool_calls"] <= 3


# -- streamed repeats are held until judged ------------------------------------------------------------------


def _stream_with_call(path: str, call_id: str) -> Reply:
    if path == CHAT:
        return Reply(chunks=openai_stream(["Let me look. "], tool_calls=[tool_call("search", '{"q": "x"}', call_id)]))
    if path == MESSAGES:
        return Reply(chunks=anthropic_stream(["Let me look. "], tool_uses=[{"id": call_id, "name": "search",
                                                                            "input": {"q": "x"}}]))
    return Reply(chunks=response_stream(["Let me look. "], calls=[("search", '{"q": "x"}', call_id)]))


def _body(path: str, stream: bool = True) -> dict[str, Any]:
    if path == CHAT:
        return {"model": GPT, "messages": MSG, "stream": stream}
    if path == MESSAGES:
        return {"model": CLAUDE, "messages": MSG, "max_tokens": 64, "stream": stream}
    return {"model": GPT, "input": "hello", "stream": stream}


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_streamed_repeat_never_reaches_the_agent(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}))
    h.fake.queue(_stream_with_call(path, "call_first"), _stream_with_call(path, "call_again"))
    status, _, first = await post(h, _body(path), "srep", path)
    assert status == 200 and b"call_first" in first
    status, _, second = await post(h, _body(path), "srep", path)
    assert b"Let me look." in second  # text before the call streams at once
    assert b"call_again" not in second and b'\\"q\\"' not in second
    assert b"loop_detected" in second
    view = await h.run("srep")
    assert (view["stop_reason"], view["tool_calls"]) == ("loop_detected", 1)
    status, hdrs, _ = await post(h, _body(path, stream=False), "srep", path)
    assert status == 403 and hdrs["x-tollgate-stop-reason"] == "loop_detected"


async def test_streamed_legacy_function_call_is_counted_and_loop_checked(gateway_factory: GatewayFactory) -> None:
    def legacy_stream(args: str) -> Reply:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": GPT,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return b"data: " + orjson.dumps(data) + b"\n\n"
        return Reply(chunks=[chunk({"role": "assistant", "content": None}),
                             chunk({"function_call": {"name": "lookup", "arguments": ""}}),
                             chunk({"function_call": {"arguments": args}}),
                             chunk({}, "function_call"), b"data: [DONE]\n\n"])

    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}, caps={"tool_calls": 10}))
    h.fake.queue(legacy_stream('{"id": 7}'), legacy_stream('{ "id" : 7 }'))
    _, _, first = await post(h, _body(CHAT), "legacy")
    assert b"lookup" in first
    _, _, second = await post(h, _body(CHAT), "legacy")
    assert b'"function_call"' not in second and b"loop_detected" in second
    view = await h.run("legacy")
    assert (view["tool_calls"], view["stop_reason"]) == (1, "loop_detected")


# -- a sticky stop keeps its reason ------------------------------------------------------------------------


async def test_a_stopped_run_answers_with_its_own_stop_reason_after_the_time_cap(
        gateway_factory: GatewayFactory) -> None:
    """The first stop wins and is sticky until reset: a run stopped by `loop_detected` refuses later steps
    with `loop_detected`, also once its time cap has passed (the run's stop reason stays loop_detected, so
    a 403 naming `time_cap` contradicts the run the admin API shows)."""
    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}, caps={"seconds": 0.3}))
    h.fake.default = chat_calls(("search", '{"q": "x"}'))
    assert (await post(h, _body(CHAT, False), "sticky"))[0] == 200
    status, hdrs, _ = await post(h, _body(CHAT, False), "sticky")
    assert (status, hdrs["x-tollgate-stop-reason"]) == (403, "loop_detected")
    await asyncio.sleep(0.4)  # the time cap itself is what is being waited for
    status, hdrs, raw = await post(h, _body(CHAT, False), "sticky")
    view = await h.run("sticky")
    assert view["stop_reason"] == "loop_detected"
    assert (status, hdrs["x-tollgate-stop-reason"], code_of(raw)) == (403, "loop_detected", "loop_detected")


# -- re-asks count toward llm_calls ---------------------------------------------------------------------------


async def test_reasked_attempts_count_toward_the_llm_call_cap(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(caps={"llm_calls": 2}, output={"grammar": "regex:(yes|no)",
                                                                          "retries": 2}))
    h.fake.queue(Reply(body=openai_completion("maybe")), Reply(body=openai_completion("yes")))
    assert (await post(h, _body(CHAT, False), "reask-cap"))[0] == 200
    status, hdrs, _ = await post(h, _body(CHAT, False), "reask-cap")
    assert (status, hdrs.get("x-tollgate-stop-reason")) == (403, "llm_call_cap")
    assert len(h.fake.seen) == 2
    # a cap reached in the middle of the re-asks: the third attempt never goes upstream
    h.fake.queue(Reply(body=openai_completion("maybe")), Reply(body=openai_completion("perhaps")),
                 Reply(body=openai_completion("yes")))
    status, hdrs, _ = await post(h, _body(CHAT, False), "reask-cap-2")
    assert (status, hdrs.get("x-tollgate-stop-reason")) == (403, "llm_call_cap")
    assert len(h.fake.seen) == 4


# -- MCP ------------------------------------------------------------------------------------------------------

MCP_TOOLS = {"allow": ["files/read_file", "files/delete_*", "read_file"], "approval": ["files/delete_*"],
             "approval_timeout_s": 10}


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start()
    yield server
    server.stop()


async def mcp_gateway(factory: GatewayFactory, files: mcp_server.RunningServer, **policy: Any) -> Harness:
    policy.setdefault("tools", MCP_TOOLS)
    state = policy.pop("state", {"backend": "memory"})
    return await factory(mcp_servers={"files": {"url": files.url}}, agents={"bot": policy}, state=state)


@asynccontextmanager
async def mcp_client(h: Harness, run: str = "r1") -> AsyncIterator[Client]:
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run}
    async with (
        httpx2.AsyncClient(headers=hdrs, timeout=httpx2.Timeout(15, read=15)) as http,
        Client(streamable_http_client(f"{h.url}/mcp/files", http_client=http), mode="auto") as client,
    ):
        yield client


async def rpc_error(coro: Any) -> dict[str, Any]:
    with pytest.raises(MCPError) as info:
        await coro
    return info.value.error.model_dump()


async def pending_approval(h: Harness, call: asyncio.Task[Any]) -> dict[str, Any]:
    """The approval `call` is parked on; fails at once, with the call's outcome, if it ended unparked."""
    for _ in range(2000):
        async with h.session.get(f"{h.admin_url}/admin/approvals?status=pending") as resp:
            items = (await resp.json())["approvals"]
        if items:
            return items[0]  # type: ignore[no-any-return]
        if call.done():
            raise AssertionError(f"the call ended without being parked: {call.exception() or call.result()!r}")
        await asyncio.sleep(0.005)
    raise AssertionError("no pending approval appeared")


async def test_a_call_approved_after_the_time_cap_does_not_run(gateway_factory: GatewayFactory,
                                                               files: mcp_server.RunningServer) -> None:
    """A `tools/call` is decided before the server sees it, the time cap among the guards. One parked for
    approval until after the run's time cap must not run when it is approved late: the check after the
    approval re-reads only whether the run is stopped, and no step has stopped it yet."""
    # a cap wide enough for the second call to be parked before it passes on a loaded machine (at 0.3 s,
    # and once at 1.0 s during a full suite on two busy cores, it passed first, so the call was refused
    # at once and never parked)
    cap = 3.0
    h = await mcp_gateway(gateway_factory, files, caps={"seconds": cap})
    async with mcp_client(h, "late") as client:
        assert not (await client.call_tool("read_file", {"path": "a"})).is_error  # the run's clock starts
        call = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        item = await pending_approval(h, call)
        await asyncio.sleep(cap)  # the time cap itself is what is being waited for
        async with h.session.post(f"{h.admin_url}/admin/approvals/{item['id']}",
                                  json={"decision": "approve", "by": "alice"}) as resp:
            assert resp.status == 200
        [outcome] = await asyncio.gather(call, return_exceptions=True)
    assert ("delete_file", {"path": "a"}) not in files.seen.calls(), "the call ran after the time cap"
    assert isinstance(outcome, MCPError) and outcome.error.data == {"code": "time_cap"}, outcome


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_concurrent_identical_mcp_calls_cannot_slip_past_loop_detection(
        gateway_factory: GatewayFactory, files: mcp_server.RunningServer, backend: str) -> None:
    state = {"backend": "memory"} if backend == "memory" else {"backend": "sqlite", "path": "mcp-loop.db"}
    h = await mcp_gateway(gateway_factory, files, loop={"window": 3, "max_distinct": 1}, state=state)
    async with mcp_client(h, "mloop") as client:
        await client.list_tools()
        results = await asyncio.gather(*(client.call_tool("read_file", {"path": "a"}) for _ in range(6)),
                                       return_exceptions=True)
    ran = [r for r in results if not isinstance(r, BaseException)]
    assert len(ran) <= 2 and len(files.seen.calls()) <= 2, results
    assert (await h.run("mloop"))["stop_reason"] == "loop_detected"


async def test_executing_a_proposal_counts_once_and_a_second_execution_counts(
        gateway_factory: GatewayFactory, files: mcp_server.RunningServer) -> None:
    h = await mcp_gateway(gateway_factory, files, caps={"tool_calls": 2})
    h.fake.queue(chat_calls(("read_file", '{"path": "a"}')))
    assert (await post(h, _body(CHAT, False), "once"))[0] == 200
    async with mcp_client(h, "once") as client:
        assert not (await client.call_tool("read_file", {"path": "a"})).is_error
        assert (await h.run("once"))["tool_calls"] == 1
        assert not (await client.call_tool("read_file", {"path": "a"})).is_error
        assert (await h.run("once"))["tool_calls"] == 2
        error = await rpc_error(client.call_tool("read_file", {"path": "a"}))
    assert error["data"] == {"code": "tool_call_cap"}
    assert len(files.seen.calls()) == 2


class GatedServer:
    """A minimal MCP server (JSON answers, no session) whose `tools/call` answers, all with the same
    result, only once `expected` calls have arrived: the calls overlap for certain."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.calls = 0
        self.gate = asyncio.Event()
        self.url = ""
        self._server: TestServer | None = None

    async def start(self) -> GatedServer:
        app = web.Application()
        app.router.add_post("/mcp", self.handle)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.url = str(self._server.make_url("/mcp"))
        return self

    async def close(self) -> None:
        self.gate.set()
        if self._server is not None:
            await self._server.close()

    async def handle(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if body.get("method") == "tools/call":
            self.calls += 1
            if self.calls >= self.expected:
                self.gate.set()
            await self.gate.wait()
        result = {"content": [{"type": "text", "text": "no results"}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": body.get("id"), "result": result})


async def test_concurrent_identical_mcp_results_cannot_slip_past_no_progress(
        gateway_factory: GatewayFactory) -> None:
    """stall_steps 2: the same result coming back a second and a third time is no progress, and the third
    is withheld with `no_progress` (README: 'Results feed the no-progress guard before the agent sees
    them'). Results of overlapping calls are judged against the history snapshot taken before each call
    went to the server, so every one of them looks new."""
    server = await GatedServer(expected=4).start()
    try:
        h = await gateway_factory(mcp_servers={"files": {"url": server.url}},
                                  agents=agent(loop={"stall_steps": 2, "window": 50, "max_distinct": 1}))
        hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "mnp", "content-type": "application/json",
                "accept": "application/json, text/event-stream"}

        async def call(rpc_id: int) -> dict[str, Any]:
            msg = {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
                   "params": {"name": "search", "arguments": {"q": f"query {rpc_id}"}}}
            async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(msg), headers=hdrs) as resp:
                return orjson.loads(await resp.read())  # type: ignore[no-any-return]

        answers = await asyncio.gather(*(call(i) for i in range(4)))
    finally:
        await server.close()
    delivered = [a for a in answers if "result" in a]
    assert len(delivered) <= 2, f"{len(delivered)} identical results reached the agent: {answers}"
    assert (await h.run("mnp"))["stop_reason"] == "no_progress"


# -- no progress: legacy function results ------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
async def test_stale_results_stall_in_the_legacy_function_flow_too(gateway_factory: GatewayFactory,
                                                                   legacy: bool) -> None:
    """The legacy `functions` flow sends a function's result back as `{"role": "function", ...}`; it is a
    tool result like `role: tool` (openai_functions: 'tollgate treats it exactly as tools'). The same
    stale result coming back round after round is no progress in both flows (stall_steps 2)."""
    h = await gateway_factory(agents=agent(loop={"stall_steps": 2}))
    messages: list[dict[str, Any]] = list(MSG)
    outcomes = []
    for i in range(6):
        if legacy:
            h.fake.queue(Reply(body={**openai_completion(""), "choices": [{"index": 0, "finish_reason": "function_call",
                "message": {"role": "assistant", "content": None,
                            "function_call": {"name": "lookup", "arguments": f'{{"page": {i}}}'}}}]}))
        else:
            h.fake.queue(chat_calls(("lookup", f'{{"page": {i}}}')))
        status, hdrs, _raw = await post(h, {"model": GPT, "messages": messages}, f"stale-{legacy}")
        outcomes.append((status, hdrs.get("x-tollgate-stop-reason")))
        if status != 200:
            break
        if legacy:
            messages = messages + [
                {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": f'{{"page": {i}}}'}},
                {"role": "function", "name": "lookup", "content": "no results"}]
        else:
            messages = messages + [
                {"role": "assistant", "content": None, "tool_calls": [tool_call("lookup", f'{{"page": {i}}}', f"c{i}")]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": "no results"}]
    assert outcomes[-1] == (403, "no_progress"), outcomes
