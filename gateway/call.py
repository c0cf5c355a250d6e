"""The neutral view of one step, shared by every stage after `parse`.

Provider adapters (`gateway.providers.*`) turn wire JSON into these objects; guards, grammars and
telemetry only ever see them, so one guard works for OpenAI, Anthropic and MCP alike. Everything here
is immutable and free of I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import orjson

from gateway import exact_json
from gateway.frozen_init import fast_init

Protocol_ = Literal["openai", "anthropic", "openai_responses", "mcp"]


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, a number with an integral value written as an
    integer (`1`, `1.0` and `1e0` are one JSON value). Equal values give equal bytes."""
    return exact_json.dumps(_integral(value), sort_keys=True)


def _integral(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) <= 2**53 else value
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def canonical_arguments(arguments: str) -> bytes:
    """Canonical form of tool-call arguments given as JSON text; non-JSON text is kept verbatim."""
    try:
        return canonical_json(orjson.loads(arguments or "{}"))
    except orjson.JSONDecodeError:
        return arguments.encode("utf-8", "surrogatepass")


def digest(*parts: bytes) -> str:
    """Short, stable content hash (hex, 32 chars) used for fingerprints and ledger input hashes."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


@fast_init
@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool offered to the model (OpenAI `tools[].function`, Anthropic `tools[]`, MCP `tools/list`)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call proposed by the model, or an MCP `tools/call` request."""

    id: str
    name: str
    arguments: str  # JSON text as the model wrote it

    @property
    def fingerprint(self) -> str:
        """Name plus canonical arguments: equal calls give equal fingerprints whatever the key order."""
        return digest(self.name.encode("utf-8", "surrogatepass"), canonical_arguments(self.arguments))


@fast_init
@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool result the agent sends back (`role: tool`, `tool_result` block, MCP result)."""

    call_id: str
    content: str
    is_error: bool = False

    @property
    def fingerprint(self) -> str:
        return digest(self.content.encode("utf-8", "surrogatepass"))


@fast_init
@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage in semconv terms: `input_tokens` includes cached tokens (Anthropic's are summed)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    reasoning_tokens: int = 0
    cache_write_1h_tokens: int = 0  # of `cache_creation_tokens`, those written for an hour (Anthropic's dearer rate)
    web_search_requests: int = 0  # web searches the provider ran and bills apart (per search, not per token)
    file_search_requests: int = 0  # file (vector store) searches the provider ran and bills apart
    input_audio_tokens: int = 0  # of `input_tokens`, those of audio (OpenAI bills them at an audio rate)
    output_audio_tokens: int = 0  # of `output_tokens`, those of audio (spoken answers)
    # of these counts, those billed on another model than the step's (Anthropic's advisor sub-inferences),
    # with that model: priced at its rates (`guards.budget.usage_cost`)
    other_models: tuple[tuple[str, Usage], ...] = ()

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens

    def plus(self, other: Usage) -> Usage:
        """Both usages' counts added field by field, their `other_models` joined."""
        counts = {name: getattr(self, name) + getattr(other, name) for name in _COUNTS}
        return Usage(**counts, other_models=self.other_models + other.other_models)

    def minus(self, other: Usage) -> Usage:
        """These counts less `other`'s, field by field and never below 0, without `other_models`: what
        is left once a part billed elsewhere is taken out."""
        return Usage(**{name: max(getattr(self, name) - getattr(other, name), 0) for name in _COUNTS})


_COUNTS = tuple(f.name for f in fields(Usage) if f.name != "other_models")


