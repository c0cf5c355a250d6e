"""Shared sample constraints and documents for the grammar tests (the 10-field schema of the notes)."""

from __future__ import annotations

import json
from typing import Any

USER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE"]},
            },
            "required": ["street", "city", "zip", "country"],
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "created_at": {"type": "string", "format": "date-time"},
                },
                "required": ["sku", "qty", "price", "created_at"],
            },
        },
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "name", "age", "email", "score", "active", "role", "tags", "address", "orders"],
}

USER: dict[str, Any] = {
    "id": "6f1c2a1e-3b7d-4c9a-9e8f-1a2b3c4d5e6f",
    "name": "Zoë Martin",
    "age": 36,
    "email": "zoe@example.com",
    "score": 9.5,
    "active": True,
    "role": "admin",
    "tags": ["vip", "beta"],
    "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345", "country": "US"},
    "orders": [
        {"sku": "A-1", "qty": 2, "price": 19.99, "created_at": "2024-05-01T10:00:00Z"},
        {"sku": "B-2", "qty": 1, "price": 5.0, "created_at": "2024-05-02T11:30:00+02:00"},
    ],
    "nickname": None,
}

COMPACT = json.dumps(USER, separators=(",", ":"), ensure_ascii=False)
PRETTY = json.dumps(USER, indent=2)  # ensure_ascii: "Zo\u00eb"
BAD_AGE = COMPACT.replace('"age":36', '"age":"36"')


def user_with(**changes: Any) -> str:
    """COMPACT with some top-level fields replaced (None value = field removed)."""
    doc = dict(USER)
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    return json.dumps(doc, separators=(",", ":"))


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


EXPONENTIAL = "[ab]*a[ab]{40}"  # its automaton has 2**41 states: a long answer visits new ones at every byte


def exponential_answer(length: int) -> str:
    """`length` bytes in no repeating pattern, ending as EXPONENTIAL wants (so it is a valid answer)."""
    state, letters = 1, []
    for _ in range(length):
        state = (state * 1103515245 + 12345) % 2**31
        letters.append("ab"[state >> 16 & 1])
    return "".join(letters) + "a" + "b" * 40
