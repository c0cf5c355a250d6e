"""The provider adapter protocol: one pure module per wire protocol.

An adapter translates between wire JSON and the neutral `Call` / `Answer`, renders errors and stop
messages in its protocol's format, and applies the request changes the pipeline asks for. It does no
I/O. `StreamReader` follows a streamed answer event by event and says, per event, which bytes to send.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.call import Answer, Call
from gateway.config import Limits
from gateway.errors import GatewayError
from gateway.frozen_init import fast_init
from gateway.providers.sse import SseEvent


@fast_init
@dataclass(frozen=True, slots=True)
class StreamStep:
    """What to do with one upstream event: bytes to relay now (possibly b""), whether it ended, and
    whether the agent's SDK yields it as a chunk (not a sentinel, a keep-alive or an event it skips or
    raises: what the chunk metrics count)."""

    out: bytes
    done: bool = False
    chunk: bool = True


class StreamReader(Protocol):
    holding: bool  # a tool call started: the relay holds events until the answer is judged
    complete: bool  # the upstream ended the answer properly
    delta: str  # the answer text the last event added: what the output checkers are fed
    # the provider ran a tool after answer text (Anthropic's server tools): that text was a preamble, and
    # the text the output constraints hold starts again (the relay starts its checkers afresh)
    restart: bool
    # the answer's text is complete as of the last event (OpenAI's finish reason, Anthropic's text block
    # stop, the Responses `output_text.done`): the SDKs parse it there against the agent's schema, so a
    # stream whose text is judged holds its events from it on until the verdict; reset by `restart`
    text_done: bool

    def feed(self, event: SseEvent) -> StreamStep: ...

    def answer(self) -> Answer: ...

    @property
    def output_chars(self) -> int: ...


class Adapter(Protocol):
    protocol: str
    operation: str
    provider_type: str  # the type of provider (`providers.*.type`) that serves this protocol
    upstream_path: str  # appended to the provider's base_url

    def parse_request(self, body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call: ...

    def parse_answer(self, body: Mapping[str, Any]) -> Answer: ...

    def stream_reader(self, *, hide_usage: bool, choices: int = 1) -> StreamReader: ...

    def error_body(self, error: GatewayError) -> bytes: ...

    def error_event(self, error: GatewayError, reader: Any = None) -> bytes:
        """An error event ending a stream; `reader`: the stream's so far (its events' numbering goes on)."""
        ...

    def stop_answer(self, call: Call, reason: str, detail: str) -> bytes: ...

    def stop_stream(self, call: Call, reason: str, detail: str) -> bytes: ...

    def stream_stop_tail(self, call: Call, reader: Any, reason: str, detail: str) -> bytes: ...

    def set_max_tokens(self, body: dict[str, Any], value: int, *, prefer_completion_field: bool) -> None: ...

    def ask_usage(self, body: dict[str, Any]) -> bool: ...

    def limit_hosted_calls(self, body: dict[str, Any], limit: int) -> bool: ...

    def search_limits(self, body: Mapping[str, Any]) -> tuple[int | None, ...]: ...

    def search_sizes(self, body: Mapping[str, Any]) -> tuple[int, ...]: ...

    def unpriced_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]: ...

    def unreserved_tools(self, body: Mapping[str, Any]) -> tuple[str, ...]: ...

    def max_tokens_field(self, body: Mapping[str, Any]) -> str | None: ...

    def with_instruction(self, body: Mapping[str, Any], answer_text: str, instruction: str) -> dict[str, Any]: ...
