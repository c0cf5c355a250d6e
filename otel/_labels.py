"""What a step's metrics are labelled with (`otel.spans.StepSpan`), and label-value helpers."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepLabels", "is_rpc_code"]


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
    protocol_version: str | None = None


def is_rpc_code(error_type: str | None) -> bool:
    return error_type is not None and error_type.lstrip("-").isdigit()
