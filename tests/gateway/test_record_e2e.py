"""The record stage through a running gateway: ledger rows for real steps, chain verifiable, metrics."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import openai
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.ledger import verify
from tests.conftest import GatewayFactory

MSG = [{"role": "user", "content": "hello"}]


async def test_ledger_rows_verify_and_tamper(gateway_factory: GatewayFactory, tmp_path: Path) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 2}}})
    for _ in range(3):
        async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps({"model": "gpt-4o-mini", "messages": MSG}),
                                  headers={"x-tollgate-run-id": "led", "content-type": "application/json"}) as resp:
            await resp.read()
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = ledger.rows("led")
    assert [r["decision"] for r in rows] == ["allow", "allow", "stop"]
    assert rows[-1]["reason"] == "llm_call_cap"
    path = tmp_path / "tollgate-ledger.db"
    assert verify(path).ok
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER IF EXISTS ledger_no_update")
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("UPDATE ledger SET detail = 'x' WHERE id = 2")
    conn.commit()
    conn.close()
    result = verify(path)
    assert not result.ok and result.first_bad_id == 2


async def test_metrics_after_steps(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    for _ in range(2):
        async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps({"model": "gpt-4o-mini", "messages": MSG}),
                                  headers={"x-tollgate-run-id": "run-zq7", "content-type": "application/json"}) as resp:
            await resp.read()
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    stopped = families["tollgate_runs_stopped"].samples
    assert any(s.labels.get("reason") == "llm_call_cap" and s.value == 1 for s in stopped)
    assert "gen_ai_client_operation_duration_seconds" in families
    assert "run-zq7" not in text  # never a run id in a label


async def test_idle_runs_export_their_root_span(fake: tuple[object, str], tmp_path: Path) -> None:
    import time

    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.app import create_apps
    from gateway.config import parse_config
    from gateway.observe_runs import end_idle_runs
    from gateway.proxy import GATEWAY
    from otel.setup import setup_telemetry
    from tests.conftest import base_config

    _, url = fake
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    config = parse_config(base_config(url, otel={"run_idle_s": 60}), env={}, base_dir=str(tmp_path))
    proxy, _ = create_apps(config, telemetry=telemetry)
    server = TestServer(proxy, host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as session:
            for run in ("idle-a", "busy-b"):
                async with session.post(str(server.make_url("/v1/chat/completions")),
                                        json={"model": "gpt-4o-mini", "messages": MSG},
                                        headers={"x-tollgate-run-id": run}) as resp:
                    assert resp.status == 200
        gw = proxy[GATEWAY]
        assert await end_idle_runs(gw, 60, time.time()) == 0  # nobody idle yet
        assert await end_idle_runs(gw, 60, time.time() + 61) == 2
        telemetry.force_flush()
        roots = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
        assert sorted(s.attributes["tollgate.run_id"] for s in roots) == ["busy-b", "idle-a"]  # type: ignore[index]
        chats = [s for s in exporter.get_finished_spans() if s.name.startswith("chat")]
        assert {c.parent.span_id for c in chats} == {r.context.span_id for r in roots}  # type: ignore[union-attr]
    finally:
        await server.close()
        telemetry.shutdown()


async def test_step_telemetry_runs_after_the_answer_is_sent(gateway_factory: GatewayFactory) -> None:
    """The step's hooks (spans, metrics, ledger) are off the agent's critical path: a hook that holds
    the event loop for a while does not delay the answer, which is already on its way."""
    h = await gateway_factory()
    hold_s = 1.0
    seen: list[int] = []

    def slow_hook(step: object) -> None:
        seen.append(1)
        time.sleep(hold_s)  # simulates expensive telemetry; nothing to await

    h.gateway.hooks.on_step.append(slow_hook)

    def call() -> float:
        started = time.monotonic()
        client = openai.OpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                               default_headers={"x-tollgate-run-id": "after-send"})
        result = client.chat.completions.create(model="gpt-4o-mini", messages=MSG)  # type: ignore[arg-type]
        assert result.choices[0].message.content
        return time.monotonic() - started

    elapsed = await asyncio.to_thread(call)
    assert seen == [1]
    assert elapsed < hold_s / 2, f"the answer waited for the step's telemetry ({elapsed:.2f}s)"
