"""Hostile probes of streaming through a running gateway, driven by the official SDKs against a fake
upstream that sends legal but unusual SSE (README "Runs, identity, decisions", "How budgets are held",
"Structured outputs", "Tools and MCP"; DESIGN sections 4 and 6).

What must hold: when nothing had to change, the agent gets the upstream's bytes and its SDK assembles
exactly what the upstream sent; a refused tool call never reaches the agent; grammars are judged on
the whole streamed text; the budget is settled from the stream's usage (nothing left reserved); errors
arrive as a final event in the provider's stream format. Loopback fakes only.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Sequence
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply, anthropic_stream, openai_stream

GPT = "gpt-4o-mini"
CLAUDE = "claude-3-5-haiku-latest"
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
MSG = [{"role": "user", "content": "go"}]
PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
           "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
OA_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("search_kb", "fetch_record", "delete_db")]
AN_TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("search_kb", "fetch_record", "delete_db")]
ALLOW = ["search_kb", "fetch_record"]
UNICODE = "h\u00e9llo w\u00f6rld \u2713 \u4e2d\u6587 \U0001F600\U0001F44D\U0001F3FD e\u0301 \u2028end"


# -- wire builders ------------------------------------------------------------------------------------


def oa_event(choices: list[dict[str, Any]], *, usage: dict[str, Any] | None = None, prefix: bytes = b"",
             model: str = GPT) -> bytes:
    data: dict[str, Any] = {"id": "chatcmpl-probe", "object": "chat.completion.chunk", "created": 1700000000,
                            "model": model, "choices": choices}
    if usage is not None:
        data["usage"] = usage
    return prefix + b"data: " + orjson.dumps(data) + b"\n\n"


def oa_delta(delta: dict[str, Any], finish: str | None = None, index: int = 0, prefix: bytes = b"") -> bytes:
    return oa_event([{"index": index, "delta": delta, "finish_reason": finish}], prefix=prefix)


def oa_usage(prompt: int, completion: int) -> bytes:
    return oa_event([], usage={"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion})


DONE = b"data: [DONE]\n\n"


def tc_delta(index: int, *, call_id: str | None = None, name: str | None = None, args: str | None = None) -> bytes:
    call: dict[str, Any] = {"index": index}
    if call_id is not None:
        call["id"] = call_id
        call["type"] = "function"
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    call["function"] = fn
    return oa_delta({"tool_calls": [call]})


def an_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def an_start(input_tokens: int = 100) -> bytes:
    return an_event("message_start", {"type": "message_start", "message": {
        "id": "msg_probe", "type": "message", "role": "assistant", "model": CLAUDE, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 1}}})


def an_block_start(index: int, block: dict[str, Any]) -> bytes:
    return an_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def an_delta(index: int, delta: dict[str, Any]) -> bytes:
    return an_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def an_block_stop(index: int) -> bytes:
    return an_event("content_block_stop", {"type": "content_block_stop", "index": index})


def an_end(output_tokens: int = 30, reason: str = "end_turn") -> list[bytes]:
    return [an_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
                                       "usage": {"output_tokens": output_tokens}}),
            an_event("message_stop", {"type": "message_stop"})]


def bytewise(chunks: Sequence[bytes]) -> list[bytes]:
    """The stream as one-byte TCP writes (every UTF-8 sequence and every event split)."""
    raw = b"".join(chunks)
    return [raw[i:i + 1] for i in range(len(raw))]


def pieces(chunks: Sequence[bytes], size: int) -> list[bytes]:
    raw = b"".join(chunks)
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def split_text(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


# -- clients ------------------------------------------------------------------------------------------


def oa(h: Harness, run: str, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, **headers})


def an(h: Harness, run: str, **headers: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                    default_headers={"x-tollgate-run-id": run, **headers})


async def raw_post(h: Harness, path: str, body: dict[str, Any], run: str, **headers: str) -> tuple[int, bytes]:
    async with h.session.post(f"{h.url}{path}", json=body, headers={"x-tollgate-run-id": run, **headers}) as resp:
        return resp.status, await resp.read()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": GPT, "messages": MSG, "stream": True, "stream_options": {"include_usage": True}, **extra}


def an_body(**extra: Any) -> dict[str, Any]:
    return {"model": CLAUDE, "messages": MSG, "max_tokens": 256, "stream": True, **extra}


async def read_chat(stream: Any) -> tuple[str, Exception | None]:
    text = ""
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
    except openai.APIError as exc:
        return text, exc
    return text, None


def assert_settled(run: dict[str, Any], prompt: int, completion: int) -> None:
    expected = prompt * 1e-6 + completion * 2e-6
    assert run["reserved_usd"] == 0, run
    assert run["spent_usd"] == pytest.approx(expected, rel=1e-6), (run["spent_usd"], expected, run)
    assert (run["input_tokens"], run["output_tokens"]) == (prompt, completion), run


def assert_oa_error_event(raw: bytes, code: str) -> None:
    """README: errors in the wire format of the API called; in a stream, the final event."""
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    last = events[-1] if events[-1] != b"data: [DONE]" else events[-2]
    assert last.startswith(b"data: "), raw[-400:]
    data = orjson.loads(last[6:])
    assert data["error"]["code"] == code, data


# ============================================================================ OpenAI Chat Completions


async def test_chat_unicode_split_bytewise_with_comments_id_retry_is_byte_identical(
        gateway_factory: GatewayFactory) -> None:
    """README/DESIGN: nothing had to change (the agent asked for usage itself), so the agent gets the
    upstream's bytes. The stream has `:` keep-alives, `id:`/`retry:` fields and multi-byte characters,
    written one byte at a time (every UTF-8 sequence split across TCP writes)."""
    h = await gateway_factory()
    parts = split_text(UNICODE, 3)
    # (comment-only events come before the first `id:`: after one, the SDK's own SSE decoder
    # dispatches every blank line as an event, so a later bare comment would break the SDK itself)
    chunks = [b": keep-alive\n\n", oa_delta({"role": "assistant", "content": ""}, prefix=b"retry: 3000\n"),
              b":\n\n", b": ping\r\n\r\n"]
    chunks += [b"id: %d\n" % i + oa_delta({"content": p}) for i, p in enumerate(parts)]
    chunks += [oa_delta({}, "stop"), oa_usage(11, 7), DONE]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, CHAT, chat_body(), "u8-raw")
    assert status == 200
    assert raw == b"".join(chunks)
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with oa(h, "u8-sdk") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True})
        text, error = await read_chat(stream)
    assert error is None and text == UNICODE


async def test_chat_one_megabyte_event_relayed_and_settled(gateway_factory: GatewayFactory) -> None:
    """A single 1 MB content delta (multi-byte characters) arrives whole in the SDK, and the step is
    settled from the usage chunk (README "How budgets are held")."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 50.0}}})
    big = ("\u00e9\U0001F600abc" * 150_000)[:600_000]
    chunks = [oa_delta({"role": "assistant", "content": ""}), oa_delta({"content": big}), oa_delta({}, "stop"),
              oa_usage(20, 300_000), DONE]
    assert len(chunks[1]) > 1_000_000
    h.fake.queue(Reply(chunks=pieces(chunks, 65_537)))
    async with oa(h, "big") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert error is None and text == big
    assert_settled(await h.run("big"), 20, 300_000)


