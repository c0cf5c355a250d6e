"""Pure mappings, table-tested: exact names, types and values (semconv v1.41)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.call import Answer, RequestParams, Usage
from otel.attributes import (
    guard_event_attributes,
    inference_end_attributes,
    inference_start_attributes,
    output_type,
    provider_name_for,
)
from tests.otel.samples import ANTHROPIC_ANSWER, OPENAI_ANSWER, OPENAI_BODY, anthropic_call, openai_call


def typed(attrs: dict[str, Any]) -> dict[str, tuple[type, Any]]:
    return {k: (type(v), v) for k, v in attrs.items()}


def test_openai_start_attributes_exact() -> None:
    attrs = inference_start_attributes(
        openai_call(stream=True), provider_name="openai", server_address="api.openai.com", server_port=443
    )
    assert typed(attrs) == {
        "gen_ai.operation.name": (str, "chat"),
        "gen_ai.provider.name": (str, "openai"),
        "gen_ai.request.model": (str, "gpt-4o-mini"),
        "server.address": (str, "api.openai.com"),
        "server.port": (int, 443),
        "gen_ai.request.max_tokens": (int, 256),
        "gen_ai.request.temperature": (float, 0.2),
        "gen_ai.request.top_p": (float, 1.0),
        "gen_ai.request.frequency_penalty": (float, 0.5),
        "gen_ai.request.presence_penalty": (float, -0.5),
        "gen_ai.request.stop_sequences": (tuple, ("END",)),
        "gen_ai.request.seed": (int, 7),
        "gen_ai.request.choice.count": (int, 2),
        "gen_ai.request.stream": (bool, True),
        "gen_ai.output.type": (str, "json"),
        "openai.api.type": (str, "chat_completions"),
        "openai.request.service_tier": (str, "default"),
    }


def test_anthropic_start_attributes_exact() -> None:
    attrs = inference_start_attributes(
        anthropic_call(), provider_name="anthropic", server_address="api.anthropic.com", server_port=443
    )
    assert typed(attrs) == {
        "gen_ai.operation.name": (str, "chat"),
        "gen_ai.provider.name": (str, "anthropic"),
        "gen_ai.request.model": (str, "claude-sonnet-4-5"),
        "server.address": (str, "api.anthropic.com"),
        "server.port": (int, 443),
        "gen_ai.request.max_tokens": (int, 512),
        "gen_ai.request.temperature": (float, 1.0),
        "gen_ai.request.top_k": (float, 40.0),  # double in v1.41
        "gen_ai.request.stop_sequences": (tuple, ("\n\nHuman:",)),
    }


@pytest.mark.parametrize(
    ("change", "absent"),
    [
        ({"stream": False}, "gen_ai.request.stream"),  # never `false`
        ({"params": RequestParams(choice_count=1)}, "gen_ai.request.choice.count"),  # only when != 1
        ({"params": RequestParams()}, "gen_ai.request.seed"),
        ({"params": RequestParams(seed=2**64 - 1)}, "gen_ai.request.seed"),  # beyond an OTLP int64
        ({"params": RequestParams(seed=-(2**63) - 1)}, "gen_ai.request.seed"),
        ({"max_tokens": None}, "gen_ai.request.max_tokens"),
        ({"params": RequestParams(stop_sequences=())}, "gen_ai.request.stop_sequences"),
    ],
)
def test_conditional_attributes_absent(change: dict[str, Any], absent: str) -> None:
    call = replace(openai_call(stream=True), **change)
    assert absent not in inference_start_attributes(
        call, provider_name="openai", server_address="h", server_port=1
    )


def test_a_call_refused_before_routing_names_no_provider() -> None:
    attrs = inference_start_attributes(openai_call(), provider_name="", server_address="", server_port=0)
    assert not {"gen_ai.provider.name", "server.address", "server.port"} & set(attrs)
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"


def test_openai_specific_attributes_only_for_openai_flavour() -> None:
    attrs = inference_start_attributes(
        openai_call(), provider_name="local", server_address="127.0.0.1", server_port=8000
    )
    assert not [k for k in attrs if k.startswith("openai.")]
    assert attrs["gen_ai.provider.name"] == "local"


@pytest.mark.parametrize(("protocol", "api_type"), [("openai", "chat_completions"), ("openai_responses", "responses")])
def test_openai_api_type_names_the_api_called(protocol: str, api_type: str) -> None:
    call = replace(openai_call(), protocol=protocol)  # type: ignore[arg-type]
    attrs = inference_start_attributes(call, provider_name="openai", server_address="api.openai.com", server_port=443)
    assert attrs["openai.api.type"] == api_type


def test_service_tier_auto_is_not_reported() -> None:
    call = openai_call({**OPENAI_BODY, "service_tier": "auto"})
    attrs = inference_start_attributes(
        call, provider_name="openai", server_address="api.openai.com", server_port=443
    )
    assert "openai.request.service_tier" not in attrs


@pytest.mark.parametrize(
    ("protocol_body", "expected"),
    [
        (("openai", {"response_format": {"type": "json_object"}}), "json"),
        (("openai", {"response_format": {"type": "json_schema", "json_schema": {}}}), "json"),
        (("openai", {"response_format": {"type": "text"}}), "text"),
        (("openai", {}), None),
        (("anthropic", {"output_format": {"type": "json_schema", "schema": {}}}), "json"),
        (("anthropic", {"output_config": {"format": {"type": "json_schema"}}}), "json"),
        (("anthropic", {}), None),
        (("openai_responses", {"text": {"format": {"type": "json_schema", "schema": {}}}}), "json"),
        (("openai_responses", {"text": {"format": {"type": "json_object"}}}), "json"),
        (("openai_responses", {"text": {"format": {"type": "text"}}}), "text"),
        (("openai_responses", {"text": {"verbosity": "low"}}), None),
        (("openai_responses", {"response_format": {"type": "json_object"}}), None),  # not this API's field
        (("mcp", {}), None),
    ],
)
def test_output_type(protocol_body: tuple[str, dict[str, Any]], expected: str | None) -> None:
    protocol, body = protocol_body
    call = replace(openai_call(), protocol=protocol, raw={"model": "m", **body})  # type: ignore[arg-type]
    assert output_type(call) == expected


def test_openai_end_attributes_exact() -> None:
    assert typed(inference_end_attributes(OPENAI_ANSWER, provider_name="openai")) == {
        "gen_ai.response.id": (str, "chatcmpl-123"),
        "gen_ai.response.model": (str, "gpt-4o-mini-2024-07-18"),
        "gen_ai.response.finish_reasons": (tuple, ("stop", "length")),
        "gen_ai.usage.input_tokens": (int, 120),
        "gen_ai.usage.output_tokens": (int, 30),
        "gen_ai.usage.cache_read.input_tokens": (int, 64),
        "gen_ai.usage.reasoning.output_tokens": (int, 12),
    }


def test_openai_response_service_tier_is_the_tier_the_answer_names() -> None:
    """Conditionally required when the response carries one; Anthropic's `speed` is no OpenAI tier."""
    tiered = replace(OPENAI_ANSWER, service_tier="default")
    assert inference_end_attributes(tiered, provider_name="openai")["openai.response.service_tier"] == "default"
    assert "openai.response.service_tier" not in inference_end_attributes(tiered, provider_name="anthropic")


