"""otel/_labels.py: step metric labels and JSON-RPC error codes among `error.type` values."""

from __future__ import annotations

import dataclasses

import pytest

from otel._labels import StepLabels, is_rpc_code


@pytest.mark.parametrize(
    ("error_type", "expected"),
    [
        ("-32602", True),
        ("-32000", True),
        ("404", True),  # an HTTP status is digits too; the MCP span sets it only for JSON-RPC errors
        ("tool_error", False),
        ("upstream_timeout", False),
        ("", False),
        ("-", False),
        ("-32602x", False),
        (None, False),
    ],
)
def test_is_rpc_code(error_type: str | None, expected: bool) -> None:
    assert is_rpc_code(error_type) is expected


def test_step_labels_defaults_and_immutability() -> None:
    labels = StepLabels("chat", "openai", "gpt-4o-mini", "api.openai.com", 443)
    assert (labels.method, labels.tool_name, labels.protocol_version) == ("", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        labels.operation = "embeddings"  # type: ignore[misc]
    assert labels == StepLabels("chat", "openai", "gpt-4o-mini", "api.openai.com", 443)
