"""Grammar-constrained outputs: which constraints apply to a step, how the upstream is asked to honour
them natively, and the verdict on an answer (its text and its tool-call arguments).

Sources of constraints: the agent's `output.grammar`, the header `x-tollgate-grammar`, and what an
OpenAI-wire request brings itself (`response_format`, vLLM `guided_*` / `structured_outputs`). All of
them apply: an answer must satisfy each. Pure apart from compiling off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from gateway.call import Answer, Call
from gateway.errors import InvalidGrammar
from gateway.frozen_init import fast_init
from gateway.identity import header_values
from grammars.checker import IncrementalChecker
from grammars.compile import Constraint, compile_async
from grammars.library import GrammarLibrary
from grammars.native import native_is_exact, native_params
from grammars.reask import reask_instruction
from grammars.requests import (
    anthropic_constraints,
    request_constraints,
    responses_constraints,
    strip_guided_fields,
)
from grammars.spec import ConstraintSpec, Violation
from grammars.tool_args import validate_tool_arguments

GRAMMAR_HEADER = "x-tollgate-grammar"
_GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs",
           "guided_decoding_backend", "guided_whitespace_pattern")
_VLLM = ("vllm", "vllm-legacy")
# what a request body asks for itself, by wire protocol
_FROM_BODY: dict[str, Callable[[Mapping[str, Any]], tuple[ConstraintSpec, ...]]] = {
    "openai": request_constraints,
    "openai_responses": responses_constraints,
    "anthropic": anthropic_constraints,
}


def _native_in_body(call: Call, dialect: str) -> tuple[bool, bool]:
    """Whether the request already asks the upstream for its first constraint in the upstream's own
    form, and whether that form fixes the output exactly, key order included: OpenAI's only in strict
    mode; vLLM's only in the fields of the generation the dialect names (the other one's it ignores)."""
    raw = call.raw
    if call.protocol == "anthropic":  # Anthropic constrains to the schema; no claim on key order
        return True, False
    if call.protocol == "openai_responses":
        text: Mapping[str, Any] = raw["text"] if isinstance(raw.get("text"), Mapping) else {}
        fmt: Mapping[str, Any] = text["format"] if isinstance(text.get("format"), Mapping) else {}
        native = dialect == "openai" and fmt.get("type") in ("json_schema", "json_object")
        return native, native and fmt.get("strict") is True
    if dialect == "openai" and "response_format" in raw:
        rf = raw.get("response_format")
        schema = rf.get("json_schema") if isinstance(rf, Mapping) else None
        return True, isinstance(schema, Mapping) and schema.get("strict") is True
    if dialect == "vllm" and "structured_outputs" in raw:
        return True, True
    if dialect == "vllm-legacy" and any(k in raw for k in _GUIDED if k != "structured_outputs"):
        return True, True
    return False, False


@fast_init
@dataclass(frozen=True, slots=True)
class OutputPlan:
    constraints: tuple[Constraint, ...]
    retries: int
    stream_check: str  # incremental | buffer
    native: Mapping[str, Any] | None  # request fields that make the upstream constrain natively
    native_exact: bool  # the native form fixes key order exactly like the first constraint
    strip_guided: bool  # the request's vLLM-only fields must not reach this upstream

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(c.spec.kind for c in self.constraints)

    @property
    def current(self) -> bool:
        """False once a constraint's compile is spoiled (`Constraint.spoiled`): plan again."""
        return all(c.current for c in self.constraints)

    def checkers(self) -> list[IncrementalChecker]:
        return [c.checker(native=self.native_exact and i == 0) for i, c in enumerate(self.constraints)]


@fast_init
@dataclass(frozen=True, slots=True)
class OutputVerdict:
    violation: Violation
    kind: str
    instruction: str
    answer_text: str | None = None  # the choice's text that broke it, quoted by its re-ask (None: the first's)


class Resolver:
    """Grammar references (names or inline constraints) resolved once: the agent's `output.grammar`
    and the `x-tollgate-grammar` values repeat on every step. Bounded: headers come from agents."""

    def __init__(self, library: GrammarLibrary, size: int = 256, max_source_bytes: int | None = None) -> None:
        self._library = library
        self._size = size
        self.max_source_bytes = max_source_bytes  # of a request's own constraints (`limits.max_schema_bytes`)
        self._specs: dict[str, ConstraintSpec] = {}
        self.plans: dict[tuple[Any, ...], OutputPlan] = {}  # see plan_outputs; bounded like _specs

    def remember(self, key: tuple[Any, ...], plan: OutputPlan) -> None:
        if len(self.plans) >= self._size:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = plan

    def resolve(self, ref: str) -> ConstraintSpec:
        spec = self._specs.get(ref)
        if spec is None:
            spec = self._library.resolve(ref)  # InvalidGrammar is not cached: a fixed file may appear
            if len(self._specs) >= self._size:
                self._specs.pop(next(iter(self._specs)))
            self._specs[ref] = spec
        return spec


