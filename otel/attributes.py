"""Pure mappings from neutral `Call` / `Answer` values to semantic-convention attributes.

Pinned to OpenTelemetry semantic conventions v1.41 (the last core release with the GenAI and MCP
conventions): `docs/gen-ai/gen-ai-spans.md`, `openai.md` and `anthropic.md` (`mcp.md` is
`otel.mcp_attributes`). Names come from `opentelemetry-semantic-conventions` constants; only tollgate's
own `tollgate.*` names are defined here. Nothing in this module needs an SDK, touches I/O or keeps
state: dicts in, dicts out.

Idiom (util-genai): a tuple of `(CONSTANT, value)` pairs filtered for `None`, so an absent value never
becomes an attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import mcp_attributes as Mcp
from opentelemetry.semconv._incubating.attributes import openai_attributes as OpenAI
from opentelemetry.semconv.attributes import server_attributes as Server
from opentelemetry.util.types import AttributeValue

from gateway.call import Answer, Call
from otel._wire import INT64_MAX, INT64_MIN

# fmt: off
__all__ = [
    "ANTHROPIC", "CHAT_COMPLETIONS", "EMBEDDINGS", "EXECUTE_TOOL", "OPENAI", "TOLLGATE_AGENT", "TOLLGATE_ATTEMPT",
    "TOLLGATE_COST_USD", "TOLLGATE_GUARD_DECISION", "TOLLGATE_GUARD_DETAIL", "TOLLGATE_GUARD_EVENT",
    "TOLLGATE_GUARD_NAME", "TOLLGATE_GUARD_REASON", "TOLLGATE_LLM_CALLS", "TOLLGATE_MAX_TOKENS_CLAMPED",
    "TOLLGATE_PATH_FINGERPRINT", "TOLLGATE_PROVIDER_KEY", "TOLLGATE_RESERVED_USD", "TOLLGATE_RUN_EPOCH",
    "TOLLGATE_RUN_ID", "TOLLGATE_RUN_SEGMENT", "TOLLGATE_STOP_REASON", "TOLLGATE_TOOL_CALLS", "TOOLS_CALL", "TOOL_ERROR",
    "Attributes", "guard_event_attributes", "inference_end_attributes", "inference_start_attributes",
    "output_type", "present", "provider_name_for"
]
# fmt: on

Attributes = dict[str, AttributeValue]

# --- tollgate.* names (no semconv equivalent in v1.41; the dev-repo `gen_ai.guardrail.*` may replace
# the guard event one day: keep every project name here so a rename touches one file) -------------
TOLLGATE_RUN_ID: Final = "tollgate.run_id"
"""Run id of the step (same key as the W3C baggage entry the agent may send). Never a metric label."""
TOLLGATE_RUN_EPOCH: Final = "tollgate.run.epoch"
"""Which incarnation of a run id (bumped by a reset) a root span summarises."""
TOLLGATE_RUN_SEGMENT: Final = "tollgate.run.segment"
"""Which root of a run epoch (1, 2, ...: the run went on after an idle export) a root span is."""
TOLLGATE_AGENT: Final = "tollgate.agent"
"""Agent name resolved by the identify stage (key lookup, `x-tollgate-agent` or `default`)."""
TOLLGATE_PROVIDER_KEY: Final = "tollgate.provider"
"""Key of the provider in tollgate's config (`providers:`), whatever `gen_ai.provider.name` says."""
TOLLGATE_ATTEMPT: Final = "tollgate.attempt"
"""0 for the first upstream attempt of a step, 1.. for grammar re-asks of the same step."""
TOLLGATE_STOP_REASON: Final = "tollgate.stop_reason"
"""Stop code of DESIGN section 4 (`budget_exhausted`, `loop_detected`, ...) when a guard stopped."""
TOLLGATE_COST_USD: Final = "tollgate.cost_usd"
"""Settled cost of the step (or the run's total on the root span), USD, double."""
TOLLGATE_RESERVED_USD: Final = "tollgate.reserved_usd"
"""Worst-case cost reserved by the budget guard before the call, USD, double."""
TOLLGATE_MAX_TOKENS_CLAMPED: Final = "tollgate.max_tokens.clamped"
"""`max_tokens` after the budget clamp, when it differs from what the agent asked (int)."""
TOLLGATE_GUARDS: Final = "tollgate.guards"
"""`guard:decision` of every guard that judged the step, in order (events mark only the stops)."""
TOLLGATE_LLM_CALLS: Final = "tollgate.llm_calls"
"""Run total of model calls (root span), int."""
TOLLGATE_TOOL_CALLS: Final = "tollgate.tool_calls"
"""Run total of tool calls (root span), int."""
TOLLGATE_PATH_FINGERPRINT: Final = "tollgate.path_fingerprint"
"""Hash of the run's decision sequence: equal paths give equal fingerprints (root span)."""
TOLLGATE_GUARD_EVENT: Final = "tollgate.guard"
"""Span event name for every guard, tool or grammar decision on a step."""
TOLLGATE_GUARD_NAME: Final = "tollgate.guard.name"
"""Event attribute: which guard decided (`budget`, `loop`, `tools`, `grammar`...)."""
TOLLGATE_GUARD_DECISION: Final = "tollgate.guard.decision"
"""Event attribute: the verdict (`continue`, `stop`, `block`, `drop`, `reask`...)."""
TOLLGATE_GUARD_REASON: Final = "tollgate.guard.reason"
"""Event attribute: low-cardinality reason code."""
TOLLGATE_GUARD_DETAIL: Final = "tollgate.guard.detail"
"""Event attribute: short human text; never user or model content."""

