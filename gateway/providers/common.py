"""Helpers shared by the adapters: request-shape checks and small conversions (pure)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gateway.config import Limits
from gateway.errors import InvalidRequest, RequestTooLarge


def json_depth_ok(value: Any, limit: int) -> bool:
    """True when nesting of lists/objects stays within `limit` (iterative; stops at the first breach)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    return True


IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})  # chat, Responses, Anthropic content parts


def _objects(value: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside `value`, itself included (iterative: no recursion limit)."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))


def _referenced_document(node: Mapping[str, Any]) -> bool:
    kind, file, source = node.get("type"), node.get("file"), node.get("source")
    if kind == "file":
        return isinstance(file, Mapping) and bool(file.get("file_id"))
    return kind == "document" and isinstance(source, Mapping) and source.get("type") in ("url", "file")


def count_referenced_documents(body: Mapping[str, Any], raw: bytes) -> int:
    """Documents a request names instead of sending (Chat Completions `file` parts by `file_id`,
    Anthropic `document` blocks whose source is a URL or a file): their tokens are unknown here."""
    if b"file" not in raw and b"document" not in raw:
        return 0
    return sum(1 for node in _objects(body) if _referenced_document(node))


def count_images(body: Mapping[str, Any], raw: bytes) -> int:
    """Image parts anywhere in a request (messages, tool results): an image's tokens follow its pixels,
    not its bytes (a URL is a few bytes; a flat PNG compresses far below its token count), so the
    budget bounds each one apart (`guards.budget`). The byte search skips the walk for most requests."""
    if b"image" not in raw:
        return 0
    kinds = (node.get("type") for node in _objects(body))
    return sum(1 for kind in kinds if isinstance(kind, str) and kind in IMAGE_PARTS)


def require_list(body: Mapping[str, Any], key: str, *, required: bool) -> list[Any]:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidRequest(f"'{key}' is required", param=key)
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"'{key}' must be an array", param=key)
    return value


def require_model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    return model


def check_counts(messages: list[Any], tools: list[Any], limits: Limits) -> None:
    if len(messages) > limits.max_messages:
        raise RequestTooLarge(f"{len(messages)} messages exceed the limit of {limits.max_messages}")
    if len(tools) > limits.max_tools:
        raise RequestTooLarge(f"{len(tools)} tools exceed the limit of {limits.max_tools}")


def opt_number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    return float(value)


def opt_int(body: Mapping[str, Any], key: str, *, minimum: int = 0, maximum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value >= 2**63 and value.is_integer():
        value = int(value)  # orjson reads an integer beyond 64 bits as a float: it is still an integer
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"'{key}' must be an integer >= {minimum}", param=key)
    if maximum is not None and value > maximum:
        raise InvalidRequest(f"'{key}' must be an integer from {minimum} to {maximum}", param=key)
    return value


MAX_TOKEN_COUNT = 1 << 53  # no answer uses more; a JSON number beyond it is not a count


def token_count(value: Any) -> int:
    """A usage count as a provider reports it: absent is 0, an integer (JSON may write `12.0`) from 0
    to `MAX_TOKEN_COUNT` is itself. Raises ValueError for anything else (negative, fractional, huge,
    not a number): such usage is not believed (the step settles at its reservation)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"token count {value!r} is not a number")  # noqa: TRY004 - one error for all
    if not 0 <= value <= MAX_TOKEN_COUNT or int(value) != value:  # NaN fails the range test
        raise ValueError(f"token count {value!r} is out of range")
    return int(value)


def required_count(value: Any) -> int:
    """`token_count` of a count every usage report carries (input, output): absent raises ValueError too,
    so a `usage: {}` is no report at all (settled at the reservation), never a free call."""
    if value is None:
        raise ValueError("a usage report without its input or output count")
    return token_count(value)


def opt_strings(value: Any) -> tuple[str, ...] | None:
    """Stop sequences for telemetry: a string, or the strings of a list; None when absent. What is not
    a string is left out here (the body goes upstream as it came, and the provider judges it)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(item for item in value if isinstance(item, str))
    return None


def usage_detail(details: Any, key: str) -> Any:
    """`details[key]` of a usage details object, or None when it is not an object."""
    return details.get(key) if isinstance(details, Mapping) else None


def stop_text(reason: str, detail: str) -> str:
    return f"tollgate stopped this run ({reason}): {detail}"


def content_text(content: Any) -> str:
    """Text of a message `content` that is a string or a list of parts/blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                elif part.get("type") in ("tool_result",):
                    parts.append(content_text(part.get("content")))
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return "" if content is None else str(content)


def request_basics(
    body: Mapping[str, Any], limits: Limits, role_ok: Callable[[Any], bool], role_rule: str
) -> tuple[str, list[Any], list[Any], bool]:
    """The fields every chat request has: model, messages (each with a valid role), tools, stream."""
    model = require_model(body)
    messages = require_list(body, "messages", required=True)
    raw_tools = require_list(body, "tools", required=False)
    check_counts(messages, raw_tools, limits)
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not role_ok(message.get("role")):
            raise InvalidRequest(f"messages[{index}] {role_rule}", param="messages")
    stream = body.get("stream")
    if stream is None:  # absent, or null (the OpenAI SDK sends `stream=None` as null): not streaming
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return model, messages, raw_tools, stream
