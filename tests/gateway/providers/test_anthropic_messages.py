"""gateway/providers/anthropic_messages.py: the Anthropic Messages adapter, wire JSON <-> Call/Answer."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from anthropic.types import ErrorResponse, Message

from gateway import errors
from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage, digest
from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.providers import anthropic_messages
from gateway.providers.anthropic_messages import AnthropicMessages, usage_from
from gateway.providers.common import PDF_PAGE_IMAGES
from gateway.providers.sse import SseEvent, SseParser
from guards.bounds import SEARCH_INPUT_TOKENS
from tests.gateway.providers.test_common import pdf_of

ADAPTER = AnthropicMessages()
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get", "description": "d", "input_schema": {"type": "object"}}


def body_of(**fields: Any) -> dict[str, Any]:
    """A Messages body; a field given as None is left out."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 256, "messages": MSG, **fields}
    return {k: v for k, v in body.items() if v is not None}


def parse(body: dict[str, Any], limits: Limits | None = None) -> Call:
    return ADAPTER.parse_request(body, orjson.dumps(body), limits or Limits())


def result(tool_use_id: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, **extra}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def use(name: str, payload: Any, bid: str = "toolu_1") -> dict[str, Any]:
    return {"type": "tool_use", "id": bid, "name": name, "input": payload}


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


