"""`make bench`'s CPU layout: the proxy under test alone on one CPU, the load on the others."""

from __future__ import annotations

import pytest

from bench.__main__ import Layout, core_layout


@pytest.mark.parametrize(
    ("available", "expected"),
    [
        ({0, 1}, Layout(proxy=frozenset({1}), load=frozenset({0}))),
        ({0, 1, 2, 3}, Layout(proxy=frozenset({3}), load=frozenset({0, 1, 2}))),
        ({2, 5}, Layout(proxy=frozenset({5}), load=frozenset({2}))),  # a cgroup's CPUs need not start at 0
        ({0}, None),  # one CPU: nothing to separate, everything unpinned
        (set(), None),
    ],
)
def test_core_layout(available: set[int], expected: Layout | None) -> None:
    assert core_layout(available) == expected
