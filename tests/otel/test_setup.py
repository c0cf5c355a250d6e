"""`setup_telemetry` from the standard OTEL_* variables (read from the mapping, never os.environ)."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from otel.setup import (
    capture_from_env,
    exporter_from_env,
    resource_from_env,
    sampler_from_env,
    setup_telemetry,
)


@pytest.mark.parametrize(
    ("env", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:9/x",
            },
            "http://b:9/x",
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "http://localhost:4318/v1/traces"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "http://c:4318/v1/traces",
        ),
    ],
)
def test_http_exporter(env: dict[str, str], endpoint: str) -> None:
    exporter = exporter_from_env(env)
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == endpoint
    exporter.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK


def test_http_exporter_options() -> None:
    exporter = exporter_from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc,x-team=ml",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
    )
    assert isinstance(exporter, HttpExporter)
    client = exporter._client
    assert client._timeout == 2.5  # milliseconds, per the specification
    assert client._headers["api-key"] == "abc" and client._headers["Content-Encoding"] == "gzip"
    exporter.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK


def test_grpc_exporter() -> None:
    exporter = exporter_from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert isinstance(exporter, GrpcExporter)
    exporter.shutdown()


@pytest.mark.parametrize(
    "env", [{}, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}]
)
def test_no_exporter(env: dict[str, str]) -> None:
    assert exporter_from_env(env) is None
    assert not setup_telemetry(env).tracing


def test_console_exporter() -> None:
    assert isinstance(exporter_from_env({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)


def test_disabled_wins_over_everything() -> None:
    telemetry = setup_telemetry({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not telemetry.tracing


def test_enabled_with_endpoint() -> None:
    telemetry = setup_telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert telemetry.tracing and not telemetry.capture_content
    assert telemetry.shutdown(timeout_s=2)


def test_resource() -> None:
    resource = resource_from_env(
        {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod, team=ml%20ops,bad"}
    )
    attrs = dict(resource.attributes)
    assert attrs["service.name"] == "tollgate"
    assert attrs["deployment.environment"] == "prod" and attrs["team"] == "ml ops"
    assert attrs["telemetry.sdk.language"] == "python" and "bad" not in attrs
    named = resource_from_env({"OTEL_SERVICE_NAME": "gw", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"})
    assert named.attributes["service.name"] == "gw"
    assert resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}).attributes["service.name"] == "x"


@pytest.mark.parametrize(
    ("env", "description"),
    [
        ({}, "ParentBased{root:AlwaysOnSampler,"),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "AlwaysOffSampler"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            "TraceIdRatioBased{0.25}",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"},
            "ParentBased{root:TraceIdRatioBased{1.0},",
        ),
        ({"OTEL_TRACES_SAMPLER": "bogus"}, "ParentBased{root:AlwaysOnSampler,"),
    ],
)
def test_sampler(env: dict[str, str], description: str) -> None:
    sampler = sampler_from_env(env)
    assert isinstance(sampler, sampling.Sampler)
    assert sampler.get_description().startswith(description)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("SPAN_ONLY", True),
        ("span_and_event", True),
        ("true", True),
        ("NO_CONTENT", False),
        ("EVENT_ONLY", False),
        ("", False),
        ("weird", False),
    ],
)
def test_capture_from_env(value: str, expected: bool) -> None:
    assert capture_from_env({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": value}) is expected


def test_capture_from_config_flag() -> None:
    assert setup_telemetry({}, capture_content=True).capture_content
