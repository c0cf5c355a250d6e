"""`python -m bench.codecs`: both libraries read the measured bodies alike, and the figures are timings."""

from __future__ import annotations

import json

import pytest

import bench.codecs
from bench.codecs import BODIES, agent_request, measure, per_call_us


def test_the_agent_request_is_agent_sized() -> None:
    body = json.loads(agent_request())
    assert len(body["messages"]) == 40 and len(body["tools"]) == 10
    assert 40_000 < len(agent_request()) < 60_000


@pytest.mark.parametrize("name", BODIES)
def test_measure_times_both_libraries_on_one_body(name: str) -> None:
    timing = measure(name, BODIES[name], seconds=0.01)
    assert timing.size == len(BODIES[name])
    figures = (timing.loads_json, timing.loads_orjson, timing.dumps_json, timing.dumps_orjson)
    assert all(0 < us < 10_000 for us in figures)


def test_a_body_the_libraries_read_differently_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.codecs.orjson, "loads", lambda body: {"read": "otherwise"})
    with pytest.raises(ValueError, match="disagree"):
        measure("bench request", BODIES["bench request"], seconds=0.01)


def test_orjson_is_measured_as_the_faster_serializer_of_an_agent_request() -> None:
    # measured ~20x apart: a swap of the two libraries' figures cannot pass
    timing = measure("agent request", agent_request(), seconds=0.05)
    assert timing.dumps_orjson < timing.dumps_json


def test_per_call_us_measures_a_slower_call_as_slower() -> None:
    fast = per_call_us(lambda: None, 0.01)
    slow = per_call_us(lambda: sum(range(2000)), 0.01)
    assert 0 < fast < slow