async def test_chat_separate_usage_chunk_settles_and_is_seen_by_the_sdk(gateway_factory: GatewayFactory) -> None:
    """`stream_options.include_usage` asked by the agent: the SDK's final completion carries the
    upstream's usage, and the run is settled from it with nothing left reserved (README: 'After the
    answer the reservation is settled to the provider's usage')."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    h.fake.queue(Reply(chunks=openai_stream(["a", "b"], usage=(123, 45))))
    async with oa(h, "usage") as c, c.chat.completions.stream(
            model=GPT, messages=MSG, stream_options={"include_usage": True}) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    assert final.usage is not None and (final.usage.prompt_tokens, final.usage.completion_tokens) == (123, 45)
    assert final.choices[0].message.content == "ab"
    assert_settled(await h.run("usage"), 123, 45)


async def test_chat_parallel_tool_calls_interleaved_many_deltas_assembled_exactly(
        gateway_factory: GatewayFactory) -> None:
    """Three allowed parallel calls whose argument deltas interleave by index, each in many pieces
    (some splitting multi-byte characters' escapes): held until judged, then relayed unchanged, so the
    SDK assembles exactly the upstream's calls (README "Tools and MCP")."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW + ["delete_db"]}}})
    args = ['{"q": "caf\u00e9 \U0001F600", "n": 1}', '{"id": "r-\u4e2d"}', '{"all": false}']
    names = ["search_kb", "fetch_record", "delete_db"]
    chunks = [oa_delta({"role": "assistant", "content": None})]
    chunks += [tc_delta(i, call_id=f"call_{i}", name=names[i], args="") for i in range(3)]
    split = [split_text(a, 2) for a in args]
    for step in range(max(len(s) for s in split)):
        for i in (2, 0, 1):
            if step < len(split[i]):
                chunks.append(tc_delta(i, args=split[i][step]))
    chunks += [oa_delta({}, "tool_calls"), oa_usage(10, 30), DONE]
    h.fake.queue(Reply(chunks=chunks))
    status, raw = await raw_post(h, CHAT, chat_body(tools=OA_TOOLS), "par-raw")
    assert status == 200 and raw == b"".join(chunks)
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with oa(h, "par") as c, c.chat.completions.stream(model=GPT, messages=MSG,
                                                           tools=OA_TOOLS) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(t.id, t.function.name, t.function.arguments) for t in calls] == [
        (f"call_{i}", names[i], args[i]) for i in range(3)]


def _late_disallowed_chunks() -> list[bytes]:
    """Text, then an allowed call streaming its arguments, and only late a second call (index 1) of
    `delete_db`, interleaved with the first one's remaining deltas, then a third allowed call."""
    return [
        oa_delta({"role": "assistant", "content": ""}),
        oa_delta({"content": "Working on it \u2014 "}),
        tc_delta(0, call_id="call_a", name="search_kb", args=""),
        tc_delta(0, args='{"q": '),
        tc_delta(0, args='"x'),
        tc_delta(1, call_id="call_b", name="delete_db", args='{"a'),
        tc_delta(0, args='yz"}'),
        tc_delta(1, args='ll": true}'),
        tc_delta(2, call_id="call_c", name="fetch_record", args='{"id": 7}'),
        oa_delta({}, "tool_calls"),
        oa_usage(10, 20),
        DONE,
    ]


async def test_chat_late_disallowed_call_reject_never_reaches_the_sdk(gateway_factory: GatewayFactory) -> None:
    """README: 'tool-call events are held from the first one until the answer is judged ... no byte of
    a refused call reaches the agent'; `reject` stops the run; the stream ends with the error event."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "reject"}}})
    h.fake.queue(Reply(chunks=bytewise(_late_disallowed_chunks())))
    status, raw = await raw_post(h, CHAT, chat_body(tools=OA_TOOLS), "late-rej")
    assert status == 200
    assert b'"tool_calls"' not in raw and b"call_b" not in raw and b'll\\": true' not in raw
    assert "Working on it \u2014 ".encode() in raw
    assert_oa_error_event(raw, "tool_not_allowed")
    run = await h.run("late-rej")
    assert (run["status"], run["stop_reason"], run["reserved_usd"]) == ("stopped", "tool_not_allowed", 0)


async def test_chat_late_disallowed_call_drop_keeps_the_others_whole(gateway_factory: GatewayFactory) -> None:
    """`drop`: the refused call leaves the answer; the allowed ones arrive whole, renumbered so the SDK
    assembles them (README: 'drop removes the call from the answer')."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "drop"}}})
    h.fake.queue(Reply(chunks=_late_disallowed_chunks()))
    async with oa(h, "late-drop") as c, c.chat.completions.stream(model=GPT, messages=MSG,
                                                                 tools=OA_TOOLS) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Working on it \u2014 "
    assert [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("call_a", "search_kb", '{"q": "xyz"}'), ("call_c", "fetch_record", '{"id": 7}')]
    assert (await h.run("late-drop"))["status"] == "active"