def test_openai_response_system_fingerprint_is_reported_for_openai_only() -> None:
    """semconv.md 1.2: `openai.response.system_fingerprint` is recommended on OpenAI spans."""
    printed = replace(OPENAI_ANSWER, system_fingerprint="fp_44709d6fcb")
    assert inference_end_attributes(printed, provider_name="openai")["openai.response.system_fingerprint"] == (
        "fp_44709d6fcb")
    assert "openai.response.system_fingerprint" not in inference_end_attributes(printed, provider_name="anthropic")


@pytest.mark.parametrize(("body", "expected"), [
    ({"dimensions": 512, "encoding_format": "base64"},
     {"gen_ai.embeddings.dimension.count": (int, 512), "gen_ai.request.encoding_formats": (tuple, ("base64",))}),
    ({"encoding_format": "float"}, {"gen_ai.request.encoding_formats": (tuple, ("float",))}),
    ({"dimensions": True, "encoding_format": ""}, {}),  # neither names one
    ({"dimensions": 0, "encoding_format": ["float"]}, {}),
    ({"dimensions": 2**63}, {}),  # beyond an OTLP int64: left out
    ({}, {}),
])
def test_embeddings_name_their_requested_dimensions_and_encoding(body: dict[str, Any],
                                                                  expected: dict[str, Any]) -> None:
    """semconv.md 1.3: `gen_ai.embeddings.dimension.count` and `gen_ai.request.encoding_formats` are
    recommended on an embeddings span; only what the request names is reported."""
    call = replace(openai_call(), operation="embeddings", raw={"model": "m", "input": "x", **body})
    attrs = typed(inference_start_attributes(call, provider_name="openai", server_address="a", server_port=1))
    keys = ("gen_ai.embeddings.dimension.count", "gen_ai.request.encoding_formats")
    assert {k: v for k, v in attrs.items() if k in keys} == expected


