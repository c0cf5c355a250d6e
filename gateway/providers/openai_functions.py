"""The OpenAI chat wire's legacy function calling (`functions`, `function_call`), in neutral terms.

OpenAI still serves it, and agent frameworks still send it. tollgate treats it exactly as `tools`:
an offered function is a tool (allow-list, telemetry), a forced `function_call` is a forced tool, and
a proposed `message.function_call` (streamed as `delta.function_call`) is a tool call for the
allow-list, the tool-call cap and loop detection. A legacy call has no id, and at most one per choice
(its stream slot is call index `LEGACY`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.call import ToolSpec
from gateway.errors import InvalidRequest

LEGACY: Final = -1  # the call index of a choice's legacy function call in stream slots


def functions(value: Any) -> tuple[ToolSpec, ...]:
    """The offered `functions` as tools; absent or null is none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest("'functions' must be a list", param="functions")
    specs: list[ToolSpec] = []
    for index, fn in enumerate(value):
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"functions[{index}] must be {{name, ...}}", param="functions")
        params = fn.get("parameters")
        schema = params if isinstance(params, Mapping) else None
        specs.append(ToolSpec(fn["name"], fn.get("description"), schema))
    return tuple(specs)


def forced_function(value: Any) -> str | None:
    """The function a `function_call` forces, or None (`auto`, `none`, absent)."""
    if value is None:  # absent from most requests: no Mapping ABC test for it
        return None
    if isinstance(value, Mapping):
        if isinstance(value.get("name"), str):
            return str(value["name"])
        raise InvalidRequest("function_call must name a function", param="function_call")
    if value is None or value in ("auto", "none"):
        return None
    raise InvalidRequest("function_call must be auto, none or {name}", param="function_call")


def proposed(message: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, arguments) of a message's or delta's legacy `function_call`, if it carries one."""
    fn = message.get("function_call")
    if not isinstance(fn, Mapping):
        return None
    args = fn.get("arguments")
    return str(fn.get("name") or ""), args if isinstance(args, str) else ""


def tool_spec(value: Any) -> Mapping[str, Any] | None:
    """The object naming a Chat Completions tool, a forced choice or a call: `function`, or `custom` for a
    custom (free-text) tool (a streamed call's later deltas carry no `type`); None when it has neither."""
    if not (type(value) is dict or isinstance(value, Mapping)):  # an ABC isinstance costs ~5x a type test
        return None
    spec = value.get("custom") if value.get("type") == "custom" else value.get("function")
    if spec is None and "type" not in value:
        spec = value.get("custom")
    return spec if type(spec) is dict or isinstance(spec, Mapping) else None


def call_spec(call: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Chat Completions tool call's `function` (or `custom`), empty when it has neither (a streamed
    delta may carry only its index). Raises ValueError for one that is not an object (a malformed answer)."""
    spec = tool_spec(call)
    if spec is None:
        if call.get("function") is not None or call.get("custom") is not None:
            raise ValueError("a tool call's function is not an object")
        return {}
    return spec


def call_fields(call: Mapping[str, Any]) -> tuple[str, str]:
    """A Chat Completions tool call's (name, arguments): a function's JSON arguments, a custom tool's text.
    Raises ValueError as `call_spec`."""
    spec = call_spec(call)
    return str(spec.get("name", "")), str(spec.get("arguments", spec.get("input", "")) or "")
