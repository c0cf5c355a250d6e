"""Redaction of captured content before it is set on a span (and so before it leaves the process).

Applied to every content string (`gen_ai.input.messages`, `.output.messages`, `.system_instructions`,
`.tool.definitions`, `gen_ai.tool.call.arguments` / `.result`), i.e. to compact JSON text. In order:

1. exact secret values given at construction (the configured provider keys, agent keys), in both
   their raw and JSON-escaped forms;
2. built-in patterns: `Bearer`/`Basic` credentials, OpenAI `sk-...` / `sk-proj-...` and Anthropic
   `sk-ant-...` keys, AWS access key ids, GitHub, Google, Slack tokens, JWTs, and long values after
   `api_key` / `key=` / `token:` / `password=`-like names (also when JSON-quoted);
3. the configured `otel.redact` regexes: every match is replaced.

Replacements never contain `"` or `\\`, so built-in redactions keep JSON text valid. A configured
pattern may match across JSON syntax; the text is then still secret-free, maybe not valid JSON.
Built once at startup; an invalid configured regex raises `re.error` there, not on a request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import orjson

__all__ = [
    "REDACTED",
    "Redactor",
]

REDACTED: Final = "[REDACTED]"
_MIN_SECRET_LEN: Final = 6  # shorter "secrets" would shred ordinary text


def _builtin_patterns() -> tuple[tuple[re.Pattern[str], str], ...]:
    token = r"[A-Za-z0-9_\-]"
    return (
        (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9\-._~+/]{6,}=*"), rf"\1\2{REDACTED}"),
        (re.compile(rf"\bsk-ant-{token}{{8,}}"), REDACTED),
        (re.compile(rf"\b(?:sk|rk|pk)-{token}{{16,}}"), REDACTED),
        (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
        (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}\b"), REDACTED),
        (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{30,}\b"), REDACTED),
        (re.compile(rf"\bAIza{token}{{30,}}"), REDACTED),
        (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), REDACTED),
        (re.compile(rf"\beyJ{token}{{8,}}\.eyJ{token}{{8,}}\.{token}{{8,}}"), REDACTED),
        (
            re.compile(
                r"(?i)\b((?:x-)?api[_-]?key|apikey|access[_-]?token|auth[_-]?token|refresh[_-]?token"
                r"|client[_-]?secret|secret|password|passwd|token|key)"
                r"(\\?[\"']?\s*[:=]\s*\\?[\"']?)"
                r"([^\s\"'\\,;&<>]{8,})"
            ),
            rf"\1\2{REDACTED}",
        ),
    )


class Redactor:
    """Removes secrets from text. Immutable after construction; safe to share across requests."""

    __slots__ = ("_extra", "_patterns", "_secrets")

    def __init__(self, extra_patterns: tuple[str, ...] = (), *, secrets: Iterable[str] = ()) -> None:
        forms: set[str] = set()
        for secret in secrets:
            if secret and len(secret) >= _MIN_SECRET_LEN:
                forms.add(secret)
                forms.add(orjson.dumps(secret).decode("utf-8")[1:-1])
        ordered = sorted(forms, key=len, reverse=True)  # longest first: no partial leftovers
        self._secrets = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._patterns = _builtin_patterns()
        self._extra = tuple(re.compile(pattern) for pattern in extra_patterns)

    def redact(self, text: str) -> str:
        """`text` with every secret replaced by `[REDACTED]`."""
        if self._secrets is not None:
            text = self._secrets.sub(REDACTED, text)
        for pattern, replacement in self._patterns:
            text = pattern.sub(replacement, text)
        for pattern in self._extra:
            text = pattern.sub(REDACTED, text)
        return text
