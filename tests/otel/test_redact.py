"""Redaction of secrets in captured content."""

from __future__ import annotations

import json
import re

import pytest

from otel.redact import REDACTED, Redactor
from tests.otel.samples import PROVIDER_KEY


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer abc.def-ghi_123", "Authorization: Bearer [REDACTED]"),
        ("use bearer eyJhbGciOiJI", "use bearer [REDACTED]"),
        ("key sk-ant-api03-AbCdEfGhIjKlMnOp_qr", "key [REDACTED]"),
        ("openai sk-proj-abcdefghijklmnop1234 ok", "openai [REDACTED] ok"),
        ("legacy sk-abcdefghijklmnopqrstuvwx", "legacy [REDACTED]"),
        ("aws AKIAIOSFODNN7EXAMPLE here", "aws [REDACTED] here"),
        ("gh ghp_abcdefghijklmnopqrstuvwxyz0123456789", "gh [REDACTED]"),
        ("jwt eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.SflKxwRJSMeKKF2QT4", "jwt [REDACTED]"),
        ("api_key=abcdef123456789", "api_key=[REDACTED]"),
        ("x-api-key: 0123456789abcdef", "x-api-key: [REDACTED]"),
        ("password = hunter2hunter2", "password = [REDACTED]"),
        ("?key=AbCdEfGh12345&x=1", "?key=[REDACTED]&x=1"),
        ("a monkey=bananas12345", "a monkey=bananas12345"),  # not a key name
        ("token: short", "token: short"),  # too short to be a secret
        ("nothing secret here, sk-short", "nothing secret here, sk-short"),
    ],
)
def test_builtin_patterns(text: str, expected: str) -> None:
    assert Redactor().redact(text) == expected


def test_json_quoted_values_stay_valid_json() -> None:
    payload = json.dumps(
        [
            {"role": "user", "parts": [{"type": "text", "content": 'my "api_key": "abcdefgh12345"'}]},
            {
                "role": "assistant",
                "parts": [
                    {"type": "tool_call", "name": "login", "arguments": {"password": "s3cretPassw0rd"}}
                ],
            },
        ],
        separators=(",", ":"),
    )
    redacted = Redactor().redact(payload)
    assert "abcdefgh12345" not in redacted and "s3cretPassw0rd" not in redacted
    parsed = json.loads(redacted)
    assert parsed[0]["parts"][0]["content"] == f'my "api_key": "{REDACTED}"'
    assert parsed[1]["parts"][0]["arguments"] == {"password": REDACTED}


def test_exact_secrets_and_configured_patterns() -> None:
    odd_secret = 'pa"ss\\word-42'  # not key-shaped; appears JSON-escaped in content
    redactor = Redactor((r"ACME-\d{6}",), secrets=(PROVIDER_KEY, odd_secret, "", "abc"))
    text = json.dumps({"content": f"{PROVIDER_KEY} / {odd_secret} / ACME-123456 / abc"})
    redacted = redactor.redact(text)
    assert PROVIDER_KEY not in redacted and "ACME-123456" not in redacted
    assert json.dumps(odd_secret)[1:-1] not in redacted
    assert (
        json.loads(redacted)["content"] == f"{REDACTED} / {REDACTED} / {REDACTED} / abc"
    )  # short secrets ignored


def test_invalid_configured_pattern_fails_at_construction() -> None:
    with pytest.raises(re.error):
        Redactor(("(unclosed",))
