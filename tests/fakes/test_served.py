"""`tests.fakes.served`: the shared helpers of tests that run `tollgate serve` (the class itself runs in
tests/gateway/test_crash_probe.py and test_durability.py)."""

from __future__ import annotations

import pytest

from tests.fakes.served import clean_env, wait_for


def test_clean_env_drops_exporters_and_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    env = clean_env(EXTRA="1")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env and "HTTPS_PROXY" not in env
    assert (env["PYTHONUNBUFFERED"], env["EXTRA"]) == ("1", "1")


async def test_wait_for_returns_the_first_truthy_value_or_names_what_never_came() -> None:
    calls = iter([None, 0, "ready"])
    assert await wait_for(lambda: next(calls), 1.0, "x") == "ready"
    with pytest.raises(AssertionError, match="timed out waiting for never"):
        await wait_for(lambda: False, 0.05, "never")