USE = {"role": "assistant", "content": [use("get", {})]}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"stream": False, "max_tokens": 256, "tools": (), "tool_choice": None, "tool_results": (),
              "params": RequestParams()}),
        ({"stream": True, "max_tokens": None}, {"stream": True, "max_tokens": None}),  # clamped later
        ({"temperature": 1, "top_p": 0.9, "top_k": 5}, {"params": RequestParams(temperature=1.0, top_p=0.9,
                                                                                top_k=5.0)}),
        ({"stop_sequences": ["\n\nH:", "END"]}, {"params": RequestParams(stop_sequences=("\n\nH:", "END"))}),
        ({"stop_sequences": "END"}, {"params": RequestParams()}),
        ({"stop_sequences": ["END", 1, None]}, {"params": RequestParams(stop_sequences=("END",))}),
        ({"tools": [TOOL]}, {"tools": (ToolSpec("get", "d", {"type": "object"}),)}),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         {"tools": (ToolSpec("web_search", None, None),)}),
        ({"tool_choice": {"type": "tool", "name": "get"}}, {"tool_choice": "get"}),
        ({"tool_choice": {"type": "auto"}}, {"tool_choice": None}),
        ({"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, {"tool_choice": None}),
        ({"tool_choice": {"type": "none"}}, {"tool_choice": None}),
        ({"messages": [*MSG, USE, user(result("toolu_1", "sunny"), text("and?"))]},
         {"tool_results": (ToolResult("toolu_1", "sunny"),)}),
        ({"messages": [*MSG, USE, user(result("a", [text("x")]), result("b", "no", is_error=True))]},
         {"tool_results": (ToolResult("a", "x"), ToolResult("b", "no", True))}),
        ({"messages": [user(result("a", "r")), {"role": "assistant", "content": "{"}]},
         {"tool_results": (ToolResult("a", "r"),)}),  # a prefill after them: the last user message counts
        ({"messages": [user(result("a", "r")), USE, *MSG]}, {"tool_results": ()}),  # string content: none
        ({"messages": [user({"type": "tool_result"})]}, {"tool_results": (ToolResult("", ""),)}),
        ({"messages": [{"role": "assistant", "content": "only"}]}, {"tool_results": ()}),
    ],
)
def test_parse_request(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    body = body_of(**fields)
    raw = orjson.dumps(body)
    call = ADAPTER.parse_request(body, raw, Limits())
    assert (call.protocol, call.operation, call.model) == ("anthropic", "chat", "claude-sonnet-4-5")
    assert (call.input_bytes, call.request_hash, call.raw) == (len(raw), digest(raw), body)
    assert {key: getattr(call, key) for key in expected} == expected


SMALL = Limits(max_messages=2, max_tools=1)


@pytest.mark.parametrize(
    ("fields", "limits", "cls", "param", "fragment"),
    [
        ({"model": None}, None, InvalidRequest, "model", "'model' is required"),
        ({"model": 1}, None, InvalidRequest, "model", "non-empty string"),
        ({"messages": None}, None, InvalidRequest, "messages", "'messages' is required"),
        ({"messages": {"role": "user"}}, None, InvalidRequest, "messages", "'messages' must be an array"),
        ({"messages": [{"role": "system", "content": "x"}]}, None, InvalidRequest, "messages",
         "messages[0] role must be user or assistant"),
        ({"messages": [*MSG, {"role": "tool"}]}, None, InvalidRequest, "messages", "messages[1] role must"),
        ({"messages": [*MSG, "hi"]}, None, InvalidRequest, "messages", "messages[1] role must be"),
        ({"messages": MSG * 3}, SMALL, RequestTooLarge, None, "3 messages exceed the limit of 2"),
        ({"tools": [TOOL, TOOL]}, SMALL, RequestTooLarge, None, "2 tools exceed the limit of 1"),
        ({"tools": TOOL}, None, InvalidRequest, "tools", "'tools' must be an array"),
        ({"tools": [TOOL, {"description": "x"}]}, None, InvalidRequest, "tools", "tools.1 must be an object"),
        ({"tools": ["get"]}, None, InvalidRequest, "tools", "tools.0 must be an object with a name"),
        ({"stream": "true"}, None, InvalidRequest, "stream", "'stream' must be a boolean"),
        ({"max_tokens": 0}, None, InvalidRequest, "max_tokens", "'max_tokens' must be an integer >= 1"),
        ({"max_tokens": "5"}, None, InvalidRequest, "max_tokens", "integer"),
        ({"temperature": "warm"}, None, InvalidRequest, "temperature", "'temperature' must be a number"),
        ({"top_p": False}, None, InvalidRequest, "top_p", "number"),
        ({"top_k": "5"}, None, InvalidRequest, "top_k", "'top_k' must be a number"),
        ({"tool_choice": "auto"}, None, InvalidRequest, "tool_choice", "must be auto, any, tool or none"),
        ({"tool_choice": {"type": "function"}}, None, InvalidRequest, "tool_choice", "any, tool or none"),
        ({"tool_choice": {"type": "tool"}}, None, InvalidRequest, "tool_choice", "of type tool needs a name"),
        ({"tool_choice": {"type": "tool", "name": 7}}, None, InvalidRequest, "tool_choice", "needs a name"),
    ],
)
def test_parse_request_refuses(
    fields: dict[str, Any], limits: Limits | None, cls: type[GatewayError], param: str | None, fragment: str
) -> None:
    with pytest.raises(GatewayError) as info:
        parse(body_of(**fields), limits)
    assert (type(info.value), info.value.param) == (cls, param)
    assert fragment in info.value.message


def test_limits_are_inclusive() -> None:
    assert len(parse(body_of(messages=MSG * 2, tools=[TOOL]), SMALL).tools) == 1


def message(*content: dict[str, Any], stop: str | None = "end_turn", **extra: Any) -> dict[str, Any]:
    head = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x"}
    usage = {"input_tokens": 10, "output_tokens": 7}
    tail = {"stop_reason": stop, "stop_sequence": None, "usage": usage}
    return {**head, "content": list(content), **tail, **extra}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (message(text("Hel"), text("lo")),
         Answer("msg_1", "claude-x", "Hello", (), ("end_turn",), Usage(10, 7))),
        (message(text("Let me look."), use("get", {"q": 1}), use("f", {}, "toolu_2"), stop="tool_use"),
         Answer("msg_1", "claude-x", "Let me look.",
                (ToolCall("toolu_1", "get", '{"q":1}'), ToolCall("toolu_2", "f", "{}")), ("tool_use",),
                Usage(10, 7))),
        (message({"type": "thinking", "thinking": "hm", "signature": "s"}, text("ok"), stop="max_tokens"),
         Answer("msg_1", "claude-x", "ok", (), ("max_tokens",), Usage(10, 7))),
        (message(stop=None), Answer("msg_1", "claude-x", "", (), (), Usage(10, 7))),
        ({"content": [{"type": "text"}, {"type": "tool_use", "input": None}]},
         Answer(tool_calls=(ToolCall("", "", "{}"),))),
        ({"content": None, "usage": "none"}, Answer()),
        ({}, Answer()),
    ],
)
def test_parse_answer(body: dict[str, Any], expected: Answer) -> None:
    assert ADAPTER.parse_answer(body) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        (7, None),
        ({}, None),  # no counts at all is no report: settled at the reservation, never free
        ({"input_tokens": 10, "output_tokens": 7}, Usage(10, 7)),
        ({"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 3,
          "cache_creation_input_tokens": 2},
         Usage(input_tokens=15, output_tokens=7, cache_read_tokens=3, cache_creation_tokens=2)),
        ({"input_tokens": 4, "cache_read_input_tokens": None, "cache_creation_input_tokens": None,
          "output_tokens": None}, None),  # output count missing
        ({"input_tokens": 10, "output_tokens": 1e300}, None),  # not believed: settled at the reservation
        ({"input_tokens": -10, "output_tokens": 7}, None),
        ({"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 2**64}, None),
    ],
)
def test_usage_from_counts_the_cache_as_input(usage: Any, expected: Usage | None) -> None:
    assert usage_from(usage) == expected


