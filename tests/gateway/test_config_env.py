"""gateway/config_env.py: `${VAR}` substitution in a parsed config tree (README "Configuration")."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config_env import substitute
from gateway.errors import ConfigError

SUBSTITUTIONS: list[tuple[str, Any, dict[str, str], Any]] = [
    ("plain variable", "${A}", {"A": "1"}, "1"),
    ("inside text", "x-${A}-y", {"A": "1"}, "x-1-y"),
    ("two variables", "${A}:${B}", {"A": "h", "B": "p"}, "h:p"),
    ("default used when unset", "${A:-fallback}", {}, "fallback"),
    ("default ignored when set", "${A:-fallback}", {"A": "set"}, "set"),
    ("empty value takes the default", "${A:-fallback}", {"A": ""}, "fallback"),
    ("empty default", "${A:-}", {}, ""),
    ("default with punctuation", "${URL:-http://127.0.0.1:8000/v1}", {}, "http://127.0.0.1:8000/v1"),
    ("no braces is literal", "$A and $$", {"A": "1"}, "$A and $$"),
    ("value is not re-expanded", "${A}", {"A": "${B}", "B": "no"}, "${B}"),
    ("non-strings untouched", {"n": 3, "f": 1.5, "b": True, "z": None}, {}, {"n": 3, "f": 1.5, "b": True, "z": None}),
    ("nested dicts and lists", {"a": [{"k": "${A}"}, "${B:-b}"]}, {"A": "1"}, {"a": [{"k": "1"}, "b"]}),
    ("$${ is a literal ${", "t = $${name} for ${A}", {"A": "1"}, "t = ${name} for 1"),
]


@pytest.mark.parametrize(("value", "env", "expected"), [(v, e, x) for _, v, e, x in SUBSTITUTIONS],
                         ids=[n for n, _, _, _ in SUBSTITUTIONS])
def test_substitute(value: Any, env: dict[str, str], expected: Any) -> None:
    assert substitute(value, env) == expected



@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": {"${A}": "v"}}, "a.${A}"),  # a key: kept literally it would name an agent `${A}`
        ({"k": "${A:-${B}}"}, "k"),  # defaults do not nest
        ({"k": "${OPENAI-API-KEY}"}, "k"),  # not a name: kept literally it would be the key sent upstream
        ({"k": ["ok", "x${"]}, "k.1"),
    ],
)
def test_malformed_references_are_errors(value: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        substitute(value, {"A": "1", "B": "2"})
    [(where, _message)] = info.value.problems
    assert where == path
