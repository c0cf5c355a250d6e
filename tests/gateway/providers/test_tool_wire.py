"""gateway/providers/tool_wire.py: allow-list edits on wire bodies and held stream events, per protocol."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import TypeAdapter

from gateway.errors import ToolNotAllowed
from gateway.providers.sse import SseParser, format_event
from gateway.providers.tool_wire import drop_calls, drop_stream_calls, filter_request_tools
from gateway.tools import matches

OPENAI = [{"type": "function", "function": {"name": n}} for n in ("search", "delete")]
ANTHROPIC = [{"name": n, "input_schema": {"type": "object"}} for n in ("search", "delete")]
EVENT = TypeAdapter[RawMessageStreamEvent](RawMessageStreamEvent)


@pytest.mark.parametrize(
    ("protocol", "body", "allowed", "changed", "after"),
    [
        ("openai", {"tools": OPENAI, "tool_choice": "auto"}, {"search"}, True,
         {"tools": OPENAI[:1], "tool_choice": "auto"}),
        ("openai", {"tools": OPENAI}, {"search", "delete"}, False, {"tools": OPENAI}),
        ("openai", {"model": "m", "tools": OPENAI, "tool_choice": "required", "parallel_tool_calls": False},
         set(), True, {"model": "m"}),  # no tools left: tool_choice and parallel_tool_calls go too
        ("openai", {"tools": [{"type": "function"}, *OPENAI]}, {"search", "delete"}, True, {"tools": OPENAI}),
        ("openai", {"tools": ANTHROPIC}, {"search"}, True, {}),  # the other protocol's shape names nothing
        ("anthropic", {"tools": ANTHROPIC, "tool_choice": {"type": "any"}}, {"delete"}, True,
         {"tools": ANTHROPIC[1:], "tool_choice": {"type": "any"}}),
        ("anthropic", {"tools": ANTHROPIC, "tool_choice": {"type": "auto"}}, set(), True, {}),
        ("anthropic", {"tools": ["search"]}, {"search"}, True, {}),
        ("openai", {"tools": []}, set(), False, {"tools": []}),
        ("openai", {"tools": None}, set(), False, {"tools": None}),
        ("anthropic", {"tools": "search"}, set(), False, {"tools": "search"}),
        ("anthropic", {}, set(), False, {}),
        # the MCP connector: servers Anthropic calls itself, only when `mcp` is allowed
        ("anthropic", {"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, {"search"}, True, {}),
        ("anthropic", {"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, {"mcp"}, False,
         {"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}),
        ("anthropic", {"mcp_servers": None}, set(), False, {"mcp_servers": None}),
        # the connector's toolset entries are named `mcp` too
        ("anthropic", {"tools": [{"type": "mcp_toolset", "mcp_server_name": "gh"}, *ANTHROPIC]}, {"mcp", "search"},
         True, {"tools": [{"type": "mcp_toolset", "mcp_server_name": "gh"}, ANTHROPIC[0]]}),
        ("openai", {"mcp_servers": [{"url": "u"}]}, set(), False, {"mcp_servers": [{"url": "u"}]}),  # not its field
    ],
)
def test_filter_request_tools(
    protocol: str, body: dict[str, Any], allowed: set[str], changed: bool, after: dict[str, Any]
) -> None:
    body = copy.deepcopy(body)
    assert filter_request_tools(protocol, body, lambda name: name in allowed) is changed
    assert body == after


def oa_call(name: str) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": "{}"}}


def completion(*choices: tuple[str | None, list[str], str]) -> dict[str, Any]:
    listed = [
        {"index": i, "finish_reason": finish,
         "message": {"role": "assistant", "content": text, **({"tool_calls": [oa_call(n) for n in names]}
                                                               if names else {})}}
        for i, (text, names, finish) in enumerate(choices)
    ]
    head = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o"}
    return {**head, "choices": listed}


@pytest.mark.parametrize(
    ("before", "names", "left", "after"),
    [
        (completion((None, ["a", "b"], "tool_calls")), {"a"}, True, completion((None, ["b"], "tool_calls"))),
        (completion((None, ["a", "b"], "tool_calls")), {"a", "b"}, False, completion((None, [], "stop"))),
        (completion(("Let me.", ["a"], "tool_calls")), {"a"}, True, completion(("Let me.", [], "stop"))),
        (completion(("", ["a"], "tool_calls")), {"a"}, False, completion(("", [], "stop"))),
        (completion((None, ["a"], "length")), {"a"}, False, completion((None, [], "length"))),
        (completion((None, ["a"], "tool_calls")), {"x"}, True, completion((None, ["a"], "tool_calls"))),
        (completion(("hi", [], "stop")), {"a"}, True, completion(("hi", [], "stop"))),
        (completion(("", [], "stop")), {"a"}, False, completion(("", [], "stop"))),
        (completion((None, ["a"], "tool_calls"), (None, ["b", "a"], "tool_calls")), {"a"}, True,
         completion((None, [], "stop"), (None, ["b"], "tool_calls"))),
        ({"choices": [{"message": None}]}, {"a"}, False, {"choices": [{"message": None}]}),
        ({}, {"a"}, False, {}),
    ],
)
def test_drop_calls_openai(
    before: dict[str, Any], names: set[str], left: bool, after: dict[str, Any]
) -> None:
    body = copy.deepcopy(before)
    assert drop_calls("openai", body, frozenset(names)) is left
    assert body == after
    if body.get("object"):
        ChatCompletion.model_validate(body)  # still a chat completion the SDK accepts


def message(*blocks: dict[str, Any], stop: str | None = "tool_use") -> dict[str, Any]:
    head = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x"}
    usage = {"input_tokens": 1, "output_tokens": 1}
    return {**head, "content": list(blocks), "stop_reason": stop, "stop_sequence": None, "usage": usage}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def use(name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{name}", "name": name, "input": {}}


THINK = {"type": "thinking", "thinking": "hm", "signature": "s"}


@pytest.mark.parametrize(
    ("before", "names", "left", "after"),
    [
        (message(text("hi"), use("a"), use("b")), {"a"}, True, message(text("hi"), use("b"))),
        (message(use("a")), {"a"}, False, message(stop="end_turn")),
        (message(text(""), use("a")), {"a"}, False, message(text(""), stop="end_turn")),
        (message(text("ok"), use("a")), {"a"}, True, message(text("ok"), stop="end_turn")),
        (message(THINK, use("a")), {"a"}, False, message(THINK, stop="end_turn")),  # thinking alone: no answer
        (message(use("a"), stop="max_tokens"), {"a"}, False, message(stop="max_tokens")),
        (message(use("a"), use("b")), {"x"}, True, message(use("a"), use("b"))),
        (message(text("hi"), stop="end_turn"), {"a"}, True, message(text("hi"), stop="end_turn")),
        ({"stop_reason": "tool_use"}, {"a"}, False, {"content": [], "stop_reason": "end_turn"}),
    ],
)
def test_drop_calls_anthropic(
    before: dict[str, Any], names: set[str], left: bool, after: dict[str, Any]
) -> None:
    body = copy.deepcopy(before)
    assert drop_calls("anthropic", body, frozenset(names)) is left
    assert body == after
    if "id" in body:
        Message.model_validate(body)


def chunk(*choices: tuple[int, dict[str, Any], str | None], usage: Any = None) -> bytes:
    listed = [{"index": i, "delta": d, "finish_reason": f} for i, d, f in choices]
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": listed}
    return format_event(orjson.dumps({**body, **({"usage": usage} if usage else {})}))


def tc(index: int, name: str | None = None, args: str = "") -> dict[str, Any]:
    head = {"id": f"call_{name}", "type": "function"} if name else {}
    return {"index": index, **head, "function": {**({"name": name} if name else {}), "arguments": args}}


DONE = b"data: [DONE]\n\n"
ROLE = chunk((0, {"role": "assistant", "content": None}, None))
A0 = chunk((0, {"tool_calls": [tc(0, "a")]}, None))
A1 = chunk((0, {"tool_calls": [tc(0, args='{"x":1}')]}, None))
B1, B2 = chunk((0, {"tool_calls": [tc(1, "b")]}, None)), chunk((0, {"tool_calls": [tc(1, args="{}")]}, None))
FINISH = chunk((0, {}, "tool_calls"))
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
STREAM = ROLE + A0 + A1 + B1 + B2 + FINISH + DONE


@pytest.mark.parametrize(
    ("raw", "names", "expected"),
    [
        (STREAM, {"x"}, STREAM),  # nothing to drop: the same bytes
        (STREAM, {"a"}, ROLE + chunk((0, {"tool_calls": [tc(0, "b")]}, None))
         + chunk((0, {"tool_calls": [tc(0, args="{}")]}, None)) + FINISH + DONE),  # b moves to index 0
        (STREAM, {"b"}, ROLE + A0 + A1 + FINISH + DONE),
        (STREAM, {"a", "b"}, ROLE + chunk((0, {}, "stop")) + DONE),
        (ROLE + chunk((0, {"tool_calls": [tc(0, "a"), tc(1, "b")]}, None)) + FINISH, {"a"},
         ROLE + chunk((0, {"tool_calls": [tc(0, "b")]}, None)) + FINISH),  # both in one chunk
        (A0 + chunk((0, {"content": "x", "tool_calls": [tc(0, args="{}")]}, None)), {"a"},
         chunk((0, {"content": "x"}, None))),  # the chunk keeps what is not the call
        (A0 + chunk((0, {"tool_calls": [tc(0, args="{}")]}, "tool_calls"), usage=USAGE), {"a"},
         chunk((0, {}, "stop"), usage=USAGE)),
        (A0 + chunk((0, {"tool_calls": [tc(0, args="{}")]}, None), usage=USAGE), {"a"},
         chunk((0, {}, None), usage=USAGE)),  # an emptied chunk that carries usage stays
        (b": ping\n\n" + A0 + b"data: {oops\n\n", {"a"}, b": ping\n\n" + b"data: {oops\n\n"),
    ],
)
def test_drop_stream_calls_openai(raw: bytes, names: set[str], expected: bytes) -> None:
    assert drop_stream_calls("openai", raw, frozenset(names)) == expected


@pytest.mark.parametrize(
    ("names", "dropped"), [({"delete_all"}, True), ({"delete_"}, False), ({"all"}, False)]
)
def test_a_call_whose_name_comes_in_pieces_is_judged_by_its_whole_name(names: set[str],
                                                                       dropped: bool) -> None:
    """OpenAI-compatible servers may split a name across chunks: a prefix of a refused name is not
    relayed while the rest is withheld, and a refused prefix does not drop a longer allowed name."""
    first = chunk((0, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "delete_", "arguments": ""}}]}, None))
    rest = chunk((0, {"tool_calls": [{"index": 0, "function": {"name": "all", "arguments": "{}"}}]}, None))
    raw = ROLE + first + rest + FINISH + DONE
    out = drop_stream_calls("openai", raw, frozenset(names))
    assert out == (ROLE + chunk((0, {}, "stop")) + DONE if dropped else raw)


def test_drop_stream_calls_openai_renumbers_per_choice() -> None:
    raw = chunk(
        (0, {"tool_calls": [tc(0, "a"), tc(1, "b")]}, None), (1, {"tool_calls": [tc(0, "c")]}, None),
        (2, {"tool_calls": [tc(0, "a")]}, None),
    ) + chunk((0, {"tool_calls": [tc(1, args="{}")]}, "tool_calls"), *[(i, {}, "tool_calls") for i in (1, 2)])
    out = drop_stream_calls("openai", raw, frozenset({"a"}))
    assert out == chunk(
        (0, {"tool_calls": [tc(0, "b")]}, None), (1, {"tool_calls": [tc(0, "c")]}, None), (2, {}, None)
    ) + chunk((0, {"tool_calls": [tc(0, args="{}")]}, "tool_calls"), (1, {}, "tool_calls"), (2, {}, "stop"))
    state = ChatCompletionStreamState()
    for event in SseParser().feed(out):
        state.handle_chunk(ChatCompletionChunk.model_validate_json(event.data))
    choices = state.get_final_completion().choices
    names = [[c.function.name for c in ch.message.tool_calls or []] for ch in choices]
    assert names == [["b"], ["c"], []]
    assert [ch.finish_reason for ch in choices] == ["tool_calls", "tool_calls", "stop"]


def an(event: dict[str, Any]) -> bytes:
    return format_event(orjson.dumps(event), str(event["type"]))


def start(i: int, block: dict[str, Any]) -> bytes:
    return an({"type": "content_block_start", "index": i, "content_block": block})


def part(i: int, piece: str) -> bytes:
    piece_delta = {"type": "input_json_delta", "partial_json": piece}
    return an({"type": "content_block_delta", "index": i, "delta": piece_delta})


def end(i: int) -> bytes:
    return an({"type": "content_block_stop", "index": i})


def closing(reason: str) -> bytes:
    return an({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
               "usage": {"output_tokens": 9}})


HEAD = an({"type": "message_start", "message": message()}) + start(0, text("")) + an(
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Look."}}
) + end(0)
STOP = an({"type": "message_stop"})
USE_A = start(1, use("a")) + part(1, '{"q":') + part(1, "1}") + end(1)
USE_B = start(2, use("b")) + part(2, "{}") + end(2)
FULL = HEAD + USE_A + USE_B + closing("tool_use") + STOP


@pytest.mark.parametrize(
    ("raw", "names", "expected", "uses"),
    [
        (FULL, {"x"}, FULL, ["a", "b"]),
        (FULL, {"b"}, HEAD + USE_A + closing("tool_use") + STOP, ["a"]),
        (FULL, {"a"}, HEAD + start(1, use("b")) + part(1, "{}") + end(1) + closing("tool_use") + STOP, ["b"]),
        (FULL, {"a", "b"}, HEAD + closing("end_turn") + STOP, []),
        (HEAD + USE_A + an({"type": "ping"}) + closing("tool_use") + STOP, {"a"},
         HEAD + an({"type": "ping"}) + closing("end_turn") + STOP, []),
    ],
)
def test_drop_stream_calls_anthropic(raw: bytes, names: set[str], expected: bytes, uses: list[str]) -> None:
    out = drop_stream_calls("anthropic", raw, frozenset(names))
    assert out == expected
    snapshot = None
    for event in SseParser().feed(out):
        if event.event != "ping":
            parsed = EVENT.validate_json(event.data)
            assert parsed.type == event.event
            snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs={})
    assert snapshot is not None
    assert [getattr(b, "name", None) for b in snapshot.content] == [None, *uses]
    assert snapshot.stop_reason == ("tool_use" if uses else "end_turn")


def test_drop_stream_calls_anthropic_keeps_what_it_cannot_read() -> None:
    raw = b": comment\n\n" + b"event: x\ndata: {oops\n\n" + b"data: [1]\n\n"
    assert drop_stream_calls("anthropic", raw, frozenset({"a"})) == raw


CUSTOM = {"type": "custom", "custom": {"name": "code_exec", "description": "runs code"}}


def allowed_tools(mode: str, *names: str) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.mark.parametrize(("body", "allowed", "after"), [
    ({"tools": [*OPENAI, CUSTOM]}, {"search"}, {"tools": OPENAI[:1]}),  # a custom tool is named by `custom.name`
    ({"tools": [*OPENAI, CUSTOM]}, {"code_exec"}, {"tools": [CUSTOM]}),
    ({"tools": OPENAI, "tool_choice": allowed_tools("required", "search", "delete")}, {"search"},
     {"tools": OPENAI[:1], "tool_choice": allowed_tools("required", "search")}),
    ({"tools": OPENAI, "tool_choice": allowed_tools("auto", "delete")}, {"search"},
     {"tools": OPENAI[:1], "tool_choice": "none"}),
])
def test_chat_custom_tools_and_allowed_tools_choices(body: dict[str, Any], allowed: set[str],
                                                    after: dict[str, Any]) -> None:
    shaped = copy.deepcopy(body)
    assert filter_request_tools("openai", shaped, allowed.__contains__) is True
    assert shaped == after


def test_chat_allowed_tools_requiring_only_refused_tools_is_refused() -> None:
    body = {"tools": OPENAI, "tool_choice": allowed_tools("required", "delete")}
    with pytest.raises(ToolNotAllowed, match="delete"):
        filter_request_tools("openai", body, {"search"}.__contains__)


def test_chat_custom_calls_are_dropped_by_name_streamed_or_not() -> None:
    calls = [{"id": "c1", "type": "custom", "custom": {"name": "code_exec", "input": "rm -rf /"}},
             {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{}"}}]
    body: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None, "tool_calls": copy.deepcopy(calls)}}]}
    assert drop_calls("openai", body, frozenset({"code_exec"})) is True
    assert body["choices"][0]["message"]["tool_calls"] == calls[1:]
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"tool_calls": [{"index": 0, **calls[0]}]}, "finish_reason": None}]}
    raw = format_event(orjson.dumps(chunk))
    assert b"code_exec" not in drop_stream_calls("openai", raw, frozenset({"code_exec"}))


# -- Anthropic's toolsets (no `name`): judged by their family, their members' calls too ---------------------

MCP_SERVERS = [{"type": "url", "url": "https://mcp.example", "name": "gh"}]
MCP_TOOLSET = {"type": "mcp_toolset", "mcp_server_name": "gh"}
COMPUTER_TOOLSET = {"type": "computer_toolset_20260801"}
BROWSER_TOOLSET = {"type": "browser_toolset_20260801"}


@pytest.mark.parametrize(("body", "allowed", "after"), [
    # the MCP connector's current shape: removed with its servers unless `mcp` is allowed
    ({"mcp_servers": MCP_SERVERS, "tools": [MCP_TOOLSET, ANTHROPIC[0]]}, {"search"}, {"tools": ANTHROPIC[:1]}),
    ({"mcp_servers": MCP_SERVERS, "tools": [MCP_TOOLSET], "tool_choice": {"type": "auto"}}, {"search"}, {}),
    ({"mcp_servers": MCP_SERVERS, "tools": [{**MCP_TOOLSET, "name": "search"}]}, {"search"}, {}),  # no disguise
    ({"tools": [COMPUTER_TOOLSET, BROWSER_TOOLSET, *ANTHROPIC]}, {"computer", "search"},
     {"tools": [COMPUTER_TOOLSET, ANTHROPIC[0]]}),
    ({"tools": [COMPUTER_TOOLSET, BROWSER_TOOLSET]}, {"browser"}, {"tools": [BROWSER_TOOLSET]}),
    ({"tools": [COMPUTER_TOOLSET]}, {"left_click"}, {}),  # a member's name allows no toolset
])
def test_anthropic_toolsets_are_filtered_by_family(body: dict[str, Any], allowed: set[str],
                                                   after: dict[str, Any]) -> None:
    shaped = copy.deepcopy(body)
    assert filter_request_tools("anthropic", shaped, allowed.__contains__) is True
    assert shaped == after


@pytest.mark.parametrize("allowed", [{"mcp"}, {"mcp", "computer", "browser"}, {"m*", "c*", "b*"}])
def test_allowed_anthropic_toolsets_are_forwarded_unchanged(allowed: set[str]) -> None:
    body = {"mcp_servers": MCP_SERVERS, "tools": [MCP_TOOLSET, COMPUTER_TOOLSET, BROWSER_TOOLSET]}
    shaped = copy.deepcopy(body)
    changed = filter_request_tools("anthropic", shaped, lambda name: any(matches(name, p) for p in allowed))
    assert changed is (allowed == {"mcp"})
    assert shaped["mcp_servers"] == MCP_SERVERS and MCP_TOOLSET in shaped["tools"]


def member(name: str, toolset: str, bid: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": bid, "name": name, "input": {}, "toolset_name": toolset}


@pytest.mark.parametrize(("names", "kept"), [
    ({"computer"}, ["t2"]), ({"left_click"}, ["t1", "t2"]), ({"browser"}, ["t1"]), ({"computer", "browser"}, []),
])
def test_toolset_member_calls_are_dropped_by_family(names: set[str], kept: list[str]) -> None:
    uses = [member("left_click", "computer", "t1"), member("left_click", "browser", "t2")]
    body: dict[str, Any] = {"content": copy.deepcopy(uses), "stop_reason": "tool_use"}
    drop_calls("anthropic", body, frozenset(names))
    assert [b["id"] for b in body["content"]] == kept
    raw = HEAD + start(1, uses[0]) + part(1, "{}") + end(1) + start(2, uses[1]) + end(2) + closing("tool_use") + STOP
    out = drop_stream_calls("anthropic", raw, frozenset(names))
    ids = [orjson.loads(e.data)["content_block"].get("id") for e in SseParser().feed(out)
           if e.event == "content_block_start"]
    assert ids == [None, *kept]


# -- OpenAI Responses namespaces (tool search): the functions inside are judged by name ---------------------

def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


def namespace(*names: str, name: str = "crm") -> dict[str, Any]:
    return {"type": "namespace", "name": name, "description": "CRM", "tools": [fn(n) for n in names]}


CUSTOM_TOOL = {"type": "custom", "name": "grep"}


@pytest.mark.parametrize(("body", "allowed", "changed", "after"), [
    ({"tools": [namespace("search_kb", "delete_all")]}, {"search_kb"}, True, {"tools": [namespace("search_kb")]}),
    # allowing the type `namespace` allows none of the functions inside it
    ({"tools": [namespace("search_kb", "delete_all")]}, {"search_kb", "namespace"}, True,
     {"tools": [namespace("search_kb")]}),
    ({"tools": [namespace("search_kb", "delete_all")]}, {"search_kb", "delete_all"}, False,
     {"tools": [namespace("search_kb", "delete_all")]}),
    ({"tools": [namespace("delete_all"), fn("search_kb")], "tool_choice": "auto"}, {"search_kb"}, True,
     {"tools": [fn("search_kb")], "tool_choice": "auto"}),
    ({"tools": [namespace("delete_all")], "tool_choice": "auto", "parallel_tool_calls": True}, {"namespace"}, True,
     {}),  # none left: the namespace goes, and with no tool left the choice too
    ({"tools": [{**namespace("a"), "tools": [CUSTOM_TOOL, fn("b")]}]}, {"grep"}, True,
     {"tools": [{**namespace("a"), "tools": [CUSTOM_TOOL]}]}),  # a custom tool inside: by name too
    ({"tools": [namespace("a", "b"), namespace("b", name="files")]}, {"b"}, True,
     {"tools": [namespace("b"), namespace("b", name="files")]}),  # a function's name, not its namespace's
    ({"tools": [{"type": "namespace", "name": "crm"}]}, {"namespace"}, False,
     {"tools": [{"type": "namespace", "name": "crm"}]}),  # no tool list: judged by its type
    ({"tools": [{"type": "namespace", "name": "crm"}]}, {"crm"}, True, {}),
    ({"tools": [{**namespace(), "tools": []}]}, set(), False, {"tools": [{**namespace(), "tools": []}]}),
    # the tool lists of input items: `tool_search_output` (loaded by a client tool search), `additional_tools`
    ({"input": [{"type": "tool_search_output", "tools": [namespace("search_kb", "delete_all")]}]}, {"search_kb"},
     True, {"input": [{"type": "tool_search_output", "tools": [namespace("search_kb")]}]}),
    ({"input": [{"type": "additional_tools", "tools": [namespace("delete_all"), fn("search_kb")]}]}, {"search_kb"},
     True, {"input": [{"type": "additional_tools", "tools": [fn("search_kb")]}]}),
    ({"input": [{"type": "additional_tools", "tools": [namespace("search_kb")]}]}, {"search_kb"}, False,
     {"input": [{"type": "additional_tools", "tools": [namespace("search_kb")]}]}),
    # an allowed_tools choice listing a namespace keeps its allowed functions
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [namespace("search_kb", "delete_all")]}},
     {"search_kb"}, True,
     {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [namespace("search_kb")]}}),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [namespace("delete_all")]}},
     {"search_kb"}, True, {"tool_choice": "none"}),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [fn("search_kb")]}}, {"search_kb"}, False,
     {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [fn("search_kb")]}}),
])
def test_responses_namespaces_keep_their_allowed_functions(body: dict[str, Any], allowed: set[str], changed: bool,
                                                           after: dict[str, Any]) -> None:
    original = copy.deepcopy(body)
    shaped = copy.copy(body)
    assert filter_request_tools("openai_responses", shaped, allowed.__contains__) is changed
    assert shaped == after
    assert body == original  # lists are replaced, never edited: the agent's body shares them


def test_responses_allowed_tools_requiring_only_refused_namespaced_functions_is_refused() -> None:
    body = {"tools": [namespace("search_kb", "delete_all")],
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [namespace("delete_all")]}}
    with pytest.raises(ToolNotAllowed, match="tool_choice requires tools outside the allow-list"):
        filter_request_tools("openai_responses", body, {"search_kb"}.__contains__)


@pytest.mark.parametrize(("names", "kept"), [({"delete_all"}, ["c2"]), ({"crm"}, ["c1", "c2"])])
def test_responses_namespaced_calls_are_dropped_by_the_function_s_name(names: set[str], kept: list[str]) -> None:
    """A namespaced call names its function in `name` (the namespace apart): judged as the offered function was."""
    calls = [{"type": "function_call", "call_id": "c1", "name": "delete_all", "namespace": "crm", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "search_kb", "namespace": "crm", "arguments": "{}"}]
    body: dict[str, Any] = {"output": calls}
    drop_calls("openai_responses", body, frozenset(names))
    assert [c["call_id"] for c in body["output"]] == kept