@pytest.mark.parametrize(
    ("error", "kind", "code", "sdk"),
    [
        (InvalidRequest("bad", param="model"), "invalid_request_error", "invalid_request", True),
        (errors.InvalidApiKey("who"), "authentication_error", "invalid_api_key", True),
        (errors.ModelNotFound("no"), "not_found_error", "model_not_found", True),
        (RequestTooLarge("big"), "request_too_large", "request_too_large", False),  # not in the SDK's union
        (errors.OutputNonconforming("no"), "invalid_request_error", "output_nonconforming", True),
        (errors.Stopped("time_cap", "late"), "permission_error", "time_cap", True),
        (errors.ToolNotAllowed("rm"), "permission_error", "tool_not_allowed", True),
        (errors.ApprovalDenied("no"), "permission_error", "approval_denied", True),
        (errors.UpstreamUnavailable("down"), "api_error", "upstream_unavailable", True),
        (errors.UpstreamTimeout("slow"), "timeout_error", "upstream_timeout", True),
        (errors.ShuttingDown("bye"), "overloaded_error", "shutting_down", True),
    ],
)
def test_error_body_and_event(error: GatewayError, kind: str, code: str, sdk: bool) -> None:
    body = ADAPTER.error_body(error)
    expected = {"type": kind, "message": error.message, "code": code}
    assert orjson.loads(body) == {"type": "error", "error": expected}
    if sdk:
        parsed = ErrorResponse.model_validate_json(body)
        assert (parsed.error.type, parsed.error.message) == (kind, error.message)
    [event] = SseParser().feed(ADAPTER.error_event(error))
    assert (event.event, event.data.encode()) == ("error", body)
    assert event.raw == b"event: error\ndata: " + body + b"\n\n"


def test_a_refused_thread_is_anthropics_thread_unsupported_request() -> None:
    """The SDK's threaded loops (its tool runner) send the turn again unthreaded on this error."""
    body = ADAPTER.error_body(InvalidRequest("'thread' continues a conversation", param="thread"))
    parsed = ErrorResponse.model_validate_json(body)
    assert parsed.error.type == "invalid_request_error"
    assert orjson.loads(body)["error"]["details"] == {"error_code": "thread_unsupported_request", "unsupported": []}
    assert "details" not in orjson.loads(ADAPTER.error_body(InvalidRequest("bad", param="fallbacks")))["error"]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anthropic_messages, "time", SimpleNamespace(time=lambda: 1_700_000_000.25))


