"""gateway/providers/openai_chat.py: the OpenAI Chat Completions adapter, wire JSON <-> Call/Answer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import ErrorObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway import errors
from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage, digest
from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.providers import openai_chat
from gateway.providers.openai_chat import OpenAIChat, usage_from
from gateway.providers.sse import SseEvent, SseParser

ADAPTER = OpenAIChat()
MSG = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}


def body_of(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": MSG, **fields}


def parse(body: dict[str, Any], limits: Limits | None = None) -> Call:
    return ADAPTER.parse_request(body, orjson.dumps(body), limits or Limits())


def tool_msg(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


ASSISTANT: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"stream": False, "max_tokens": None, "tools": (), "tool_choice": None, "tool_results": (),
              "params": RequestParams()}),
        ({"stream": True}, {"stream": True}),
        ({"max_tokens": 100}, {"max_tokens": 100}),
        # both sent: upstreams differ in which they honour, so the larger one is the worst case
        ({"max_completion_tokens": 50, "max_tokens": 100}, {"max_tokens": 100}),
        ({"max_completion_tokens": 100, "max_tokens": 50}, {"max_tokens": 100}),
        ({"max_completion_tokens": None, "max_tokens": 7}, {"max_tokens": 7}),
        ({"temperature": 0, "top_p": 0.5, "frequency_penalty": -1, "presence_penalty": 1.5, "seed": -(2**63),
          "n": 2}, {"params": RequestParams(temperature=0.0, top_p=0.5, frequency_penalty=-1.0,
                                            presence_penalty=1.5, seed=-(2**63), choice_count=2)}),
        ({"stop": "END"}, {"params": RequestParams(stop_sequences=("END",))}),
        ({"stop": ["a", "b"]}, {"params": RequestParams(stop_sequences=("a", "b"))}),
        ({"stop": [1, None, "c"]}, {"params": RequestParams(stop_sequences=("c",))}),  # strings only
        ({"stop": 7}, {"params": RequestParams()}),
        ({"tools": [FN]}, {"tools": (ToolSpec("get", "d", {"type": "object"}),)}),
        ({"tools": [{"function": {"name": "f", "parameters": "x"}}]},
         {"tools": (ToolSpec("f", None, None),)}),
        ({"tool_choice": {"type": "function", "function": {"name": "get"}}}, {"tool_choice": "get"}),
        ({"tool_choice": "auto"}, {"tool_choice": None}),
        ({"tool_choice": "none"}, {"tool_choice": None}),
        ({"tool_choice": "required"}, {"tool_choice": None}),
        ({"messages": [*MSG, ASSISTANT, tool_msg("a", "r1"), tool_msg("b", [{"type": "text", "text": "p"}])]},
         {"tool_results": (ToolResult("a", "r1"), ToolResult("b", "p"))}),
        ({"messages": [tool_msg("old", "x"), ASSISTANT, {"role": "tool", "content": "r"}]},
         {"tool_results": (ToolResult("", "r"),)}),  # only the round after the last assistant message
        ({"messages": [tool_msg("a", "r"), ASSISTANT, *MSG]}, {"tool_results": ()}),
        ({"messages": [{"role": "developer", "content": "be brief"}, *MSG]}, {"tool_results": ()}),
    ],
)
def test_parse_request(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    body = body_of(**fields)
    raw = orjson.dumps(body)
    call = ADAPTER.parse_request(body, raw, Limits())
    assert (call.protocol, call.operation, call.model) == ("openai", "chat", "gpt-4o-mini")
    assert (call.input_bytes, call.request_hash, call.raw) == (len(raw), digest(raw), body)
    assert {key: getattr(call, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("fields", "limits", "cls", "param", "fragment"),
    [
        ({"model": None}, None, InvalidRequest, "model", "'model' is required"),
        ({"model": ""}, None, InvalidRequest, "model", "non-empty string"),
        ({"messages": None}, None, InvalidRequest, "messages", "'messages' is required"),
        ({"messages": "hi"}, None, InvalidRequest, "messages", "'messages' must be an array"),
        ({"messages": ["hi"]}, None, InvalidRequest, "messages", "messages[0] must be an object with a role"),
        ({"messages": [*MSG, {"content": "x"}]}, None, InvalidRequest, "messages", "messages[1] must be"),
        ({"messages": [{"role": 1}]}, None, InvalidRequest, "messages", "messages[0]"),
        ({"messages": MSG * 3}, Limits(max_messages=2), RequestTooLarge, None, "3 messages exceed the limit"),
        ({"tools": [FN, FN]}, Limits(max_tools=1), RequestTooLarge, None, "2 tools exceed the limit of 1"),
        ({"tools": {"get": FN}}, None, InvalidRequest, "tools", "'tools' must be an array"),
        ({"tools": [FN, {"type": "function"}]}, None, InvalidRequest, "tools", "tools[1] must be {type: fu"),
        ({"tools": [{"function": {"name": 3}}]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"tools": ["get"]}, None, InvalidRequest, "tools", "tools[0]"),
        ({"stream": "yes"}, None, InvalidRequest, "stream", "'stream' must be a boolean"),
        ({"max_tokens": 0}, None, InvalidRequest, "max_tokens", "'max_tokens' must be an integer >= 1"),
        ({"max_tokens": 1.5}, None, InvalidRequest, "max_tokens", "integer"),
        ({"max_tokens": True}, None, InvalidRequest, "max_tokens", "integer"),
        ({"max_completion_tokens": -1}, None, InvalidRequest, "max_completion_tokens", "integer >= 1"),
        ({"temperature": "hot"}, None, InvalidRequest, "temperature", "'temperature' must be a number"),
        ({"top_p": True}, None, InvalidRequest, "top_p", "number"),
        ({"frequency_penalty": [0]}, None, InvalidRequest, "frequency_penalty", "number"),
        ({"presence_penalty": "0"}, None, InvalidRequest, "presence_penalty", "number"),
        ({"seed": "1"}, None, InvalidRequest, "seed", "integer"),
        ({"n": 0}, None, InvalidRequest, "n", "'n' must be an integer >= 1"),
        # every choice is reserved: a wild n would stop the run on its budget, so it is refused instead
        ({"n": 129}, None, InvalidRequest, "n", "'n' must be an integer from 1 to 128"),
        ({"n": 2**63}, None, InvalidRequest, "n", "'n' must be an integer from 1 to 128"),
        ({"tool_choice": "any"}, None, InvalidRequest, "tool_choice", "auto, none, required, allowed_tools or name a tool"),
        ({"tool_choice": {"type": "function"}}, None, InvalidRequest, "tool_choice", "must name a function"),
        ({"tool_choice": {"function": {"name": 1}}}, None, InvalidRequest, "tool_choice", "must name a func"),
    ],
)
def test_parse_request_refuses(
    fields: dict[str, Any], limits: Limits | None, cls: type[GatewayError], param: str | None, fragment: str
) -> None:
    body = {k: v for k, v in body_of(**fields).items() if v is not None}
    with pytest.raises(GatewayError) as info:
        parse(body, limits)
    assert (type(info.value), info.value.param) == (cls, param)
    assert fragment in info.value.message


def test_limits_are_inclusive() -> None:
    call = parse(body_of(messages=MSG * 2, tools=[FN]), Limits(max_messages=2, max_tools=1))
    assert len(call.tools) == 1


def completion(*messages: dict[str, Any], finish: str | None = "stop", **extra: Any) -> dict[str, Any]:
    choices = [{"index": i, "message": m, "finish_reason": finish} for i, m in enumerate(messages)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
            "choices": choices, **extra}


def calls(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in pairs]


USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (completion({"role": "assistant", "content": "Hello"}, usage=USAGE),
         Answer("chatcmpl-1", "gpt-4o", "Hello", (), ("stop",), Usage(10, 5))),
        (completion({"role": "assistant", "content": None,
                     "tool_calls": calls(("get", '{"q":1}'), ("f", "{}"))}, finish="tool_calls"),
         Answer("chatcmpl-1", "gpt-4o", "",
                (ToolCall("call_get", "get", '{"q":1}'), ToolCall("call_f", "f", "{}")), ("tool_calls",))),
        (completion({"role": "assistant", "content": "first"},
                    {"role": "assistant", "content": "second", "tool_calls": calls(("g", "{}"))}),
         Answer("chatcmpl-1", "gpt-4o", "first", (ToolCall("call_g", "g", "{}"),), ("stop", "stop"),
                other_texts=("second",), choice_calls=((), ("g",)))),
        (completion({"role": "assistant", "content": "cut"}, finish="length"),
         Answer("chatcmpl-1", "gpt-4o", "cut", (), ("length",))),
        (completion({"role": "assistant", "content": "x"}, finish=None),
         Answer("chatcmpl-1", "gpt-4o", "x")),
        (completion({"role": "assistant", "content": [{"type": "text", "text": "odd"}]}),
         Answer("chatcmpl-1", "gpt-4o", "", (), ("stop",))),  # content that is not a string gives no text
        ({"choices": [{"message": None}, {}]}, Answer(other_texts=("",), choice_calls=((), ()))),
        ({"choices": [{"message": {"tool_calls": [{}]}}]}, Answer(tool_calls=(ToolCall("", "", ""),))),
        ({"choices": None, "usage": None}, Answer()),
        ({}, Answer()),
        # a refusal instead of content, in the first choice or another (whose text is then not judged;
        # `refusals` says which choice it was, so the finish reasons stay in line with the choices)
        (completion({"role": "assistant", "content": None, "refusal": "no"}),
         Answer("chatcmpl-1", "gpt-4o", "", (), ("stop",), refused=True, refusals=("no",))),
        (completion({"role": "assistant", "content": "{}"}, {"role": "assistant", "content": None, "refusal": "no"}),
         Answer("chatcmpl-1", "gpt-4o", "{}", (), ("stop", "stop"), refusals=("", "no"))),
        (completion({"role": "assistant", "content": None, "refusal": "no"}, {"role": "assistant", "content": "b"},
                    finish="length"),
         Answer("chatcmpl-1", "gpt-4o", "", (), ("length", "length"), other_texts=("b",), choice_calls=((), ()),
                refused=True, refusals=("no", ""))),
        (completion({"role": "assistant", "content": "text", "refusal": "no"}),
         Answer("chatcmpl-1", "gpt-4o", "text", (), ("stop",))),
    ],
)
def test_parse_answer(body: dict[str, Any], expected: Answer) -> None:
    assert ADAPTER.parse_answer(body) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ("10", None),
        ([10, 5], None),
        ({}, None),  # no counts at all is no report: settled at the reservation, never free
        (USAGE, Usage(10, 5)),
        ({**USAGE, "prompt_tokens_details": {"cached_tokens": 4},
          "completion_tokens_details": {"reasoning_tokens": 2}},
         Usage(input_tokens=10, output_tokens=5, cache_read_tokens=4, reasoning_tokens=2)),
        ({"prompt_tokens": None, "completion_tokens": 3, "prompt_tokens_details": None,
          "completion_tokens_details": None}, None),  # input count missing
        ({"prompt_tokens": 10.0, "completion_tokens": 5}, Usage(10, 5)),
        # counts no provider reports are not believed: the step settles at its reservation
        ({"prompt_tokens": 1, "completion_tokens": 1e300}, None),
        ({"prompt_tokens": 10**30, "completion_tokens": 1}, None),
        ({"prompt_tokens": -100000, "completion_tokens": -5}, None),
        ({**USAGE, "prompt_tokens_details": {"cached_tokens": -4}}, None),
        ({"prompt_tokens": "10", "completion_tokens": 5}, None),
    ],
)
def test_usage_from(usage: Any, expected: Usage | None) -> None:
    assert usage_from(usage) == expected


@pytest.mark.parametrize(
    ("error", "kind", "param", "code"),
    [
        (InvalidRequest("bad", param="model"), "invalid_request_error", "model", "invalid_request"),
        (errors.InvalidGrammar("no regex"), "invalid_request_error", None, "invalid_request"),
        (errors.InvalidApiKey("who"), "invalid_request_error", None, "invalid_api_key"),
        (errors.ModelNotFound("no"), "invalid_request_error", None, "model_not_found"),
        (RequestTooLarge("big"), "invalid_request_error", None, "request_too_large"),
        (errors.OutputNonconforming("no"), "invalid_request_error", None, "output_nonconforming"),
        (errors.Stopped("budget_exhausted", "spent"), "permission_error", None, "budget_exhausted"),
        (errors.ToolNotAllowed("rm"), "permission_error", None, "tool_not_allowed"),
        (errors.ApprovalTimeout("late"), "permission_error", None, "approval_timeout"),
        (errors.UpstreamUnavailable("down"), "server_error", None, "upstream_unavailable"),
        (errors.UpstreamTimeout("slow"), "server_error", None, "upstream_timeout"),
        (errors.ShuttingDown("bye"), "server_error", None, "shutting_down"),
    ],
)
def test_error_body_and_event(error: GatewayError, kind: str, param: str | None, code: str) -> None:
    body = ADAPTER.error_body(error)
    expected = {"type": kind, "param": param, "code": code}
    assert orjson.loads(body) == {"error": {"message": error.message, **expected}}
    parsed = ErrorObject.model_validate(orjson.loads(body)["error"])
    assert (parsed.code, parsed.message) == (expected["code"], error.message)
    [event] = SseParser().feed(ADAPTER.error_event(error))
    assert (event.event, event.data.encode(), event.raw) == (None, body, b"data: " + body + b"\n\n")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_chat, "time", SimpleNamespace(time=lambda: 1_700_000_000.25))


CALL = Call("openai", "chat", "gpt-4o-mini")
REASONS = [("budget_exhausted", "spent $2.00"), ("loop_detected", 'said "again"\nand ü')]


@pytest.mark.parametrize(("reason", "detail"), REASONS)
def test_stop_answer_is_a_chat_completion(clock: None, reason: str, detail: str) -> None:
    raw = ADAPTER.stop_answer(CALL, reason, detail)
    completion_ = ChatCompletion.model_validate_json(raw)
    assert (completion_.id, completion_.created, completion_.model) == (
        "chatcmpl-tollgate-1700000000250", 1_700_000_000, "gpt-4o-mini"
    )
    [choice] = completion_.choices
    text = f"tollgate stopped this run ({reason}): {detail}"
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "stop")
    assert completion_.usage is not None and completion_.usage.total_tokens == 0
    expected = Answer(completion_.id, "gpt-4o-mini", text, (), ("stop",), Usage())
    assert ADAPTER.parse_answer(orjson.loads(raw)) == expected


@pytest.mark.parametrize(("reason", "detail"), REASONS)
def test_stop_stream_is_one_chunk_then_done(clock: None, reason: str, detail: str) -> None:
    raw = ADAPTER.stop_stream(CALL, reason, detail)
    events = SseParser().feed(raw)
    assert [e.data for e in events][1:] == ["[DONE]"] and raw.endswith(b"\n\ndata: [DONE]\n\n")
    chunk = ChatCompletionChunk.model_validate_json(events[0].data)
    assert (chunk.id, chunk.object, chunk.model) == (
        "chatcmpl-tollgate-1700000000250", "chat.completion.chunk", "gpt-4o-mini"
    )
    state = ChatCompletionStreamState()
    state.handle_chunk(chunk)
    [choice] = state.get_final_completion().choices
    text = f"tollgate stopped this run ({reason}): {detail}"
    assert (choice.message.content, choice.finish_reason) == (text, "stop")
    assert ADAPTER.stream_stop_tail(CALL, object(), reason, detail) == raw  # whatever was relayed before


@pytest.mark.parametrize(
    ("body", "prefer", "field", "after"),
    [
        ({}, True, None, {"max_completion_tokens": 9}),
        ({}, False, None, {"max_tokens": 9}),
        ({"max_tokens": 100}, True, "max_tokens", {"max_tokens": 9}),
        ({"max_completion_tokens": 100}, False, "max_completion_tokens", {"max_completion_tokens": 9}),
        ({"max_completion_tokens": 100, "max_tokens": 200}, False, "max_completion_tokens",
         {"max_completion_tokens": 9, "max_tokens": 9}),  # both: whichever the upstream honours
        ({"max_completion_tokens": 5, "max_tokens": 200}, False, "max_completion_tokens",
         {"max_completion_tokens": 5, "max_tokens": 9}),  # one the agent set lower stays lower
        ({"max_tokens": None}, True, None, {"max_tokens": None, "max_completion_tokens": 9}),
        ({"max_completion_tokens": None, "max_tokens": 12}, True, "max_tokens",
         {"max_completion_tokens": None, "max_tokens": 9}),
    ],
)
def test_max_tokens_field_and_set(
    body: dict[str, Any], prefer: bool, field: str | None, after: dict[str, Any]
) -> None:
    assert ADAPTER.max_tokens_field(body) == field
    ADAPTER.set_max_tokens(body, 9, prefer_completion_field=prefer)
    assert body == after
    assert parse(body_of(**body)).max_tokens == 9


@pytest.mark.parametrize(
    ("options", "hidden", "after"),
    [
        (None, True, {"include_usage": True}),
        ({"include_usage": True}, False, {"include_usage": True}),
        ({"include_usage": False}, True, {"include_usage": True}),
        ({"include_usage": 1}, True, {"include_usage": True}),
        ({"include_obfuscation": False}, True, {"include_obfuscation": False, "include_usage": True}),
        ("on", True, {"include_usage": True}),
    ],
)
def test_ask_usage(options: Any, hidden: bool, after: dict[str, Any]) -> None:
    body: dict[str, Any] = {"stream": True, **({} if options is None else {"stream_options": options})}
    assert ADAPTER.ask_usage(body) is hidden
    assert body == {"stream": True, "stream_options": after}


@pytest.mark.parametrize(
    ("body", "answer", "expected"),
    [
        (body_of(temperature=0), "{bad", [*MSG, {"role": "assistant", "content": "{bad"}]),
        (body_of(), "", [*MSG, {"role": "assistant", "content": ""}]),
        ({"model": "m"}, "x", [{"role": "assistant", "content": "x"}]),
    ],
)
def test_with_instruction(body: dict[str, Any], answer: str, expected: list[dict[str, Any]]) -> None:
    before = orjson.dumps(body)
    out = ADAPTER.with_instruction(body, answer, "Answer with JSON only.")
    assert out == {**body, "messages": [*expected, {"role": "user", "content": "Answer with JSON only."}]}
    assert orjson.dumps(body) == before  # the original body is not touched


# -- service tier and audio ---------------------------------------------------------------------------


@pytest.mark.parametrize(("sent", "tier"), [({}, None), ({"service_tier": "priority"}, "priority"),
                                            ({"service_tier": "auto"}, "auto"), ({"service_tier": 3}, None),
                                            ({"service_tier": None}, None)])
def test_the_service_tier_asked_for_and_answered(sent: dict[str, Any], tier: str | None) -> None:
    assert parse({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], **sent}).service_tier == tier
    answer = {"id": "c", "model": "gpt-4o", "choices": [], "usage": USAGE, **sent}
    assert ADAPTER.parse_answer(answer).service_tier == tier


@pytest.mark.parametrize(("modalities", "speaks"), [(None, False), (["text"], False), (["text", "audio"], True),
                                                    ("audio", False)])
def test_a_request_that_lets_the_model_speak(modalities: Any, speaks: bool) -> None:
    body: dict[str, Any] = {"model": "gpt-audio", "messages": [{"role": "user", "content": "hi"}]}
    if modalities is not None:
        body["modalities"] = modalities
    assert parse(body).audio_output is speaks


def test_usage_from_reads_the_audio_tokens() -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 8},
             "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 3}}
    assert usage_from(usage) == Usage(10, 5, input_audio_tokens=8, output_audio_tokens=3)


@pytest.mark.parametrize(("choices", "index"), [(1, 1), (1, -1), (2, 2), (3, 7)])
def test_a_streamed_choice_beyond_n_is_malformed(choices: int, index: int) -> None:
    """Only `n` choices are judged and reserved for: another one's text would be relayed unjudged."""
    reader = ADAPTER.stream_reader(hide_usage=False, choices=choices)
    first = orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "yes"}}]}).decode()
    reader.feed(SseEvent(f"data: {first}\n\n".encode(), None, first))
    extra = orjson.dumps({"id": "c", "choices": [{"index": index, "delta": {"content": "DROP"}}]}).decode()
    with pytest.raises(ValueError, match=f"index {index}, beyond the {choices} asked for"):
        reader.feed(SseEvent(f"data: {extra}\n\n".encode(), None, extra))


