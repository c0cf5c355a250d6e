"""otel/_wire.py: protobuf wire primitives, checked against opentelemetry-proto's own messages."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.internal.encoder import _VarintBytes  # type: ignore[import-untyped]
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel._wire import (
    _CACHE_LIMIT,
    _MEMO,
    Unsupported,
    _any_value,
    _key_value,
    attributes,
    field,
    utf8,
    varint,
)


def expected_any(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[expected_any(v) for v in value]))
    if isinstance(value, dict):
        return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=expected_any(v))
                                                          for k, v in value.items()]))
    return AnyValue()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**32, 2**63 - 1, 2**64 - 1])
def test_varint_matches_protobuf(value: int) -> None:
    assert varint(value) == _VarintBytes(value)


@pytest.mark.parametrize("value", [-1, -2, -(2**31), -(2**63)])
def test_negative_varint_is_int64_twos_complement(value: int) -> None:
    assert varint(value) == _VarintBytes(value + (1 << 64))
    assert len(varint(value)) == 10


@pytest.mark.parametrize("payload", [b"", b"x", b"a" * 127, b"b" * 128, b"c" * 70000])
def test_field_is_tag_length_payload(payload: bytes) -> None:
    assert field(b"\x0a", payload) == b"\x0a" + _VarintBytes(len(payload)) + payload


@pytest.mark.parametrize(
    "value",
    [
        "", "chat", "héllo ✓", True, False, 0, 1, -1, 2**63 - 1, -(2**63), 0.0, -0.0, 1.5, -2.25e300,
        b"", b"\x00\xff", ("a", "b"), ["x", 1, 2.5, True], (), {"k": "v", "n": 1}, {"outer": {"inner": [1]}},
    ],
)
def test_any_value_matches_the_sdk_message(value: Any) -> None:
    assert _any_value(value) == expected_any(value).SerializeToString()


def test_none_is_an_empty_any_value() -> None:
    assert _any_value(None) == b""


@pytest.mark.parametrize(
    "value",
    ["\ud800", 2**63, -(2**63) - 1, {1: "x"}, {"": "x"}, {"a", "b"}, object(), ("ok", "\udfff")],
)
def test_what_only_the_sdk_encoder_handles_is_unsupported(value: Any) -> None:
    with pytest.raises(Unsupported):
        _any_value(value)


def test_utf8_refuses_lone_surrogates() -> None:
    assert utf8("ok ✓") == "ok ✓".encode()
    with pytest.raises(Unsupported):
        utf8("bad \udc80")


@pytest.mark.parametrize(("key", "value"), [("gen_ai.operation.name", "chat"), ("n", 3), ("flag", False)])
def test_key_value_matches_the_sdk_message(key: str, value: Any) -> None:
    assert _key_value(key, value) == KeyValue(key=key, value=expected_any(value)).SerializeToString()


def test_an_empty_key_is_unsupported() -> None:
    with pytest.raises(Unsupported):
        _key_value("", "x")


def test_attributes_are_span_attribute_fields_in_order() -> None:
    attrs = {"a": "x", "b": 2, "c": 1.5, "d": ("p", "q"), "e": True, "long": "z" * 1000}
    encoded = b"".join(attributes(b"\x4a", attrs))  # Span.attributes is field 9
    span = Span()
    span.MergeFromString(encoded)
    assert [(kv.key, kv.value) for kv in span.attributes] == [(k, expected_any(v)) for k, v in attrs.items()]


@pytest.mark.parametrize(("first", "second"), [(True, 1), (1, True), (0.0, -0.0), (False, 0), ("1", 1)])
def test_memoised_fields_never_mix_equal_values_of_other_types(first: Any, second: Any) -> None:
    one = b"".join(attributes(b"\x4a", {"k": first}))
    two = b"".join(attributes(b"\x4a", {"k": second}))
    assert one == field(b"\x4a", KeyValue(key="k", value=expected_any(first)).SerializeToString())
    assert two == field(b"\x4a", KeyValue(key="k", value=expected_any(second)).SerializeToString())


@pytest.mark.parametrize("attrs", [None, {}])
def test_no_attributes_no_fields(attrs: dict[str, Any] | None) -> None:
    assert attributes(b"\x4a", attrs) == []


def _decoded(encoded: list[bytes]) -> list[tuple[str, AnyValue]]:
    span = Span()
    span.MergeFromString(b"".join(encoded))
    return [(kv.key, kv.value) for kv in span.attributes]


def test_a_tuple_holding_something_unhashable_is_encoded_unmemoised() -> None:
    attrs = {"k": ("a", ["x", 1])}
    assert _decoded(attributes(b"\x4a", attrs)) == [("k", expected_any(("a", ["x", 1])))]
    assert _decoded(attributes(b"\x4a", attrs)) == [("k", expected_any(("a", ["x", 1])))]


def test_the_memo_stays_bounded_and_right_across_a_clear() -> None:
    for i in range(_CACHE_LIMIT + 50):
        attrs = {"id": f"r-{i}", "n": i, "stable": "chat"}
        assert _decoded(attributes(b"\x4a", attrs)) == [(k, expected_any(v)) for k, v in attrs.items()]
        assert _MEMO.count <= _CACHE_LIMIT
    assert sum(len(table) for kinds in _MEMO.tables.values() for table in kinds.values()) == _MEMO.count