CALL = Call("anthropic", "chat", "claude-sonnet-4-5")


REASONS = [("budget_exhausted", "spent $2.00"), ("no_progress", 'a "b"\nü')]


@pytest.mark.parametrize(("reason", "detail"), REASONS)
def test_stop_answer_is_a_message(clock: None, reason: str, detail: str) -> None:
    raw = ADAPTER.stop_answer(CALL, reason, detail)
    parsed = Message.model_validate_json(raw)
    said = f"tollgate stopped this run ({reason}): {detail}"
    assert (parsed.id, parsed.model, parsed.role, parsed.stop_reason) == (
        "msg_tollgate_1700000000250", "claude-sonnet-4-5", "assistant", "end_turn"
    )
    assert [(b.type, getattr(b, "text", None)) for b in parsed.content] == [("text", said)]
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (0, 0)
    expected = Answer("msg_tollgate_1700000000250", "claude-sonnet-4-5", said, (), ("end_turn",), Usage())
    assert ADAPTER.parse_answer(orjson.loads(raw)) == expected


@pytest.mark.parametrize(
    ("body", "prefer", "field", "after"),
    [
        ({}, True, None, {"max_tokens": 9}),
        ({}, False, None, {"max_tokens": 9}),  # Anthropic has one field whatever the preference
        ({"max_tokens": 4096}, True, "max_tokens", {"max_tokens": 9}),
        ({"max_tokens": None}, False, None, {"max_tokens": 9}),
    ],
)
def test_max_tokens_field_and_set(
    body: dict[str, Any], prefer: bool, field: str | None, after: dict[str, Any]
) -> None:
    assert ADAPTER.max_tokens_field(body) == field
    ADAPTER.set_max_tokens(body, 9, prefer_completion_field=prefer)
    assert body == after


@pytest.mark.parametrize("body", [{"stream": True}, {"stream": True, "stream_options": {"include_usage": 0}}])
def test_ask_usage_changes_nothing(body: dict[str, Any]) -> None:
    before = dict(body)
    assert ADAPTER.ask_usage(body) is False  # Anthropic streams always carry usage
    assert body == before


@pytest.mark.parametrize(
    ("body", "answer", "said"),
    [
        (body_of(temperature=0), "{bad", "{bad"),
        (body_of(), "", "(empty)"),  # Anthropic refuses an empty assistant turn
        ({"model": "m", "max_tokens": 5}, "x", "x"),
    ],
)
def test_with_instruction(body: dict[str, Any], answer: str, said: str) -> None:
    before = orjson.dumps(body)
    out = ADAPTER.with_instruction(body, answer, "Answer with JSON only.")
    turns = [{"role": "assistant", "content": said}, {"role": "user", "content": "Answer with JSON only."}]
    assert out == {**body, "messages": [*body.get("messages", []), *turns]}
    assert orjson.dumps(body) == before
    assert parse(out).tool_results == ()  # still a request the adapter accepts


def test_an_assistant_prefill_is_part_of_the_answer_and_of_its_re_ask() -> None:
    user = {"role": "user", "content": "JSON please"}
    body = {"model": "m", "max_tokens": 5, "messages": [user, {"role": "assistant", "content": [
        {"type": "text", "text": '{"answer":'}]}]}
    assert parse(body).prefill == '{"answer":'
    assert parse({"model": "m", "max_tokens": 5, "messages": [user]}).prefill == ""
    out = ADAPTER.with_instruction(body, ' "four"}', "Answer with JSON only.")
    assert out["messages"] == [user, {"role": "assistant", "content": '{"answer": "four"}'},
                               {"role": "user", "content": "Answer with JSON only."},
                               body["messages"][-1]]  # roles alternate; the re-ask is continued from the prefill
    assert parse(out).prefill == '{"answer":'  # so its answer is judged with the prefill, as the agent reads it


