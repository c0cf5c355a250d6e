"""Incremental (streaming) checks: feed chunks as they arrive, learn at the first chunk after which the
output can no longer become valid.

One llguidance matcher per stream, `deep_copy`-ed from the compiled constraint's pristine matcher.
Per chunk the cost is one UTF-8 encode plus `try_consume_tokens` over its bytes (see
tests/grammars/bench_grammars.py). For JSON kinds, whitespace before and after the document is
tolerated (llguidance allows none), and `finish()` gives the complete verdict (jsonschema), because
the streaming grammar may be weaker than the schema (syntax only, or keywords llguidance ignores).
"""

from __future__ import annotations

from collections.abc import Callable

import llguidance as llg

from grammars import engine
from grammars.spec import Violation

_JSON_WS = " \t\n\r"
_JSON_WS_BYTES = b" \t\n\r"


class IncrementalChecker:
    """Streaming check of one output.

    `feed(chunk)` returns False from the first chunk after which no continuation can be valid, and
    then keeps returning False; `violation` holds the reason. `finish()` is the complete check at the
    end of the output (for JSON kinds the full jsonschema verdict) and returns the violation or None.
    Not thread-safe: one checker per stream.
    """

    __slots__ = ("_chars", "_final", "_json", "_matcher", "_parts", "_started", "_trailing", "violation")

    def __init__(
        self,
        matcher: llg.LLMatcher,
        *,
        json_document: bool,
        final: Callable[[str], Violation | None] | None,
    ) -> None:
        self.violation: Violation | None = None
        self._matcher = matcher
        self._json = json_document
        self._final = final
        self._parts: list[str] = []
        self._chars = 0  # characters fed so far (offsets in violations count from the output start)
        self._started = not json_document  # JSON: leading whitespace not yet skipped
        self._trailing = False  # JSON: the document is complete, only whitespace may follow

    def feed(self, chunk: str) -> bool:
        """Consume the next chunk of output; False once the output can no longer become valid."""
        if self.violation is not None:
            return False
        if self._final is not None:
            self._parts.append(chunk)
        base = self._chars
        self._chars += len(chunk)
        if not self._started:
            body = chunk.lstrip(_JSON_WS)
            if not body:
                return True
            base += len(chunk) - len(body)
            chunk = body
            self._started = True
        if self._trailing:
            return self._only_whitespace(chunk, base)
        data = chunk.encode("utf-8")
        accepted = engine.advance(self._matcher, list(data))
        if accepted == len(data):
            return True
        if self._json and self._matcher.is_accepting() and data[accepted] in _JSON_WS_BYTES:
            # A complete document followed by whitespace: fine, as long as nothing else follows.
            self._trailing = True
            rest = data[accepted:].decode("utf-8")
            return self._only_whitespace(rest, base + engine.char_offset(data, accepted))
        self.violation = engine.failure(self._matcher, chunk, engine.char_offset(data, accepted), base)
        return False

    def _only_whitespace(self, chunk: str, base: int) -> bool:
        body = chunk.lstrip(_JSON_WS)
        if not body:
            return True
        pos = base + len(chunk) - len(body)
        self.violation = Violation(
            f"at char {pos}: unexpected {body[0]!r} after the end of the JSON document; "
            "expected end of output",
            pos,
        )
        return False

    def finish(self) -> Violation | None:
        """End of output: the complete verdict (None when the output is valid)."""
        if self.violation is not None:
            return self.violation
        if self._final is not None:
            self.violation = self._final("".join(self._parts))
        elif not self._matcher.is_accepting():
            self.violation = engine.incomplete(self._matcher, self._chars)
        return self.violation