def test_embeddings_report_no_output_tokens() -> None:
    """They produce none: a 0 was a count never obtained (semconv: not reported) and skewed the metric."""
    attrs = inference_end_attributes(OPENAI_ANSWER, provider_name="openai", operation="embeddings")
    assert "gen_ai.usage.output_tokens" not in attrs and attrs["gen_ai.usage.input_tokens"] == 120


def test_anthropic_input_tokens_not_double_counted() -> None:
    attrs = inference_end_attributes(ANTHROPIC_ANSWER, provider_name="anthropic")
    assert attrs["gen_ai.usage.input_tokens"] == 150  # already input + cache read + cache creation
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 20
    assert attrs["gen_ai.usage.cache_creation.input_tokens"] == 30
    assert attrs["gen_ai.response.finish_reasons"] == ("tool_use",)
    assert "gen_ai.usage.reasoning.output_tokens" not in attrs


def test_end_attributes_without_usage_or_ids() -> None:
    assert inference_end_attributes(Answer(), provider_name="openai") == {}
    zero = inference_end_attributes(Answer(usage=Usage()), provider_name="openai")
    assert zero == {"gen_ai.usage.input_tokens": 0, "gen_ai.usage.output_tokens": 0}


@pytest.mark.parametrize(
    ("provider_type", "base_url", "custom", "expected"),
    [
        ("openai", "https://api.openai.com/v1", None, "openai"),
        ("openai", "https://API.OpenAI.com./v1", None, "openai"),
        ("openai", "https://api.openai.com.evil.example/v1", "evil", "evil"),
        ("openai", "http://127.0.0.1:8000/v1", "local", "local"),
        ("openai", "http://127.0.0.1:8000/v1", None, "openai_compatible"),
        ("openai", "https://api.groq.com/openai/v1", None, "groq"),
        ("openai", "https://api.deepseek.com", None, "deepseek"),
        ("openai", "https://my-res.openai.azure.com/openai", None, "azure.ai.openai"),
        ("openai", "https://generativelanguage.googleapis.com/v1beta/openai", None, "gcp.gemini"),
        ("openai", "https://api.mistral.ai/v1", None, "mistral_ai"),
        ("openai", "https://api.x.ai/v1", None, "x_ai"),
        ("anthropic", "https://api.anthropic.com", None, "anthropic"),
        ("anthropic", "https://llm-proxy.corp.example", "corp", "anthropic"),
    ],
)
def test_provider_name_for(provider_type: str, base_url: str, custom: str | None, expected: str) -> None:
    assert provider_name_for(provider_type, base_url, custom=custom) == expected


def test_guard_event_attributes() -> None:
    assert guard_event_attributes("budget", "stop", "budget_exhausted", "spent 2.01 of 2.00") == {
        "tollgate.guard.name": "budget",
        "tollgate.guard.decision": "stop",
        "tollgate.guard.reason": "budget_exhausted",
        "tollgate.guard.detail": "spent 2.01 of 2.00",
    }
    assert guard_event_attributes("loop", "continue", None, None) == {
        "tollgate.guard.name": "loop",
        "tollgate.guard.decision": "continue",
    }