async def plan_outputs(
    library: Resolver, call: Call, headers: Mapping[str, str], grammar_ref: str | None, retries: int,
    stream_check: str, dialect: str,
) -> OutputPlan | None:
    """The constraints of a step, compiled (cached by content). Raises InvalidGrammar (400)."""
    header = header_values(headers, GRAMMAR_HEADER)  # every copy of the header applies
    body_constraints = _FROM_BODY.get(call.protocol)
    from_request = body_constraints(call.raw) if body_constraints is not None else ()
    if not (grammar_ref or header or from_request):
        return None
    if call.protocol == "openai_responses" and dialect != "openai":
        dialect = "none"  # other dialects' native fields belong to Chat Completions bodies
    body_has_guided = call.protocol == "openai" and any(k in call.raw for k in _GUIDED)
    # without constraints from the body, the plan depends only on these: an agent's steps share one
    key = (grammar_ref, header, retries, stream_check, dialect, body_has_guided)
    cached = None if from_request else library.plans.get(key)
    if cached is not None and cached.current:
        return cached
    specs: list[ConstraintSpec] = []
    if grammar_ref:
        specs.append(library.resolve(grammar_ref))
    specs.extend(library.resolve(value.strip()) for value in header)
    specs.extend(from_request)
    _check_sizes(from_request, library.max_source_bytes)  # a header's is bounded by its size, a name's trusted
    unique = list({s.key: s for s in specs}.values())
    own = next((s for s in unique if s in from_request), None)
    if own is not None and own is not unique[0] and _native_in_body(call, dialect)[0]:
        # the request's own constraint, already in the upstream's form, is forwarded as sent: an agent's
        # or a header's grammar never replaces it natively (it may be the weaker); they are validated after
        unique.remove(own)
        unique.insert(0, own)
    first = unique[0]
    already_native, body_exact = (_native_in_body(call, dialect) if from_request and first in from_request
                                  else (False, False))
    if len(first.source) > _ON_LOOP_CHARS:  # rewriting a large schema takes milliseconds: off the loop
        native, exact = await asyncio.to_thread(_native_form, dialect, first, already_native, body_exact)
    else:
        native, exact = _native_form(dialect, first, already_native, body_exact)
    # answers are validated against the constraints as given: a native rewrite only narrows them
    constraints = tuple([await compile_async(s) for s in unique])
    plan = OutputPlan(constraints, retries, stream_check, native, exact,
                      strip_guided=body_has_guided and dialect not in _VLLM)
    if not from_request:
        library.remember(key, plan)
    return plan


_ON_LOOP_CHARS: Final = 16 * 1024  # a schema rewritten on the event loop (~0.2 ms per KB), larger ones off it


def _native_form(dialect: str, first: ConstraintSpec, already_native: bool,
                 body_exact: bool) -> tuple[Mapping[str, Any] | None, bool]:
    """The first constraint's native request fields (None when the body has them already or the dialect
    has none), and whether they fix the output exactly."""
    native = None if already_native else native_params(dialect, first)
    return native, native_is_exact(dialect, first) and (native is not None or body_exact)


def _check_sizes(specs: tuple[ConstraintSpec, ...], limit: int | None) -> None:
    """Raise InvalidGrammar when a request's constraints are longer than `limit` bytes together:
    compiling and rewriting them for strict mode would cost seconds, some of it on the event loop."""
    if limit is not None and sum(len(spec.source) for spec in specs) > limit // 4:
        size = sum(len(spec.source.encode("utf-8", "surrogatepass")) for spec in specs)
        if size > limit:
            raise InvalidGrammar(f"the request's output constraints are {size} bytes together, more than "
                                 f"limits.max_schema_bytes ({limit})")


def _into_text_format(body: dict[str, Any], native: Mapping[str, Any]) -> None:
    """OpenAI's native `response_format` as a Responses `text.format` (flat: name, schema, strict)."""
    rf = native.get("response_format")
    if not isinstance(rf, Mapping):
        raise TypeError(f"no Responses form for native fields {sorted(native)}")  # plan_outputs forbids it
    text = body.get("text")
    fmt = {"type": rf["type"], **rf.get("json_schema", {})}
    body["text"] = {**(text if isinstance(text, Mapping) else {}), "format": fmt}


# how native fields enter a body, by wire protocol (default: merged at the top level)
_NATIVE_INTO: dict[str, Callable[[dict[str, Any], Mapping[str, Any]], None]] = {
    "openai_responses": _into_text_format,
}


def apply_native(plan: OutputPlan, body: dict[str, Any], protocol: str) -> bool:
    """Merge native constraint fields into the request body; True when the body changed."""
    changed = False
    if plan.strip_guided:
        stripped = strip_guided_fields(body)
        body.clear()
        body.update(stripped)
        changed = True
    if plan.native:
        into = _NATIVE_INTO.get(protocol)
        if into is not None:
            into(body, plan.native)
        else:
            body.update(plan.native)
        changed = True
    return changed


