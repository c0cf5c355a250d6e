"""llguidance over a 257-token byte tokenizer built in code (no model, no hub download).

One token per byte plus an end-of-output token, so "how many tokens were accepted" is "how many bytes",
and the token mask at a failure point is the set of bytes the grammar would have taken instead. Grammar
construction drops the GIL; a pristine matcher is built once per constraint and `deep_copy`-ed (about
1 µs) for every check, because building one costs about 0.5 ms.

Checks run on the event loop, so a context-free grammar's matcher time is bounded (`Fuel`): an ambiguous grammar
(`a: "x" | a a`) makes llguidance's Earley parse grow with about the cube of the output's length, which
its `LLParserLimits` do not bound (1,000 characters took 27 s, stalling every other request).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Final

import llguidance as llg

from gateway.errors import GrammarTooComplex, InvalidGrammar
from grammars.spec import Violation

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

EOS: Final[int] = 256
# Why these options: general \uXXXX escapes are valid JSON that every serializer emits for non-ASCII
# text (off by default in llguidance); `lenient` turns keywords llguidance cannot enforce into warnings
# (jsonschema still enforces them at the end); `coerce_one_of` accepts overlapping oneOf branches,
# whose exclusivity jsonschema checks.
JSON_OPTIONS: Final[JsonCompileOptions] = {
    "json_allow_general_unicode_escapes": True,
    "lenient": True,
    "coerce_one_of": True,
}
_MAX_EXPECTED_ITEMS: Final[int] = 12
CHECK_S: Final[float] = 0.25  # the matcher CPU time a context-free grammar's check may take beyond...
_PER_TOKEN_S: Final[float] = 3e-6  # ...this much per token it took (about 3x what a linear grammar costs)
_SLICE: Final[int] = 1 << 16  # tokens per call without a Fuel: ~5 ms of a regex's matching, the GIL held
_STEP_S: Final[float] = 0.002  # what one call into the matcher should take at most (the next is sized by it)
_LEXER_SPENT: Final[str] = "lexer error"  # how llguidance's error state begins when its lexer hit a limit
_NOISE: Final = re.compile(r"^([\s^~]*|\d+\s*\|.*|regex parse error:)$")


class _ByteTokenizer:
    """The duck-typed tokenizer `llg.TokenizerWrapper` wants: token i is byte i, 256 is EOS."""

    eos_token_id: ClassVar[int] = EOS
    bos_token_id: ClassVar[int | None] = None
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(256)] + [b"<|end|>"]
    special_token_ids: ClassVar[list[int]] = [EOS]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@functools.cache
def tokenizer() -> llg.LLTokenizer:
    """The process-wide byte tokenizer, built on first use (slices disabled: useless for bytes)."""
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer()), slices=[])


def grammar_for(kind: str, source: str) -> str:
    """The llguidance grammar for a non-JSON kind (regex, lark, gbnf, choice). Raises ValueError."""
    if kind == "regex":
        _check_regex(source)
        return llg.LLMatcher.grammar_from_regex(source)
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(source)
    if kind == "gbnf":
        return llg.grammar_from("gbnf", source)
    if kind == "choice":
        options = json.loads(source)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    raise ValueError(f"no llguidance grammar for kind {kind!r}")


def _check_regex(source: str) -> None:
    """Raise ValueError for a regex ending in an escape that escapes nothing (`[0-9]+\\`).

    Why: `grammar_from_regex` wraps the regex in a Lark `/.../` literal and silently drops such a
    backslash, so the grammar would mean something else (a lone `\\` becomes "empty output only")
    where Rust's regex, RE2 and Python's `re` all refuse it. Everything else is left to llguidance's
    own parser (Rust `regex` syntax, not Python's)."""
    trailing = len(source) - len(source.rstrip("\\"))
    if trailing % 2:
        raise ValueError(
            f"invalid regex {source!r}: it ends in an incomplete escape sequence (a lone trailing "
            "backslash; write \\\\ for a literal backslash)"
        )


def grammar_for_schema(schema: dict[str, object]) -> str:
    """The llguidance grammar for an object JSON schema, with `JSON_OPTIONS` (llguidance takes no
    boolean schemas). Raises ValueError."""
    return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)


