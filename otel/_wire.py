"""Protobuf wire-format primitives for `otel._encode`: varints, length-delimited fields, OTLP
`AnyValue` / `KeyValue` payloads, and memoised attribute fields (see `_Memo`).

Every function raises `Unsupported` for input the SDK's encoder would coerce, log or skip, so the
caller can hand the batch to the SDK encoder instead (see `otel._encode`)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["INT64_MAX", "INT64_MIN", "Unsupported", "attributes", "field", "pack_fixed32", "pack_fixed64", "utf8", "varint"]


class Unsupported(ValueError):
    """The batch holds something only the SDK encoder handles (see the module docstring)."""


_pack_double: Final[Callable[[float], bytes]] = struct.Struct("<d").pack
pack_fixed64: Final[Callable[[int], bytes]] = struct.Struct("<Q").pack
pack_fixed32: Final[Callable[[int], bytes]] = struct.Struct("<I").pack
_SMALL: Final = tuple(bytes((n,)) for n in range(128))
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
_CACHE_LIMIT: Final = 8192  # memoised encodings kept (cleared when full; values come from bounded sets)


def varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64  # int64 two's complement, ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (tag already encoded)."""
    return tag + varint(len(payload)) + payload


def utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates: the SDK encoder decides what happens
        raise Unsupported("string is not valid UTF-8") from exc


def _any_value(value: Any) -> bytes:
    """Payload of an `AnyValue` (oneof: string 1, bool 2, int 3, double 4, array 5, kvlist 6, bytes 7),
    in the SDK encoder's order of type checks."""
    kind = type(value)
    if kind is str:
        return field(b"\x0a", utf8(value))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise Unsupported("int outside int64")
        return b"\x18" + varint(value)
    if kind is float:
        return b"\x21" + _pack_double(value)
    if value is None:
        return b""
    if kind is bytes:
        return field(b"\x3a", value)
    if kind is tuple or kind is list:
        return field(b"\x2a", b"".join([field(b"\x0a", _any_value(item)) for item in value]))
    if isinstance(value, Mapping) and all(type(k) is str and k for k in value):
        return field(b"\x32", b"".join([field(b"\x0a", _key_value(k, v)) for k, v in value.items()]))
    raise Unsupported(f"attribute value of type {kind.__name__}")


class _Memo:
    """Encodings of attribute keys, and of whole attribute fields (tag, key and value) for values that
    repeat: short strings, ints, bools and short tuples of short strings. Fields are kept per tag, then
    per exact value type (`True == 1` and `0.0 == -0.0` must not share an encoding), keyed by the
    `(key, value)` item itself: a lookup builds nothing. At most `_CACHE_LIMIT` fields in all, each of
    bounded size."""

    __slots__ = ("count", "keys", "tables")

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.tables: dict[bytes, dict[type, dict[tuple[str, Any], bytes]]] = {}
        self.count = 0

    def kinds(self, tag: bytes) -> dict[type, dict[tuple[str, Any], bytes]]:
        """The tables of `tag`, one per memoised value type."""
        kinds = self.tables.get(tag)
        if kinds is None:
            kinds = self.tables[tag] = {str: {}, int: {}, bool: {}, tuple: {}}
        return kinds

    def keep(self, table: dict[tuple[str, Any], bytes], item: tuple[str, Any], encoded: bytes) -> None:
        if self.count >= _CACHE_LIMIT:
            for kinds in self.tables.values():
                for other in kinds.values():
                    other.clear()
            self.count = 0
        table[item] = encoded
        self.count += 1


_MEMO: Final = _Memo()
_MEMO_CHARS: Final = 256  # longer strings (content capture, details) are rarely repeated: not kept


def _memoisable(kind: type, value: Any) -> bool:
    if kind is str:
        return len(value) <= _MEMO_CHARS
    if kind is int or kind is bool:
        return True
    return kind is tuple and len(value) <= 8 and all(type(v) is str and len(v) <= _MEMO_CHARS for v in value)


def _key_value(key: str, value: Any) -> bytes:
    """Payload of a `KeyValue` (key 1, value 2); the SDK always sets `value`, even when empty."""
    keys = _MEMO.keys
    key_field = keys.get(key)
    if key_field is None:
        if not key:
            raise Unsupported("empty attribute key")
        if len(keys) >= _CACHE_LIMIT:
            keys.clear()
        key_field = keys[key] = field(b"\x0a", utf8(key))
    return key_field + field(b"\x12", _any_value(value))


def attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> list[bytes]:
    """One `tag` field per attribute. BoundedAttributes' `copy()` is a plain dict (cheap to iterate).

    Runs for every attribute of every exported span (a gateway span has ~16), on the export thread
    that shares the GIL with the event loop: a repeated field costs one lookup of the item."""
    if not attrs:
        return []
    if type(attrs) is not dict:
        copy = getattr(attrs, "copy", None)
        attrs = copy() if callable(copy) else attrs
    kinds = _MEMO.kinds(tag)
    out = []
    for item in attrs.items():
        value = item[1]
        kind = type(value)
        table = kinds.get(kind)
        if table is not None:
            try:
                encoded = table.get(item)
            except TypeError:  # a tuple holding something unhashable: never memoised (nor valid)
                table = None
            else:
                if encoded is not None:
                    out.append(encoded)
                    continue
        encoded = field(tag, _key_value(item[0], value))
        if table is not None and _memoisable(kind, value):
            _MEMO.keep(table, item, encoded)
        out.append(encoded)
    return out