async def test_chat_disallowed_call_on_second_choice_is_held(gateway_factory: GatewayFactory) -> None:
    """`n: 2`: a refused call proposed only in choice 1 must not reach the agent either (README:
    'Every choice is held to the constraints (OpenAI's n)'; tool calls are held until judged)."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "reject"}}})
    chunks = [
        oa_event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                  {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
        oa_event([{"index": 0, "delta": {"content": "fine"}, "finish_reason": None}]),
        oa_event([{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "call_z", "type": "function",
                                                          "function": {"name": "delete_db", "arguments": "{}"}}]},
                   "finish_reason": None}]),
        oa_event([{"index": 0, "delta": {}, "finish_reason": "stop"},
                  {"index": 1, "delta": {}, "finish_reason": "tool_calls"}]),
        oa_usage(10, 10), DONE]
    h.fake.queue(Reply(chunks=chunks))
    status, raw = await raw_post(h, CHAT, chat_body(tools=OA_TOOLS, n=2), "n2-tool")
    assert status in (200, 403)
    assert b'"tool_calls"' not in raw and b"call_z" not in raw
    assert (await h.run("n2-tool"))["stop_reason"] == "tool_not_allowed"


async def test_chat_refusal_deltas_assembled_by_the_sdk(gateway_factory: GatewayFactory) -> None:
    """A refusal streamed in `delta.refusal` pieces (no grammar): relayed unchanged, the SDK's final
    message carries the whole refusal, and the run is settled from the usage."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    refusal = "I can\u2019t help with that \U0001F6AB."
    chunks = [oa_delta({"role": "assistant", "content": None, "refusal": ""})]
    chunks += [oa_delta({"refusal": p}) for p in split_text(refusal, 4)]
    chunks += [oa_delta({}, "stop"), oa_usage(9, 8), DONE]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with oa(h, "refusal") as c, c.chat.completions.stream(
            model=GPT, messages=MSG, stream_options={"include_usage": True}) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    assert final.choices[0].message.refusal == refusal
    assert_settled(await h.run("refusal"), 9, 8)


async def test_chat_finish_length_truncated_json_header_grammar_is_an_sdk_error(
        gateway_factory: GatewayFactory) -> None:
    """`x-tollgate-grammar` JSON Schema, streamed 1 byte per write with a multi-byte string, cut by
    `finish_reason: length`: every chunk was a valid prefix, the whole text is not; the SDK must see
    `output_nonconforming` (README: 'the stream's end waits for the final verdict, so an SDK sees the
    error')."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    schema = {"type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]}
    chunks = [oa_delta({"role": "assistant", "content": ""})]
    chunks += [oa_delta({"content": p}) for p in split_text('{"t": "caf\u00e9 \U0001F600 and more', 3)]
    chunks += [oa_delta({}, "length"), oa_usage(10, 16), DONE]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with oa(h, "len", **{"x-tollgate-grammar": "json_schema:" + orjson.dumps(schema).decode()}) as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert error is not None, f"the SDK took {text!r} as a complete answer"
    assert isinstance(error, openai.APIError) and error.code == "output_nonconforming"


async def test_chat_valid_json_grammar_over_one_byte_chunks_passes_unchanged(gateway_factory: GatewayFactory) -> None:
    """The same grammar via the agent's `output.grammar`, a valid JSON answer with escapes, emoji and
    a surrogate-pair escape, one byte per TCP write: judged on the whole text, it passes and the agent
    gets the upstream's bytes."""
    schema = {"type": "object", "properties": {"t": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["t", "n"]}
    h = await gateway_factory(agents={"default": {"output": {
        "grammar": "json_schema:" + orjson.dumps(schema).decode(), "retries": 0, "stream_check": "incremental"}}})
    answer = '{"t": "caf\u00e9 \\ud83d\\ude00 \U0001F44D \\"q\\" \\/", "n": 42}'
    chunks = [oa_delta({"role": "assistant", "content": ""})]
    chunks += [oa_delta({"content": p}) for p in split_text(answer, 2)]
    chunks += [oa_delta({}, "stop"), oa_usage(10, 16), DONE]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, CHAT, chat_body(), "json-ok")
    assert status == 200
    assert b"output_nonconforming" not in raw, raw[-300:]
    # the native response_format tollgate adds changes the request, never the answer's bytes
    assert raw == b"".join(chunks)


async def test_chat_lone_surrogate_escapes_end_the_stream_as_malformed(gateway_factory: GatewayFactory) -> None:
    """An emoji split across two SSE events as escaped halves of a UTF-16 surrogate pair (`"\\ud83d"`
    then `"\\ude00"`): RFC 8259 section 8.2 leaves such strings' meaning unpredictable, no provider's
    serializer writes them, and tollgate's parser (orjson) refuses them. Deliberately strict: the stream
    ends with a clear `upstream_unavailable` error event in the wire format, after what was relayed,
    and the step is charged its reservation, not left open."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = [oa_delta({"role": "assistant", "content": ""}),
              b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",'
              b'"choices":[{"index":0,"delta":{"content":"smile \\ud83d"},"finish_reason":null}]}\n\n',
              b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini",'
              b'"choices":[{"index":0,"delta":{"content":"\\ude00!"},"finish_reason":null}]}\n\n',
              oa_delta({}, "stop"), oa_usage(3, 3), DONE]
    h.fake.queue(Reply(chunks=chunks))
    status, raw = await raw_post(h, CHAT, chat_body(), "surrogate")
    assert status == 200 and raw.startswith(chunks[0]), raw[:200]
    assert raw.rstrip().endswith(b'"code":"upstream_unavailable"}}'), raw[-300:]
    run = await h.run("surrogate")
    assert run["reserved_usd"] == 0 and run["spent_usd"] > 0, run


async def test_chat_done_twice_is_harmless(gateway_factory: GatewayFactory) -> None:
    """An upstream that sends `[DONE]` twice: the SDK reads one normal answer, the run is settled
    from the usage and not stopped."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = openai_stream(["tw", "ice"], usage=(5, 2)) + [DONE]
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h, "done2") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert (text, error) == ("twice", None)
    run = await h.run("done2")
    assert run["status"] == "active"
    assert_settled(run, 5, 2)