def test_blocks_of_tools_anthropic_ran_are_counted_not_judged() -> None:
    body = {"id": "msg_1", "model": "m", "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1},
            "content": [{"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "x"}},
                        {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
                        {"type": "mcp_tool_use", "id": "m1", "name": "read", "server_name": "files", "input": {}},
                        {"type": "text", "text": "done"}]}
    answer = ADAPTER.parse_answer(body)
    assert (answer.hosted_calls, answer.tool_calls, answer.text) == (2, (), "done")


def test_limit_hosted_calls_sets_max_uses_of_server_tools() -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search"}, {"type": "web_fetch_20250910", "name": "f",
                                                                     "max_uses": 2},
             {"type": "web_search_20250305", "name": "w2", "max_uses": 9}, {"name": "mine", "input_schema": {}},
             {"type": "code_execution_20250522", "name": "code_execution"}]
    body = {"tools": tools}
    assert ADAPTER.limit_hosted_calls(body, 3) is True
    assert [t.get("max_uses") for t in body["tools"]] == [3, 2, 3, None, None]
    assert ADAPTER.limit_hosted_calls(body, 3) is False  # already within
    assert ADAPTER.limit_hosted_calls({"tools": "x"}, 3) is False


def test_limit_hosted_calls_leaves_what_is_no_count_and_lower_counts() -> None:
    tools = [{"type": "web_search_20250305", "name": "w", "max_uses": "3"},
             {"type": "web_search_20250305", "name": "v", "max_uses": 0},
             {"type": "advisor_20260301", "name": "a"}]
    body = {"tools": tools}
    assert ADAPTER.limit_hosted_calls(body, 2) is True
    assert [t.get("max_uses") for t in body["tools"]] == ["3", 0, 2]


def test_with_no_tool_calls_left_server_tools_and_the_mcp_connector_go() -> None:
    body = {"tools": [{"type": "web_search_20250305", "name": "w"}, {"name": "mine", "input_schema": {}},
                      {"type": "mcp_toolset", "mcp_server_name": "gh"}, {"type": "code_execution_20250825",
                                                                          "name": "code_execution"}],
            "mcp_servers": [{"type": "url", "url": "u", "name": "gh"}], "tool_choice": {"type": "auto"}}
    assert ADAPTER.limit_hosted_calls(body, 0) is True
    assert body == {"tools": [{"name": "mine", "input_schema": {}}], "tool_choice": {"type": "auto"}}
    only = {"tools": [{"type": "web_fetch_20250910", "name": "f"}], "tool_choice": {"type": "any"}}
    assert ADAPTER.limit_hosted_calls(only, 0) is True and only == {}
    assert ADAPTER.limit_hosted_calls({"tools": [{"name": "mine"}]}, 0) is False


@pytest.mark.parametrize(
    ("choice", "kept"),
    [
        ({"type": "tool", "name": "w"}, False),  # it forced a tool no longer offered: the API would refuse it
        ({"type": "tool", "name": "mine"}, True),
        ({"type": "any"}, True),
    ],
)
def test_with_no_calls_left_a_tool_choice_naming_a_removed_tool_goes(choice: dict[str, Any], kept: bool) -> None:
    body = {"tools": [{"type": "web_search_20250305", "name": "w"}, {"name": "mine", "input_schema": {}}],
            "tool_choice": choice}
    assert ADAPTER.limit_hosted_calls(body, 0) is True
    assert body.get("tool_choice") == (choice if kept else None)


