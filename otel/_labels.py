"""What a step's metrics are labelled with (`otel.spans.StepSpan`), the Prometheus label names of the
GenAI and MCP histograms, and label-value helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import mcp_attributes as Mcp
from opentelemetry.semconv._incubating.attributes import rpc_attributes as Rpc
from opentelemetry.semconv.attributes import error_attributes as Error
from opentelemetry.semconv.attributes import server_attributes as Server

from gateway.frozen_init import fast_init

__all__ = ["GENAI_LABELS", "MCP_LABELS", "StepLabels", "is_rpc_code", "label"]


def label(attribute: str) -> str:
    """Prometheus label name of a semconv attribute (`gen_ai.request.model` -> `gen_ai_request_model`)."""
    return attribute.replace(".", "_")


GENAI_LABELS: Final = tuple(
    label(a)
    for a in (
        GenAI.GEN_AI_OPERATION_NAME,
        GenAI.GEN_AI_PROVIDER_NAME,
        GenAI.GEN_AI_REQUEST_MODEL,
        GenAI.GEN_AI_RESPONSE_MODEL,
        Server.SERVER_ADDRESS,
        Server.SERVER_PORT,
    )
)
MCP_LABELS: Final = tuple(
    label(a)
    for a in (
        Mcp.MCP_METHOD_NAME,
        GenAI.GEN_AI_TOOL_NAME,
        GenAI.GEN_AI_PROMPT_NAME,
        GenAI.GEN_AI_OPERATION_NAME,
        Mcp.MCP_PROTOCOL_VERSION,
        Server.SERVER_ADDRESS,
        Server.SERVER_PORT,
        Rpc.RPC_RESPONSE_STATUS_CODE,
        Error.ERROR_TYPE,
    )
)


@fast_init
@dataclass(frozen=True, slots=True)
class StepLabels:
    """What a step's metrics are labelled with, known at start (computed even when not recording)."""

    operation: str
    provider: str = ""
    request_model: str | None = None
    server_address: str | None = None
    server_port: int | None = None
    method: str = ""  # MCP only
    tool_name: str | None = None
    prompt_name: str | None = None  # `prompts/get`
    protocol_version: str | None = None


def is_rpc_code(error_type: str | None) -> bool:
    return error_type is not None and error_type.lstrip("-").isdigit()