def build_matcher(grammar: str) -> tuple[llg.LLMatcher | None, str]:
    """A pristine matcher for `grammar`, or (None, error text) when the grammar does not compile."""
    # The constructor never raises: a bad grammar leaves the matcher in its error state.
    matcher = llg.LLMatcher(tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return None, _reason(matcher.get_error())
    return matcher, ""


def _reason(text: str) -> str:
    """llguidance errors quote the source with carets and a line-numbered excerpt; keep the reason."""
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = [line for line in lines if line and not _NOISE.match(line)]
    return " ".join(kept[:3]) if kept else text.strip()


def char_offset(data: bytes, byte_pos: int) -> int:
    """Character index of byte `byte_pos` in `data` (a split multibyte char counts as its start)."""
    return len(data[:byte_pos].decode("utf-8", "ignore"))


def expected_from_mask(mask: bytes) -> str:
    """Describe the allowed next bytes of a token mask: "expected one of: '0'-'9', end of output"."""
    allowed = [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]
    eos = bool(mask[EOS >> 3] >> (EOS & 7) & 1)
    ascii_allowed = [b for b in allowed if b < 0x80]
    items: list[str]
    if len(ascii_allowed) > 64:
        # Mostly-open sets (a string body, a Lark catch-all) read better as what is excluded.
        present = set(ascii_allowed)
        excluded = [b for b in range(0x80) if b not in present]
        items = ["any character" + (" except " + ", ".join(_ranges(excluded)) if excluded else "")]
    else:
        items = _ranges(ascii_allowed)
        if any(b >= 0x80 for b in allowed):
            items.append("non-ASCII characters")
    if eos:
        items.append("end of output")
    if not items:
        return "expected nothing (no continuation is possible)"
    if len(items) > _MAX_EXPECTED_ITEMS:
        rest = len(items) - _MAX_EXPECTED_ITEMS
        items = [*items[:_MAX_EXPECTED_ITEMS], f"... ({rest} more)"]
    if len(items) == 1:
        return f"expected {items[0]}"
    return "expected one of: " + ", ".join(items)


def _ranges(values: Sequence[int]) -> list[str]:
    out: list[str] = []
    start = prev = -2
    for v in [*values, -1]:
        if v == prev + 1:
            prev = v
            continue
        if start >= 0:
            out.append(_show(start) if start == prev else f"{_show(start)}-{_show(prev)}")
        start = prev = v
    return out


def _show(byte: int) -> str:
    return repr(chr(byte))


def failure(matcher: llg.LLMatcher, text: str, char_pos: int, base: int = 0) -> Violation:
    """The violation for a matcher that just refused the character at `char_pos` of `text`, a piece
    of output that starts at character `base` of the whole output."""
    got = text[char_pos] if char_pos < len(text) else ""
    expected = expected_from_mask(matcher.compute_bitmask())
    pos = base + char_pos
    return Violation(f"at char {pos}: unexpected {got!r}; {expected}", pos,
                     summary=f"at char {pos}: unexpected character; {expected}")


def incomplete(matcher: llg.LLMatcher, char_pos: int) -> Violation:
    """The violation for an output that ended (at `char_pos`) before the grammar was satisfied."""
    expected = expected_from_mask(matcher.compute_bitmask())
    return Violation(f"at char {char_pos}: output ended too early; {expected}", char_pos)


class Fuel:
    """The matcher CPU time one output's check may still take: `CHECK_S`, plus `_PER_TOKEN_S` for every
    token it took (a linear grammar takes under 1 µs a byte, so it never runs out; one whose parse grows
    faster than the output does), and the size of its next call: from one token, doubling while a call
    stays within `_STEP_S`. Thread CPU time, so waiting for the GIL costs nothing. `spend` raises
    InvalidGrammar once it is used up: the grammar, not the answer, is at fault."""

    __slots__ = ("left", "per_token", "size")

    def __init__(self, seconds: float = CHECK_S) -> None:
        self.left = seconds
        self.per_token = 0.0
        self.size = 1

    def step(self) -> int:
        """How many tokens the next call may take."""
        return self.size

    def spend(self, seconds: float, tokens: int) -> None:
        self.left += tokens * _PER_TOKEN_S - seconds
        self.per_token = seconds / max(tokens, 1)
        fits = int(_STEP_S / self.per_token) if self.per_token > 0 else 2 * self.size
        self.size = max(1, min(2 * self.size, fits))
        if self.left < 0:
            raise InvalidGrammar(
                "checking the answer against its grammar took too long: its parse grows faster than the "
                "answer (an ambiguous grammar, such as a: \"x\" | a a, grows with about the cube of the "
                "answer's length): write the grammar so that each text has one parse")


def advance(matcher: llg.LLMatcher, tokens: list[int], fuel: Fuel | None = None) -> int:
    """Consume the longest acceptable prefix of `tokens`; return its length. The matcher stays usable
    (its state is just before the first refused token, where `compute_bitmask` says what would do).
    With `fuel` (a context-free grammar), in calls it sizes, raising InvalidGrammar when the check has
    taken its time.

    Why not `try_consume_tokens`: `validate_tokens` (read-only) then `consume_tokens` is 1.2-2x faster
    per chunk (measured in tests/grammars/bench_grammars.py), and gives the same count."""
    if fuel is None:
        done = 0
        while True:  # in slices: llguidance holds the GIL through a call, a worker thread's check too
            part = tokens[done : done + _SLICE] if done or len(tokens) > _SLICE else tokens
            accepted = matcher.validate_tokens(part)
            if accepted:
                matcher.consume_tokens(part if accepted == len(part) else part[:accepted])
                _check_limits(matcher)
            done += accepted
            if accepted < len(part):
                _check_refusal(matcher, part[accepted])
                return done
            if done >= len(tokens):
                return done
    done = 0
    while done < len(tokens):
        part = tokens[done : done + fuel.step()]
        started = time.thread_time()
        accepted = matcher.validate_tokens(part)
        if accepted:
            matcher.consume_tokens(part if accepted == len(part) else part[:accepted])
            _check_limits(matcher)
        refused = accepted < len(part)
        if refused and len(part) > 1 and not matcher.is_error():
            # llguidance may refuse a token batched after a `stop=` lexeme that it takes alone: judge
            # the refused one by itself, as a stream fed a byte at a time would be
            alone = part[accepted : accepted + 1]
            if matcher.validate_tokens(alone):
                matcher.consume_tokens(alone)
                _check_limits(matcher)
                accepted, refused = accepted + 1, False
        fuel.spend(time.thread_time() - started, accepted)
        done += accepted
        if refused:
            _check_refusal(matcher, part[accepted])
            break
    return done


def _check_limits(matcher: llg.LLMatcher) -> None:
    """Raise GrammarTooComplex (an InvalidGrammar) when consuming put the matcher in its error state:
    llguidance's parser limits (`LLParserLimits`: items per Earley row, lexer fuel) were hit, a grammar too complex to check
    the answer with, not a verdict on it. Only the first line of llguidance's message is kept: the rest
    quotes the answer."""
    if matcher.is_error():
        reason = matcher.get_error().strip().splitlines()[:1]
        raise GrammarTooComplex("the grammar is too complex to check the answer with"
                             + (f" ({reason[0][:200]})" if reason else ""))


def _check_refusal(matcher: llg.LLMatcher, token: int) -> None:
    """Raise InvalidGrammar when `matcher` refused `token` because a parser limit was hit rather than
    because the grammar forbids it. Why: a lexer out of states (`max_lexer_states`, reached by a
    regex whose automaton is exponential, such as [ab]*a[ab]{40}, on a long answer) refuses every new
    byte without entering its error state, which would read as the answer's fault. Consuming the
    token on a copy tells the two apart: only the spent lexer answers with a "lexer error" there (a
    forbidden token is a "Parser Error", one after the end a stopped parser)."""
    probe = matcher.deep_copy()
    probe.consume_token(token)
    if probe.is_error() and probe.get_error().startswith(_LEXER_SPENT):
        _check_limits(probe)


def check_complete(pristine: llg.LLMatcher, text: str, *, bounded: bool = False) -> Violation | None:
    """Match a whole output against a pristine matcher (which is left untouched).

    One read-only `validate_tokens` over the bytes plus the end-of-output token decides (about 7x
    cheaper than consuming them); the matcher only advances to explain a failure. `bounded` (a
    context-free grammar, whose parse may grow faster than the output): the bytes are consumed in calls
    a `Fuel` sizes and bounds instead (raising InvalidGrammar when the check takes too long), and the
    end judged as a stream's is, by `is_accepting`."""
    matcher = pristine.deep_copy()
    data = text.encode("utf-8")
    tokens = [*data, EOS]
    if bounded:
        accepted = advance(matcher, list(data), Fuel())
        if accepted == len(data) and matcher.is_accepting():
            return None
    else:
        accepted = matcher.validate_tokens(tokens)
        if accepted == len(tokens):
            return None
        if accepted:
            matcher.consume_tokens(tokens[:accepted])
        if accepted < len(data):
            _check_refusal(matcher, tokens[accepted])
    if accepted == len(data):
        return incomplete(matcher, len(text))
    return failure(matcher, text, char_offset(data, accepted))
