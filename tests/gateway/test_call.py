"""gateway/call.py: canonical JSON, content digests and the fingerprints guards compare."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from gateway.call import (
    Answer,
    Call,
    ToolCall,
    ToolResult,
    Usage,
    canonical_arguments,
    canonical_json,
    digest,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"b": 1, "a": [2, {"d": 1, "c": 0}]}, b'{"a":[2,{"c":0,"d":1}],"b":1}'),
        ([], b"[]"),
        ("é", '"é"'.encode()),
        (None, b"null"),
    ],
)
def test_canonical_json(value: object, expected: bytes) -> None:
    assert canonical_json(value) == expected


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"b": 1, "a": 2}', b'{"a":2,"b":1}'),
        ('{ "a" : 2 , "b":1 }', b'{"a":2,"b":1}'),
        ("", b"{}"),  # no arguments is the empty object
        ("not json", b"not json"),  # kept verbatim
        ('{"a": ', b'{"a": '),
        ("\ud800", b"\xed\xa0\x80"),  # a lone surrogate the model wrote is kept, not an error
    ],
)
def test_canonical_arguments(arguments: str, expected: bytes) -> None:
    assert canonical_arguments(arguments) == expected


def test_digest_is_blake2b_of_length_prefixed_parts() -> None:
    h = hashlib.blake2b(digest_size=16)
    for part in (b"ab", b"c"):
        h.update(len(part).to_bytes(8, "big") + part)
    assert digest(b"ab", b"c") == h.hexdigest()
    assert len(digest()) == 32


@pytest.mark.parametrize(
    ("left", "right"),
    [((b"ab", b"c"), (b"a", b"bc")), ((b"",), ()), ((b"x",), (b"x", b""))],
)
def test_digest_keeps_part_boundaries(left: tuple[bytes, ...], right: tuple[bytes, ...]) -> None:
    assert digest(*left) != digest(*right)


@pytest.mark.parametrize(
    ("one", "two", "same"),
    [
        (ToolCall("1", "f", '{"a":1,"b":2}'), ToolCall("2", "f", '{"b": 2, "a": 1}'), True),  # ids and order
        (ToolCall("1", "f", '{"a":1}'), ToolCall("1", "g", '{"a":1}'), False),
        (ToolCall("1", "f", '{"a":1}'), ToolCall("1", "f", '{"a":2}'), False),
        (ToolCall("1", "f", ""), ToolCall("1", "f", "{}"), True),
        (ToolCall("1", "fa", "{}"), ToolCall("1", "f", 'a{}'), False),  # name and arguments stay apart
    ],
)
def test_tool_call_fingerprint(one: ToolCall, two: ToolCall, same: bool) -> None:
    assert (one.fingerprint == two.fingerprint) is same


def test_tool_result_fingerprint_is_its_content() -> None:
    assert ToolResult("a", "out").fingerprint == ToolResult("b", "out", is_error=True).fingerprint
    assert ToolResult("a", "out").fingerprint != ToolResult("a", "out2").fingerprint


@pytest.mark.parametrize(("usage", "total"), [(Usage(), 0), (Usage(10, 5), 15), (Usage(3, 4, cache_read_tokens=2), 7)])
def test_usage_total_is_input_plus_output(usage: Usage, total: int) -> None:
    assert usage.total == total


def test_calls_compare_without_their_raw_body_and_are_immutable() -> None:
    one = Call("openai", "chat", "m", raw={"model": "m"})
    two = Call("openai", "chat", "m", raw={"model": "m", "x": 1})
    assert one == two
    assert "raw" not in repr(one)
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.model = "other"  # type: ignore[misc]
    assert Answer().tool_calls == () and Answer().usage is None