@pytest.mark.parametrize(
    ("tools", "limits"),
    [
        ([], ()),
        ([{"name": "mine", "input_schema": {}}], ()),
        # a fetch's content is billed as input: held as searches' results are (its size: `search_sizes`)
        ([{"type": "web_fetch_20250910", "name": "web_fetch"}], (None,)),  # no content limit: it gets one
        ([{"type": "web_fetch_20250910", "name": "f", "max_uses": 5}], (None,)),
        ([{"type": "web_fetch_20250910", "name": "f", "max_uses": 5, "max_content_tokens": 20000}], (5,)),
        ([{"type": "web_fetch_20250910", "name": "f", "max_content_tokens": 8000}], (None,)),
        ([{"type": "web_search_20250305", "name": "w", "max_uses": 3},
          {"type": "web_fetch_20250910", "name": "f", "max_uses": 1, "max_content_tokens": 9000}], (3, 1)),
        ([{"type": "web_search_20250305", "name": "web_search"}], (None,)),
    ],
)
def test_search_limits_are_each_web_search_tools_max_uses(tools: list[Any], limits: tuple[int | None, ...]) -> None:
    body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 10,
                            "messages": [{"role": "user", "content": "hi"}]}
    assert parse({**body, "tools": tools} if tools else body).search_limits == limits
    assert ADAPTER.search_limits({"tools": tools}) == limits


def test_search_limits_read_a_limit_that_is_no_count_as_no_limit() -> None:
    """The pure reading, for a body `parse_request` did not check: no count is no limit."""
    fetch = {"type": "web_fetch_20250910", "name": "f", "max_uses": 2, "max_content_tokens": "x"}
    assert ADAPTER.search_limits({"tools": [fetch]}) == (None,)
    searches = [{"type": "web_search_20250305", "name": "w", "max_uses": 3},
                {"type": "web_search_20250305", "name": "w2", "max_uses": "x"}]
    assert ADAPTER.search_limits({"tools": searches}) == (3, None)


