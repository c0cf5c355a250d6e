"""`make bench`: its CPU layout (the proxy under test alone on one CPU, the load on the others) and how
its throughput figure is read from alternating rounds."""

from __future__ import annotations

import pytest

from bench.__main__ import Layout, Round, core_layout, median_round, round_order


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


def rounded(rps: tuple[float, float], cpu: tuple[float, float] | None) -> Round:
    """A round with tollgate's and the bare proxy's req/s and (optionally) CPU ms per request."""
    one = Round(rps={"tollgate": rps[0], "bare proxy": rps[1], "direct": 9999.0})
    if cpu is not None:
        one.cpu_ms = {"tollgate": cpu[0], "bare proxy": cpu[1]}
    return one


@pytest.mark.parametrize(
    ("one", "expected"),
    [
        (rounded((500, 1000), (0.5, 0.25)), 0.5),  # both ratios agree
        (rounded((900, 1000), (0.5, 0.25)), 0.5),  # the load side saturated first: the CPU ratio counts
        (rounded((400, 1000), (0.3, 0.27)), 0.4),  # the req/s ratio is the lower one
        (rounded((400, 1000), None), 0.4),  # no CPU figures: req/s alone
        (rounded((400, 1000), (0.0, 0.25)), 0.4),  # an unreadable CPU figure is not divided by
    ],
)
def test_round_ratio_is_the_lower_of_req_s_and_cpu(one: Round, expected: float) -> None:
    assert one.ratio() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([0.5], 0.5),
        ([0.5, 0.3, 0.4], 0.4),
        ([0.6, 0.3], 0.3),  # even count: the lower middle, never the flattering one
        ([0.5, 0.2, 0.45, 0.9], 0.45),
    ],
)
def test_median_round(ratios: list[float], expected: float) -> None:
    rounds = [rounded((r * 1000, 1000), None) for r in ratios]
    middle = median_round(rounds)
    assert middle.ratio() == pytest.approx(expected)
    assert any(middle is one for one in rounds)  # the round itself: its table and paced rate are reported


def test_round_order_alternates_so_no_target_is_always_first() -> None:
    names = ["direct", "bare proxy", "tollgate"]
    orders = [round_order(names, index) for index in range(4)]
    assert orders == [names, names[::-1], names, names[::-1]]
    assert {order[0] for order in orders} == {"direct", "tollgate"}
