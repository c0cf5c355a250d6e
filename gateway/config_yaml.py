"""Reading a config file's YAML: the parsed tree, or a ConfigError that never quotes the file's text
(a line of it may hold a literal provider key or admin token)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import ConfigError

if TYPE_CHECKING:
    import yaml


def read_yaml(p: Path) -> Any:
    """The parsed YAML tree of the file `p`. Raises ConfigError, never quoting the file's text."""
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("<file>", f"cannot read {p}: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([("<file>", f"{p} is not UTF-8 text (byte {exc.start})")]) from None
    import yaml  # only reading a file needs the YAML parser (default_config, parse_config do not)

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([("<file>", f"invalid YAML: {_yaml_problem(exc)}")]) from None
    except RecursionError:
        raise ConfigError([("<file>", "invalid YAML: nested too deeply")]) from None
    except _TAG_FAILURES:
        # PyYAML converts an explicitly tagged scalar (`!!int x`) with int(), float() or a dict lookup,
        # whose own errors quote the scalar: the traceback would print a literal key
        raise ConfigError([("<file>", "invalid YAML: a value does not fit its tag (!!int, ...)")]) from None


_TAG_FAILURES = (ValueError, TypeError, KeyError, AttributeError)
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# what PyYAML quotes that is not the file's text: one character (or its escape) and its token names
_HARMLESS = re.compile(r".|\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|.)|<[a-z ]+>")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, never the file's text. PyYAML's own message quotes the offending lines
    (and names tags and aliases), and such a line may hold a literal provider key or admin token."""
    import yaml  # already loaded: only load_config, which imported it, gets here

    if not isinstance(exc, yaml.MarkedYAMLError):
        return _unquote(" ".join(str(exc).split()))
    problem = f"{_unquote(exc.problem or 'malformed document')}{_at(exc.problem_mark)}"
    if not exc.context:
        return problem
    return f"{problem} ({_unquote(exc.context)}{_at(exc.context_mark)})"


def _at(mark: yaml.Mark | None) -> str:
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def _unquote(text: str) -> str:
    """`text` with every quoted stretch but a single character or a token name shown as '...'."""
    return _QUOTED.sub(lambda m: m.group() if _HARMLESS.fullmatch(m.group()[1:-1]) else "'...'", text)
