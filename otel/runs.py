"""Trace shape: one trace per run, or the agent's own trace.

- The agent sent a W3C `traceparent`: `context_from_headers` extracts it, step spans are its children,
  and `inject_headers` passes the step span's context upstream.
- It did not: every step of a run is parented to the run's `invoke_agent {agent}` root span (INTERNAL,
  `gen-ai-agent-spans.md`). Its trace id and span id are derived from the run id, so steps can name
  their parent long before it exists; the root span itself is created and exported by
  `Telemetry.end_run` when the run ends, with the run's totals and its real start time.

Run epochs: a run id is reused after `POST /admin/runs/{id}/reset`. Each incarnation ("epoch") has its
own derived ids, from `(run_id, epoch)`; pass the same `epoch` to `run_parent` and `end_run` (the
number of resets, or any value that changes when the run starts afresh; default 0). A stop or a
reset ends an epoch's root for good: a step arriving after a stop still lands under the exported root.
An idle run's root is exported too, but not for good: a step of the run after that goes under the
epoch's next root ("segment", same trace, its span id derived from `(run_id, epoch, segment)`,
starting where the previous one ended), which the next export carries with the run's totals then, its
stop reason included. Otherwise a run that paused longer than the idle time kept a root saying it was
fine, and its stop was on no root. Which segment a span goes under, and which one is exported when,
is the run store's to say (`RunState.root_segment`, `RunStore.claim_root`): every gateway process
sharing the store then exports each root once.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv.attributes import error_attributes as Error
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

from gateway.call import digest
from gateway.frozen_init import fast_init
from otel.attributes import (
    TOLLGATE_AGENT,
    TOLLGATE_COST_USD,
    TOLLGATE_LLM_CALLS,
    TOLLGATE_PATH_FINGERPRINT,
    TOLLGATE_RUN_EPOCH,
    TOLLGATE_RUN_ID,
    TOLLGATE_RUN_SEGMENT,
    TOLLGATE_STOP_REASON,
    TOLLGATE_TOOL_CALLS,
    Attributes,
    present,
)
from otel.propagation import context_from_headers, inject_headers

# fmt: off
__all__ = [
    "GATEWAY_PROVIDER", "INVOKE_AGENT", "TOLLGATE_CHARGED_INPUT_TOKENS", "TOLLGATE_CHARGED_OUTPUT_TOKENS",
    "RunIdGenerator", "RunParents", "RunTotals", "context_from_headers",
    "inject_headers", "path_fingerprint", "run_ids", "run_root_attributes"
]
# fmt: on

INVOKE_AGENT = GenAI.GenAiOperationNameValues.INVOKE_AGENT.value
GATEWAY_PROVIDER = "tollgate"
"""`gen_ai.provider.name` of a run root whose steps used several providers (custom value)."""
TOLLGATE_CHARGED_INPUT_TOKENS: Final = "tollgate.charged.input_tokens"
"""Run root, in place of `gen_ai.usage.input_tokens` when a step's usage was not reported (a cut stream, a
timeout: the step is charged its reservation): the tokens charged, which overstate those the provider
counted, so they are no usage (semconv: not obtained, not reported). int."""
TOLLGATE_CHARGED_OUTPUT_TOKENS: Final = "tollgate.charged.output_tokens"
"""As `TOLLGATE_CHARGED_INPUT_TOKENS`, for output tokens."""


@fast_init
@dataclass(frozen=True, slots=True)
class RunTotals:
    """What the root span of a run reports. `provider_name` is the run's single provider, if any."""

    cost_usd: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    llm_calls: int = 0
    tool_calls: int = 0
    stop_reason: str | None = None
    path_fingerprint: str | None = None
    provider_name: str | None = None
    usage_estimated: bool = False  # a step was charged without provider-reported usage (its reservation)


def path_fingerprint(decisions: Sequence[str]) -> str:
    """Hash of a run's decision sequence (e.g. `llm:continue`, `tool:search_kb:allowed`): runs that
    took the same path have the same fingerprint; order matters."""
    return digest(*(decision.encode("utf-8", "surrogatepass") for decision in decisions))


def run_ids(run_id: str, epoch: int | str = 0, segment: int = 0) -> tuple[int, int]:
    """(trace id, span id) of a run epoch's root span (of its `segment`-th root: one trace, another span
    id): 128 + 64 uniformly distributed, non-zero bits (ratio samplers stay fair), stable across
    processes."""
    raw = hashlib.blake2b(
        f"{run_id}\x00{epoch}".encode("utf-8", "surrogatepass"), digest_size=24, person=b"tollgate.run"
    ).digest()
    if segment:
        raw = raw[:16] + hashlib.blake2b(f"{run_id}\x00{epoch}\x00{segment}".encode("utf-8", "surrogatepass"),
                                         digest_size=8, person=b"tollgate.seg").digest()
    trace_id = int.from_bytes(raw[:16], "big") or 1
    span_id = int.from_bytes(raw[16:], "big") or 1
    return trace_id, span_id