async def test_chat_text_after_done_does_not_fail_a_valid_answer(gateway_factory: GatewayFactory) -> None:
    """`data: [DONE]` ends an OpenAI stream (the SDKs stop reading there). A valid answer followed by
    stray data after `[DONE]` must reach the agent as the valid answer it is: the grammar is judged on
    the streamed answer, not on bytes past its terminator."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+", "retries": 0}}})
    chunks = openai_stream(["12", "34"], usage=(5, 2)) + [oa_delta({"content": "trailing junk"}), DONE]
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h, "after-done") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert error is None, f"valid answer {text!r} failed: {error}"
    assert text == "1234"


async def test_chat_call_after_done_is_never_a_silent_stop(gateway_factory: GatewayFactory) -> None:
    """DESIGN section 4: 'A stop is never silent'. An upstream that puts a refused call after `[DONE]`:
    either it is ignored (the agent never saw it: the run goes on), or the stop reaches the SDK. A run
    stopped while its agent read a normal, complete answer breaks the contract."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "reject"}}})
    chunks = openai_stream(["all good"], usage=(5, 2)) + [
        tc_delta(0, call_id="call_late", name="delete_db", args="{}"), oa_delta({}, "tool_calls"), DONE]
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h, "call-after-done") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, tools=OA_TOOLS,  # type: ignore[arg-type]
                                                 stream=True)
        text, error = await read_chat(stream)
    run = await h.run("call-after-done")
    assert run["status"] == "active" or error is not None, (
        f"run stopped ({run['stop_reason']}) while the SDK read {text!r} with no error")


async def test_chat_no_done_after_finish_and_usage_is_complete_and_settled(gateway_factory: GatewayFactory) -> None:
    """A stream that ends (cleanly) after `finish_reason` and the usage chunk but without `[DONE]`:
    the answer was complete, so the SDK reads it without error and the step is settled from its usage."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    h.fake.queue(Reply(chunks=openai_stream(["no ", "done"], usage=(7, 3), done=False)))
    async with oa(h, "nodone") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert (text, error) == ("no done", None)
    assert_settled(await h.run("nodone"), 7, 3)


async def test_chat_upstream_error_chunk_mid_stream_reaches_the_sdk_and_is_charged(
        gateway_factory: GatewayFactory) -> None:
    """OpenAI reports a failure mid-stream as `data: {"error": {...}}`. The SDK must raise, and the
    call is charged (README: a stream that broke is settled at the full reservation, never at $0);
    nothing stays reserved."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    err = b'data: {"error": {"message": "The server had an error", "type": "server_error", "param": null, "code": null}}\n\n'
    chunks = [oa_delta({"role": "assistant", "content": ""}), oa_delta({"content": "par"}), err]
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h, "uperr") as c:
        stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
        text, error = await read_chat(stream)
    assert error is not None and text == "par"
    run = await h.run("uperr")
    assert run["reserved_usd"] == 0 and run["spent_usd"] > 0, run


async def test_chat_gzip_encoded_sse_split_mid_member(gateway_factory: GatewayFactory) -> None:
    """An upstream that gzips its SSE (`Content-Encoding: gzip`), written in small pieces: the agent
    gets the decoded events, unchanged, without the encoding header."""
    h = await gateway_factory()
    chunks = openai_stream(split_text(UNICODE, 2), usage=(4, 4))
    packed = gzip.compress(b"".join(chunks))
    h.fake.queue(Reply(chunks=[packed[i:i + 7] for i in range(0, len(packed), 7)],
                       headers={"Content-Encoding": "gzip"}))
    async with h.session.post(f"{h.url}{CHAT}", json=chat_body(), auto_decompress=False,
                              headers={"x-tollgate-run-id": "gz"}) as resp:
        raw = await resp.read()
        encoding = resp.headers.get("Content-Encoding")
    assert encoding in (None, "identity")
    assert raw == b"".join(chunks)


# ============================================================================ Anthropic Messages


def _anthropic_rich() -> tuple[list[bytes], dict[str, Any]]:
    thinking = "Let me think\u2026 \U0001F914 about \u4e2d\u6587"
    signature = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"
    citation = {"type": "char_location", "cited_text": "h\u00e9llo", "document_index": 0,
                "document_title": "Doc \u2713", "start_char_index": 0, "end_char_index": 5}
    chunks = [an_start(100), an_event("ping", {"type": "ping"}), b": keep-alive\n\n",
              an_block_start(0, {"type": "thinking", "thinking": "", "signature": ""})]
    chunks += [an_delta(0, {"type": "thinking_delta", "thinking": p}) for p in split_text(thinking, 5)]
    chunks += [an_delta(0, {"type": "signature_delta", "signature": signature}), an_block_stop(0),
               b"id: 17\nretry: 100\n" + an_block_start(1, {"type": "text", "text": ""}),
               an_event("ping", {"type": "ping"})]
    chunks += [an_delta(1, {"type": "text_delta", "text": p}) for p in split_text(UNICODE, 3)]
    chunks += [an_delta(1, {"type": "citations_delta", "citation": citation}), an_block_stop(1), *an_end(30)]
    return chunks, {"thinking": thinking, "signature": signature, "citation": citation}