@pytest.mark.parametrize("value", ["3", 1000.0, 1e30, 2.5, -1, True, float(2**64), 2**53 + 1, [3], {"n": 3}])
@pytest.mark.parametrize(("tool", "key"), [
    ({"type": "web_search_20250305", "name": "w"}, "max_uses"),
    ({"type": "web_fetch_20250910", "name": "f"}, "max_uses"),
    ({"type": "web_fetch_20250910", "name": "f"}, "max_content_tokens"),
    ({"type": "advisor_20260301", "name": "a", "model": "claude-opus-4-1"}, "max_uses"),
])
def test_a_server_tool_limit_that_is_no_integer_is_refused(tool: dict[str, Any], key: str, value: Any) -> None:
    """The budget and the tool-call cap lower these limits and reserve for what they allow: one they could
    not read (1000.0 among them, which an API may read as 1000) would reach the API unlowered."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "mine", "input_schema": {}}, {**tool, key: value}]}
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == f"tools.1.{key}"
    assert f"'tools[1].{key}' must be an integer from 0 to" in str(caught.value)


@pytest.mark.parametrize("value", [None, 0, 1, 2**53])
def test_a_server_tool_limit_that_is_a_count_or_null_is_read(value: Any) -> None:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "w", "max_uses": value}]}
    assert parse(body).search_limits == (value,)


def test_a_fetch_content_limit_past_any_context_is_held_at_the_largest_context() -> None:
    tool = {"type": "web_fetch_20250910", "name": "f", "max_uses": 1, "max_content_tokens": 10**12}
    assert ADAPTER.search_limits({"tools": [tool]}) == (1,)
    assert ADAPTER.search_sizes({"tools": [tool]}) == (1_000_000,)  # no fetch adds more than a context holds


@pytest.mark.parametrize(("tools", "sizes"), [
    ([{"type": "web_search_20250305", "name": "w"}], (SEARCH_INPUT_TOKENS,)),
    ([{"type": "web_fetch_20250910", "name": "f"}], (anthropic_messages.FETCH_CONTENT_TOKENS,)),  # it gets one
    ([{"type": "web_fetch_20250910", "name": "f", "max_content_tokens": 100_000},
      {"type": "web_search_20250305", "name": "w", "max_uses": 2}], (100_000, SEARCH_INPUT_TOKENS)),
])
def test_search_sizes_are_what_one_use_of_each_tool_adds(tools: list[Any], sizes: tuple[int, ...]) -> None:
    body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 10,
                            "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert parse(body).search_sizes == sizes == ADAPTER.search_sizes(body)


def test_limiting_hosted_calls_gives_a_fetch_its_content_limit() -> None:
    """The content a fetch adds is what the reservation held (`search_limits`): one sent without a limit
    gets FETCH_CONTENT_TOKENS; one the agent set is kept (held whole), and one that is no count is left
    for the API to refuse."""
    tools = [{"type": "web_fetch_20250910", "name": "f"},
             {"type": "web_fetch_20250910", "name": "g", "max_uses": 1, "max_content_tokens": 20000},
             {"type": "web_fetch_20250910", "name": "h", "max_uses": 1, "max_content_tokens": "many"}]
    body: dict[str, Any] = {"tools": tools}
    assert ADAPTER.limit_hosted_calls(body, 2) is True
    assert [(t.get("max_uses"), t.get("max_content_tokens")) for t in body["tools"]] == [
        (2, anthropic_messages.FETCH_CONTENT_TOKENS), (1, 20000), (1, "many")]
    assert tools[0] == {"type": "web_fetch_20250910", "name": "f"}  # the agent's own tool is not edited
    assert ADAPTER.limit_hosted_calls(body, 2) is False


def test_fetch_held_uses_cover_the_content_they_allow() -> None:
    """Each entry `search_limits` reports is held at its `search_sizes` per use: whatever limit tollgate
    sends, the fetches it allows add no more input than their entries hold."""
    for content in (1, 7999, 8000, 8001, 20000, 100000):
        tool = {"type": "web_fetch_20250910", "name": "f", "max_uses": 7, "max_content_tokens": content}
        for limit in (1, 3, 7):
            body: dict[str, Any] = {"tools": [tool]}
            ADAPTER.limit_hosted_calls(body, limit)
            sent = body["tools"][0]
            held = sum(min(n or 10, limit) * size for n, size in zip(
                ADAPTER.search_limits({"tools": [tool]}), ADAPTER.search_sizes({"tools": [tool]}), strict=True))
            assert sent["max_uses"] * sent["max_content_tokens"] <= held


THINK = {"type": "enabled", "budget_tokens": 8000}


@pytest.mark.parametrize(
    ("thinking", "value", "sent"),
    [
        (THINK, 5851, {"type": "enabled", "budget_tokens": 5850}),  # below the new limit, as Anthropic requires
        (THINK, 8000, {"type": "enabled", "budget_tokens": 7999}),
        (THINK, 8001, THINK),  # already below it
        ({"type": "enabled", "budget_tokens": 1024}, 1025, {"type": "enabled", "budget_tokens": 1024}),
        ({"type": "enabled", "budget_tokens": "x"}, 500, {"type": "enabled", "budget_tokens": "x"}),  # the API's
        ({"type": "disabled"}, 500, {"type": "disabled"}),
        ({"type": "adaptive"}, 500, {"type": "adaptive"}),  # no budget to keep below the limit
    ],
)
def test_a_clamped_max_tokens_keeps_the_thinking_budget_below_it(
    thinking: dict[str, Any], value: int, sent: dict[str, Any]
) -> None:
    original = dict(thinking)
    body = body_of(max_tokens=16000, thinking=thinking)
    ADAPTER.set_max_tokens(body, value, prefer_completion_field=False)
    assert (body["max_tokens"], body["thinking"]) == (value, sent)
    assert thinking == original  # the agent's body (shared by re-asks) keeps its own budget


@pytest.mark.parametrize("value", [1024, 16, 1])
def test_a_limit_that_leaves_no_room_to_think_is_refused_for_this_step(value: int) -> None:
    """Anthropic takes no thinking budget under 1,024 tokens: a grant that small cannot be sent with
    thinking, so the step is refused (held, the run goes on) and the body is left as it came."""
    body = body_of(max_tokens=16000, thinking=THINK)
    with pytest.raises(errors.BudgetHeld, match="extended thinking") as info:
        ADAPTER.set_max_tokens(body, value, prefer_completion_field=False)
    assert type(info.value) is errors.BudgetHeld and info.value.stop_reason is None
    assert (body["max_tokens"], body["thinking"]) == (16000, THINK)


def test_base64_pdf_pages_are_bounded_like_images() -> None:
    """A base64 PDF is billed per page (its text and an image of it): each page counts PDF_PAGE_IMAGES
    images; one whose pages cannot be counted is unbounded, like a document named by URL."""
    def doc(data: str) -> dict[str, Any]:
        return {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}

    pdf = base64.b64encode(pdf_of(3)).decode()
    content = [doc(pdf), {"type": "image", "source": {"type": "url", "url": "u"}}, doc("bm90IGEgcGRm"), text("x")]
    call = parse(body_of(messages=[{"role": "user", "content": content}]))
    assert (call.input_images, call.referenced_documents) == (1 + 3 * PDF_PAGE_IMAGES, 1)


def sse(data: dict[str, Any]) -> SseEvent:
    text = orjson.dumps(data).decode()
    return SseEvent(f"event: {data['type']}\ndata: {text}\n\n".encode(), str(data["type"]), text)


SEARCHED = [{"type": "text", "text": "Let me search."},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "Found "}, {"type": "text", "text": "it."}]


def test_the_answer_text_is_what_follows_the_last_tool_the_provider_ran() -> None:
    answer = ADAPTER.parse_answer({"id": "m", "model": "c", "content": SEARCHED, "stop_reason": "end_turn"})
    assert (answer.text, answer.hosted_calls, answer.after_provider_tool) == ("Found it.", 1, True)


def test_a_stream_restarts_its_answer_text_at_a_tool_the_provider_runs() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    restarts = []
    for index, block in enumerate(SEARCHED):
        start = {**block, "text": ""} if block["type"] == "text" else block
        reader.feed(sse({"type": "content_block_start", "index": index, "content_block": start}))
        restarts.append(reader.restart)
        if block["type"] == "text":
            reader.feed(sse({"type": "content_block_delta", "index": index,
                             "delta": {"type": "text_delta", "text": block["text"]}}))
    assert restarts == [False, True, True, False, False]  # at each block of the tool: the answer starts after
    assert reader.answer().text == "Found it."


@pytest.mark.parametrize(("body", "provider_tools"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, True),
    ({"tools": [{"type": "code_execution_20250522", "name": "code_execution"}]}, True),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]}, True),
    ({"tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}, False),
    ({}, False),
])
def test_a_request_offering_tools_the_provider_runs_says_so(body: dict[str, Any], provider_tools: bool) -> None:
    full = {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **body}
    assert ADAPTER.parse_request(full, orjson.dumps(full), Limits()).provider_tools is provider_tools


@pytest.mark.parametrize("content", [
    [{"type": "tool_use", "id": "t9", "name": "delete_everything", "input": {}}],
    [{"type": "text", "text": "unjudged"}],
])
def test_a_message_start_carrying_content_is_malformed(content: list[dict[str, Any]]) -> None:
    """The SDK starts its message from `message_start`: content there would skip every judgement."""
    reader = ADAPTER.stream_reader(hide_usage=False)
    start = {"type": "message_start", "message": {"id": "m", "model": "claude", "content": content,
                                                  "usage": {"input_tokens": 3, "output_tokens": 1}}}
    with pytest.raises(ValueError, match="message_start carries content"):
        reader.feed(sse(start))


def test_a_message_start_with_empty_content_starts_the_stream() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    reader.feed(sse({"type": "message_start", "message": {"id": "m", "model": "claude", "content": [],
                                                          "usage": {"input_tokens": 3, "output_tokens": 1}}}))
    assert reader.started
