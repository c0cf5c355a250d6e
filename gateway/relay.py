"""Streaming forward + inspect: relay SSE events as they arrive, never buffering the whole answer.

Text events go to the agent at once. From the first tool-call event on, events are held until the
answer is complete and judged (allow-list, caps, loop detection), so a call the guards refuse never
reaches the agent. A stop after bytes were sent ends the stream with a final event in the provider's
stream format. The reservation is settled from the usage the stream reported, or at the full
reservation when the stream broke or carried no usage.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import replace

from aiohttp import web

from gateway.call import Answer
from gateway.errors import GatewayError, OutputNonconforming, Stopped, ToolNotAllowed, UpstreamUnavailable
from gateway.observe import ledger_stop_now, step_span
from gateway.outputs import CHECK_ON_LOOP_CHARS, held_to_text, judge_tool_arguments, off_loop_if_long
from gateway.pipeline import guard_after, provider_secret, settle, stop_answer
from gateway.providers.base import StreamStep
from gateway.providers.sse import SseParser
from gateway.providers.tool_wire import drop_stream_calls
from gateway.respond import base_headers
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.toolgate import TOOL_NOT_ALLOWED, answers_something, judge_tools, without
from gateway.upstream import UpstreamResponse, answer_headers, scrub, secret_bytes
from grammars.checker import IncrementalChecker
from otel.spans import StepSpan

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# what a stream offering tools holds of its text after it broke its grammar, waiting for a call to show
# it was a preamble (a sentence or two): past it the text is the answer, and the grammar's error ends it
PREAMBLE_BYTES = 64 * 1024


async def relay_stream(gw: Gateway, step: Step, request: web.Request, upstream: UpstreamResponse) -> web.StreamResponse:
    adapter = step.adapter
    reader = adapter.stream_reader(hide_usage=step.hide_usage, choices=step.call.params.choice_count or 1)
    parser = SseParser()
    key = provider_secret(step.route.provider)
    headers = answer_headers(upstream.headers, SSE_HEADERS, base_headers(step.identity, step), secret=key)
    out = web.StreamResponse(status=200, headers=headers)
    held: list[bytes] = []
    failure: GatewayError | None = None
    client_gone = False
    checkers = step.outputs.checkers() if step.outputs is not None else []
    if checkers and step.call.prefill:  # the answer is the prefill plus what streams back
        for checker in checkers:
            checker.feed(step.call.prefill)
    secret = secret_bytes(key)
    ended = False  # the stream's final event was read: what an upstream sends after it is ignored
    limit = gw.config.limits.max_answer_bytes  # what is kept (the answer's text, held events) stays under it
    kept = 0  # bytes of held events
    broken: GatewayError | None = None  # the checkers refused the text (cut at once unless it may be a preamble)
    # text before a call (a client tool's, or one the provider runs) is a preamble, not the answer: a
    # stream that offers tools is not cut where its text stops conforming, but judged once it is known to
    # be the answer; from there a client-tools stream holds its events, so the agent sees no more of
    # that text unless a call follows
    hold_broken = False
    try:
        await out.prepare(request)  # in here: a client gone already must not keep the upstream connection
        span = step_span(gw, step)
        async for chunk in upstream.chunks():
            for event in parser.feed(chunk):
                if ended:
                    continue  # the SDK stops at the final event: nothing after it may count
                emitted = reader.feed(event)
                chunk_arrived(step, span, emitted)
                ended = emitted.done
                if checkers and reader.restart:  # what streamed so far was a preamble to a provider's tool
                    checkers = step.outputs.checkers() if step.outputs is not None else []
                    broken = None
                    if held and not (reader.holding or hold_broken):  # only that text's end was held
                        await out.write(b"".join(held))
                        held.clear()
                        kept = 0
                if reader.output_chars + kept > limit:
                    raise _too_long(limit)
                if checkers and broken is None and (delta := reader.delta) and not (
                        _feed_all(checkers, delta) if len(delta) <= CHECK_ON_LOOP_CHARS
                        else await asyncio.to_thread(_feed_all, checkers, delta)):  # a long delta off the loop
                    broken = _nonconforming(checkers)
                    if not (step.call.provider_tools or step.call.tools):
                        failure = broken
                        break
                    hold_broken = not step.call.provider_tools  # a provider's tool restarts the checkers
                if not emitted.out:
                    continue
                data = scrub(emitted.out, secret)  # an error event may echo the provider key
                # the stream's end waits for the final verdict too: an SDK stops reading at it, so an
                # error event after it would never be seen; and from the text's end on, where an SDK
                # parses the text against the agent's schema (its parse error would hide the verdict)
                if hold_broken and not reader.holding and kept > PREAMBLE_BYTES:
                    failure = broken  # no call came: this is the answer, not a preamble (held no longer)
                    break
                if reader.holding or hold_broken or (checkers and (emitted.done or reader.text_done)):
                    held.append(data)
                    kept += len(data)
                    continue
                await out.write(data)
            if failure is not None:
                break
    except GatewayError as exc:
        # read on to the response's end after its final event (its connection is reused); if that part
        # breaks or never comes, the answer is whole all the same
        failure = None if ended else exc
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        # an event larger than the SSE size limit, undecodable JSON, or JSON of the wrong shape
        failure = _malformed(exc)
    except ConnectionResetError:
        client_gone = True
    finally:
        upstream.release()
    answer = reader.answer()
    step.answer = answer
    step.relayed_chars = reader.output_chars
    step.status = 200
    # usage counts only from a stream that ended as the upstream meant it: running usage (vLLM's
    # continuous_usage_stats) of one that broke or was cut is not what the upstream bills
    finished = failure is None and not client_gone and reader.complete
    try:
        await settle(gw, step, answer if finished else replace(answer, usage=None))
    except GatewayError as exc:  # the run store failed after the stream started: end it with the error
        failure = failure or exc
    if client_gone:
        step.error_type = "client_disconnected"
        return out
    if failure is None and not reader.complete and answer.provider_error and not held:
        step.error_type = answer.provider_error  # the provider ended it with an error event the agent has
        return out
    if failure is None and not reader.complete:
        failure = UpstreamUnavailable("upstream stream ended before the answer was complete")
    if failure is None and broken is not None and not answer.tool_calls and held_to_text(answer):
        failure = broken  # the answer's text, not a preamble, broke its constraint
    text_judged = False  # an answer that calls tools is not held to the text constraints (unless they are dropped)
    if failure is None and checkers and not answer.tool_calls and held_to_text(answer):
        text_judged = True
        failure = await _text_failure(checkers, answer)
    try:
        if failure is not None:
            step.error_type = failure.code
            _record_violation(step, checkers, failure)
            await out.write(adapter.error_event(failure, reader))
        else:
            try:
                held_bytes = b"".join(held)
                tools = judge_tools(step.tools, answer) if step.tools is not None else None
                if tools is not None:
                    step.extra["tools_denied"] = len(tools.denied)
                    if tools.action == "reject":
                        await stop_answer(gw, step, TOOL_NOT_ALLOWED, tools.detail)
                    # drop: the held events lose the refused calls, whose bytes never reach the agent
                    held_bytes = drop_stream_calls(step.call.protocol, held_bytes, tools.names)
                    answer = step.answer = without(answer, tools.names)
                    step.extra["tools_dropped"] = len(tools.denied)
                    if checkers and not text_judged and not answer.tool_calls and held_to_text(answer):
                        # what is left is the answer now (commentary before the calls is none of it)
                        dropped = await _text_failure(checkers, answer)
                        if dropped is not None:
                            raise dropped
                    if not answers_something(answer):
                        # its start is sent: it cannot be re-asked (`stream_check: buffer` holds it and
                        # can), and an empty answer would end the agent's turn with nothing: say why
                        step.error_type = TOOL_NOT_ALLOWED
                        raise ToolNotAllowed(
                            f"{tools.detail}; the answer called nothing else, and a stream relayed as it "
                            "arrives cannot be re-asked (output.stream_check: buffer can): the run goes on")
                # the held calls reach the agent only with arguments their tools' schemas accept; a
                # stream cannot be re-asked once it started (`stream_check: buffer` can)
                verdict = await off_loop_if_long(answer, functools.partial(judge_tool_arguments, step.call, answer))
                if verdict is not None:
                    step.violations.append(f"{verdict.kind}: {verdict.violation.redacted}")
                    raise OutputNonconforming(f"the streamed answer breaks a tool's parameter schema: "
                                              f"{verdict.violation.message}")
                await guard_after(gw, step, answer)
            except Stopped as stop:
                await ledger_stop_now(gw, step)
                await out.write(_stop_tail(step, reader, stop))
            except GatewayError as exc:  # e.g. the run store failed while judging the answer
                step.error_type = exc.code
                await out.write(adapter.error_event(exc, reader))
            else:
                if held_bytes:
                    await out.write(held_bytes)
        await out.write_eof()
    except ConnectionResetError:
        step.error_type = "client_disconnected"
    return out


def _record_violation(step: Step, checkers: Sequence[IncrementalChecker], failure: GatewayError) -> None:
    """A stream ended for breaking a text constraint counts as a failed output check (the metric and the
    span's violations), as a non-streamed answer's verdict does."""
    if not isinstance(failure, OutputNonconforming) or step.outputs is None:
        return
    for kind, checker in zip(step.outputs.kinds, checkers, strict=False):
        if checker.violation is not None:
            step.violations.append(f"{kind}: {checker.violation.redacted}")
            return


def _nonconforming(checkers: list[IncrementalChecker]) -> OutputNonconforming:
    bad = next((c.violation for c in checkers if c.violation is not None), None)
    reason = bad.message if bad is not None else "the output can no longer satisfy its constraint"
    return OutputNonconforming(f"the streamed answer breaks its constraint: {reason}")


def chunk_arrived(step: Step, span: StepSpan | None, emitted: StreamStep) -> None:
    """An event of the attempt's stream came from the upstream, its reader relaying `emitted`. The
    attempt's span takes the first event the agent's SDK yields (`StreamStep.chunk`, relayed: not the
    usage chunk tollgate asked for on the agent's behalf) as its time to first chunk, each later one as a
    time per output chunk from the previous one (semconv measures them as the client receives them, so
    a stream tollgate holds or buffers has them too; a held tool call the guards drop later is counted
    all the same)."""
    if step.first_chunk_at is None:
        step.first_chunk_at = time.monotonic()
    if span is not None and emitted.out and emitted.chunk:
        span.chunk()


async def collect_stream(gw: Gateway, step: Step, upstream: UpstreamResponse, limit: int) -> tuple[bytes, Answer]:
    """`stream_check: buffer`: read the whole stream without relaying it, so it can be validated and
    re-asked like a non-streamed answer. Returns the events to send and the answer. A stream of more
    than `limit` bytes (`limits.max_answer_bytes`) is an `UpstreamUnavailable`."""
    reader = step.adapter.stream_reader(hide_usage=step.hide_usage, choices=step.call.params.choice_count or 1)
    parser = SseParser()
    parts: list[bytes] = []
    ended = False
    secret = secret_bytes(provider_secret(step.route.provider))
    room = limit
    span = step_span(gw, step)  # each attempt (a re-ask is one) has its own
    try:
        async for chunk in upstream.chunks():
            room -= len(chunk)
            if room < 0:
                raise _too_long(limit)
            for event in parser.feed(chunk):
                if not ended:  # nothing after the final event counts (see relay_stream)
                    emitted = reader.feed(event)
                    chunk_arrived(step, span, emitted)
                    parts.append(scrub(emitted.out, secret))
                    ended = emitted.done
    except GatewayError:
        if not ended:
            raise  # after the final event, the rest of the response no longer concerns the answer
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise _malformed(exc) from None
    finally:
        upstream.release()
        step.relayed_chars = reader.output_chars  # a cut answer is charged what it streamed, at least
    step.status = 200
    if not reader.complete:
        raise UpstreamUnavailable("upstream stream ended before the answer was complete")
    return b"".join(parts), reader.answer()


def _malformed(exc: Exception) -> UpstreamUnavailable:
    """A stream the readers could not follow. Their own ValueErrors say what was wrong with it; an
    event of the wrong shape trips Python's own errors (`'str' object has no attribute 'get'`), whose
    text says nothing to the caller: it is named by kind only."""
    what = str(exc) if type(exc) is ValueError and str(exc) else f"an event of the wrong shape ({type(exc).__name__})"
    return UpstreamUnavailable(f"upstream stream is malformed: {what}")


def _too_long(limit: int) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"upstream stream keeps more than limits.max_answer_bytes ({limit} bytes)")


def _stop_tail(step: Step, reader: object, stop: Stopped) -> bytes:
    if step.identity.policy.on_stop == "message":
        return step.adapter.stream_stop_tail(step.call, reader, stop.reason, stop.message)
    return step.adapter.error_event(stop, reader)


def _feed_all(checkers: Sequence[IncrementalChecker], delta: str) -> bool:
    return all(c.feed(delta) for c in checkers)


async def _text_failure(checkers: Sequence[IncrementalChecker], answer: Answer) -> OutputNonconforming | None:
    """The error of an answer whose streamed text breaks a constraint once complete, else None."""
    problems = await off_loop_if_long(answer, lambda: [v for v in (c.finish() for c in checkers) if v is not None])
    if problems:
        return OutputNonconforming(f"the streamed answer breaks its constraint: {problems[0].message}")
    return None