async def test_anthropic_ping_thinking_signature_citations_bytewise_identical(gateway_factory: GatewayFactory) -> None:
    """`event: ping`, comments, `id:`/`retry:`, a thinking block with `thinking_delta` and
    `signature_delta`, a text block with `citations_delta` and multi-byte text, one byte per write:
    relayed byte for byte; the SDK's final message is what the upstream sent; usage settles the run."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks, want = _anthropic_rich()
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, MESSAGES, an_body(), "an-raw")
    assert status == 200 and raw == b"".join(chunks)
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with an(h, "an-rich") as ac, ac.messages.stream(model=CLAUDE, max_tokens=256,
                                                         messages=MSG) as stream:  # type: ignore[arg-type]
        texts = [t async for t in stream.text_stream]
        msg = await stream.get_final_message()
    assert "".join(texts) == UNICODE
    assert msg.content[0].type == "thinking"
    assert (msg.content[0].thinking, msg.content[0].signature) == (want["thinking"], want["signature"])
    assert msg.content[1].type == "text" and msg.content[1].text == UNICODE
    got = [c.model_dump() for c in msg.content[1].citations or []]
    assert [{k: c[k] for k in want["citation"]} for c in got] == [want["citation"]]
    assert msg.usage.output_tokens == 30
    assert_settled(await h.run("an-rich"), 100, 30)


async def test_anthropic_input_json_delta_in_many_pieces_assembled(gateway_factory: GatewayFactory) -> None:
    """An allowed tool_use whose input arrives in many `input_json_delta` pieces (with multi-byte
    characters), after thinking and text blocks: held until judged, then the SDK's final message has
    the exact input."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW}}})
    tool_input = {"q": "caf\u00e9 \U0001F600", "filters": {"lang": ["\u4e2d", "en"], "n": 3}}
    partial = orjson.dumps(tool_input).decode()
    chunks = [an_start(), an_block_start(0, {"type": "text", "text": ""}),
              an_delta(0, {"type": "text_delta", "text": "Searching \u2026"}), an_block_stop(0),
              an_block_start(1, {"type": "tool_use", "id": "toolu_1", "name": "search_kb", "input": {}})]
    chunks += [an_delta(1, {"type": "input_json_delta", "partial_json": p}) for p in ["", *split_text(partial, 3)]]
    chunks += [an_block_stop(1), an_event("ping", {"type": "ping"}), *an_end(12, "tool_use")]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with an(h, "an-json") as ac, ac.messages.stream(model=CLAUDE, max_tokens=256, messages=MSG,
                                                         tools=AN_TOOLS) as stream:  # type: ignore[arg-type]
        msg = await stream.get_final_message()
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.id, u.name, u.input) for u in uses] == [("toolu_1", "search_kb", tool_input)]
    assert msg.stop_reason == "tool_use"


async def test_anthropic_late_disallowed_block_dropped_later_blocks_intact(gateway_factory: GatewayFactory) -> None:
    """`drop`: a refused tool_use between two allowed ones is removed whole; the later block keeps its
    input and the SDK sees contiguous indices (README: 'drop removes the call from the answer')."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "drop"}}})
    chunks = [an_start(), an_block_start(0, {"type": "text", "text": ""}),
              an_delta(0, {"type": "text_delta", "text": "ok \U0001F44D"}), an_block_stop(0),
              an_block_start(1, {"type": "tool_use", "id": "t1", "name": "search_kb", "input": {}}),
              an_delta(1, {"type": "input_json_delta", "partial_json": '{"q":'}),
              an_delta(1, {"type": "input_json_delta", "partial_json": ' "a"}'}), an_block_stop(1),
              an_block_start(2, {"type": "tool_use", "id": "t2", "name": "delete_db", "input": {}}),
              an_delta(2, {"type": "input_json_delta", "partial_json": '{"all": true}'}), an_block_stop(2),
              an_block_start(3, {"type": "tool_use", "id": "t3", "name": "fetch_record", "input": {}}),
              an_delta(3, {"type": "input_json_delta", "partial_json": '{"id":'}),
              an_delta(3, {"type": "input_json_delta", "partial_json": " 9}"}), an_block_stop(3),
              *an_end(20, "tool_use")]
    h.fake.queue(Reply(chunks=chunks))
    async with an(h, "an-drop") as ac, ac.messages.stream(model=CLAUDE, max_tokens=256, messages=MSG,
                                                         tools=AN_TOOLS) as stream:  # type: ignore[arg-type]
        msg = await stream.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content] == [
        ("text", None, None), ("tool_use", "search_kb", {"q": "a"}), ("tool_use", "fetch_record", {"id": 9})]


async def test_anthropic_reject_after_text_ends_with_error_event(gateway_factory: GatewayFactory) -> None:
    """`reject` after streamed text: the stream ends with an `event: error` in Anthropic's format whose
    code is `tool_not_allowed`; the SDK raises it; no byte of the call is relayed; the run stops."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "reject"}}})
    chunks = anthropic_stream(["I will ", "wipe it"], tool_uses=[{"id": "tz", "name": "delete_db", "input": {"x": 1}}])
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, MESSAGES, an_body(tools=AN_TOOLS), "an-rej")
    assert status == 200 and b'"tool_use"' not in raw and b'"tz"' not in raw
    last = [e for e in raw.split(b"\n\n") if e.strip()][-1]
    assert last.startswith(b"event: error\n"), last
    assert orjson.loads(last.split(b"data: ", 1)[1])["error"]["code"] == "tool_not_allowed"
    run = await h.run("an-rej")
    assert (run["stop_reason"], run["reserved_usd"]) == ("tool_not_allowed", 0)


