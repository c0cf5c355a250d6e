"""JSON that keeps integers of any size, for messages tollgate re-serialises on an agent's behalf (MCP).

orjson reads an integer beyond 64 bits as a float and refuses to write one: an MCP tool's argument of
2**70 + 1 would reach the server as 1.1805916207174113e+21. JSON sets no such limit and the SDKs (Python's
`json`) read it exactly, so these helpers keep it: orjson first (strict, fast), the standard library
only when the bytes hold a digit run long enough to overflow it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# 19 digits: the shortest integer outside [-2**63, 2**64) has 19 (in a string too: then parsed twice)
_LONG_NUMBER = re.compile(rb"\d{19}")


def loads(raw: bytes) -> Any:
    """orjson's parse (raises orjson.JSONDecodeError as it does), with integers of any size exact.
    A document nested too deeply for the standard parser (it recurses per level, up to Python's limit
    of ~1000; orjson reads 1024) keeps orjson's reading, such an integer a float: every caller refuses
    that depth (`limits.max_json_depth`) before it forwards anything."""
    value = orjson.loads(raw)
    if _LONG_NUMBER.search(raw) is None:
        return value
    try:
        return json.loads(raw)  # orjson accepted it: the stricter parser judged, this one only reads it
    except RecursionError:
        return value


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """orjson's compact serialisation; an integer beyond 64 bits is written exactly."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    # an integer beyond 64 bits, or nesting deeper than orjson writes (values parsed from JSON hold nothing
    # else that orjson refuses)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys,
                          allow_nan=False).encode()
