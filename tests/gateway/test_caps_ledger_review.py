"""Review of a98858f / 618a7bb / 2332ac8 (`limits.max_answer_bytes`, pieces of compressed streams, a stop's
ledger row before its answer): each test shows one defect and fails on the reviewed code."""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from gateway.http1 import HIGH_WATER, Http1Pool
from gateway.ledger import Ledger
from tests.fakes.upstream import Reply, openai_stream
from tests.gateway.test_answer_cap import (  # noqa: F401 - fixtures `env` uses
    BIG,
    CAP,
    endless,
    env,
)
from tests.gateway.test_faults import (  # noqa: F401 - a fixture `env` uses
    CHAT,
    MESSAGES,
    USER,
    Env,
    assert_released,
    body_for,
    call,
    frozen_heap,
)
from tests.gateway.test_http1 import FAST, Handler, Server
from tests.gateway.test_ledger import entry

REPO = Path(__file__).resolve().parents[2]


# -- 618a7bb: compressed streams decoded a piece at a time ------------------------------------------------


def gzip_chunked(body: bytes) -> Handler:
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n"
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        await writer.drain()

    return handle


@pytest.fixture
async def pool_for() -> AsyncIterator[Any]:
    made: list[tuple[Http1Pool, Server]] = []

    async def make(handler: Handler) -> tuple[Http1Pool, str]:
        pool = Http1Pool(asyncio.get_running_loop())
        server = Server(handler)
        url = await server.start()
        made.append((pool, server))
        return pool, url

    yield make
    for pool, server in made:
        await pool.close()
        await server.close()


async def test_a_gzip_member_ending_on_a_piece_boundary_does_not_repeat_the_next_member(pool_for: Any) -> None:
    """A gzip member whose output ends exactly at a `HIGH_WATER` piece boundary, after a cut piece:
    CPython's decompressobj then keeps the bytes after the member both in `unused_data` and in
    `unconsumed_tail`; `Decoder.pending` sees the tail, `decode(b"")` feeds it to the finished member
    again, and the next member is decoded twice (silently here; a partial next member breaks the stream)."""
    first = b"data: " + b"x" * (2 * HIGH_WATER - 8) + b"\n\n"  # exactly two pieces
    second = b"data: [DONE]\n\n"
    body = gzip.compress(first) + gzip.compress(second)
    pool, url = await pool_for(gzip_chunked(body))
    resp = await pool.open("GET", url, {}, None, FAST)
    got = b"".join([piece async for piece in resp.chunks()])
    assert len(got) == len(first) + len(second), f"{len(got) - len(first) - len(second)} bytes too many"
    assert got == first + second


_SPIN = textwrap.dedent("""
    import asyncio, zlib
    from gateway.config import Timeouts
    from gateway.http1 import HIGH_WATER, Http1Pool

    # a deflate body that decodes to more than one piece, then bytes after its end (here a second zlib
    # stream, as a server compressing chunk by chunk sends; the chunk-at-a-time decoder ignored them)
    BODY = zlib.compress(b"data: x\\n\\n" * (HIGH_WATER // 3)) + zlib.compress(b"data: [DONE]\\n\\n")

    async def main():
        async def handle(reader, writer):
            await reader.readuntil(b"\\r\\n\\r\\n")
            writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Encoding: deflate\\r\\nContent-Length: %d\\r\\n\\r\\n"
                         % len(BODY) + BODY)
            await writer.drain()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d/" % server.sockets[0].getsockname()[1]
        pool = Http1Pool(asyncio.get_running_loop())
        resp = await pool.open("GET", url, {}, None, Timeouts(connect=1, first_byte=1, idle=1))
        print(sum([len(piece) async for piece in resp.chunks()]))
        await pool.close()

    asyncio.run(main())
""")


