"""Request bodies that repeat a key tollgate acts on, refused before anything is reserved or forwarded.

tollgate forwards the agent's original bytes when it changed nothing, and orjson keeps the last of two
equal names in one object. An upstream whose parser keeps the first would then run a request tollgate
did not judge: `"max_tokens": 100000, "max_tokens": 5` reserved for 5 tokens, or a first `tools` list
holding a tool the allow-list removed from the second. RFC 8259 leaves such a body's meaning to the
parser, so one that repeats a name tollgate reads is a 400 instead.

Cost: one regular expression pass over the raw bytes (about 1 µs for a short request, 60-200 µs
for a 46-54 KB agent request); the exact check (the standard parser, every object's pairs) runs only when a
watched name occurs twice anywhere or the body holds a `\\u` escape (a key may be spelled with one).
`name`, which most agent bodies hold many times (tools, messages), is suspected instead when orjson's
re-encoding of the parsed body holds fewer of it than the raw bytes (about 50 µs more for 45 KB).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# what the budget, the caps, the allow-list, the grammar check and routing read from a request, and what
# they refuse (a repeat could hide a refused value first: input tollgate cannot bound, background work,
# other models, a hosted MCP server, a pricier speed)
WATCHED = frozenset({
    "model", "messages", "input", "system", "instructions", "prompt",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "stream", "stream_options",
    "tools", "tool_choice", "allowed_tools", "functions", "function_call", "parallel_tool_calls",
    "max_tool_calls", "max_uses", "max_content_tokens", "response_format", "text", "format", "thinking",
    "budget_tokens", "reasoning", "modalities", "audio", "prediction", "service_tier", "speed",
    "web_search_options", "previous_response_id", "conversation", "background", "mcp_servers", "fallbacks",
    "context_management", "edits", "thread", "compaction",
})


def _names_pattern() -> re.Pattern[bytes]:
    """A watched name written as a key (`"name"` then `:`), its alternatives grouped by first letter: a
    string whose first letter starts no name is left at once, one that does tries only that letter's."""
    groups: dict[str, list[str]] = {}
    for name in sorted(WATCHED, key=len, reverse=True):
        groups.setdefault(name[0], []).append(name[1:])
    alternatives = b"|".join(
        re.escape(first.encode()) + b"(?:" + b"|".join(re.escape(rest.encode()) for rest in rests) + b")"
        for first, rests in sorted(groups.items()))
    return re.compile(rb'"(' + alternatives + rb')"\s*:')


_NAMES = _names_pattern()
# a tool's name the allow-list judged; every tool and many messages carry one, so the pattern above would
# send most agent bodies to the exact check
COMMON = "name"
_COMMON = b'"name"'


class _Repeated(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen and (name in WATCHED or name == COMMON):
            raise _Repeated(name)
        seen.add(name)
    return dict(pairs)


def _common_repeat_suspected(raw: bytes, body: Any) -> bool:
    """Whether orjson's writing of the parsed body holds fewer `"name"` than the raw bytes: orjson keeps
    the last of a repeated name, so a repeat is one occurrence less, and once the raw bytes hold no `\\u`
    escape nothing else changes the count (a `"` inside a string is written escaped either way)."""
    count = raw.count(_COMMON)
    if count < 2:
        return False
    try:
        return orjson.dumps(orjson.loads(raw) if body is None else body).count(_COMMON) != count
    except orjson.JSONEncodeError:
        return True  # deeper than orjson writes: the exact check decides


def repeated_key(raw: bytes, body: Any = None) -> str | None:
    """The first watched name (or `name`) that some object of `raw` (a JSON document orjson accepted,
    parsed as `body`, which is parsed again when not given) holds twice, else None. Exact: a body without
    an escape that names each watched key at most once and loses no `name` to orjson needs no parse."""
    if b"\\u" not in raw:
        found = _NAMES.findall(raw)
        if len(found) == len(set(found)) and not _common_repeat_suspected(raw, body):
            return None
    try:
        json.loads(raw, object_pairs_hook=_pairs)
    except _Repeated as exc:
        return exc.name
    except (ValueError, RecursionError):
        return None  # orjson accepted it (its NaN, depth): nothing more to say than it did
    return None