CHAT_COMPLETIONS: Final = OpenAI.OpenaiApiTypeValues.CHAT_COMPLETIONS.value
RESPONSES: Final = OpenAI.OpenaiApiTypeValues.RESPONSES.value
_API_TYPES: Final[Mapping[str, str]] = {"openai": CHAT_COMPLETIONS, "openai_responses": RESPONSES}
_CHAT: Final = GenAI.GenAiOperationNameValues.CHAT.value
TOOLS_CALL: Final = Mcp.McpMethodNameValues.TOOLS_CALL.value
EXECUTE_TOOL: Final = GenAI.GenAiOperationNameValues.EXECUTE_TOOL.value
EMBEDDINGS: Final = GenAI.GenAiOperationNameValues.EMBEDDINGS.value
TOOL_ERROR: Final = "tool_error"  # error.type for `CallToolResult.isError` (mcp.md, v1.41)
OPENAI: Final = GenAI.GenAiProviderNameValues.OPENAI.value
ANTHROPIC: Final = GenAI.GenAiProviderNameValues.ANTHROPIC.value
_JSON: Final = GenAI.GenAiOutputTypeValues.JSON.value
_TEXT: Final = GenAI.GenAiOutputTypeValues.TEXT.value

# Well-known `gen_ai.provider.name` values by upstream host (suffix match; first match wins).
_HOST_PROVIDERS: Final[tuple[tuple[str, str], ...]] = (
    ("api.openai.com", OPENAI),
    ("openai.azure.com", GenAI.GenAiProviderNameValues.AZURE_AI_OPENAI.value),
    ("services.ai.azure.com", GenAI.GenAiProviderNameValues.AZURE_AI_INFERENCE.value),
    ("models.inference.ai.azure.com", GenAI.GenAiProviderNameValues.AZURE_AI_INFERENCE.value),
    ("api.anthropic.com", ANTHROPIC),
    ("api.groq.com", GenAI.GenAiProviderNameValues.GROQ.value),
    ("api.deepseek.com", GenAI.GenAiProviderNameValues.DEEPSEEK.value),
    ("api.mistral.ai", GenAI.GenAiProviderNameValues.MISTRAL_AI.value),
    ("api.x.ai", GenAI.GenAiProviderNameValues.X_AI.value),
    ("api.perplexity.ai", GenAI.GenAiProviderNameValues.PERPLEXITY.value),
    ("api.cohere.com", GenAI.GenAiProviderNameValues.COHERE.value),
    ("api.cohere.ai", GenAI.GenAiProviderNameValues.COHERE.value),
    ("generativelanguage.googleapis.com", GenAI.GenAiProviderNameValues.GCP_GEMINI.value),
    ("aiplatform.googleapis.com", GenAI.GenAiProviderNameValues.GCP_VERTEX_AI.value),
    ("amazonaws.com", GenAI.GenAiProviderNameValues.AWS_BEDROCK.value),
    ("ml.cloud.ibm.com", GenAI.GenAiProviderNameValues.IBM_WATSONX_AI.value),
)
# Provider types whose flavour is fixed whatever the host (the Anthropic conventions apply to any
# Messages API endpoint, e.g. a corporate proxy in front of api.anthropic.com).
_TYPE_PROVIDERS: Final[Mapping[str, str]] = {"anthropic": ANTHROPIC}


