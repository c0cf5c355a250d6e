"""gateway.exact_json: integers of any size survive a parse and a serialisation."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway import exact_json


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"n": 1180591620717411303425}', {"n": 2**70 + 1}),
        (b"[-9223372036854775809, 18446744073709551615]", [-(2**63) - 1, 2**64 - 1]),
        (b'{"s": "12345678901234567890", "f": 1.5}', {"s": "12345678901234567890", "f": 1.5}),
        (b'{"a": 1, "a": 2}', {"a": 2}),
    ],
)
def test_loads_keeps_every_integer_exact(raw: bytes, value: object) -> None:
    assert exact_json.loads(raw) == value


@pytest.mark.parametrize("raw", [b"{", b'{"n": 1e400}', b'["\\ud800"]', b'{"n": 12345678901234567890123, }'])
def test_loads_refuses_what_orjson_refuses(raw: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        exact_json.loads(raw)


def test_dumps_writes_big_integers_exactly_and_orjsons_bytes_otherwise() -> None:
    assert exact_json.dumps({"b": 2**70, "a": "é"}, sort_keys=True) == '{"a":"é","b":1180591620717411303424}'.encode()
    assert exact_json.dumps({"b": 1, "a": [1.5, None]}) == orjson.dumps({"b": 1, "a": [1.5, None]})
    assert exact_json.loads(exact_json.dumps({"n": -(2**80)})) == {"n": -(2**80)}


DEEP = b"[" * 1000 + b"12345678901234567890123" + b"]" * 1000  # orjson reads 1024 levels


def innermost(value: Any) -> Any:
    for _ in range(1000):
        value = value[0]
    return value


def test_loads_too_deep_for_the_standard_parser_keeps_orjsons_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    def too_deep(raw: bytes) -> Any:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")

    # Python 3.11's json recurses past its limit at ~1000 levels; 3.12's reads deeper than orjson does,
    # so the refusal is simulated to hold the fallback on every version
    monkeypatch.setattr(exact_json.json, "loads", too_deep)
    assert innermost(exact_json.loads(DEEP)) == orjson.loads(b"12345678901234567890123")  # a float: every
    # caller refuses this depth (`limits.max_json_depth`) before it forwards anything


def test_loads_a_deep_document_without_raising_on_this_python() -> None:
    try:
        best = innermost(json.loads(DEEP))  # exact where the standard parser reads this depth (3.12+)
    except RecursionError:
        best = orjson.loads(b"12345678901234567890123")  # 3.11: orjson's float
    assert innermost(exact_json.loads(DEEP)) == best