async def test_anthropic_regex_grammar_bytewise_multibyte(gateway_factory: GatewayFactory) -> None:
    """A regex grammar over multi-byte text streamed one byte per write: the valid answer reaches the
    SDK unchanged; the same text with one wrong character at the end is an SDK error."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[\u00e9\u4e2d\U0001F600 ]+ok",
                                                             "retries": 0}}})
    good = ["\u00e9\u4e2d", " \U0001F600", "\U0001F600 o", "k"]
    h.fake.queue(Reply(chunks=bytewise(anthropic_stream(good))),
                 Reply(chunks=bytewise(anthropic_stream([*good, "!"]))))
    async with an(h, "an-re") as ac:
        async with ac.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as stream:  # type: ignore[arg-type]
            text = "".join([t async for t in stream.text_stream])
        assert text == "".join(good)
        with pytest.raises(anthropic.APIError):
            async with ac.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as stream2:  # type: ignore[arg-type]
                async for _ in stream2.text_stream:
                    pass


async def test_anthropic_upstream_error_event_is_relayed_and_charged(gateway_factory: GatewayFactory) -> None:
    """Anthropic's mid-stream `event: error` (overloaded): the SDK raises the upstream's error, the
    call is charged (a broken stream is settled at its reservation), nothing stays reserved."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = anthropic_stream(["partial"], complete=False)[:3] + [an_event("error", {
        "type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})]
    h.fake.queue(Reply(chunks=chunks))
    async with an(h, "an-up") as ac:
        with pytest.raises(anthropic.APIStatusError) as info:
            async with ac.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as stream:  # type: ignore[arg-type]
                async for _ in stream.text_stream:
                    pass
    assert "overloaded" in str(info.value).lower()
    run = await h.run("an-up")
    assert run["reserved_usd"] == 0 and run["spent_usd"] > 0, run


async def test_anthropic_usage_with_message_delta_input_tokens(gateway_factory: GatewayFactory) -> None:
    """Current Anthropic streams repeat the (final) input counts in `message_delta.usage`; the run is
    settled from the final usage: input 100 + output 30."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = [an_start(100), an_block_start(0, {"type": "text", "text": ""}),
              an_delta(0, {"type": "text_delta", "text": "hi"}), an_block_stop(0),
              an_event("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                         "usage": {"input_tokens": 100, "cache_creation_input_tokens": None,
                                                   "cache_read_input_tokens": None, "output_tokens": 30,
                                                   "server_tool_use": None}}),
              an_event("message_stop", {"type": "message_stop"})]
    h.fake.queue(Reply(chunks=chunks))
    async with an(h, "an-usage") as ac, ac.messages.stream(model=CLAUDE, max_tokens=64,
                                                          messages=MSG) as stream:  # type: ignore[arg-type]
        msg = await stream.get_final_message()
    assert msg.usage.output_tokens == 30
    assert_settled(await h.run("an-usage"), 100, 30)


# ============================================================================ OpenAI Responses


async def test_responses_unicode_bytewise_with_keepalives(gateway_factory: GatewayFactory) -> None:
    """The Responses stream one byte per write with comment keep-alives: the final event is held and
    judged, then relayed; the agent's bytes are the upstream's and the SDK's `output_text` is exact;
    the run is settled from the final event's usage."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    events = response_stream(split_text(UNICODE, 3), usage=(40, 12))
    chunks = [events[0], b": keep-alive\n\n", *events[1:4], b": ping\n\n", *events[4:]]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, RESPONSES, {"model": GPT, "input": "hi", "stream": True}, "r-raw")
    assert status == 200 and raw == b"".join(chunks)
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    async with oa(h, "r-sdk") as c, c.responses.stream(model=GPT, input="hi") as stream:
        final = await stream.get_final_response()
    assert final.output_text == UNICODE
    assert_settled(await h.run("r-sdk"), 40, 12)