def _int64(value: int | None) -> int | None:
    """`value` when an OTLP int attribute can hold it (an int64); a request may send any integer, and the
    SDK's encoder logs an error for a larger one and drops it."""
    return value if value is not None and INT64_MIN <= value <= INT64_MAX else None


def present(pairs: Iterable[tuple[str, AttributeValue | None]]) -> Attributes:
    """The pairs whose value is not None, as an attribute dict."""
    return {key: value for key, value in pairs if value is not None}


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def provider_name_for(provider_type: str, base_url: str, *, custom: str | None = None) -> str:
    """`gen_ai.provider.name` for a configured upstream (the "telemetry flavour discriminator").

    A well-known value only when the host really is that provider (`openai` only for api.openai.com,
    so `openai.*` attributes never decorate a vLLM span); `anthropic` for every `type: anthropic`
    provider. Anything else gets the custom value `custom` (pass the config's provider key, e.g.
    `local`), or `<type>_compatible` without one. Computed once per provider at startup.
    """
    fixed = _TYPE_PROVIDERS.get(provider_type)
    if fixed is not None:
        return fixed
    host = (urlsplit(base_url).hostname or "").lower().rstrip(".")
    for suffix, name in _HOST_PROVIDERS:
        if host == suffix or host.endswith("." + suffix):
            return name
    return custom or f"{provider_type}_compatible"


def _openai_output_type(raw: Mapping[str, Any]) -> str | None:
    fmt = raw.get("response_format")
    kind = fmt.get("type") if fmt is not None and isinstance(fmt, Mapping) else None  # mostly absent
    return {"json_object": _JSON, "json_schema": _JSON, "text": _TEXT}.get(kind) if kind else None


def _responses_output_type(raw: Mapping[str, Any]) -> str | None:
    text = raw.get("text")
    return _openai_output_type({"response_format": text.get("format")}) if isinstance(text, Mapping) else None


def _anthropic_output_type(raw: Mapping[str, Any]) -> str | None:
    fmt = raw.get("output_format")
    config = raw.get("output_config")
    if fmt is None and isinstance(config, Mapping):
        fmt = config.get("format")
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    return _JSON if kind == "json_schema" else None


_OUTPUT_TYPE: Final[Mapping[str, Callable[[Mapping[str, Any]], str | None]]] = {
    "openai": _openai_output_type,
    "anthropic": _anthropic_output_type,
    "openai_responses": _responses_output_type,
}


def output_type(call: Call) -> str | None:
    """`gen_ai.output.type` when the request names an output format (`response_format`, Anthropic
    `output_format` / `output_config.format`); None otherwise, as the convention asks."""
    extract = _OUTPUT_TYPE.get(call.protocol)
    return extract(call.raw) if extract is not None else None


def _openai_extras(call: Call) -> Attributes:
    tier = call.raw.get("service_tier")
    api = _API_TYPES.get(call.protocol) if call.operation == _CHAT else None  # embeddings share the wire only
    return present(((OpenAI.OPENAI_API_TYPE, api),
                    (OpenAI.OPENAI_REQUEST_SERVICE_TIER, tier if isinstance(tier, str) and tier != "auto" else None)))


def _embeddings_extras(call: Call) -> Attributes:
    """The embeddings' requested `dimensions` and `encoding_format`, when the request names them."""
    dimensions, encoding = call.raw.get("dimensions"), call.raw.get("encoding_format")
    return present((
        (GenAI.GEN_AI_EMBEDDINGS_DIMENSION_COUNT,
         _int64(dimensions) if isinstance(dimensions, int) and not isinstance(dimensions, bool) and dimensions > 0
         else None),
        (GenAI.GEN_AI_REQUEST_ENCODING_FORMATS, (encoding,) if isinstance(encoding, str) and encoding else None),
    ))


