"""Request bodies that repeat a key tollgate acts on, refused before anything is reserved or forwarded.

tollgate forwards the agent's original bytes when it changed nothing, and orjson keeps the last of two
equal names in one object. An upstream whose parser keeps the first would then run a request tollgate
did not judge: `"max_tokens": 100000, "max_tokens": 5` reserved for 5 tokens, or a first `tools` list
holding a tool the allow-list removed from the second. RFC 8259 leaves such a body's meaning to the
parser, so one that repeats a name tollgate reads is a 400 instead.

Cost: a body whose objects repeat no key at all (the common case) is known so by counting: orjson's
writing of the parsed body holds one `:` per key it kept, the raw bytes one per key sent, and both the
same colons inside strings (orjson writes a colon as it is, so only one spelled `\\u003a` in the raw bytes
could differ: such a body is checked the slow way). Equal counts mean no object lost a key. That is a
pattern search, two byte counts and one orjson write: about 60-100 us for a 65 KB agent body, against
300-700 us for the pattern pass and the standard parse this replaced (an Anthropic body with tool-use
history always needed the parse: `input` and `text` repeat across its blocks). The SDKs write a body as
orjson does (compact, UTF-8 as is): one equal to orjson's writing needs neither the search nor the
counts (~18 us at 65 KB). A body whose counts differ is parsed again by the standard parser, every
object's pairs checked.
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


# a tool's name the allow-list judged; every tool and many messages carry one
COMMON = "name"
# a colon spelled as an escape inside a string, which orjson writes as a plain colon: the one thing besides
# a lost key that can make the two counts of `:` differ (whitespace and quotes count no colon)
_ESCAPED_COLON = re.compile(rb"\\u003[aA]")


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


def _every_key_kept(raw: bytes, body: Any) -> bool:
    """Whether orjson kept every key of `raw` (parsed as `body`): see the module docstring. False also
    when the count cannot tell (the caller then checks every object)."""
    try:
        written = orjson.dumps(body)
    except orjson.JSONEncodeError:
        return False  # deeper than orjson writes: the exact check decides
    # the openai and anthropic SDKs (and httpx's `json=`) write compact JSON with UTF-8 as is, as orjson
    # does: bytes equal to orjson's writing hold exactly the keys it kept, with no scan of either
    if written == raw:
        return True
    if _ESCAPED_COLON.search(raw) is not None:
        return False
    return written.count(b":") == raw.count(b":")


def repeated_key(raw: bytes, body: Any = None) -> str | None:
    """The first watched name (or `name`) that some object of `raw` (a JSON document orjson accepted,
    parsed as `body`, which is parsed again when not given) holds twice, else None. Exact: a body whose
    objects repeat no key needs no second parse."""
    if _every_key_kept(raw, orjson.loads(raw) if body is None else body):
        return None
    try:
        json.loads(raw, object_pairs_hook=_pairs)
    except _Repeated as exc:
        return exc.name
    except (ValueError, RecursionError):
        return None  # orjson accepted it (its NaN, depth): nothing more to say than it did
    return None
