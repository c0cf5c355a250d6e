"""Contract probes (session 7): CLI, admin API, headers, telemetry and ledger against DESIGN.md.

Every test asserts the behaviour the contract states; loopback fakes only.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from multidict import CIMultiDict
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv.attributes import error_attributes as Error
from prometheus_client.parser import text_string_to_metric_families

from gateway.approvals import queue_of
from gateway.ledger import Ledger, LedgerEntry, input_hash, verify
from tests.conftest import GatewayFactory, Harness
from tests.fakes.ports import free_port
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, tool_call
from tests.otel.otlp_sink import OtlpSink, WireSpan, running_sink

REPO = Path(__file__).resolve().parents[2]
MSG = [{"role": "user", "content": "hello"}]
CHAT = {"model": "gpt-4o-mini", "messages": MSG}
PROVIDER_KEYS = ("sk-provider-openai", "sk-ant-provider")
RUN_HEADER = "x-tollgate-run-id"
STOP_HEADER = "x-tollgate-stop-reason"


# -- helpers -----------------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra})
    return env


async def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 20.0) -> tuple[int, str, str]:
    """`python -m gateway ARGS` as a subprocess, without blocking the loop (an in-process gateway may
    have to answer it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, cwd=cwd, env=env or cli_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def post(h: Harness, body: Any, *, run: str | None = "r", path: str = "/v1/chat/completions",
               headers: dict[str, str] | CIMultiDict[str] | None = None, raw: bytes | None = None
               ) -> tuple[int, Any, CIMultiDict[str]]:
    hdrs: CIMultiDict[str] = CIMultiDict({"content-type": "application/json"})
    if run is not None:
        hdrs[RUN_HEADER] = run
    if headers:
        hdrs.extend(headers)
    data = raw if raw is not None else orjson.dumps(body)
    async with h.session.post(f"{h.url}{path}", data=data, headers=hdrs) as resp:
        payload = await resp.read()
        try:
            parsed: Any = orjson.loads(payload)
        except orjson.JSONDecodeError:
            parsed = payload
        return resp.status, parsed, CIMultiDict(resp.headers)


async def admin(h: Harness, method: str, path: str, **kwargs: Any) -> tuple[int, Any, str]:
    async with h.session.request(method, f"{h.admin_url}{path}", **kwargs) as resp:
        text = await resp.text()
        try:
            return resp.status, orjson.loads(text), resp.headers.get("Content-Type", "")
        except orjson.JSONDecodeError:
            return resp.status, text, resp.headers.get("Content-Type", "")


async def ledger_rows(h: Harness, run_id: str | None = None) -> list[dict[str, Any]]:
    await asyncio.sleep(0)  # the step's record hook runs right after the answer is written
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    return ledger.rows(run_id, limit=10_000)  # type: ignore[no-any-return]


def tamper(db: Path, *statements: str) -> None:
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_update")
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_delete")
        for statement in statements:
            conn.execute(statement)


async def make_ledger(path: Path, n: int) -> None:
    ledger = Ledger.open(path)
    await ledger.start()
    for i in range(1, n + 1):
        ledger.append_nowait(LedgerEntry(agent="bot", run_id="run-1", operation="chat", model="gpt-4o-mini",
                                         input_hash=input_hash(f"in {i}"), decision="allow", detail=f"step {i}"))
    await ledger.close()


# -- CLI: check-config ------------------------------------------------------------------------------


async def test_check_config_names_key_paths_at_any_depth(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "providers:\n"
        "  openai: {type: openai, base_url: 'http://127.0.0.1:1/v1', timeouts: {connect: 1, bogus: 2}}\n"
        "agents:\n"
        "  bot:\n"
        "    budget: {usd: 1, tokenz: 5}\n"
        "mcp_servers:\n"
        "  files: {url: 'http://127.0.0.1:1/mcp', extra: 1}\n"
        "pricing:\n"
        "  'x-*': {input_per_mtok: 1, output_per_mtok: 1, surprise: 2}\n"
    )
    code, out, err = await cli("check-config", str(cfg), cwd=tmp_path)
    assert code == 1, out
    for path in ("providers.openai.timeouts.bogus", "agents.bot.budget.tokenz", "mcp_servers.files.extra",
                 "pricing.x-*.surprise"):
        assert path in err, err
    assert "Traceback" not in err


async def test_check_config_missing_env_reference_names_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("agents:\n  bot:\n    keys: ['${PROBE_S7_UNSET_KEY}']\n")
    env = cli_env()
    env.pop("PROBE_S7_UNSET_KEY", None)
    code, _, err = await cli("check-config", str(cfg), cwd=tmp_path, env=env)
    assert code == 1
    assert "agents.bot.keys.0" in err and "PROBE_S7_UNSET_KEY" in err
    code, out, _ = await cli("check-config", str(cfg), cwd=tmp_path, env=cli_env(PROBE_S7_UNSET_KEY="k-123"))
    assert code == 0 and out.startswith("ok:")


async def test_check_config_rejects_undocumented_base_dir_key(tmp_path: Path) -> None:
    """`base_dir` is no config key of DESIGN section 5 (it is where the file is): unknown keys are errors.
    Accepting it silently moves where grammars, state and ledger resolve."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("base_dir: /nonexistent-elsewhere\n")
    code, out, err = await cli("check-config", str(cfg), cwd=tmp_path)
    assert code == 1, out
    assert "base_dir" in err


# -- CLI: serve ---------------------------------------------------------------------------------------


async def test_serve_defaults_to_tollgate_yaml_in_cwd(fake: tuple[FakeProvider, str], tmp_path: Path) -> None:
    _, fake_url = fake
    port, admin_port = free_port(), free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port},
        "providers": {"openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"}},
        "models": {"gpt-*": "openai"},
        "state": {"backend": "memory"},
    }
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "serve.log").open("wb")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "serve", cwd=tmp_path,
                                                env=cli_env(), stdout=log, stderr=log)
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 10
            while True:
                assert proc.returncode is None, (tmp_path / "serve.log").read_text()
                try:
                    async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert time.monotonic() < deadline, "serve never became ready on the configured admin port"
                await asyncio.sleep(0.05)
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert resp.headers[RUN_HEADER] == "default:default"
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
        log.close()


# -- CLI: runs -----------------------------------------------------------------------------------------


async def test_runs_admin_down_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    code, _out, err = await cli("runs", "--admin", f"http://127.0.0.1:{port}", cwd=tmp_path)
    assert code == 1
    assert "Traceback" not in err and err.strip().startswith("error:")


async def test_runs_table_columns(gateway_factory: GatewayFactory, tmp_path: Path) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=11, completion_tokens=7)))
    assert (await post(h, CHAT, run="tbl-1"))[0] == 200
    assert (await post(h, CHAT, run="tbl-1"))[0] == 403
    code, out, err = await cli("runs", "--admin", h.admin_url, cwd=tmp_path)
    assert code == 0, err
    lines = out.strip().splitlines()
    header = lines[0].split()
    assert " ".join(header) == "RUN ID AGENT STATUS STOP REASON SPENT USD TOKENS LLM CALLS TOOL CALLS"
    row = next(line for line in lines[1:] if line.startswith("tbl-1"))
    cells = row.split()
    assert cells[:4] == ["tbl-1", "default", "stopped", "llm_call_cap"]
    assert cells[5:] == ["18", "1", "0"]


# -- CLI: ledger verify ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statements", "bad_id"),
    [
        (["UPDATE ledger SET decision = 'stop' WHERE id = 3"], 3),
        (["UPDATE ledger SET ts = ts + 1 WHERE id = 2"], 2),
        (["UPDATE ledger SET reason = 'budget_exhausted' WHERE id = 4"], 4),
        (["DELETE FROM ledger WHERE id = 3"], 4),
        (["DELETE FROM ledger WHERE id = 5"], 5),
        (["UPDATE ledger SET id = 100 WHERE id = 2", "UPDATE ledger SET id = 2 WHERE id = 3",
          "UPDATE ledger SET id = 3 WHERE id = 100"], 2),
        ([(f"INSERT INTO ledger (id, ts, agent, run_id, operation, model, input_hash, decision, reason, detail,"
          f" prev_hash, entry_hash) VALUES (6, 1.5, 'bot', 'run-1', 'chat', 'gpt-4o-mini', 'x', 'allow', NULL, '',"
          f" '{'0' * 64}', '{'1' * 64}')")], 6),
    ],
    ids=["field", "ts", "reason", "delete-middle", "delete-last", "reorder", "insert"],
)
async def test_ledger_verify_names_first_bad_row(tmp_path: Path, statements: list[str], bad_id: int) -> None:
    db = tmp_path / "l.db"
    await make_ledger(db, 5)
    code, out, _ = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 0 and "5" in out
    tamper(db, *statements)
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 1
    assert f"row id {bad_id}" in out + err, out + err


async def test_ledger_verify_missing_file_is_clear(tmp_path: Path) -> None:
    code, _out, err = await cli("ledger", "verify", "--db", str(tmp_path / "nope.db"), cwd=tmp_path)
    assert code == 1
    assert "Traceback" not in err and "nope.db" in err


async def test_ledger_verify_default_finds_the_ledger_serve_writes(tmp_path: Path) -> None:
    """With `./tollgate.yaml` using memory state, `serve` writes its ledger to ./tollgate-ledger.db
    (gateway/app.py `_ledger_default`); `ledger verify` without --db must verify that same file."""
    (tmp_path / "tollgate.yaml").write_text("state: {backend: memory}\n")
    await make_ledger(tmp_path / "tollgate-ledger.db", 3)
    code, out, err = await cli("ledger", "verify", cwd=tmp_path)
    assert code == 0, err
    assert "3 ledger rows" in out


async def test_demo_exits_zero(tmp_path: Path) -> None:
    code, out, err = await cli("demo", cwd=tmp_path, timeout=30)
    assert code == 0, err
    assert "hash chain verified" in out


# -- admin API ---------------------------------------------------------------------------------------


RUN_FIELDS = {"run_id", "agent", "status", "stop_reason", "spent_usd", "reserved_usd", "input_tokens",
              "output_tokens", "reserved_tokens", "llm_calls", "tool_calls", "started_at", "steps"}


async def test_admin_run_fields_and_unknown_run(gw: Harness) -> None:
    gw.fake.queue(Reply(body=openai_completion(prompt_tokens=12, completion_tokens=3)))
    assert (await post(gw, CHAT, run="fields-1"))[0] == 200
    status, run, _ = await admin(gw, "GET", "/admin/runs/fields-1")
    assert status == 200
    assert RUN_FIELDS <= set(run)
    assert (run["run_id"], run["agent"], run["status"], run["stop_reason"]) == ("fields-1", "default", "active", None)
    assert (run["input_tokens"], run["output_tokens"], run["llm_calls"], run["tool_calls"]) == (12, 3, 1, 0)
    assert run["reserved_usd"] == 0 and run["reserved_tokens"] == 0
    assert isinstance(run["started_at"], float) and len(run["steps"]) == 1
    status, listing, _ = await admin(gw, "GET", "/admin/runs")
    assert status == 200 and set(listing) == {"runs"}
    assert any(r["run_id"] == "fields-1" and RUN_FIELDS <= set(r) for r in listing["runs"])
    status, body, ctype = await admin(gw, "GET", "/admin/runs/no-such-run")
    assert status == 404 and ctype.startswith("application/json") and body["error"]["code"] == "not_found"
    status, body, ctype = await admin(gw, "POST", "/admin/runs/no-such-run/reset")
    assert status == 404 and ctype.startswith("application/json")
    status, _, _ = await admin(gw, "GET", "/admin/runs/no-such-run")
    assert status == 404  # resetting an unknown run did not create it


async def test_admin_reset_clears_stop_spend_counters_and_loop_history(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(
        agents={"default": {"caps": {"llm_calls": 3}, "loop": {"window": 3, "max_distinct": 1}}},
        pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
    )
    same = [tool_call("search", '{"q": "x"}')]
    h.fake.default = Reply(body=openai_completion("", tool_calls=same))
    for _ in range(2):
        assert (await post(h, CHAT, run="rs-1"))[0] == 200
    before = await h.run("rs-1")
    assert before["llm_calls"] == 2 and before["tool_calls"] == 2 and before["spent_usd"] > 0
    status, after, _ = await admin(h, "POST", "/admin/runs/rs-1/reset")
    assert status == 200
    assert after["status"] == "active" and after["stop_reason"] is None
    assert (after["spent_usd"], after["input_tokens"], after["output_tokens"], after["llm_calls"],
            after["tool_calls"]) == (0, 0, 0, 0, 0)
    # loop history cleared: two more identical proposals are not a loop (window 3) after the reset
    for _ in range(2):
        status, _, headers = await post(h, CHAT, run="rs-1")
        assert status == 200, headers.get(STOP_HEADER)
    # and the third in a row is, as for a fresh run
    status, _body, headers = await post(h, CHAT, run="rs-1")
    assert status == 403 and headers[STOP_HEADER] == "loop_detected"
    # a stop, reset, then the run goes on
    assert (await admin(h, "POST", "/admin/runs/rs-1/reset"))[0] == 200
    h.fake.default = None
    assert (await post(h, CHAT, run="rs-1"))[0] == 200
    rows = await ledger_rows(h, "rs-1")
    assert [r["decision"] for r in rows] == ["allow", "allow", "allow", "allow", "stop", "allow"]
    assert verify(Path(h.config.base_dir) / "tollgate-ledger.db").ok


async def test_admin_approvals_bad_bodies(gw: Harness) -> None:
    item = queue_of(gw.gateway).request("ap-run", "default", "files/delete_x", {"path": "a"})
    url = f"/admin/approvals/{item.id}"
    assert (await admin(gw, "POST", url, data=b"{not json"))[0] == 400
    assert (await admin(gw, "POST", url, json=["approve"]))[0] == 400
    assert (await admin(gw, "POST", url, json={"decision": "maybe", "by": "me"}))[0] == 400
    assert (await admin(gw, "POST", url, json={"decision": "approve"}))[0] == 400
    status, body, _ = await admin(gw, "GET", "/admin/approvals?status=pending")
    assert status == 200 and [a["id"] for a in body["approvals"]] == [item.id]
    assert set(body["approvals"][0]) >= {"id", "run_id", "agent", "tool", "arguments", "requested_at", "status"}
    assert (await admin(gw, "POST", "/admin/approvals/nope", json={"decision": "deny", "by": "me"}))[0] == 404
    status, body, _ = await admin(gw, "POST", url, json={"decision": "approve", "by": "alice"})
    assert status == 200 and body["status"] == "approved"
    status, body, _ = await admin(gw, "POST", url, json={"decision": "deny", "by": "bob"})
    assert 400 <= status < 500 and status != 404
    status, body, _ = await admin(gw, "GET", "/admin/approvals")
    assert [a["status"] for a in body["approvals"]] == ["approved"]


@pytest.mark.parametrize("decision", [["approve"], {"x": 1}], ids=["list", "object"])
async def test_admin_approval_unhashable_decision_is_400_not_500(gw: Harness, decision: Any) -> None:
    item = queue_of(gw.gateway).request("ap-run", "default", "files/delete_x", {"path": "a"})
    status, body, ctype = await admin(gw, "POST", f"/admin/approvals/{item.id}",
                                      json={"decision": decision, "by": "me"})
    assert status == 400, (status, body)
    assert ctype.startswith("application/json") and body["error"]["code"] == "invalid_request"


async def test_admin_token_and_wrong_methods(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(admin={"token": "adm-secret-1"})
    assert (await admin(h, "GET", "/healthz"))[0] == 200
    assert (await admin(h, "GET", "/readyz"))[0] == 200
    for path in ("/admin/runs", "/metrics", "/admin/approvals"):
        status, _, _ = await admin(h, "GET", path)
        assert status == 401, path
        status, _, _ = await admin(h, "GET", path, headers={"Authorization": "Bearer wrong"})
        assert status == 401, path
        status, _, _ = await admin(h, "GET", path, headers={"Authorization": "Bearer adm-secret-1"})
        assert status == 200, path
    auth = {"Authorization": "Bearer adm-secret-1"}
    assert (await admin(h, "POST", "/admin/runs/x/reset"))[0] == 401
    assert (await admin(h, "DELETE", "/admin/runs", headers=auth))[0] == 405
    assert (await admin(h, "POST", "/metrics", headers=auth))[0] == 405
    assert (await admin(h, "PUT", "/admin/runs/x/reset", headers=auth))[0] == 405


async def test_metrics_genai_names_and_no_run_id(gw: Harness) -> None:
    gw.fake.queue(Reply(body=openai_completion(prompt_tokens=21, completion_tokens=4)))
    assert (await post(gw, CHAT, run="metric-run-zz9"))[0] == 200
    await asyncio.sleep(0)
    status, text, ctype = await admin(gw, "GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = families["gen_ai_client_token_usage"]
    by_type = {s.labels["gen_ai_token_type"]: s.value for s in tokens.samples if s.name.endswith("_sum")}
    assert by_type == {"input": 21, "output": 4}
    duration = families["gen_ai_client_operation_duration_seconds"]
    counts = [s for s in duration.samples if s.name.endswith("_count")]
    assert counts and counts[0].labels["gen_ai_operation_name"] == "chat"
    assert counts[0].labels["gen_ai_provider_name"] == "openai"
    assert "metric-run-zz9" not in text
    for key in PROVIDER_KEYS:
        assert key not in text


# -- headers -----------------------------------------------------------------------------------------


async def test_run_id_echoed_on_errors(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(limits={"max_body_bytes": 2000})
    status, _, headers = await post(h, None, run="err-1", raw=b"{nope")
    assert status == 400 and headers[RUN_HEADER] == "err-1"
    status, body, headers = await post(h, {"model": "llama-unknown", "messages": MSG}, run="err-2")
    assert status == 404 and headers[RUN_HEADER] == "err-2" and body["error"]["code"] == "model_not_found"
    status, body, headers = await post(h, {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x" * 5000}]},
                                       run="err-3")
    assert status == 413 and headers[RUN_HEADER] == "err-3"
    status, body, headers = await post(h, CHAT, run="err-4", path="/v1/messages")
    assert status == 400 and headers[RUN_HEADER] == "err-4"
    status, _, headers = await post(h, CHAT, run=None)
    assert status == 200 and headers[RUN_HEADER] == "default:default"


async def test_run_id_echoed_on_401(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"keys": ["agent-key-123"]}})
    status, body, headers = await post(h, CHAT, run="auth-1", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert headers[RUN_HEADER] == "auth-1"
    status, _, headers = await post(h, CHAT, run="auth-2", headers={"Authorization": "Bearer agent-key-123"})
    assert status == 200 and headers[RUN_HEADER] == "auth-2"


async def test_run_id_from_baggage_echoed_on_401(gateway_factory: GatewayFactory) -> None:
    """Every response echoes the run id; the run id comes from the header, else from baggage: a 401
    (the key is unknown, the run id is not) echoes the baggage's run id as it echoes the header's."""
    h = await gateway_factory(agents={"bot": {"keys": ["agent-key-123"]}})
    status, _, headers = await post(h, CHAT, run=None,
                                    headers={"Authorization": "Bearer wrong", "baggage": "tollgate.run_id=bag-401"})
    assert status == 401
    assert headers.get(RUN_HEADER) == "bag-401"


@pytest.mark.parametrize(
    ("baggage", "expected"),
    [
        ("tollgate.run_id=bag-1", "bag-1"),
        ("userId=alice,tollgate.run_id=bag-2,serverNode=DF%2028", "bag-2"),
        ("userId=alice , tollgate.run_id = bag-3 , x=y", "bag-3"),
        ("tollgate.run_id=team%2Fbag-4", "team/bag-4"),
        ("tollgate.run_id=bag-5;ttl=30;secure,other=1", "bag-5"),
        ("other=1;tollgate.run_id=nope,x=2", "default:default"),
    ],
    ids=["plain", "others", "spaces", "percent", "properties", "property-not-entry"],
)
async def test_run_id_from_baggage(gw: Harness, baggage: str, expected: str) -> None:
    status, _, headers = await post(gw, CHAT, run=None, headers={"baggage": baggage})
    assert status == 200
    assert headers[RUN_HEADER] == expected
    assert (await gw.run(expected))["llm_calls"] >= 1
    assert "baggage" not in {k.lower() for k in gw.fake.seen[-1].headers}


async def test_run_id_header_wins_over_baggage(gw: Harness) -> None:
    status, _, headers = await post(gw, CHAT, run="hdr-1", headers={"baggage": "tollgate.run_id=bag-x"})
    assert status == 200 and headers[RUN_HEADER] == "hdr-1"


async def test_run_id_from_second_baggage_header_line(gw: Harness) -> None:
    """W3C Baggage: several `baggage` header lines are one list (RFC 9110 field combination)."""
    hdrs: CIMultiDict[str] = CIMultiDict()
    hdrs.add("baggage", "userId=alice")
    hdrs.add("baggage", "tollgate.run_id=bag-multi")
    status, _, headers = await post(gw, CHAT, run=None, headers=hdrs)
    assert status == 200
    assert headers[RUN_HEADER] == "bag-multi"


async def test_run_id_echoed_on_unknown_proxy_path(gw: Harness) -> None:
    async with gw.session.get(f"{gw.url}/nope", headers={RUN_HEADER: "path-1"}) as resp:
        assert resp.status == 404
        assert resp.headers.get(RUN_HEADER) == "path-1"


async def test_stop_reason_header_on_every_stop(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={
        "default": {"caps": {"llm_calls": 1}},
        "polite": {"caps": {"llm_calls": 1}, "on_stop": "message"},
        "picky": {"tools": {"allow": ["search"]}},
    })
    assert (await post(h, CHAT, run="st-1"))[0] == 200
    status, body, headers = await post(h, CHAT, run="st-1")
    assert status == 403 and headers[STOP_HEADER] == "llm_call_cap" and body["error"]["code"] == "llm_call_cap"
    status, body, headers = await post(h, CHAT, run="st-1")  # sticky
    assert status == 403 and headers[STOP_HEADER] == "llm_call_cap"
    # other /v1 paths of a stopped run are stopped too, with the header
    async with h.session.post(f"{h.url}/v1/embeddings", json={"model": "gpt-4o-mini", "input": "x"},
                              headers={RUN_HEADER: "st-1"}) as resp:
        assert resp.status == 403 and resp.headers[STOP_HEADER] == "llm_call_cap"
        assert resp.headers[RUN_HEADER] == "st-1"
    polite = {"x-tollgate-agent": "polite"}
    assert (await post(h, CHAT, run="st-2", headers=polite))[0] == 200
    status, body, headers = await post(h, CHAT, run="st-2", headers=polite)
    assert status == 200 and headers[STOP_HEADER] == "llm_call_cap"
    assert body["choices"][0]["finish_reason"] == "stop"
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("rm_rf")])))
    status, body, headers = await post(h, CHAT, run="st-3", headers={"x-tollgate-agent": "picky"})
    assert status == 403 and headers[STOP_HEADER] == "tool_not_allowed"
    rows = await ledger_rows(h)
    stops = [(r["run_id"], r["reason"]) for r in rows if r["decision"] == "stop"]
    assert ("st-1", "llm_call_cap") in stops and ("st-2", "llm_call_cap") in stops
    assert ("st-3", "tool_not_allowed") in stops


async def test_max_tokens_header_when_clamped(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 300}}})
    status, _, headers = await post(h, {**CHAT, "max_tokens": 100000}, run="mt-1")
    assert status == 200
    clamped = int(headers["x-tollgate-max-tokens"])
    assert 0 < clamped < 300
    assert h.fake.seen[-1].json.get("max_completion_tokens", h.fake.seen[-1].json.get("max_tokens")) == clamped
    status, _, headers = await post(h, CHAT, run="mt-2")  # absent under a budget: clamped too
    assert status == 200 and 0 < int(headers["x-tollgate-max-tokens"]) < 300


# -- ledger ------------------------------------------------------------------------------------------


async def test_ledger_row_for_every_step_and_chain_verifies(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 2}}})  # the 500 is no model call
    h.fake.queue(Reply(body=openai_completion()), Reply(status=500, body={"error": {"message": "boom"}}),
                 Reply(status=400, body={"error": {"message": "bad"}}))
    results = [(await post(h, CHAT, run="mix-1"))[0] for _ in range(4)]
    assert results == [200, 500, 400, 403]
    rows = await ledger_rows(h, "mix-1")
    assert [(r["decision"], r["reason"]) for r in rows] == [
        ("allow", None), ("error", "500"), ("error", "400"), ("stop", "llm_call_cap")]
    for row in rows:
        assert row["agent"] == "default" and row["operation"] == "chat" and row["model"] == "gpt-4o-mini"
        assert row["input_hash"] and all(c in "0123456789abcdef" for c in row["input_hash"])
        for key in PROVIDER_KEYS:
            assert key not in orjson.dumps(row).decode()
    path = Path(h.config.base_dir) / "tollgate-ledger.db"
    result = verify(path)
    assert result.ok and result.rows == 4
    code, _out, err = await cli("ledger", "verify", "--db", str(path), cwd=Path(h.config.base_dir))
    assert code == 0, err


async def test_upstream_unreachable_is_a_ledger_row_and_no_key_in_body(gateway_factory: GatewayFactory) -> None:
    dead = free_port()
    h = await gateway_factory(providers={
        "openai": {"type": "openai", "base_url": f"http://127.0.0.1:{dead}/v1", "api_key": "sk-provider-openai",
                   "timeouts": {"connect": 2}},
    }, models={"gpt-*": "openai"})
    status, body, headers = await post(h, CHAT, run="dead-1")
    assert status == 502 and body["error"]["code"] == "upstream_unavailable"
    assert headers[RUN_HEADER] == "dead-1"
    assert "sk-provider-openai" not in orjson.dumps(body).decode()
    rows = await ledger_rows(h, "dead-1")
    assert [(r["decision"], r["reason"]) for r in rows] == [("error", "upstream_unavailable")]


# -- telemetry ----------------------------------------------------------------------------------------


@pytest.fixture
def otel_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


@pytest.fixture
async def sink(otel_clean: None, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OtlpSink]:
    async with running_sink() as s:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", s.url)
        yield s


async def flushed(h: Harness, sink: OtlpSink) -> list[WireSpan]:
    assert await asyncio.to_thread(h.gateway.services["telemetry"].force_flush)
    return list(sink.spans)


def of_run(spans: list[WireSpan], run: str) -> list[WireSpan]:
    return [s for s in spans if s.attributes.get("tollgate.run_id", ("", None))[1] == run]


def all_text(spans: list[WireSpan]) -> str:
    return repr([(s.name, s.attributes, s.events, s.status_message, s.resource) for s in spans])


async def test_spans_semconv_stops_errors_and_no_content_by_default(
    sink: OtlpSink, gateway_factory: GatewayFactory
) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 2}}})
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=13, completion_tokens=2)),
                 Reply(status=400, body={"error": {"message": "boom"}}))  # counts: no SDK retries it
    secret_text = "my-private-prompt-text-q7"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": secret_text}]}
    assert (await post(h, body, run="sp-1"))[0] == 200
    assert (await post(h, body, run="sp-1"))[0] == 400
    assert (await post(h, body, run="sp-1"))[0] == 403
    await asyncio.sleep(0)
    spans = await flushed(h, sink)
    chats = [s for s in of_run(spans, "sp-1") if s.name.startswith("chat")]
    assert [s.name for s in chats] == ["chat gpt-4o-mini"] * 3
    for s in chats:
        assert s.value(GenAI.GEN_AI_OPERATION_NAME) == "chat"
        assert s.value(GenAI.GEN_AI_PROVIDER_NAME) == "openai"
        assert s.value(GenAI.GEN_AI_REQUEST_MODEL) == "gpt-4o-mini"
    ok, failed, stopped = chats
    assert ok.value(GenAI.GEN_AI_USAGE_INPUT_TOKENS) == 13 and Error.ERROR_TYPE not in ok.attributes
    assert failed.value(Error.ERROR_TYPE) == "400" and failed.status_code == 2
    assert stopped.value(Error.ERROR_TYPE) == "llm_call_cap" and stopped.status_code == 2
    assert any(name == "tollgate.guard" and attrs.get("tollgate.guard.reason", ("", ""))[1] == "llm_call_cap"
               for name, attrs in stopped.events)
    text = all_text(spans)
    assert secret_text not in text
    assert "gen_ai.input.messages" not in text
    for key in PROVIDER_KEYS:
        assert key not in text


async def test_content_captured_with_env_and_keys_redacted(
    sink: OtlpSink, gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    h = await gateway_factory()
    leaked = "please use sk-provider-openai and sk-ant-provider for this"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"visible-q7 {leaked}"}]}
    assert (await post(h, body, run="cc-1"))[0] == 200
    await asyncio.sleep(0)
    spans = of_run(await flushed(h, sink), "cc-1")
    text = all_text(spans)
    assert "visible-q7" in text
    for key in PROVIDER_KEYS:
        assert key not in text


async def test_content_captured_with_config(sink: OtlpSink, gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(otel={"capture_content": True})
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "cfg-visible-q7"}]}
    assert (await post(h, body, run="cc-2"))[0] == 200
    await asyncio.sleep(0)
    assert "cfg-visible-q7" in all_text(of_run(await flushed(h, sink), "cc-2"))


async def test_stop_on_other_v1_path_is_in_the_ledger(gateway_factory: GatewayFactory) -> None:
    """"A stop is never silent: every stop carries its reason in the body, in the header, on the span
    and in the ledger" -- also the refusal of a stopped run's call on another /v1 path."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    assert (await post(h, CHAT, run="ostop-1"))[0] == 200
    assert (await post(h, CHAT, run="ostop-1"))[0] == 403
    before = len(await ledger_rows(h, "ostop-1"))
    status, _body, headers = await post(h, {"model": "gpt-4o-mini", "input": "x"}, run="ostop-1", path="/v1/embeddings")
    assert status == 403 and headers[STOP_HEADER] == "llm_call_cap"
    rows = await ledger_rows(h, "ostop-1")
    assert len(rows) == before + 1
    assert (rows[-1]["decision"], rows[-1]["reason"]) == ("stop", "llm_call_cap")


async def test_other_v1_paths_are_traced(sink: OtlpSink, gateway_factory: GatewayFactory) -> None:
    """DESIGN section 2: `GET /v1/models and other /v1/... paths (embeddings, ...): forwarded to the
    provider, traced`."""
    h = await gateway_factory()
    h.fake.queue(Reply(body={"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1]}],
                             "model": "text-embedding-3-small", "usage": {"prompt_tokens": 2, "total_tokens": 2}}))
    status, _, headers = await post(h, {"model": "gpt-embed", "input": "x"}, run="emb-1", path="/v1/embeddings")
    assert status == 200 and headers[RUN_HEADER] == "emb-1"
    await asyncio.sleep(0)
    spans = await flushed(h, sink)
    names = [s.name for s in spans]
    assert any(name.startswith("embeddings") for name in names), names