def test_a_stream_reports_the_tier_its_chunks_carry() -> None:
    reader = ADAPTER.stream_reader(hide_usage=False)
    chunks = [{"id": "c", "model": "gpt-4o", "service_tier": "priority",
               "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]},
              {"id": "c", "model": "gpt-4o", "service_tier": None, "choices": [], "usage": USAGE}]
    for data in chunks:
        raw = orjson.dumps(data).decode()
        reader.feed(SseEvent(f"data: {raw}\n\n".encode(), None, raw))
    assert reader.answer().service_tier == "priority"


@pytest.mark.parametrize(("sent", "fingerprint"), [({}, None), ({"system_fingerprint": "fp_1"}, "fp_1"),
                                                  ({"system_fingerprint": ""}, None), ({"system_fingerprint": 7}, None)])
def test_the_system_fingerprint_of_an_answer_and_of_a_stream(sent: dict[str, Any], fingerprint: str | None) -> None:
    answer = {"id": "c", "model": "gpt-4o", "choices": [], "usage": USAGE, **sent}
    assert ADAPTER.parse_answer(answer).system_fingerprint == fingerprint
    reader = ADAPTER.stream_reader(hide_usage=False)
    for data in [{"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}], **sent},
                 {"id": "c", "choices": [], "usage": USAGE, "system_fingerprint": None}]:
        raw = orjson.dumps(data).decode()
        reader.feed(SseEvent(f"data: {raw}\n\n".encode(), None, raw))
    assert reader.answer().system_fingerprint == fingerprint


@pytest.mark.parametrize(("messages", "unbounded"), [
    (MSG, False),
    ([*MSG, {"role": "assistant", "audio": {"id": "audio_1"}}, {"role": "user", "content": "again"}], True),
    ([*MSG, {"role": "assistant", "audio": None, "content": "said"}], False),
    ([*MSG, {"role": "assistant", "content": "about audio"}], False),  # the word alone names nothing
    ([*MSG, {"role": "assistant", "\\u0061udio": {"id": "audio_1"}}], True),  # spelled with an escape
])
def test_a_spoken_answer_named_by_id_cannot_be_bounded(messages: list[Any], unbounded: bool) -> None:
    """OpenAI puts a stored spoken answer back in the context, billed as input audio the body does not
    carry: under a budget such a request is refused (`Call.unbounded`)."""
    body = body_of(messages=messages)
    raw = orjson.dumps(body).replace(b"\\\\u0061udio", b"\\u0061udio")
    call = ADAPTER.parse_request(orjson.loads(raw), raw, Limits())
    assert bool(call.unbounded) is unbounded
    assert not unbounded or "audio.id" in call.unbounded[0]


def test_custom_tools_are_offered_forced_and_called_by_name() -> None:
    """A custom tool takes free text: it has no parameter schema to hold its calls to (not in `tools`)."""
    custom = {"type": "custom", "custom": {"name": "code_exec", "format": {"type": "text"}}}
    call = parse(body_of(tools=[custom], tool_choice={"type": "custom", "custom": {"name": "code_exec"}}))
    assert (call.tools, call.tool_choice) == ((), "code_exec")
    subset = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [custom]}}
    assert parse(body_of(tools=[custom], tool_choice=subset)).tool_choice is None
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "code_exec", "input": "print(1)"}}]}
    answer = ADAPTER.parse_answer({"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]})
    assert answer.tool_calls == (ToolCall("c1", "code_exec", "print(1)"),)


@pytest.mark.parametrize(("reasons", "expected"), [
    (["stop"], ("stop",)),
    ([None, "stop"], ("error", "stop")),  # a server that left one out: the others keep their places
    (["length", None, "refusal"], ("length", "error", "refusal")),
    ([None], ()),  # none known at all
    ([None, None], ()),
])
def test_finish_reasons_are_one_per_choice_in_choice_order(reasons: list[str | None], expected: tuple[str, ...]) -> None:
    choices = [{"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": r}
               for i, r in enumerate(reasons)]
    assert ADAPTER.parse_answer({"id": "c", "model": "m", "choices": choices}).finish_reasons == expected
