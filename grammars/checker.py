"""Incremental (streaming) checks: feed chunks as they arrive, learn at the first chunk after which the
output can no longer become valid.

One llguidance matcher per stream, `deep_copy`-ed from the compiled constraint's pristine matcher.
Per chunk the cost is one UTF-8 encode plus `validate_tokens` and `consume_tokens` over its bytes
(see tests/grammars/bench_grammars.py). For JSON kinds, whitespace before and after the document is
tolerated (llguidance allows none), and `finish()` gives the complete verdict (jsonschema), because
the streaming grammar may be weaker than the schema (syntax only, or keywords llguidance ignores).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

import llguidance as llg

from gateway.errors import GrammarTooComplex
from grammars import engine
from grammars.spec import Violation

_JSON_WS = " \t\n\r"
_JSON_WS_BYTES = b" \t\n\r"
_BACKSLASH, _SLASH, _LETTER_B = 0x5C, 0x2F, 0x62
_NUMBER_CHARS: Final = frozenset("0123456789+-.eE")
_NUMBER_STARTS: Final = b"-0123456789"
# A prefix of a JSON number (RFC 8259 `number`), the empty one included.
_NUMBER_PREFIX: Final = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?")
_ESCAPE: Final = re.compile(r"\\.", re.DOTALL)


class IncrementalChecker:
    """Streaming check of one output.

    `feed(chunk)` returns False from the first chunk after which no continuation can be valid, and
    then keeps returning False; `violation` holds the reason. `finish()` is the complete check at the
    end of the output (for JSON kinds the full jsonschema verdict) and returns the violation or None.
    `feed` raises InvalidGrammar once a `bounded` stream's matcher time is spent (`engine.Fuel`: an
    ambiguous grammar). Not thread-safe: one checker per stream.
    """

    __slots__ = (
        "_chars",
        "_escape_open",
        "_fallback",
        "_final",
        "_fuel",
        "_json",
        "_matcher",
        "_on_limit",
        "_parts",
        "_started",
        "_trailing",
        "violation",
    )

    def __init__(
        self,
        matcher: llg.LLMatcher,
        *,
        json_document: bool,
        final: Callable[[str], Violation | None] | None,
        fallback: llg.LLMatcher | None = None,
        bounded: bool = False,
        on_limit: Callable[[], llg.LLMatcher | None] | None = None,
    ) -> None:
        """`matcher` is this stream's own matcher. `fallback` (JSON schema grammars only) is a
        pristine any-JSON matcher to switch to when the upstream spells a literal with escapes. `bounded`
        (a context-free grammar): its matcher time is bounded (`engine.Fuel`). `on_limit` is called
        when the matcher hits a parser limit (the pristine matcher may be spent): a fresh matcher it
        returns checks the output so far again; without one `feed` switches to `fallback`, or raises
        GrammarTooComplex."""
        self.violation: Violation | None = None
        self._matcher = matcher
        self._fuel = engine.Fuel() if bounded else None  # a context-free grammar's: its matcher time
        self._fallback = fallback
        self._on_limit = on_limit
        self._json = json_document
        self._final = final
        self._parts: list[str] = []
        self._chars = 0  # characters fed so far (offsets in violations count from the output start)
        self._started = not json_document  # JSON: leading whitespace not yet skipped
        self._trailing = False  # JSON: the document is complete, only whitespace may follow
        self._escape_open = False  # JSON: the bytes fed so far end inside an escape ("\\")

    def feed(self, chunk: str) -> bool:
        """Consume the next chunk of output; False once the output can no longer become valid."""
        if self.violation is not None:
            return False
        if self._final is not None or self._on_limit is not None:  # kept to replay on a fresh matcher
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
        return self._consume(chunk, base)

    def _consume(self, text: str, base: int) -> bool:
        """Feed `text` (starting at character `base` of the output) to the matcher."""
        data = text.encode("utf-8")
        if self._json:
            data = self._json_equivalent(data)
        try:
            accepted = engine.advance(self._matcher, list(data), self._fuel)
        except GrammarTooComplex:
            fresh = self._on_limit() if self._on_limit is not None else None
            if fresh is not None and not self._json:
                # another answer may have spent the lexer this matcher shares: the output again, fresh
                self._matcher = fresh
                self._fuel = engine.Fuel() if self._fuel is not None else None
                return self._consume("".join(self._parts), 0)
            if self._fallback is None:
                raise
            # the schema grammar gave up (a `pattern` whose automaton is exponential ran its lexer out of
            # states): JSON syntax can still be checked, and the final verdict, on RE2, decides the rest
            return self._degrade()
        if accepted == len(data):
            return True
        pos = engine.char_offset(data, accepted)
        if self._json and self._matcher.is_accepting() and data[accepted] in _JSON_WS_BYTES:
            # A complete document followed by whitespace: fine, as long as nothing else follows.
            self._trailing = True
            return self._only_whitespace(text[pos:], base + pos)
        if self._fallback is not None and (self._respelled(base + pos) or self._renumbered(base + pos)):
            return self._degrade()
        self.violation = engine.failure(self._matcher, text, pos, base)
        return False

    def _json_equivalent(self, data: bytes) -> bytes:
        """`data` with the two JSON spellings llguidance refuses replaced by equivalents it takes:
        a raw DEL in a string becomes "~" and the escape "\\/" becomes "\\b" (same JSON syntax:
        allowed in strings, nowhere else). Same length, so positions hold; the final verdict reads
        the real text."""
        if b"\x7f" in data:
            data = data.replace(b"\x7f", b"~")
        if not self._escape_open and b"\\" not in data:
            return data
        out = bytearray(data)
        odd = self._escape_open  # inside a run of backslashes of odd length: next byte is escaped
        for i, byte in enumerate(out):
            if odd and byte == _SLASH:
                out[i] = _LETTER_B
            odd = byte == _BACKSLASH and not odd
        self._escape_open = odd
        return bytes(out)

    def _respelled(self, pos: int) -> bool:
        """Whether the output up to the refused character `pos` spells a string in a way a schema
        grammar's literals (enum, const, property names) would not: a \\u or \\/ escape, or a raw
        DEL. A refused backslash counts too: what it escapes may not have arrived yet."""
        text = "".join(self._parts)[: pos + 2]
        return text[pos : pos + 1] == "\\" or "\\u" in text or "\\/" in text or "\x7f" in text

    def _renumbered(self, pos: int) -> bool:
        """Whether the refused character `pos` may belong to another spelling of a number the schema
        grammar wants: a schema grammar takes one spelling of a number while JSON Schema judges its
        value (llguidance's bounded numbers have no exponent, its integers no `4.0`, its const and
        enum numbers one spelling only; `-0.0` is 0).

        Narrow on purpose: the character must extend the number the output is writing (outside any
        string) into a JSON number prefix, and a refused first character must be one where the
        grammar itself would start a number. Anything else (a quote where a number belongs, a letter
        in a string) still cuts the stream. Runs once per stream, at its first refusal."""
        text = "".join(self._parts)
        if text[pos : pos + 1] not in _NUMBER_CHARS:
            return False
        start = pos
        while start and text[start - 1] in _NUMBER_CHARS:
            start -= 1
        if not _NUMBER_PREFIX.fullmatch(text, start, pos + 1):
            return False
        # The exact grammar took the output up to `pos`, so it is a JSON prefix in which escapes only
        # occur in strings: an odd number of quotes outside escapes means `pos` is inside a string.
        if _ESCAPE.sub("", text[:start]).count('"') % 2:
            return False
        if start < pos:
            return True  # the grammar took the number's first characters: it wants a number here
        mask = self._matcher.compute_bitmask()  # the matcher waits just before the refused character
        return any(mask[b >> 3] >> (b & 7) & 1 for b in _NUMBER_STARTS)

    def _degrade(self) -> bool:
        """Switch from the schema grammar to JSON syntax only, replaying the output so far.

        Why: a schema grammar matches enum/const values, property names and patterns byte for byte,
        while JSON may spell the same string with escapes (a "\\u00e9" for "é", "\\/" for "/"); an
        escaped property name even reads as an extra property, which breaks the key order later.
        Numbers likewise have many spellings (`1e-05`, `4.0`, `-0.0`). Rather than cut an answer that
        may be valid, check syntax from here on; the final verdict is jsonschema's."""
        assert self._fallback is not None
        self._matcher = self._fallback.deep_copy()
        self._fallback = None
        self._escape_open = False
        text = "".join(self._parts)
        body = text.lstrip(_JSON_WS)
        return self._consume(body, len(text) - len(body))

    def _only_whitespace(self, chunk: str, base: int) -> bool:
        body = chunk.lstrip(_JSON_WS)
        if not body:
            return True
        pos = base + len(chunk) - len(body)
        self.violation = Violation(
            f"at char {pos}: unexpected {body[0]!r} after the end of the JSON document; "
            "expected end of output",
            pos,
            summary=f"at char {pos}: text after the end of the JSON document; expected end of output",
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