def _responses_interleaved(drop_name: str) -> list[bytes]:
    """Text, then two function calls whose argument deltas interleave by output_index."""
    events: list[bytes] = []

    def ev(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **fields}
        events.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    msg = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "On it \u2713", "annotations": []}]}
    calls = [{"id": "fc_a", "type": "function_call", "status": "completed", "name": "search_kb",
              "arguments": '{"q": "\u00e9\U0001F600"}', "call_id": "call_a"},
             {"id": "fc_b", "type": "function_call", "status": "completed", "name": drop_name,
              "arguments": '{"all": true}', "call_id": "call_b"},
             {"id": "fc_c", "type": "function_call", "status": "completed", "name": "fetch_record",
              "arguments": '{"id": 3}', "call_id": "call_c"}]
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    final = {"id": "resp_p", "object": "response", "created_at": 1, "status": "completed", "model": GPT,
             "output": [msg, *calls], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
             "usage": usage}
    ev("response.created", response={**final, "status": "in_progress", "output": [], "usage": None})
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    ev("response.output_item.added", output_index=0, item={**msg, "status": "in_progress", "content": []})
    ev("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    ev("response.output_text.delta", **where, delta="On it ", logprobs=[])
    ev("response.output_text.delta", **where, delta="\u2713", logprobs=[])
    ev("response.output_text.done", **where, text="On it \u2713", logprobs=[])
    ev("response.content_part.done", **where, part=msg["content"][0])
    ev("response.output_item.done", output_index=0, item=msg)
    for i, call in enumerate(calls, start=1):
        ev("response.output_item.added", output_index=i, item={**call, "status": "in_progress", "arguments": ""})
    parts = [split_text(str(c["arguments"]), 3) for c in calls]
    for step in range(max(len(p) for p in parts)):
        for i in (2, 1, 3):
            if step < len(parts[i - 1]):
                ev("response.function_call_arguments.delta", item_id=calls[i - 1]["id"], output_index=i,
                   delta=parts[i - 1][step])
    for i, call in enumerate(calls, start=1):
        ev("response.function_call_arguments.done", item_id=call["id"], output_index=i,
           arguments=call["arguments"])
        ev("response.output_item.done", output_index=i, item=call)
    ev("response.completed", response=final)
    return events


async def test_responses_interleaved_calls_drop_keeps_allowed_whole(gateway_factory: GatewayFactory) -> None:
    """Responses API, `drop`: of three calls whose argument deltas interleave, the refused middle one
    is removed; the SDK's final response has the text and the two allowed calls, arguments intact."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW, "on_violation": "drop"}}})
    h.fake.queue(Reply(chunks=bytewise(_responses_interleaved("delete_db"))))
    tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("search_kb", "fetch_record")]
    async with oa(h, "r-drop") as c, c.responses.stream(model=GPT, input="hi", tools=tools) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_response()
    assert final.output_text == "On it \u2713"
    calls = [(i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [("search_kb", '{"q": "\u00e9\U0001F600"}'), ("fetch_record", '{"id": 3}')]


async def test_responses_interleaved_allowed_calls_byte_identical(gateway_factory: GatewayFactory) -> None:
    """All three calls allowed: held until judged, then relayed as the upstream sent them."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW + ["delete_db"]}}})
    events = _responses_interleaved("delete_db")
    h.fake.queue(Reply(chunks=pieces(events, 5)))
    status, raw = await raw_post(h, RESPONSES, {"model": GPT, "input": "hi", "stream": True}, "r-all")
    assert status == 200 and raw == b"".join(events)


# ============================================================================ close-delimited upstream


async def _close_delimited_upstream(payload: bytes) -> tuple[asyncio.Server, str]:
    """A bare HTTP/1.1 upstream whose SSE body has no length and no chunked framing: it ends when the
    connection closes (RFC 9112 section 6.3, legal for a response)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for i in range(0, len(payload), 11):
            writer.write(payload[i:i + 11])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_close_delimited_sse_body_is_relayed_and_settled(gateway_factory: GatewayFactory) -> None:
    """An upstream that frames its stream by closing the connection: the agent gets every event, the
    SDK reads the whole answer, and the step is settled from the usage chunk."""
    chunks = openai_stream(split_text(UNICODE, 4), usage=(6, 9))
    server, url = await _close_delimited_upstream(b"".join(chunks))
    try:
        h = await gateway_factory(providers={"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "k"}},
                                  models={"gpt-*": "openai"}, pricing=PRICING,
                                  agents={"default": {"budget": {"usd": 5.0}}})
        async with oa(h, "close") as c:
            stream = await c.chat.completions.create(model=GPT, messages=MSG, stream=True)  # type: ignore[arg-type]
            text, error = await read_chat(stream)
        assert (text, error) == (UNICODE, None)
        assert_settled(await h.run("close"), 6, 9)
    finally:
        server.close()
        await server.wait_closed()


# ============================================================================ more probes


async def test_chat_n2_stream_cut_cleanly_before_second_choice_finished_is_an_error(
        gateway_factory: GatewayFactory) -> None:
    """`n: 2`: choice 0 finished, choice 1 still mid-sentence, then the upstream ends its body (no
    `finish_reason` for choice 1, no `[DONE]`). The answer is incomplete: the stream must end with the
    `upstream_unavailable` error event (README/test_streaming: truncated upstream streams end with an
    error event) and be charged at the reservation, not pass as a complete answer."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}}})
    chunks = [
        oa_event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                  {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
        oa_event([{"index": 0, "delta": {"content": "done."}, "finish_reason": None},
                  {"index": 1, "delta": {"content": "The second answer is"}, "finish_reason": None}]),
        oa_event([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        oa_event([{"index": 1, "delta": {"content": " still"}, "finish_reason": None}]),
    ]
    h.fake.queue(Reply(chunks=chunks))
    status, raw = await raw_post(h, CHAT, chat_body(n=2), "n2-cut")
    assert status == 200
    assert b"upstream_unavailable" in raw, f"a truncated choice passed as complete: {raw[-200:]!r}"
    assert_oa_error_event(raw, "upstream_unavailable")


def _final_only_text_stream(text: str) -> list[bytes]:
    """A Responses stream whose message text is never streamed as deltas: the item is added empty and
    its text arrives in `response.output_item.done` and in the final `response.completed`."""
    events: list[bytes] = []

    def ev(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **fields}
        events.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    item = {"id": "msg_f", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    final = {"id": "resp_f", "object": "response", "created_at": 1, "status": "completed", "model": GPT,
             "output": [item], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage}
    ev("response.created", response={**final, "status": "in_progress", "output": [], "usage": None})
    ev("response.output_item.added", output_index=0, item={**item, "status": "in_progress", "content": []})
    ev("response.output_item.done", output_index=0, item=item)
    ev("response.completed", response=final)
    return events


async def test_responses_text_only_in_final_event_is_held_to_the_grammar(gateway_factory: GatewayFactory) -> None:
    """README: 'A stream's final event is held and judged'; 'every answer is validated'. A text that
    comes only in the final response (no `output_text.delta`) and breaks the grammar must not reach
    the agent as a completed response."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]*", "retries": 0}}})
    h.fake.queue(Reply(chunks=_final_only_text_stream("rm -rf /")))
    got: str | None = None
    error: Exception | None = None
    try:
        async with oa(h, "r-final-bad") as c, c.responses.stream(model=GPT, input="n?") as stream:
            got = (await stream.get_final_response()).output_text
    except openai.APIError as exc:
        error = exc
    assert error is not None, f"nonconforming final text reached the agent: {got!r}"


async def test_responses_valid_text_only_in_final_event_is_not_refused(gateway_factory: GatewayFactory) -> None:
    """The mirror case: a conforming text that comes only in the final response is a valid answer
    (the same answer unstreamed passes); the stream must not end with `output_nonconforming`."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    h = await gateway_factory(agents={"default": {"output": {
        "grammar": "json_schema:" + orjson.dumps(schema).decode(), "retries": 0}}})
    h.fake.queue(Reply(body=response_body('{"n": 3}')), Reply(chunks=_final_only_text_stream('{"n": 3}')))
    async with oa(h, "r-final-ok") as c:
        unstreamed = await c.responses.create(model=GPT, input="n?")
        assert unstreamed.output_text == '{"n": 3}'  # the control: the same answer, not streamed, passes
        try:
            async with c.responses.stream(model=GPT, input="n?") as stream:
                final = await stream.get_final_response()
        except openai.APIError as exc:
            raise AssertionError(f"a valid final-only answer was refused: {exc}") from None
    assert final.output_text == '{"n": 3}'


async def test_chat_interleaved_calls_second_breaks_its_schema_no_call_reaches_the_sdk(
        gateway_factory: GatewayFactory) -> None:
    """README: 'a streamed tool call is held until the answer is complete, and one whose arguments
    break its schema never reaches the agent (the stream ends with output_nonconforming)'. Two
    interleaved calls, the second's arguments (in many deltas) break its schema."""
    tools = [{"type": "function", "function": {"name": "search_kb", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
             {"type": "function", "function": {"name": "fetch_record", "parameters": {
                 "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}]
    h = await gateway_factory(agents={"default": {"tools": {"allow": ALLOW}}})
    chunks = [oa_delta({"role": "assistant", "content": None}),
              tc_delta(0, call_id="call_q", name="search_kb", args=""),
              tc_delta(1, call_id="call_r", name="fetch_record", args=""),
              tc_delta(0, args='{"q"'), tc_delta(1, args='{"id"'), tc_delta(0, args=': "x"}'),
              tc_delta(1, args=': "seven"}'), oa_delta({}, "tool_calls"), oa_usage(5, 5), DONE]
    h.fake.queue(Reply(chunks=bytewise(chunks)))
    status, raw = await raw_post(h, CHAT, chat_body(tools=tools), "args")
    assert status == 200
    assert b'"tool_calls"' not in raw and b"call_q" not in raw
    assert_oa_error_event(raw, "output_nonconforming")
    assert (await h.run("args"))["reserved_usd"] == 0


async def test_chat_streamed_parallel_calls_over_the_cap_never_reach_the_agent(
        gateway_factory: GatewayFactory) -> None:
    """README: streamed tool calls are 'held from the first one until the answer is judged (allow-list,
    caps, loop detection)'. Three parallel calls against `caps.tool_calls: 2`: the run stops with
    `tool_call_cap` and no call byte reaches the agent."""
    h = await gateway_factory(agents={"default": {"caps": {"tool_calls": 2}}})
    chunks = [oa_delta({"role": "assistant", "content": ""}), oa_delta({"content": "Three at once"})]
    chunks += [tc_delta(i, call_id=f"call_{i}", name="search_kb", args=f'{{"q": {i}}}') for i in range(3)]
    chunks += [oa_delta({}, "tool_calls"), oa_usage(5, 5), DONE]
    h.fake.queue(Reply(chunks=chunks))
    status, raw = await raw_post(h, CHAT, chat_body(tools=OA_TOOLS), "cap")
    assert status == 200
    assert b"Three at once" in raw
    assert b'"tool_calls"' not in raw and b"call_0" not in raw
    assert_oa_error_event(raw, "tool_call_cap")
    assert (await h.run("cap"))["stop_reason"] == "tool_call_cap"


async def test_anthropic_on_stop_message_after_thinking_and_text_is_a_final_text_block(
        gateway_factory: GatewayFactory) -> None:
    """DESIGN: '`on_stop: message` while streaming: one final assistant chunk saying why, then the
    stream's end'. After a thinking block and a text block were relayed, a refused tool_use: the SDK
    reads a complete message whose last block is a text block saying why, with no tool_use."""
    h = await gateway_factory(agents={"default": {"on_stop": "message",
                                                  "tools": {"allow": ALLOW, "on_violation": "reject"}}})
    chunks = [an_start(), an_block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
              an_delta(0, {"type": "thinking_delta", "thinking": "hmm"}),
              an_delta(0, {"type": "signature_delta", "signature": "sig"}), an_block_stop(0),
              an_block_start(1, {"type": "text", "text": ""}),
              an_delta(1, {"type": "text_delta", "text": "Deleting \u2026"}), an_block_stop(1),
              an_block_start(2, {"type": "tool_use", "id": "tx", "name": "delete_db", "input": {}}),
              an_delta(2, {"type": "input_json_delta", "partial_json": "{}"}), an_block_stop(2),
              *an_end(9, "tool_use")]
    h.fake.queue(Reply(chunks=chunks))
    async with an(h, "an-msg") as ac, ac.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG,
                                                        tools=AN_TOOLS) as stream:  # type: ignore[arg-type]
        msg = await stream.get_final_message()
    assert [b.type for b in msg.content] == ["thinking", "text", "text"]
    assert msg.content[1].text == "Deleting \u2026"  # type: ignore[union-attr]
    assert "tool_not_allowed" in msg.content[2].text  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"


async def test_anthropic_text_carried_in_content_block_start_is_held_to_the_grammar(
        gateway_factory: GatewayFactory) -> None:
    """A text block whose text comes in `content_block_start` itself (the event carries a whole
    TextBlock, and the SDK keeps its text) with no `text_delta`: that text is part of the answer the
    agent reads, so it must be judged by the grammar (README: 'every answer is validated')."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]*", "retries": 0}}})
    chunks = [an_start(), an_block_start(0, {"type": "text", "text": "rm -rf /"}), an_block_stop(0), *an_end(4)]
    h.fake.queue(Reply(chunks=chunks))
    got: str | None = None
    error: Exception | None = None
    try:
        async with an(h, "an-start-text") as ac, ac.messages.stream(model=CLAUDE, max_tokens=64,
                                                                   messages=MSG) as stream:  # type: ignore[arg-type]
            msg = await stream.get_final_message()
            got = "".join(b.text for b in msg.content if b.type == "text")
    except anthropic.APIError as exc:
        error = exc
    assert error is not None, f"nonconforming text reached the agent: {got!r}"


async def test_chat_on_stop_message_after_text_reads_as_one_final_answer(gateway_factory: GatewayFactory) -> None:
    """DESIGN: '`on_stop: message` while streaming: one final assistant chunk saying why, then the
    stream's end'. After streamed text, a refused call (reject): the SDK's stream helper assembles the
    text plus the stop message, `finish_reason: stop`, and no tool call."""
    h = await gateway_factory(agents={"default": {"on_stop": "message",
                                                  "tools": {"allow": ALLOW, "on_violation": "reject"}}})
    h.fake.queue(Reply(chunks=_late_disallowed_chunks()))
    async with oa(h, "oa-msg") as c, c.chat.completions.stream(model=GPT, messages=MSG,
                                                              tools=OA_TOOLS) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert (choice.message.content or "").startswith("Working on it \u2014 ")
    assert "tool_not_allowed" in (choice.message.content or "")