def test_bytes_after_a_deflate_stream_do_not_hang_the_event_loop() -> None:
    """After a cut piece, a deflate stream that ends with input left over keeps it in `unconsumed_tail`
    for good (see above): `Decoder.pending` stays True, each `decode(b"")` returns nothing, and
    `Http1Response._pieces` loops forever without yielding, so the whole event loop hangs at 100% CPU.
    Run in a child process so that the hang is a failure, not a stuck suite."""
    try:
        done = subprocess.run([sys.executable, "-c", _SPIN], cwd=REPO, capture_output=True, text=True, timeout=20,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("Http1Response.chunks() spun for 20 s on a deflate body with bytes after its end")
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == len(b"data: x\n\n") * (HIGH_WATER // 3)


# -- a98858f / 618a7bb: settling a step whose answer trips the cap --------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES], ids=["openai", "anthropic"])
async def test_an_oversized_upstream_error_body_is_not_charged(env: Env, path: str) -> None:  # noqa: F811 (the fixture)
    """An upstream error status (known before its body is read) is settled uncharged
    (test_faults.test_upstream_5xx_passed_through_and_released); with a body over the cap, the same
    upstream error is charged the whole reservation."""
    if path == MESSAGES:
        error = {"type": "error", "error": {"type": "overloaded_error", "message": BIG}}
    else:
        error = {"error": {"message": BIG, "type": "server_error", "param": None, "code": None}}
    env.fake.queue(Reply(status=500, body=error))
    run_id = env.run_id()
    status, _ = await call(env, path, body_for(path), run_id)
    assert status == 502
    run = await assert_released(env, run_id)
    assert run["spent_usd"] == 0, run  # an upstream error is not charged, whatever its size


async def test_a_held_stream_cut_by_the_cap_is_charged_the_output_it_streamed(env: Env) -> None:  # noqa: F811 (the fixture)
    """A runaway stream (the upstream ignores `max_tokens`) cut by the cap: relayed, the step is charged
    the output read beyond its reservation (`settlement`'s relayed output); held whole (grammar, n > 1,
    `collect_stream`), `step.relayed_chars` is never set on the way out, so only the 16-token reservation
    is charged for ~64 KiB of output the upstream bills."""
    chunks = openai_stream(["y" * 1024] * 100)
    streamed = {}
    for label, headers in (("relayed", {}), ("held", {"x-tollgate-grammar": "regex:y+"})):
        env.fake.queue(Reply(chunks=chunks))
        run_id = f"runaway-{label}"
        async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": run_id, **headers}) as oa:
            with pytest.raises(openai.APIError, match="max_answer_bytes"):
                stream = await oa.chat.completions.create(model="gpt-4o-mini", messages=USER, n=2,  # type: ignore[arg-type]
                                                          max_tokens=16, stream=True)
                async for _ in stream:
                    pass
        streamed[label] = (await assert_released(env, run_id))["output_tokens"]
    # each is charged what it read beyond its 2 x 16-token reservation (the held one is cut sooner: it
    # keeps the events themselves, the relayed one only their text)
    assert streamed["relayed"] > 5_000, streamed
    assert streamed["held"] > 5_000, streamed


# -- 618a7bb: what a legitimate stream weighs -------------------------------------------------------------


def choices_stream(choices: int, deltas: int, word: str) -> list[bytes]:
    """An OpenAI stream of `choices` answers (`n`), one delta per event as OpenAI sends them."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000,
                "model": "gpt-4o-mini", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(data) + b"\n\n"

    out = [chunk(i, {"role": "assistant", "content": ""}) for i in range(choices)]
    for _ in range(deltas):
        out += [chunk(i, {"content": word}) for i in range(choices)]
    out += [chunk(i, {}, "stop") for i in range(choices)]
    usage = {"prompt_tokens": 10, "completion_tokens": choices * deltas, "total_tokens": 10 + choices * deltas}
    out.append(b"data: " + orjson.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                         "created": 1700000000, "model": "gpt-4o-mini", "choices": [],
                                         "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


async def test_a_streamed_answer_far_under_the_cap_is_not_cut(env: Env) -> None:  # noqa: F811 (the fixture)
    """The relay keeps the answer's text (and events held from a tool call on), not the events it relayed,
    yet it counts every byte of every event against the cap. An event carries one token of one choice in
    a ~130-byte envelope (~250 bytes from OpenAI, more with logprobs), so a stream weighs 30-60 times its
    text: 4 choices of 2,000 characters (8 KB of text, 12% of the 64 KiB cap, and accepted whole when not
    streamed) are cut. With the default 64 MiB the same happens to a legitimate n=8 x 32k-token answer."""
    choices, deltas, word = 4, 400, "word "
    text = word * deltas
    whole = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1700000000, "model": "gpt-4o-mini",
             "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                         for i in range(choices)],
             "usage": {"prompt_tokens": 10, "completion_tokens": choices * deltas,
                       "total_tokens": 10 + choices * deltas}}
    assert len(orjson.dumps(whole)) < CAP // 5
    env.fake.queue(Reply(body=whole))
    status, _ = await call(env, CHAT, {**body_for(CHAT), "n": choices}, env.run_id())
    assert status == 200  # the same answer, not streamed, is well within the cap

    env.fake.queue(Reply(chunks=choices_stream(choices, deltas, word)))
    got = [""] * choices
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-run-id": env.run_id()}) as oa:
        stream = await oa.chat.completions.create(model="gpt-4o-mini", messages=USER, n=choices,  # type: ignore[arg-type]
                                                  stream=True)
        async for part in stream:
            for choice in part.choices:
                got[choice.index] += choice.delta.content or ""
    assert got == [text] * choices


# -- 2332ac8: a stop's row before its answer ---------------------------------------------------------------


async def test_a_flush_does_not_wait_out_a_linger_already_begun(tmp_path: Path) -> None:
    """`flush` sets `_urgent`, which the writer reads only before it starts to linger: a stop whose row
    comes while the writer lingers over an ordinary step's row (the usual case under load) waits out the
    whole linger (50 ms in `tollgate serve`; 2 s here, the test's own bound) instead of skipping it."""
    ledger = Ledger.open(tmp_path / "l.db", linger_s=2.0, on_loop=True)
    await ledger.start()
    try:
        ledger.append_nowait(entry(0))  # an ordinary step's row: the writer starts to linger
        await asyncio.sleep(0.05)
        ledger.append_nowait(entry(1))  # a stop's row, whose answer waits for it
        started = time.monotonic()
        await ledger.flush()
        waited = time.monotonic() - started
        assert ledger.written == 2
        assert waited < 0.5, f"the stop's flush waited {waited:.2f}s for the writer's linger"
    finally:
        await ledger.close()