def inference_start_attributes(
    call: Call, *, provider_name: str, server_address: str, server_port: int
) -> Attributes:
    """Attributes of an inference span known before the call (all set at span start).

    Includes the sampling-relevant set (operation, provider, request model, server address and port)
    and every request parameter the call carries. `gen_ai.request.stream` only when streaming (never
    `false`); `gen_ai.request.choice.count` only when != 1; `top_k` as a double (v1.41 type). Pass
    the call as forwarded (after the shape stage), so `max_tokens` is what the upstream was given.
    """
    params = call.params
    attrs = present(
        (
            (GenAI.GEN_AI_OPERATION_NAME, call.operation),
            (GenAI.GEN_AI_PROVIDER_NAME, provider_name or None),  # none for a call refused before routing
            (GenAI.GEN_AI_REQUEST_MODEL, call.model or None),
            (Server.SERVER_ADDRESS, server_address or None),
            (Server.SERVER_PORT, server_port if server_address else None),
            (GenAI.GEN_AI_REQUEST_MAX_TOKENS, call.max_tokens),
            (GenAI.GEN_AI_REQUEST_TEMPERATURE, _float(params.temperature)),
            (GenAI.GEN_AI_REQUEST_TOP_P, _float(params.top_p)),
            (GenAI.GEN_AI_REQUEST_TOP_K, _float(params.top_k)),
            (GenAI.GEN_AI_REQUEST_FREQUENCY_PENALTY, _float(params.frequency_penalty)),
            (GenAI.GEN_AI_REQUEST_PRESENCE_PENALTY, _float(params.presence_penalty)),
            (
                GenAI.GEN_AI_REQUEST_STOP_SEQUENCES,
                tuple(params.stop_sequences) if params.stop_sequences else None,
            ),
            (GenAI.GEN_AI_REQUEST_SEED, _int64(params.seed)),
            (GenAI.GEN_AI_REQUEST_CHOICE_COUNT, params.choice_count if params.choice_count != 1 else None),
            (GenAI.GEN_AI_REQUEST_STREAM, True if call.stream else None),
            (GenAI.GEN_AI_OUTPUT_TYPE, output_type(call)),
        )
    )
    if provider_name == OPENAI:
        attrs.update(_openai_extras(call))
    if call.operation == EMBEDDINGS:
        attrs.update(_embeddings_extras(call))
    return attrs


def inference_end_attributes(answer: Answer, *, provider_name: str, operation: str = "") -> Attributes:
    """Attributes an answer provides: response id, model, finish reasons (as the provider sent them,
    one per choice) and usage.

    `answer.usage.input_tokens` already includes cached tokens (the Anthropic adapter sums
    `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`), so it is reported as is.
    Cache and reasoning counts are subsets and reported only when non-zero. `provider_name` selects
    provider-specific ones: OpenAI's `openai.response.service_tier`, the tier the answer names, and its
    `openai.response.system_fingerprint`. An
    `embeddings` operation produces no output tokens, so none are reported (none were obtained).
    """
    usage = answer.usage
    return present(
        (
            (OpenAI.OPENAI_RESPONSE_SERVICE_TIER, answer.service_tier if provider_name == OPENAI else None),
            (OpenAI.OPENAI_RESPONSE_SYSTEM_FINGERPRINT, answer.system_fingerprint if provider_name == OPENAI else None),
            (GenAI.GEN_AI_RESPONSE_ID, answer.response_id or None),
            (GenAI.GEN_AI_RESPONSE_MODEL, answer.model or None),
            (
                GenAI.GEN_AI_RESPONSE_FINISH_REASONS,
                tuple(answer.finish_reasons) if answer.finish_reasons else None,
            ),
            (GenAI.GEN_AI_USAGE_INPUT_TOKENS, usage.input_tokens if usage else None),
            (GenAI.GEN_AI_USAGE_OUTPUT_TOKENS, usage.output_tokens if usage and operation != EMBEDDINGS else None),
            (
                GenAI.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
                usage.cache_read_tokens if usage and usage.cache_read_tokens else None,
            ),
            (
                GenAI.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS,
                usage.cache_creation_tokens if usage and usage.cache_creation_tokens else None,
            ),
            (
                GenAI.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS,
                usage.reasoning_tokens if usage and usage.reasoning_tokens else None,
            ),
        )
    )


def guard_event_attributes(name: str, decision: str, reason: str | None, detail: str | None) -> Attributes:
    """Attributes of one `tollgate.guard` span event."""
    return present(
        (
            (TOLLGATE_GUARD_NAME, name),
            (TOLLGATE_GUARD_DECISION, decision),
            (TOLLGATE_GUARD_REASON, reason or None),
            (TOLLGATE_GUARD_DETAIL, detail or None),
        )
    )