@fast_init
@dataclass(frozen=True, slots=True)
class RequestParams:
    """Sampling parameters the request carried (None when absent); telemetry reads them."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop_sequences: tuple[str, ...] | None = None
    seed: int | None = None
    choice_count: int | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Call:
    """One request step in neutral form.

    `model` is the name as the agent sent it, a `provider/` prefix included (routing strips it:
    `Route.model` is the name sent upstream). `input_bytes` is the UTF-8 size
    of the request body; byte-level BPE tokenizers never emit more tokens than bytes, so it bounds the
    input token count from above. `request_hash` identifies identical repeated requests.
    `raw` is the parsed wire body, kept for adapters (content capture, re-ask); stages other than
    the adapter must not interpret it.
    """

    protocol: Protocol_
    operation: str
    model: str
    stream: bool = False
    max_tokens: int | None = None
    input_bytes: int = 0
    input_images: int = 0  # image parts: bounded apart, their tokens do not follow their bytes
    # input tokens the provider bills that the body does not carry (Anthropic's tool-use system prompt and
    # the definitions of its server tools): added to the body's bound
    input_overhead: int = 0
    # ids of reasoning items the input names without their content (the Responses API), which OpenAI reads
    # from storage and bills as input: emptied once held at what the run's answers said they cost
    # (`guards.reasoning.resolve`); any left are refused under a budget (`guards.budget`)
    stored_reasoning: tuple[str, ...] = ()
    referenced_documents: int = 0  # documents named, not sent (by file id or URL): no bound is known
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str | None = None
    tool_results: tuple[ToolResult, ...] = ()
    tool_call: ToolCall | None = None  # the MCP `tools/call` this step executes
    params: RequestParams = field(default_factory=RequestParams)
    request_hash: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    prefill: str = ""  # text the request puts in the answer's mouth (Anthropic: a last assistant message)
    # one entry per limit on the searches the provider may run and bill apart (an Anthropic web search
    # tool's `max_uses`, a Responses request's `max_tool_calls` over its search tools); None: no limit sent
    search_limits: tuple[int | None, ...] = ()
    # the input tokens one use of each `search_limits` entry may add (its results: an Anthropic web fetch's
    # `max_content_tokens`); empty, or shorter: `guards.bounds.SEARCH_INPUT_TOKENS` each
    search_sizes: tuple[int, ...] = ()
    # the request may make the provider write its prompt cache, billed above plain input (Anthropic: only
    # where a `cache_control` marks it); True unless the adapter knows better
    cache_writes: bool = True
    search_preview: bool = False  # it offers OpenAI's `web_search_preview` tool (priced apart: gateway.pricing)
    # it offers tools the provider runs between parts of the answer's text (Anthropic's server tools): text
    # before one is a preamble, so a stream's text is judged once it is known to be the answer's
    provider_tools: bool = False
    # tools the provider runs and bills apart at a cost tollgate cannot bound (the Responses API's Code
    # Interpreter containers, image generation; Anthropic's code execution): a USD budget refuses the request
    # (`guards.budget`)
    unpriced_tools: tuple[str, ...] = ()
    # tools whose use makes the provider bill what no reservation holds (Anthropic's advisor, a sub-inference
    # on a model of its own; a hosted MCP server, whose tool list and results are read in as input of any
    # size): a USD or token budget refuses the request (`guards.budget`)
    unreserved_tools: tuple[str, ...] = ()
    # why the request's cost cannot be bounded, one reason per request field (Anthropic's `thread`
    # continuation, its `fallbacks`): a USD or token budget refuses the request with them (`guards.budget`)
    unbounded: tuple[str, ...] = ()
    # the request fields those reasons name (`thread` first): the refusal's `param`
    unbounded_params: tuple[str, ...] = ()
    # the price tier asked for: OpenAI's service tier as sent (`auto`, `priority`, ...), Anthropic's `speed`
    # unless standard (`fast`); `gateway.pricing.reserved_tier` reads it
    service_tier: str | None = None
    audio_output: bool = False  # the answer may be spoken (Chat Completions `modalities` lists audio)


@fast_init
@dataclass(frozen=True, slots=True)
class Answer:
    """The upstream's answer in neutral form (first choice for text; tool calls of every choice)."""

    response_id: str | None = None
    model: str | None = None
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reasons: tuple[str, ...] = ()
    usage: Usage | None = None
    is_error: bool = False  # MCP `CallToolResult.isError`
    hosted_calls: int = 0  # tool calls the provider ran itself (web search, its MCP client): counted only
    tool_result: ToolResult | None = None  # MCP: the result the server returned
    other_texts: tuple[str, ...] = ()  # the text of every choice after the first (OpenAI's `n` > 1)
    # OpenAI's `n` > 1: the names of the tools each choice calls, the first's then those of `other_texts`
    # (`tool_calls` are every choice's); a choice that calls tools is no final answer: its text is a preamble
    choice_calls: tuple[tuple[str, ...], ...] = ()
    # the price tier the answer says it was billed at: OpenAI's service tier, Anthropic's `usage.speed`
    service_tier: str | None = None
    system_fingerprint: str | None = None  # OpenAI Chat Completions: the backend configuration that answered
    # `text` follows a tool the provider ran (Anthropic's server tools): it is the answer without what came
    # before, the request's prefill included
    after_provider_tool: bool = False
    # ids of the answer's reasoning items (the Responses API): an agent may send them back by id
    # (`guards.reasoning`)
    reasoning: tuple[str, ...] = ()
    # the model refused (OpenAI's `refusal` in place of content; Anthropic says so in `stop_reason`)
    refused: bool = False
    # OpenAI Chat Completions: the refusal of every choice, in choice order, "" for one that answered (a
    # refusal next to content is an answer); empty when none refused. A choice after the first that refused
    # has no text to judge: it is in neither `other_texts` nor `choice_calls`, and this says where it was
    refusals: tuple[str, ...] = ()
    # the provider says the call failed, in an answer relayed as it came (a Responses `status: failed`):
    # its error code, the span's `error.type`
    provider_error: str | None = None
