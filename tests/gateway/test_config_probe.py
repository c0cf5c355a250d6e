"""Hostile probes of configuration, routing, identity, custom guards and approvals (README, DESIGN.md,
docs/custom-guards.md). Each test states the documented (or clearly expected) behaviour it holds the
gateway to."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from gateway.call import Answer
from gateway.cli import main as cli_main
from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.store.base import Claim
from guards.base import Add, Decision, StepContext
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.ports import free_port
from tests.fakes.served import tollgate_command
from tests.gateway.test_mcp import TOOLS, admin, mcp_client, pending, raw_post, refused
from tests.gateway.test_mcp import call as mcp_call
from tests.gateway.test_mcp import gateway as mcp_gateway

MSG = [{"role": "user", "content": "hello"}]
PROVIDERS: dict[str, Any] = {"openai": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-prov-1234567890"}}
MOD = "tollgate_probe_guards"


def problems(data: dict[str, Any], env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The (key path, message) pairs a config is refused with; [] when it loads."""
    try:
        parse_config(data, env=env or {})
    except ConfigError as exc:
        return list(exc.problems)
    return []


# -- custom guards used below (importable as tollgate_probe_guards:Class) -------------------------------


class StopAll:
    name = "stop_all"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.stop(self.name, "custom_stop", "this guard stops everything")

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class Raises:
    name = "raises"

    def before(self, ctx: StepContext) -> Decision:
        raise RuntimeError("boom")

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class RejectAfter:
    """Refuses a step on its answer with `Decision.reject` (guards/base.py: the run goes on)."""

    name = "reject_after"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.reject(self.name, "bad_answer", "this answer is refused")


class RejectBefore:
    name = "reject_before"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.reject(self.name, "bad_step", "this step is refused")

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class ClaimCap:
    """Claims one `probe_calls` per step, at most `limit` per run (a claim with a limit, guards/base.py)."""

    name = "claim_cap"

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name, claims=(Claim("probe_calls", 1.0, 0.0, float(self.limit), "probe_cap"),))

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class AddCap:
    """Counts steps with an `Add` effect (docs/custom-guards.md: to count something it returns effects)."""

    name = "add_cap"

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name, effects=(Add("probe_steps", 1.0, float(self.limit), "probe_step_cap"),))

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class AfterReturnsDict:
    name = "after_dict"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Any:
        return {"action": "allow"}


class CtorFails:
    name = "ctor_fails"

    def __init__(self) -> None:
        raise RuntimeError("needs a database")

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


@pytest.fixture
def guards_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(MOD)
    for cls in (StopAll, Raises, RejectAfter, RejectBefore, ClaimCap, AddCap, AfterReturnsDict, CtorFails):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, MOD, module)
    return module


def guard(cls: str, on_error: str = "fail_closed", **options: Any) -> dict[str, Any]:
    return {"use": f"{MOD}:{cls}", "options": options, "on_error": on_error}


async def chat(h: Harness, run: str, agent: str = "bot", **headers: str) -> tuple[int, dict[str, str], Any]:
    hdrs = {"x-tollgate-run-id": run, "x-tollgate-agent": agent, "content-type": "application/json", **headers}
    body = {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 50}
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps(body), headers=hdrs) as resp:
        raw = await resp.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = raw
        return resp.status, dict(resp.headers), data