def run_root_attributes(run_id: str, agent: str, totals: RunTotals, epoch: int | str = 0,
                        segment: int = 0) -> Attributes:
    """Attributes of the `invoke_agent {agent}` root span (INTERNAL: an agent run seen in process)."""
    return present(
        (
            (GenAI.GEN_AI_OPERATION_NAME, INVOKE_AGENT),
            (GenAI.GEN_AI_PROVIDER_NAME, totals.provider_name or GATEWAY_PROVIDER),
            (GenAI.GEN_AI_AGENT_NAME, agent or None),
            (TOLLGATE_AGENT, agent or None),
            (TOLLGATE_RUN_ID, run_id),
            (TOLLGATE_RUN_EPOCH, epoch if epoch != 0 else None),
            (TOLLGATE_RUN_SEGMENT, segment or None),
            (TOLLGATE_CHARGED_INPUT_TOKENS if totals.usage_estimated else GenAI.GEN_AI_USAGE_INPUT_TOKENS,
             totals.input_tokens),
            (TOLLGATE_CHARGED_OUTPUT_TOKENS if totals.usage_estimated else GenAI.GEN_AI_USAGE_OUTPUT_TOKENS,
             totals.output_tokens),
            (TOLLGATE_COST_USD, float(totals.cost_usd)),
            (TOLLGATE_LLM_CALLS, totals.llm_calls),
            (TOLLGATE_TOOL_CALLS, totals.tool_calls),
            (TOLLGATE_STOP_REASON, totals.stop_reason or None),
            (Error.ERROR_TYPE, totals.stop_reason or None),
            (TOLLGATE_PATH_FINGERPRINT, totals.path_fingerprint or None),
        )
    )


class RunIdGenerator(RandomIdGenerator):
    """Random ids, except inside `override(trace_id, span_id)`, where the next root span gets exactly
    those ids. The override lives in a context variable owned by this generator (one per
    `TracerProvider`), so concurrent requests and tasks never see each other's override."""

    def __init__(self) -> None:
        self._override: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
            f"tollgate_run_ids_{id(self):x}", default=None
        )

    @contextmanager
    def override(self, trace_id: int, span_id: int) -> Iterator[None]:
        token = self._override.set((trace_id, span_id))
        try:
            yield
        finally:
            self._override.reset(token)

    def generate_trace_id(self) -> int:
        chosen = self._override.get()
        return chosen[0] if chosen is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        chosen = self._override.get()
        return chosen[1] if chosen is not None else super().generate_span_id()


class RunParents:
    """Parent contexts of runs' steps: the (future) root span `invoke_agent {agent}` of a run epoch,
    with the `run_ids` ids and the sampler's root decision in its flags.

    Memoised per (run, agent, epoch), at most `kept` entries (cleared when full: runs come and go).
    That is exact because the ids are derived and the root decision of every sampler
    `sampler_from_env` builds depends on the trace id only; contexts are immutable, so sharing one
    between steps is safe."""

    __slots__ = ("_cache", "_kept", "_sampler")

    def __init__(self, sampler: Sampler, kept: int = 4096) -> None:
        self._sampler = sampler
        self._kept = kept
        self._cache: dict[tuple[str, str, int | str, int], Context] = {}

    def get(self, run_id: str, agent: str, epoch: int | str, segment: int = 0) -> Context:
        key = (run_id, agent, epoch, segment)
        parent = self._cache.get(key)
        if parent is not None:
            return parent
        trace_id, span_id = run_ids(run_id, epoch, segment)
        name = f"{INVOKE_AGENT} {agent}"
        decision = self._sampler.should_sample(Context(), trace_id, name, SpanKind.INTERNAL)
        sampled = decision.decision.is_sampled()  # type: ignore[no-untyped-call]  # unannotated in SDK
        flags = TraceFlags.RANDOM_TRACE_ID | (TraceFlags.SAMPLED if sampled else 0)
        root = SpanContext(
            trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags),
            trace_state=decision.trace_state,
        )
        parent = set_span_in_context(NonRecordingSpan(root), Context())
        if len(self._cache) >= self._kept:
            self._cache.clear()
        self._cache[key] = parent
        return parent
