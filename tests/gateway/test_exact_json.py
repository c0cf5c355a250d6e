"""gateway.exact_json: integers of any size survive a parse and a serialisation."""

from __future__ import annotations

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


def test_loads_too_deep_for_the_standard_parser_keeps_orjsons_reading() -> None:
    raw = b"[" * 1000 + b"12345678901234567890123" + b"]" * 1000  # orjson reads 1024 levels, json ~1000
    value = exact_json.loads(raw)
    for _ in range(1000):
        value = value[0]
    assert value == orjson.loads(b"12345678901234567890123")  # a float: every caller refuses this depth
