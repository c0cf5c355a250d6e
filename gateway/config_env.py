"""`${VAR}` substitution in a parsed config file: the environment's values, a default, or an error that
names the key path (a reference kept as text would become, say, the provider key sent upstream)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.errors import ConfigError

_MALFORMED = "malformed ${...}: write ${NAME} or ${NAME:-default} (NAME of letters, digits and _; no nesting)"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def substitute(value: Any, env: Mapping[str, str], path: str = "") -> Any:
    """Replace `${VAR}` and `${VAR:-default}` in every string value of a parsed YAML tree; `$${` is a
    literal `${`. Any other `${` (a nested default, a name with `-`) or one in a mapping key is an error:
    kept as text it would become, say, the provider key sent upstream."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and "${" in k:
                raise ConfigError([(where, "${...} is substituted in values only, not in keys")])
            out[k] = substitute(v, env, where)
        return out
    if isinstance(value, list):
        return [substitute(v, env, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        if "$${" in value:  # `$${` writes a literal `${` (a grammar or template that needs one)
            return "${".join(substitute(part, env, path) for part in value.split("$${"))
        if "${" in _VAR.sub("", value) or any("${" in (m.group(2) or "") for m in _VAR.finditer(value)):
            raise ConfigError([(path or "<root>", _MALFORMED)])

        def repl(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in env and env[name] != "":
                return env[name]
            if default is not None:
                return default
            raise ConfigError([(path or "<root>", f"environment variable {name} is not set")])

        return _VAR.sub(repl, value)
    return value