def run_cli(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([*tollgate_command(), *args], capture_output=True, text=True, env=env, timeout=30)


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start(slow_s=0.3)
    yield server
    server.stop()


# == configuration: interpolation ===========================================================================


def test_a_nested_default_is_substituted_or_refused_never_left_as_a_literal_reference() -> None:
    """README Configuration: `${VAR}` and `${VAR:-default}` are substituted from the environment. A default
    that is itself a reference (`${A:-${B}}`) must either resolve B or be a config error naming the key;
    what it must not do is put the literal text `${B}` into the config (here: sent as the provider key)."""
    data = {"providers": {"openai": {"type": "openai", "base_url": "http://x/v1", "api_key": "${PRIMARY:-${FALLBACK}}"}}}
    try:
        config = parse_config(data, env={"FALLBACK": "sk-fallback-123"})
    except ConfigError as exc:
        assert [p for p, _ in exc.problems] == ["providers.openai.api_key"], exc.problems
        return
    key = config.providers["openai"].api_key
    assert key == "sk-fallback-123", f"nested default left as the literal provider key {key!r}"


def test_a_reference_in_a_mapping_key_is_substituted_or_refused() -> None:
    """README Configuration: `${VAR}` references are substituted. One written as a mapping key (an agent
    named from the environment) must be substituted or refused, not silently become an agent literally
    named `${AGENT_NAME}`."""
    data = {"agents": {"${AGENT_NAME}": {"budget": {"usd": 1.0}}}}
    try:
        config = parse_config(data, env={"AGENT_NAME": "support-bot"})
    except ConfigError:
        return
    assert "${AGENT_NAME}" not in config.agents, f"literal reference kept as an agent name: {list(config.agents)}"
    assert "support-bot" in config.agents


def test_a_malformed_reference_is_refused_not_sent_as_the_provider_key() -> None:
    """README Configuration / DESIGN 5 (provider keys are environment references): `${OPENAI-API-KEY}` (a
    typo: `-` is not a variable character) is neither a valid reference nor a key; check-config must name
    it instead of sending the literal text upstream as the API key."""
    data = {"providers": {"openai": {"type": "openai", "base_url": "http://x/v1", "api_key": "${OPENAI-API-KEY}"}}}
    found = problems(data, env={"OPENAI-API-KEY": "sk-real"})
    assert [p for p, _ in found] == ["providers.openai.api_key"], (
        f"malformed reference accepted as a literal key: {found}")


def test_a_set_but_empty_variable_takes_its_default() -> None:
    """`${VAR:-default}` (README Configuration), with POSIX `:-` semantics: set-but-empty takes the default."""
    data = {"providers": {"openai": {"type": "openai", "base_url": "${BASE:-http://fallback/v1}", "api_key": "k"}}}
    config = parse_config(data, env={"BASE": ""})
    assert config.providers["openai"].base_url == "http://fallback/v1"


def test_dollar_signs_that_are_not_references_are_kept() -> None:
    """Only `${VAR}` / `${VAR:-default}` are substituted (README): a `$` elsewhere in a value is text, and a
    substituted value is not substituted again."""
    data = {"providers": {"openai": {"type": "openai", "base_url": "http://x/v1", "api_key": "pa$$w$rd-$HOME-${K}"}}}
    config = parse_config(data, env={"K": "${OTHER}", "HOME": "/root"})
    assert config.providers["openai"].api_key == "pa$$w$rd-$HOME-${OTHER}"


# == configuration: invalid values ==========================================================================


def test_an_mcp_server_url_must_be_an_http_url() -> None:
    """config.py: wrong values are errors naming their key path; a provider's `base_url` must be an
    absolute http(s) URL, and an MCP server (`mcp_servers.<name>.url`, DESIGN 5) is an upstream too:
    `files` or `ftp://...` can never be reached and must be refused at check-config."""
    for url in ("files", "ftp://127.0.0.1/mcp"):
        found = problems({"mcp_servers": {"files": {"url": url}}})
        assert [p for p, _ in found] == ["mcp_servers.files.url"], f"url {url!r} accepted: {found}"


def test_an_agent_key_equal_to_a_provider_key_is_refused() -> None:
    """DESIGN 3: upstream provider keys live in tollgate and are never taken from, nor shown to, the
    agent. An agent key equal to a provider key hands the provider key to the agent; check-config must
    refuse it (as it refuses a key shared by two agents)."""
    data = {"providers": {"openai": {"type": "openai", "base_url": "http://x/v1", "api_key": "sk-shared-123456"}},
            "agents": {"bot": {"keys": ["sk-shared-123456"]}}}
    found = problems(data)
    assert any(p == "agents.bot.keys.0" for p, _ in found), f"agent key == provider key accepted: {found}"


def test_an_agent_key_with_surrounding_blanks_is_refused() -> None:
    """README identity: the agent is the bearer token among `agents.<name>.keys`; tollgate strips the
    token it receives (and HTTP strips header values), so a configured key with leading/trailing blanks
    can never match: it is a config error, like an empty key."""
    found = problems({"agents": {"bot": {"keys": [" key-bot-1 "]}}})
    assert any(p == "agents.bot.keys.0" for p, _ in found), f"unmatchable key accepted: {found}"


def test_a_boolean_is_not_a_count() -> None:
    """config.py docstring: wrong types are errors naming their key path. `caps.llm_calls: true` (a YAML
    `yes`) is not a number of calls; it must not silently become a cap of 1."""
    found = problems({"agents": {"bot": {"caps": {"llm_calls": True}, "output": {"retries": True}}}})
    assert {p for p, _ in found} == {"agents.bot.caps.llm_calls", "agents.bot.output.retries"}, found


INVALID: list[tuple[str, str, str]] = [
    ("zero tool cap", "agents:\n  a: {caps: {tool_calls: 0}}\n", "agents.a.caps.tool_calls"),
    ("zero time cap", "agents:\n  a: {caps: {seconds: 0}}\n", "agents.a.caps.seconds"),
    ("window below max_distinct", "agents:\n  a: {loop: {window: 3, max_distinct: 4}}\n", "agents.a.loop"),
    ("key twice in one agent", "agents:\n  a: {keys: [k1, k1]}\n", "agents.a.keys.1"),
    ("empty key from env default", "agents:\n  a: {keys: ['${PROBE_UNSET_KEY:-}']}\n", "agents.a.keys.0"),
    ("zero approval timeout", "agents:\n  a: {tools: {approval_timeout_s: 0}}\n", "agents.a.tools.approval_timeout_s"),
    ("too many retries", "agents:\n  a: {output: {retries: 11}}\n", "agents.a.output.retries"),
    ("negative price", "pricing:\n  'x-*': {input_per_mtok: -1, output_per_mtok: 1}\n", "pricing.x-*.input_per_mtok"),
    ("bad tier", "agents:\n  a: {tools: {tiers: {'f/*': root}}}\n", "agents.a.tools.tiers.f/*"),
    ("unknown key in tools", "agents:\n  a: {tools: {alow: [x]}}\n", "agents.a.tools.alow"),
    ("unknown key in timeouts", "providers:\n  p: {type: openai, base_url: 'http://x', timeouts: {total: 5}}\n",
     "providers.p.timeouts.total"),
    ("unknown key in mcp server", "mcp_servers:\n  f: {url: 'http://x/mcp', header: {a: b}}\n", "mcp_servers.f.header"),
    ("redis without url", "state: {backend: redis}\n", "state"),
]


@pytest.mark.parametrize(("text", "key_path"), [(t, k) for _, t, k in INVALID], ids=[n for n, _, _ in INVALID])
def test_check_config_names_each_invalid_value(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, text: str, key_path: str) -> None:
    """DESIGN 1: check-config validates a config; errors name the key path; exit 1 on error."""
    monkeypatch.delenv("PROBE_UNSET_KEY", raising=False)
    path = tmp_path / "tollgate.yaml"
    path.write_text(text)
    assert cli_main(["check-config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and any(line.startswith(f"error: {key_path}: ") for line in err.splitlines()), err


@pytest.mark.parametrize("setting", ["budget", "price"])
async def test_an_infinite_amount_is_refused_or_served_never_a_500(
    gateway_factory: GatewayFactory, setting: str
) -> None:
    """check-config accepts `.inf` for `budget.usd` and a `pricing:` rate (YAML floats). DESIGN 4: errors
    are decisions in the wire format; a config the checker passed must not turn every call of the
    agent into a 500. Either the value is a config error or the step is served/stopped cleanly."""
    inf = float("inf")
    overrides: dict[str, Any] = {"pricing": {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
                                 "agents": {"bot": {"budget": {"usd": inf}}}}
    if setting == "price":
        overrides = {"pricing": {"gpt-*": {"input_per_mtok": inf, "output_per_mtok": 2.0}},
                     "agents": {"bot": {"budget": {"usd": 1.0}}}}
    try:
        h = await gateway_factory(**overrides)
    except ConfigError:
        return
    status, _, body = await chat(h, f"inf-{setting}")
    assert status in (200, 403), f"{setting} .inf accepted by the config, then the call answered {status}: {body}"


# == configuration: custom guards that cannot be built ======================================================


def test_check_config_reports_a_guard_module_that_fails_to_import(tmp_path: Path) -> None:
    """docs/custom-guards.md: check-config loads custom guards, so a bad `use` is a config error naming
    `agents.<agent>.guards.<i>.use`; DESIGN 1: exit 1 on error. A module that raises while importing is
    a bad `use`, not a traceback."""
    (tmp_path / "probe_boom_guards.py").write_text('raise RuntimeError("cannot import: no database")\n')
    path = tmp_path / "tollgate.yaml"
    path.write_text("agents:\n  x: {guards: [{use: 'probe_boom_guards:Guard'}]}\n")
    result = run_cli("check-config", str(path), pythonpath=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1 and "error: agents.x.guards.0.use: " in result.stderr, result.stderr


def test_check_config_reports_a_guard_whose_constructor_raises(tmp_path: Path) -> None:
    """As above: a guard class whose constructor raises (a missing option value, a resource it needs)
    is a config error at `agents.<agent>.guards.<i>.use`, exit 1, no traceback."""
    (tmp_path / "probe_ctor_guards.py").write_text(
        "class Guard:\n    name = 'g'\n    def __init__(self, limit=None):\n"
        "        if limit is None:\n            raise RuntimeError('limit is required')\n"
        "    def before(self, ctx): ...\n    def after(self, ctx, answer): ...\n")
    path = tmp_path / "tollgate.yaml"
    path.write_text("agents:\n  x: {guards: [{use: 'probe_ctor_guards:Guard'}]}\n")
    result = run_cli("check-config", str(path), pythonpath=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1 and "error: agents.x.guards.0.use: " in result.stderr, result.stderr


async def test_serve_refuses_a_config_whose_guard_check_config_refuses(tmp_path: Path) -> None:
    """DESIGN 5: the config is parsed once; README: a bad `use` is a config error, and `serve` exits 1 on
    a broken config. A config `check-config` refuses (unknown guard) must not start a gateway that then
    fails the agent's every step."""
    path = tmp_path / "tollgate.yaml"
    path.write_text("state: {backend: memory}\nagents:\n  x: {guards: [{use: no_such_guard_probe}]}\n")
    assert run_cli("check-config", str(path)).returncode == 1
    proc = await asyncio.create_subprocess_exec(
        *tollgate_command(), "serve", "--config", str(path), "--port", str(free_port()),
        "--admin-port", str(free_port()), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 30)  # the listening line, or EOF at exit
        assert not first.startswith(b"tollgate listening"), f"serve started with a refused guard: {first!r}"
        await asyncio.wait_for(proc.wait(), 30)
        err = (await proc.stderr.read()).decode()
        assert proc.returncode == 1 and "agents.x.guards.0.use" in err, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_guard_that_cannot_be_built_is_never_a_500(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """README: a bad `use` is a config error; DESIGN 4: every answer is a decision in the wire format.
    A gateway built from a config whose guard cannot be constructed must refuse at build time
    (ConfigError), not answer the agent's calls with 500 internal_error."""
    try:
        h = await gateway_factory(agents={"bot": {"guards": [guard("CtorFails")]}})
    except ConfigError:
        return
    status, _, body = await chat(h, "ctor-1")
    assert status != 500, f"guard construction failure surfaced as {status}: {body}"


# == routing =================================================================================================


async def test_a_prefixed_model_is_routed_stripped_and_priced_by_its_bare_name(gateway_factory: GatewayFactory) -> None:
    """DESIGN 3: `provider/model` names the provider (prefix stripped upstream); DESIGN 5: pricing and
    `models:` globs match the model name without a `provider/` prefix. A USD budget on `openai/gpt-4o-mini`
    is therefore priced by the `gpt-*` entry (no 'unknown price' stop), and the upstream sees the bare name."""
    h = await gateway_factory(pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
                              agents={"bot": {"budget": {"usd": 1.0}}})
    client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="none", max_retries=0,
                                default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "pfx-1"})
    async with client:
        resp = await client.chat.completions.create(model="openai/gpt-4o-mini", messages=MSG, max_tokens=20)
    assert resp.choices[0].message.content == "Hello!"
    assert h.fake.seen[-1].json["model"] == "gpt-4o-mini"
    run = await h.run("pfx-1")
    assert run["spent_usd"] == pytest.approx((10 * 1.0 + 5 * 2.0) / 1e6)


async def test_a_unicode_model_name_routes_by_glob_and_reaches_the_upstream_unchanged(
    gateway_factory: GatewayFactory,
) -> None:
    """DESIGN 3: `models:` maps exact names or globs; globs are matched on the raw name (case-sensitive),
    and nothing in the request is rewritten when nothing had to change."""
    h = await gateway_factory()
    name = "gpt-4o-\u00fcnicode-\u6a21\u578b"
    client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="none", max_retries=0)
    async with client:
        await client.chat.completions.create(model=name, messages=MSG)
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="\u0262pt-4o", messages=MSG)  # small capital G: no glob
    assert h.fake.seen[-1].json["model"] == name
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert len(h.fake.seen) == 1


async def test_a_provider_named_like_a_model_is_a_prefix_only_when_followed_by_a_slash(
    gateway_factory: GatewayFactory, fake: Any
) -> None:
    """DESIGN 3: `provider/model` names the provider explicitly; otherwise `models:` decides. A provider
    named `gpt-4o` does not capture the model `gpt-4o` (the glob routes it), only `gpt-4o/<model>`."""
    _, url = fake
    providers = {"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"},
                 "gpt-4o": {"type": "openai", "base_url": f"{url}/alt/v1", "api_key": "sk-provider-alt"}}
    h = await gateway_factory(providers=providers, models={"gpt-*": "openai"})
    client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="none", max_retries=0)
    async with client:
        await client.chat.completions.create(model="gpt-4o", messages=MSG)
        await client.chat.completions.create(model="gpt-4o/mini", messages=MSG)
    first, second = h.fake.seen
    assert (first.path, first.json["model"]) == ("/v1/chat/completions", "gpt-4o")
    assert (second.path, second.json["model"]) == ("/alt/v1/chat/completions", "mini")


# == identity ================================================================================================

KEYED = {"bot": {"keys": ["key-bot-123456"], "caps": {"llm_calls": 5}},
         "ops": {"keys": ["key-ops-123456"], "caps": {"llm_calls": 1}}}


async def test_the_anthropic_sdk_key_names_the_agent_and_the_agent_header_cannot_override_it(
    gateway_factory: GatewayFactory,
) -> None:
    """DESIGN 3: the bearer token (or Anthropic's `x-api-key`) is looked up among the agent keys; the
    `x-tollgate-agent` header names the agent only without keys configured."""
    h = await gateway_factory(agents=KEYED)
    claude = anthropic.AsyncAnthropic(base_url=h.url, api_key="key-bot-123456", max_retries=0,
                                      default_headers={"x-tollgate-agent": "ops", "x-tollgate-run-id": "id-1"})
    async with claude:
        for _ in range(2):  # ops would stop at its cap of 1 call
            await claude.messages.create(model="claude-3-5-haiku-latest", max_tokens=20, messages=MSG)
    run = await h.run("id-1")
    assert (run["agent"], run["status"], run["llm_calls"]) == ("bot", "active", 2)
    assert h.fake.seen[-1].headers.get("x-api-key") == "sk-ant-provider"


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_keys_configured_but_none_sent_is_401_whatever_agent_header(
    gateway_factory: GatewayFactory, sdk: str
) -> None:
    """README: 401 `invalid_api_key` for an unknown agent key; DESIGN 3: the agent header names nobody
    once keys are configured. The SDKs raise AuthenticationError and nothing goes upstream."""
    h = await gateway_factory(agents=KEYED)
    headers = {"x-tollgate-agent": "bot"}
    if sdk == "openai":
        status, _, body = await chat(h, "nokey-1", agent="bot")  # no Authorization, no x-api-key
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
    else:
        claude = anthropic.AsyncAnthropic(base_url=h.url, api_key="key-bot-12345", max_retries=0,
                                          default_headers=headers)
        async with claude:
            with pytest.raises(anthropic.AuthenticationError):
                await claude.messages.create(model="claude-3-5-haiku-latest", max_tokens=20, messages=MSG)
    assert h.fake.seen == []


# == custom guards through a running gateway =================================================================


async def test_a_custom_stop_reaches_the_sdk_with_its_code_and_is_sticky(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """docs/custom-guards.md: `Decision.stop(name, code, detail)` stops the run (sticky until reset) and
    reaches the agent as a 403 with `code`; README: stops carry `x-tollgate-stop-reason`."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("StopAll")]}})
    for _ in range(2):
        status, headers, body = await chat(h, "cs-1")
        assert status == 403 and body["error"]["code"] == "custom_stop", body
        assert headers.get("x-tollgate-stop-reason") == "custom_stop"
    assert h.fake.seen == []
    run = await h.run("cs-1")
    assert (run["status"], run["stop_reason"]) == ("stopped", "custom_stop")


@pytest.mark.parametrize(("on_error", "status"), [("fail_closed", 403), ("fail_open", 200)])
async def test_a_raising_guard_follows_on_error(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType, on_error: str, status: int
) -> None:
    """docs/custom-guards.md: a guard that raises stops the run with `guard_error` (fail_closed), or is
    skipped with fail_open."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("Raises", on_error=on_error)]}})
    got, _, body = await chat(h, f"raise-{on_error}")
    assert got == status, body
    if status == 403:
        assert body["error"]["code"] == "guard_error" and h.fake.seen == []


async def test_an_after_hook_returning_a_dict_withholds_the_answer(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """guards/chain.py: a guard returning something other than a Decision has failed like one that raised
    (fail_closed: `guard_error`); `after` sees the answer before the agent does, so it is withheld."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("AfterReturnsDict")]}})
    status, _, body = await chat(h, "dict-1")
    assert status == 403 and body["error"]["code"] == "guard_error", body
    assert "Hello!" not in orjson.dumps(body).decode()


async def test_a_reject_before_the_call_is_a_400_and_the_run_goes_on(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """guards/base.py `Decision.reject`: refuse this step as a bad request (400) without stopping the run."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("RejectBefore")]}})
    status, _, body = await chat(h, "rej-b")
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert (await h.run("rej-b"))["status"] == "active"


async def test_a_reject_on_the_answer_does_not_stop_the_run(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """guards/base.py: `Decision.reject` refuses this step (400) without stopping the run; `action:
    reject` means 'the run goes on'. Returned from `after`, it must not become a sticky stop."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("RejectAfter")]}})
    status, headers, body = await chat(h, "rej-a")
    run = await h.run("rej-a")
    assert (status, run["status"]) == (400, "active"), (
        f"reject in after answered {status} {body} with stop header "
        f"{headers.get('x-tollgate-stop-reason')!r}; run {run['status']} ({run['stop_reason']})")


async def test_a_reject_on_an_mcp_call_does_not_stop_the_run(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType, files: mcp_server.RunningServer
) -> None:
    """guards/base.py: `Decision.reject` refuses the step without stopping the run; docs/custom-guards.md:
    one guard sees the same `Call` for OpenAI, Anthropic and MCP. On a `tools/call` it refuses that call
    as a model call's reject is refused (400 `invalid_request`, the guard's detail), and the run stays
    active."""
    h = await mcp_gateway(gateway_factory, files, guards=[guard("RejectBefore")])
    status, body = await raw_post(h, mcp_call("read_file", {"path": "a"}), run="rej-mcp")
    assert status == 400 and body["error"]["data"]["code"] == "invalid_request", body
    run = await h.run("rej-mcp")
    assert run["status"] == "active", f"a reject stopped the run: {run['stop_reason']}"
    assert files.seen.calls() == []


async def test_a_custom_claim_with_a_limit_holds_across_steps(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """guards/base.py: a guard's wishes reach the store as `claims` (amounts reserved atomically before the
    call, with limits) so that a limit holds even when steps race. A claim of 1 `probe_calls` per step
    with limit 2 must refuse the third step (`probe_cap`); a settled call may not release it to zero (it is
    kept when usage is missing, guards/budget.py settlement)."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("ClaimCap", limit=2)]}})
    statuses = [(await chat(h, "claim-1"))[0] for _ in range(3)]
    assert statuses == [200, 200, 403], f"claim limit of 2 per run did not hold: {statuses}"


async def test_a_custom_add_effect_counts_stops_at_its_limit_and_reset_clears_it(
    gateway_factory: GatewayFactory, guards_module: types.ModuleType
) -> None:
    """docs/custom-guards.md: to count something a guard returns effects (`Add`); an `Add` over its limit
    stops the run with its code (store/base.py); DESIGN 5: reset clears counters."""
    h = await gateway_factory(agents={"bot": {"guards": [guard("AddCap", limit=2)]}})
    statuses = [(await chat(h, "add-1"))[0] for _ in range(3)]
    assert statuses == [200, 200, 403]
    run = await h.run("add-1")
    assert run["stop_reason"] == "probe_step_cap" and len(h.fake.seen) == 2
    async with h.session.post(f"{h.admin_url}/admin/runs/add-1/reset") as resp:
        assert resp.status == 200
    assert (await chat(h, "add-1"))[0] == 200


# == approvals ===============================================================================================


async def test_who_approved_a_parked_call_is_in_the_ledger(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: every step decision is a ledger row (decision, reason); gateway/ledger.py lists `approve`
    and `deny` among decisions; a human's `POST /admin/approvals/{id}` with `by` is that decision. After
    alice approves, the run's ledger must show the approval and who made it (an audit trail)."""
    h = await mcp_gateway(gateway_factory, files)
    async with mcp_client(h, run="appr-ledger") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending(h)
        status, _ = await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        assert status == 200
        await task
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = ledger.rows("appr-ledger", limit=100)
    assert any("alice" in (r["detail"] or "") for r in rows), (
        f"approval by alice not in the ledger: {[(r['operation'], r['decision'], r['detail']) for r in rows]}")


async def test_an_unknown_status_filter_is_refused(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: `GET /admin/approvals[?status=pending]`, statuses `pending`, `approved`, `denied`,
    `timed_out`. A misspelt filter (`?status=pendng`) must be a 400, not an empty list that reads as
    'nothing is waiting for a human' while a call is parked."""
    h = await mcp_gateway(gateway_factory, files)
    async with mcp_client(h, run="flt-1") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending(h)
        status, body = await admin(h, "GET", "/admin/approvals?status=pendng")
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "probe"})
        await refused(task)
    assert status == 400, f"unknown status filter answered {status} {body}"


async def test_status_filters_list_each_outcome(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: approvals are listed by `GET /admin/approvals[?status=...]` with statuses pending,
    approved, denied, timed_out; deciding a timed-out approval is an error (a decision is final)."""
    h = await mcp_gateway(gateway_factory, files, tools={**TOOLS, "approval_timeout_s": 0.3})
    async with mcp_client(h, run="flt-2") as client:
        for path, decision in (("a", "approve"), ("b", "deny")):
            task = asyncio.create_task(client.call_tool("delete_file", {"path": path}))
            [item] = await pending(h)
            await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": decision, "by": " carol "})
            if decision == "approve":
                await task
            else:
                await refused(task)
        error = await refused(client.call_tool("delete_file", {"path": "c"}))
        assert error["data"] == {"code": "approval_timeout"}
    listed: dict[str, list[dict[str, Any]]] = {}
    for status in ("pending", "approved", "denied", "timed_out"):
        code, body = await admin(h, "GET", f"/admin/approvals?status={status}")
        assert code == 200
        listed[status] = body["approvals"]
    assert [a["arguments"]["path"] for a in listed["approved"]] == ["a"]
    assert [a["arguments"]["path"] for a in listed["denied"]] == ["b"]
    assert [a["arguments"]["path"] for a in listed["timed_out"]] == ["c"]
    assert listed["pending"] == []
    assert listed["approved"][0]["decided_by"] == "carol"
    late = listed["timed_out"][0]["id"]
    code, body = await admin(h, "POST", f"/admin/approvals/{late}", {"decision": "approve", "by": "dave"})
    assert code == 400 and body["error"]["code"] == "already_decided"


async def test_concurrent_decisions_on_one_approval_exactly_one_wins(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """gateway/approvals.py: a decision is final, deciding twice is an error. Two humans deciding the same
    id at once: exactly one 200, the other 400 `already_decided`, and the call follows the winner."""
    h = await mcp_gateway(gateway_factory, files)
    async with mcp_client(h, run="race-1") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending(h)
        url = f"/admin/approvals/{item['id']}"
        results = await asyncio.gather(admin(h, "POST", url, {"decision": "approve", "by": "alice"}),
                                       admin(h, "POST", url, {"decision": "deny", "by": "bob"}))
        codes = sorted(code for code, _ in results)
        assert codes == [200, 400], results
        winner = next(body for code, body in results if code == 200)
        if winner["status"] == "approved":
            await task
            assert files.seen.calls() == [("delete_file", {"path": "a"})]
        else:
            await refused(task)
            assert files.seen.calls() == []
    _, body = await admin(h, "GET", "/admin/approvals")
    assert [a["decided_by"] for a in body["approvals"]] == [winner["decided_by"]]
