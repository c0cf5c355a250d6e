"""Build a `Telemetry` from the standard `OTEL_*` variables, read from the mapping given (never from
`os.environ` directly; pass `os.environ` at startup). No global provider is installed.

Variables:

- `OTEL_SDK_DISABLED=true`: no tracer at all; step spans are non-recording and the agent's trace
  context passes upstream unchanged. Prometheus metrics still work.
- `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: full URL of the traces endpoint, used as is.
- `OTEL_EXPORTER_OTLP_ENDPOINT`: base URL; `/v1/traces` is appended for http/protobuf, used as is
  for grpc.
- `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`: `http/protobuf` (default) or `grpc`; `http/json` is not
  supported by the Python SDK and falls back to http/protobuf.
- `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, `_TIMEOUT` (milliseconds, as the specification says; the
  Python SDK alone reads seconds), `_COMPRESSION` (`gzip`), `_INSECURE` (grpc).
- `OTEL_TRACES_EXPORTER`: `otlp` (default), `console`, `none`.
- `OTEL_SERVICE_NAME` (default `tollgate`), `OTEL_RESOURCE_ATTRIBUTES`: the resource.
- `OTEL_TRACES_SAMPLER` (+ `_ARG`): `parentbased_always_on` (default), `always_on`, `always_off`,
  `traceidratio`, `parentbased_traceidratio`, `parentbased_always_off`.
- `OTEL_BSP_MAX_QUEUE_SIZE` (2048), `_SCHEDULE_DELAY` (5000 ms), `_MAX_EXPORT_BATCH_SIZE` (64, not the
  SDK's 512: the export thread encodes a batch holding the GIL, and a 512-span burst delayed requests
  by tens of ms; 64 kept the paced p99 of `make bench` ~2-4x lower at the same CPU), `_EXPORT_TIMEOUT`:
  the batch processor.
- `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`, `OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`,
  `OTEL_SPAN_EVENT_COUNT_LIMIT`: span limits.
- `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`: `SPAN_ONLY` / `SPAN_AND_EVENT` (or `true`)
  turn content capture on; `NO_CONTENT` (default) / `EVENT_ONLY` leave it off (tollgate emits no
  content events).

No endpoint configured (and `OTEL_TRACES_EXPORTER` not explicitly `otlp`): tracing is off, exactly
as with `OTEL_SDK_DISABLED=true`, rather than the SDK default of exporting to localhost:4318. A
sidecar without a collector would otherwise log export failures forever, and upstream services
would see tollgate spans as parents that no backend ever receives.
Certificates and credential providers are left to the SDK exporters' own environment lookups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Final
from urllib.parse import unquote

from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace import sampling as Sampling
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.version import __version__ as sdk_version
from opentelemetry.semconv.attributes import service_attributes as Service
from opentelemetry.semconv.attributes import telemetry_attributes as Tel
from opentelemetry.semconv.schemas import Schemas
from opentelemetry.util.re import parse_env_headers

from otel._fastspan import FastTracer
from otel._safe import ErrorCounter
from otel.export import CountingSpanProcessor
from otel.metrics import Metrics
from otel.runs import RunIdGenerator
from otel.telemetry import Telemetry

# fmt: off
__all__ = [
    "DEFAULT_SERVICE_NAME", "SCHEMA_URL", "capture_from_env", "exporter_from_env", "resource_from_env",
    "sampler_from_env", "setup_telemetry"
]
# fmt: on

_log = logging.getLogger("tollgate.otel")

SCHEMA_URL: Final = Schemas.V1_41_0.value
DEFAULT_SERVICE_NAME: Final = "tollgate"
_CAPTURE: Final[Mapping[str, bool]] = {
    "span_only": True,
    "span_and_event": True,
    "true": True,
    "event_only": False,
    "no_content": False,
    "false": False,
    "": False,
}
_SAMPLERS: Final[Mapping[str, Callable[[float], Sampling.Sampler]]] = {
    "always_on": lambda _: Sampling.ALWAYS_ON,
    "always_off": lambda _: Sampling.ALWAYS_OFF,
    "parentbased_always_on": lambda _: Sampling.ParentBased(Sampling.ALWAYS_ON),
    "parentbased_always_off": lambda _: Sampling.ParentBased(Sampling.ALWAYS_OFF),
    "traceidratio": Sampling.TraceIdRatioBased,
    "parentbased_traceidratio": Sampling.ParentBasedTraceIdRatio,
}


def _get(env: Mapping[str, str], *keys: str) -> str:
    return next((env[k].strip() for k in keys if env.get(k, "").strip()), "")


def _number(env: Mapping[str, str], key: str, default: float) -> float:
    raw = _get(env, key)
    try:
        return float(raw) if raw else default
    except ValueError:
        _log.warning("%s=%r is not a number; using %s", key, raw, default)
        return default


def capture_from_env(env: Mapping[str, str]) -> bool:
    """Content capture requested by `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`."""
    raw = _get(env, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT").lower()
    if raw not in _CAPTURE:
        _log.warning("unknown OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=%r; content off", raw)
    return _CAPTURE.get(raw, False)


def resource_from_env(env: Mapping[str, str]) -> Resource:
    attrs: dict[str, str] = {}
    for item in _get(env, "OTEL_RESOURCE_ATTRIBUTES").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attrs[key.strip()] = unquote(value.strip())
        elif item.strip():
            _log.warning("ignoring malformed OTEL_RESOURCE_ATTRIBUTES entry %r", item)
    attrs[Service.SERVICE_NAME] = (
        _get(env, "OTEL_SERVICE_NAME") or attrs.get(Service.SERVICE_NAME) or DEFAULT_SERVICE_NAME
    )
    try:
        attrs.setdefault(Service.SERVICE_VERSION, version("tollgate"))
    except PackageNotFoundError:
        pass
    attrs.update(
        {
            Tel.TELEMETRY_SDK_LANGUAGE: Tel.TelemetrySdkLanguageValues.PYTHON.value,
            Tel.TELEMETRY_SDK_NAME: "opentelemetry",
            Tel.TELEMETRY_SDK_VERSION: sdk_version,
        }
    )
    return Resource(attrs)


def sampler_from_env(env: Mapping[str, str]) -> Sampling.Sampler:
    name = _get(env, "OTEL_TRACES_SAMPLER").lower() or "parentbased_always_on"
    factory = _SAMPLERS.get(name)
    if factory is None:
        _log.warning("unknown OTEL_TRACES_SAMPLER=%r; using parentbased_always_on", name)
        factory = _SAMPLERS["parentbased_always_on"]
    rate = _number(env, "OTEL_TRACES_SAMPLER_ARG", 1.0)
    return factory(min(max(rate, 0.0), 1.0))


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    """The span exporter the variables ask for, or None when nothing is to be exported."""
    kind = _get(env, "OTEL_TRACES_EXPORTER").lower()
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    traces = _get(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = _get(env, "OTEL_EXPORTER_OTLP_ENDPOINT")
    if not traces and not base and kind != "otlp":
        return None
    protocol = _get(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL").lower()
    headers = dict(
        parse_env_headers(
            _get(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"), liberal=True
        )
    )
    timeout_ms = _number(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", 0) or _number(
        env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10_000
    )
    gzip = (
        _get(env, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION").lower() == "gzip"
    )
    if protocol == "grpc":
        import grpc  # type: ignore[import-untyped]  # grpcio ships no stubs; only Compression is used
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        insecure = _get(env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE").lower()
        return GrpcExporter(
            endpoint=traces or base or "http://localhost:4317",
            insecure={"true": True, "false": False}.get(insecure),
            headers=headers or None,
            timeout=timeout_ms / 1000,
            compression=grpc.Compression.Gzip if gzip else None,
            meter_provider=NoOpMeterProvider(),
        )
    if protocol not in ("", "http/protobuf"):
        _log.warning("OTLP protocol %r is not supported; using http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http import Compression

    from otel._otlp_http import OTLPSpanExporter as HttpExporter

    exporter = HttpExporter(
        endpoint=traces or f"{(base or 'http://localhost:4318').rstrip('/')}/v1/traces",
        headers=headers or None,
        timeout=timeout_ms / 1000,
        compression=Compression.Gzip if gzip else Compression.NoCompression,
        meter_provider=NoOpMeterProvider(),
    )
    exporter.prefer_urllib3(env)
    return exporter


def _span_limits(env: Mapping[str, str]) -> SpanLimits:
    length = int(_number(env, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", SpanLimits.UNSET))
    return SpanLimits(
        max_attributes=128,
        max_events=int(_number(env, "OTEL_SPAN_EVENT_COUNT_LIMIT", 128)),
        max_links=128,
        max_span_attributes=int(_number(env, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", 128)),
        max_event_attributes=128,
        max_link_attributes=128,
        max_attribute_length=length,
        max_span_attribute_length=length,
    )


EXPORT_BATCH = 64  # see the module docstring


def setup_telemetry(
    env: Mapping[str, str],
    *,
    capture_content: bool = False,
    exporter: SpanExporter | None = None,
    budget_reserved: Callable[[], float] | None = None,
) -> Telemetry:
    """Tracer (private `TracerProvider`, batch export, drop counting) and Prometheus `Metrics`.

    `capture_content` (config `otel.capture_content`) or the env variable turns content capture on.
    `exporter` replaces the exporter the variables describe (tests, `tollgate demo --otlp-json`);
    it is used even without an endpoint, but not when the SDK is disabled. `budget_reserved` feeds the
    `tollgate_budget_reserved_usd` gauge at scrape time. Call `Telemetry.shutdown()` at exit.
    """
    errors = ErrorCounter()
    capture = capture_content or capture_from_env(env)
    disabled = _get(env, "OTEL_SDK_DISABLED").lower() == "true"
    span_exporter = None if disabled else (exporter if exporter is not None else exporter_from_env(env))
    if span_exporter is None:
        metrics = Metrics(errors=errors, spans_dropped=lambda: 0, budget_reserved=budget_reserved)
        return Telemetry(
            tracer=None,
            provider=None,
            processor=None,
            sampler=None,
            ids=None,
            metrics=metrics,
            errors=errors,
            capture_content=capture,
        )
    processor = CountingSpanProcessor(
        span_exporter,
        max_queue_size=max(1, int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048))),
        schedule_delay_millis=max(1.0, _number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000)),
        max_export_batch_size=max(1, int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", EXPORT_BATCH))),
        export_timeout_millis=_number(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000),
    )
    ids = RunIdGenerator()
    sampler = sampler_from_env(env)
    limits = _span_limits(env)
    provider = TracerProvider(
        sampler=sampler,
        resource=resource_from_env(env),
        shutdown_on_exit=False,
        id_generator=ids,
        span_limits=limits,
        meter_provider=NoOpMeterProvider(),
    )
    provider.add_span_processor(processor)
    try:
        tollgate_version = version("tollgate")
    except PackageNotFoundError:
        tollgate_version = None
    # spans recorded without the SDK span's per-call machinery (otel/_fastspan.py); the provider stays
    # for flush and shutdown, and the processor gets the ReadableSpans the SDK tracer would build
    tracer = FastTracer(
        processor=processor,
        sampler=sampler,
        ids=ids,
        resource=provider.resource,
        scope=InstrumentationScope("tollgate", tollgate_version, SCHEMA_URL),
        limits=limits,
    )
    metrics = Metrics(errors=errors, spans_dropped=processor.dropped, budget_reserved=budget_reserved)
    return Telemetry(
        tracer=tracer,
        provider=provider,
        processor=processor,
        sampler=sampler,
        ids=ids,
        metrics=metrics,
        errors=errors,
        capture_content=capture,
    )
