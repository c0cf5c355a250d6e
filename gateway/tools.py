"""Tool policy of one agent: allow-list, tiers and approval (pure).

One policy serves every path (OpenAI and Anthropic tools, MCP `tools/list` and `tools/call`). MCP
tools are matched as `server/tool`; tools offered to or proposed by a model by the name it uses (an
Anthropic toolset, which has none, by its family: `gateway.providers.anthropic_tools.tool_name`).

Matching is exact string equality or an `fnmatch` glob (`*`, `?`, `[...]`), case-sensitive, on the
raw name: no Unicode normalisation, case folding or trimming, so a crafted name (a Cyrillic `а`, a
zero-width space, a trailing blank) never matches an entry it only looks like. Once `allow` is set,
everything it does not match is denied; `allow: null` (the default) allows every tool.
"""

from __future__ import annotations

import unicodedata
from fnmatch import fnmatchcase
from typing import Literal

from gateway.config import Tools

Tier = Literal["read", "write", "dangerous"]
_SEVERITY: dict[Tier, int] = {"read": 0, "write": 1, "dangerous": 2}
SIDE_EFFECT_TIERS: frozenset[Tier] = frozenset({"write", "dangerous"})


def mcp_tool_name(server: str, tool: str) -> str:
    """The name an MCP tool is matched by: `server/tool`."""
    return f"{server}/{tool}"


def _sdk_part(value: str, fallback: str) -> str:
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in value).strip("_-")
    return safe or fallback


def proposed_names(server: str, tool: str) -> tuple[str, str, str]:
    """The names a model may have proposed an MCP call by, which the agent then executes through the
    MCP proxy: the tool's own, `server/tool`, and the OpenAI Agents SDK's with its
    `include_server_in_tool_names` (`mcp_<server>__<tool>`, when the agent names its MCP server as
    tollgate does; a name the SDK shortens with a hash is not recognised, and counts again)."""
    return tool, mcp_tool_name(server, tool), f"mcp_{_sdk_part(server, 'server')}__{_sdk_part(tool, 'tool')}"


def matches(name: str, pattern: str) -> bool:
    """True when `name` equals `pattern` or matches it as a case-sensitive glob."""
    return name == pattern or fnmatchcase(name, pattern)


def _any(name: str, patterns: tuple[str, ...]) -> bool:
    return any(matches(name, p) for p in patterns)


class ToolPolicy:
    """The `tools:` section of one agent, as decisions about tool names. Immutable; cheap to build."""

    __slots__ = ("_allow", "_approval", "_tiers", "approval_timeout_s", "on_violation")

    def __init__(self, tools: Tools) -> None:
        self._allow = tools.allow
        self._approval = tools.approval
        self._tiers = tuple(tools.tiers.items())
        self.on_violation = tools.on_violation
        self.approval_timeout_s = tools.approval_timeout_s

    @property
    def restricted(self) -> bool:
        """True when an allow-list is set (some names may be denied)."""
        return self._allow is not None

    def allowed(self, name: str) -> bool:
        """May the agent see and call this tool? Deny by default once `allow` is set."""
        return self._allow is None or _any(name, self._allow)

    def tier(self, name: str) -> Tier:
        """The most severe tier among the `tiers` entries that match; `read` when none does."""
        found: Tier = "read"
        for pattern, tier in self._tiers:
            if _SEVERITY[tier] > _SEVERITY[found] and matches(name, pattern):
                found = tier
        return found

    def needs_approval(self, name: str) -> bool:
        """Must a human approve each call of this tool before it runs?"""
        return _any(name, self._approval)


def refusal_detail(name: str) -> str:
    """Why `name` was refused, for the error message: names non-ASCII or invisible characters, since
    a look-alike of an allowed name is refused on purpose and the caller should see why."""
    odd = [(i, ch) for i, ch in enumerate(name) if not (ch.isascii() and ch.isprintable())]
    text = f"tool {name!r} is not in the agent's allow-list"
    if odd:
        shown = ", ".join(
            f"U+{ord(ch):04X} {unicodedata.name(ch, 'UNNAMED')} at index {i}" for i, ch in odd[:3]
        )
        more = f" and {len(odd) - 3} more" if len(odd) > 3 else ""
        text += f"; the name contains non-ASCII or invisible characters ({shown}{more}) and is matched as is"
    return text