def judge_tool_arguments(call: Call, answer: Answer) -> OutputVerdict | None:
    """The first call in the answer whose arguments break the parameter schema its tool declared.
    Raises InvalidGrammar when that schema cannot be checked (the tool declaration is broken)."""
    if not answer.tool_calls or not call.tools:
        return None
    schemas = {t.name: t.parameters for t in call.tools}
    for tool_call in answer.tool_calls:
        if tool_call.name in schemas:
            violation = validate_tool_arguments(schemas[tool_call.name], tool_call.arguments)
            if violation is not None:
                message = f"arguments of tool {tool_call.name!r}: {violation.message}"
                return OutputVerdict(
                    Violation(message, violation.offset,
                              f"arguments of tool {tool_call.name!r}: {violation.redacted}"), "tool_arguments",
                    "Your previous tool call had invalid arguments.\n"
                    f"Error: {message}\nCall the tool again with arguments that satisfy its parameter schema.",
                )
    return None


CHECK_ON_LOOP_CHARS: Final = 64 * 1024
"""An answer longer than this (text and tool arguments together) is checked in a worker thread: a check
may take time in proportion to the answer up to its bounds (`engine.Fuel`, the schema keyword budget),
seconds for a megabyte, and no other request should wait for it. Shorter ones are checked at once: the
thread hop costs more than their check."""
T = TypeVar("T")


def answer_chars(answer: Answer) -> int:
    return (len(answer.text) + sum(map(len, answer.other_texts))
            + sum(len(call.arguments) for call in answer.tool_calls))


async def off_loop_if_long(answer: Answer, check: Callable[[], T]) -> T:
    """`check()`, in a worker thread when `answer` is longer than `CHECK_ON_LOOP_CHARS`."""
    if answer_chars(answer) > CHECK_ON_LOOP_CHARS:
        return await asyncio.to_thread(check)
    return check()


PAUSED: Final = frozenset({"pause_turn"})
"""Finish reasons of a turn the provider paused (Anthropic: a long server-tool turn the agent sends back
as it is for the model to go on): its text is a fragment, and the text constraints hold for the turn's
final answer."""


def unfinished(answer: Answer) -> bool:
    return any(reason in PAUSED for reason in answer.finish_reasons)


def refused(answer: Answer) -> bool:
    """The model refused instead of answering (OpenAI's `refusal` without content, Anthropic's
    `stop_reason: refusal`): the SDKs surface it as such and a re-ask cannot change it (Anthropic: the
    refused turn must be removed before the conversation goes on). For several choices, the first's."""
    return answer.refused or answer.finish_reasons[:1] == ("refusal",)


def held_to_text(answer: Answer) -> bool:
    """Whether the (first choice's) text is held to the text constraints: not a paused turn, nor a
    refusal."""
    return not (refused(answer) or unfinished(answer))


def judge(plan: OutputPlan | None, call: Call, answer: Answer) -> OutputVerdict | None:
    """The first violation of the answer: tool arguments against their declared schemas, then text
    against every constraint. An answer that calls tools, or a paused turn (`unfinished`), is not held
    to the text constraints: it is no final answer, and text before its calls is a preamble ("I'll look
    that up"); a refusal (`refused`) is not either, but the other choices still are."""
    verdict = judge_tool_arguments(call, answer)
    if verdict is not None:
        return verdict
    if plan is None or unfinished(answer):
        return None
    # every choice reaches the agent (OpenAI's `n`), so every choice's text must conform, but one that
    # calls tools is no final answer: its text is a preamble
    prefill = "" if answer.after_provider_tool else call.prefill
    texts = [*enumerate(answer.other_texts, 1)] if refused(answer) else [
        (0, prefill + answer.text), *enumerate(answer.other_texts, 1)]
    for choice, text in texts:
        if _calls_tools(answer, choice):
            continue
        for constraint in plan.constraints:
            violation = constraint.validate(text)
            if violation is not None:
                # a re-ask quotes the text that broke it (another choice's, for `n`; the first without prefill)
                return OutputVerdict(violation, constraint.spec.kind, reask_instruction(violation, constraint.spec),
                                     None if choice == 0 else text)
    return None


def _calls_tools(answer: Answer, choice: int) -> bool:
    """Whether choice `choice` (0: the first) calls tools; an answer of one choice says so in
    `tool_calls` alone (other protocols fill no `choice_calls`)."""
    if choice < len(answer.choice_calls):
        return bool(answer.choice_calls[choice])
    return choice == 0 and bool(answer.tool_calls)


def resolve_agent_grammars(library: GrammarLibrary, agents: Mapping[str, Any]) -> None:
    """Config-load check: every agent's `output.grammar` resolves and compiles."""
    from gateway.errors import ConfigError

    problems = []
    for name, agent in agents.items():
        ref = agent.output.grammar
        if ref:
            try:
                library.resolve(ref)
            except InvalidGrammar as exc:
                problems.append((f"agents.{name}.output.grammar", exc.message))
    if problems:
        raise ConfigError(problems)
