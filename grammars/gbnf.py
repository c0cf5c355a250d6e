"""GBNF (llama.cpp grammar) from regexes and choice lists, and regex-escaped choice lists.

`regex_to_gbnf` walks the stdlib regex parser's tree (`re._parser`). It covers literals, classes,
`.`, `\\d \\w \\s` (as ASCII classes: GBNF has no Unicode categories), groups, alternation and every
quantifier, and rejects what a GBNF rule cannot mean: look-around, backreferences, word boundaries,
conditionals, atomic groups, possessive quantifiers and flags. `^` and `$` are dropped: the whole
output is matched anyway.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Sequence
from typing import Any, Final

from gateway.errors import InvalidGrammar

# The stdlib regex parser and its opcodes (private modules, stable since 3.11; typeshed has no stubs).
sre: Any = importlib.import_module("re._parser")
C: Any = importlib.import_module("re._constants")

_CATEGORIES: Final[dict[Any, tuple[bool, str]]] = {
    C.CATEGORY_DIGIT: (False, "0-9"),
    C.CATEGORY_WORD: (False, "0-9a-zA-Z_"),
    C.CATEGORY_SPACE: (False, " \\t\\n\\r\\x0B\\x0C"),
    C.CATEGORY_NOT_DIGIT: (True, "0-9"),
    C.CATEGORY_NOT_WORD: (True, "0-9a-zA-Z_"),
    C.CATEGORY_NOT_SPACE: (True, " \\t\\n\\r\\x0B\\x0C"),
}
_ANCHORS: Final = (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING)
_REGEX_SPECIAL: Final[frozenset[str]] = frozenset("\\.^$|?*+()[]{}")


def regex_to_gbnf(pattern: str) -> str:
    """A GBNF grammar (`root ::= ...`) matching exactly the strings `pattern` fully matches.
    Raises InvalidGrammar for constructs GBNF cannot express."""
    try:
        with warnings.catch_warnings():
            # "Possible nested set" (POSIX classes like [[:alpha:]]) means a dialect mismatch.
            warnings.simplefilter("error")
            parsed = sre.parse(pattern)
    except (re.error, FutureWarning) as exc:
        raise InvalidGrammar(f"regex: cannot convert to GBNF: {exc}") from exc
    if parsed.state.flags & ~C.SRE_FLAG_UNICODE:
        raise InvalidGrammar("regex: cannot convert to GBNF: inline flags such as (?i) are not supported")
    return "root ::= " + (_sequence(parsed) or '""')


def choice_to_gbnf(options: Sequence[str]) -> str:
    """`root ::= "a" | "b"`."""
    return "root ::= " + " | ".join(gbnf_literal(o) for o in options)


def gbnf_literal(text: str) -> str:
    """A GBNF string literal for `text`."""
    return '"' + "".join(_char(ord(ch)) for ch in text) + '"'


def regex_alternatives(options: Sequence[str]) -> str:
    """A regex matching exactly the given strings: `(a|b)`, escaping only regex metacharacters
    (re.escape also escapes spaces and more, which some engines warn about)."""
    return "(" + "|".join(regex_escape(o) for o in options) + ")"


def regex_escape(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02X}")
        else:
            out.append(ch)
    return "".join(out)


def _char(code: int, in_class: bool = False) -> str:
    ch = chr(code)
    if in_class and ch in "]^-[\\":
        return f"\\x{code:02X}"
    if ch in '"\\':
        return "\\" + ch
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch == "\t":
        return "\\t"
    if code < 0x20 or 0x7F <= code < 0xA0:
        return f"\\x{code:02X}"
    return ch


def _class(items: list[tuple[Any, Any]]) -> str:
    negated = False
    parts: list[str] = []
    for op, av in items:
        if op is C.NEGATE:
            negated = True
        elif op is C.LITERAL:
            parts.append(_char(av, True))
        elif op is C.RANGE:
            parts.append(f"{_char(av[0], True)}-{_char(av[1], True)}")
        elif op is C.CATEGORY and av in _CATEGORIES:
            inverted, chars = _CATEGORIES[av]
            if inverted:
                # [\D] alone is [^0-9]; mixed with other items it is a union GBNF classes can't write.
                if len(items) != 1:
                    raise InvalidGrammar("regex: cannot convert to GBNF: a negated category inside a class")
                return f"[^{chars}]"
            parts.append(chars)
        else:
            raise InvalidGrammar(f"regex: cannot convert to GBNF: unsupported class item {op}")
    return f"[{'^' if negated else ''}{''.join(parts)}]"


def _sequence(parsed: Any) -> str:
    out: list[str] = []
    for op, av in parsed:
        if op is C.LITERAL:
            out.append(f'"{_char(av)}"')
        elif op is C.NOT_LITERAL:
            out.append(f"[^{_char(av, True)}]")
        elif op is C.ANY:
            out.append("[^\\n]")
        elif op is C.IN:
            out.append(_class(av))
        elif op is C.BRANCH:
            out.append("(" + " | ".join(_sequence(b) or '""' for b in av[1]) + ")")
        elif op is C.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise InvalidGrammar("regex: cannot convert to GBNF: scoped flags such as (?i:...)")
            out.append("(" + (_sequence(sub) or '""') + ")")
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, sub = av
            out.append("(" + (_sequence(sub) or '""') + ")" + _quantifier(low, high))
        elif op is C.AT and av in _ANCHORS:
            continue
        else:
            raise InvalidGrammar(f"regex: cannot convert to GBNF: {_describe(op)} is not supported")
    return " ".join(out)


def _quantifier(low: int, high: int) -> str:
    if (low, high) == (0, C.MAXREPEAT):
        return "*"
    if (low, high) == (1, C.MAXREPEAT):
        return "+"
    if (low, high) == (0, 1):
        return "?"
    if high == C.MAXREPEAT:
        return f"{{{low},}}"
    if low == high:
        return f"{{{low}}}"
    return f"{{{low},{high}}}"


def _describe(op: Any) -> str:
    names = {
        "ASSERT": "look-ahead/look-behind",
        "ASSERT_NOT": "negative look-around",
        "GROUPREF": "a backreference",
        "GROUPREF_EXISTS": "a conditional group",
        "AT": "a word boundary or anchor in this position",
        "ATOMIC_GROUP": "an atomic group",
        "POSSESSIVE_REPEAT": "a possessive quantifier",
    }
    return names.get(str(op), str(op))
