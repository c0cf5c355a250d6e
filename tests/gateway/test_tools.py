"""The tool policy (pure): allow-list, tiers, approval, and how refusals are explained."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Tools
from gateway.tools import ToolPolicy, matches, mcp_tool_name, refusal_detail


def policy(**tools: Any) -> ToolPolicy:
    return ToolPolicy(Tools(**tools))


ALLOW = ("search_kb", "files/read_*", "files/write_note", "db/q?ery", "api/[ab]*")


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("search_kb", True),
        ("files/read_file", True),
        ("files/read_", True),
        ("files/write_note", True),
        ("db/query", True),
        ("api/alpha", True),
        ("api/gamma", False),
        ("files/write_notes", False),
        ("files/delete_file", False),
        ("search_KB", False),  # case-sensitive
        ("Files/read_file", False),
        ("search_kb ", False),  # no trimming
        (" search_kb", False),
        ("search_k\u0432", False),
        ("s\u0435arch_kb", False),  # Cyrillic e
        ("files/re\u0430d_file", False),  # Cyrillic a breaks the literal prefix of the glob
        ("search_kb\u200b", False),  # zero-width space
        ("ｓearch_kb", False),  # fullwidth s: NFKC would fold it, tollgate does not
        ("", False),
        ("other/read_file", False),
    ],
)
def test_allow_list_is_exact_or_glob_and_case_sensitive(name: str, allowed: bool) -> None:
    assert policy(allow=ALLOW).allowed(name) is allowed


def test_no_allow_list_allows_everything_and_an_empty_one_denies_everything() -> None:
    assert policy().allowed("anything/at_all") and not policy().restricted
    empty = policy(allow=())
    assert empty.restricted and not empty.allowed("search_kb")


def test_tiers_pick_the_most_severe_match_and_default_to_read() -> None:
    p = policy(tiers={"files/*": "write", "files/delete_*": "dangerous", "files/read_*": "read"})
    assert p.tier("files/delete_all") == "dangerous"  # matches write and dangerous: dangerous wins
    assert p.tier("files/write_note") == "write"
    assert p.tier("files/read_file") == "write"  # files/* says write; a read entry cannot lower it
    assert p.tier("search_kb") == "read"
    assert policy().tier("x") == "read"


def test_approval_matches_like_allow() -> None:
    p = policy(allow=("files/*",), approval=("files/delete_*", "files/rm"))
    assert p.needs_approval("files/delete_file") and p.needs_approval("files/rm")
    assert not p.needs_approval("files/read_file") and not p.needs_approval("files/rm2")
    assert p.approval_timeout_s == 300 and p.on_violation == "reject"


def test_mcp_names_and_glob_matching() -> None:
    assert mcp_tool_name("files", "read_file") == "files/read_file"
    assert matches("a[b]c", "a[b]c")  # a literal name equal to the pattern matches even with brackets
    assert matches("files/x", "files/*") and not matches("files/x", "Files/*")


def test_refusal_detail_names_invisible_and_look_alike_characters() -> None:
    assert refusal_detail("files/admin") == "tool 'files/admin' is not in the agent's allow-list"
    detail = refusal_detail("files/re\u0430d_file")
    assert "U+0430 CYRILLIC SMALL LETTER A at index 8" in detail and "matched as is" in detail
    assert "U+200B ZERO WIDTH SPACE at index 4" in refusal_detail("read\u200b")
    assert "and 2 more" in refusal_detail("\u0430\u0430\u0430\u0430\u0430")
