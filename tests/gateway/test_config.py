"""gateway/config.py as tables: `${VAR}` substitution, validation with key paths, loading, defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config import Config, default_config, ledger_file_of, load_config, parse_config
from gateway.errors import ConfigError

OPENAI = {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}


# -- substitution (gateway/config_env.py has its own tests) ------------------------------------------

UNSET: list[tuple[str, dict[str, Any], str]] = [
    ("top-level string", {"admin": {"token": "${NOPE}"}}, "admin.token"),
    ("provider key", {"providers": {"openai": {**OPENAI, "api_key": "${NOPE}"}}}, "providers.openai.api_key"),
    ("list item", {"agents": {"bot": {"keys": ["ok", "${NOPE}"]}}}, "agents.bot.keys.1"),
    ("set but empty", {"admin": {"token": "${EMPTY}"}}, "admin.token"),
]


@pytest.mark.parametrize(("data", "path"), [(d, p) for _, d, p in UNSET], ids=[n for n, _, _ in UNSET])
def test_unset_variable_names_key_path_and_variable(data: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={"EMPTY": ""})
    [(where, message)] = info.value.problems
    assert where == path
    assert "NOPE" in message or "EMPTY" in message


def test_substituted_strings_are_coerced_to_their_field_types() -> None:
    config = parse_config(
        {"listen": {"port": "${PORT:-9000}"}, "limits": {"max_body_bytes": "${MAX}"},
         "otel": {"capture_content": "${CAPTURE:-true}"}},
        env={"MAX": "1024"},
    )
    assert config.listen.port == 9000
    assert config.limits.max_body_bytes == 1024
    assert config.otel.capture_content is True


def test_environment_is_read_at_load_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_CFG_TEST_KEY", "first")
    config = parse_config({"providers": {"openai": {**OPENAI, "api_key": "${TOLLGATE_CFG_TEST_KEY}"}}})
    monkeypatch.setenv("TOLLGATE_CFG_TEST_KEY", "second")
    assert config.providers["openai"].api_key == "first"


# -- validation errors name the key path ----------------------------------------------------------------

ERRORS: list[tuple[str, dict[str, Any], str, str]] = [
    ("unknown top-level key", {"listn": {}}, "listn", "unknown key"),
    ("unknown nested key", {"listen": {"prot": 1}}, "listen.prot", "unknown key"),
    ("unknown provider key", {"providers": {"o": {**OPENAI, "apikey": "k"}}}, "providers.o.apikey", "unknown key"),
    ("unknown timeout key", {"providers": {"o": {**OPENAI, "timeouts": {"total": 5}}}}, "providers.o.timeouts.total",
     "unknown key"),
    ("unknown agent key", {"agents": {"bot": {"budjet": {}}}}, "agents.bot.budjet", "unknown key"),
    ("unknown limits key", {"limits": {"max_bytes": 1}}, "limits.max_bytes", "unknown key"),
    ("zero answer cap", {"limits": {"max_answer_bytes": 0}}, "limits.max_answer_bytes", "greater than 0"),
    ("answer cap not an int", {"limits": {"max_answer_bytes": 1.5}}, "limits.max_answer_bytes", "integer"),
    ("port not an int", {"listen": {"port": "http"}}, "listen.port", ""),
    ("port out of range", {"admin": {"port": 70000}}, "admin.port", ""),
    ("empty admin token", {"admin": {"token": ""}}, "admin.token", "is empty"),  # it left the admin API open
    ("admin token defaulted empty", {"admin": {"token": "${TOLLGATE_TEST_UNSET:-}"}}, "admin.token", "is empty"),
    ("admin token with blanks", {"admin": {"token": " t0ken "}}, "admin.token", "blanks"),  # never presentable
    ("provider type", {"providers": {"o": {**OPENAI, "type": "gemini"}}}, "providers.o.type", ""),
    ("provider without base_url", {"providers": {"o": {"type": "openai"}}}, "providers.o.base_url", ""),
    ("relative base_url", {"providers": {"o": {**OPENAI, "base_url": "/v1"}}}, "providers.o.base_url", "http"),
    ("ftp base_url", {"providers": {"o": {**OPENAI, "base_url": "ftp://h/v1"}}}, "providers.o.base_url", "http"),
    ("zero timeout", {"providers": {"o": {**OPENAI, "timeouts": {"idle": 0}}}}, "providers.o.timeouts.idle", ""),
    ("structured outputs dialect", {"providers": {"o": {**OPENAI, "structured_outputs": "x"}}},
     "providers.o.structured_outputs", ""),
    ("negative usd budget", {"agents": {"bot": {"budget": {"usd": -0.01}}}}, "agents.bot.budget.usd", ""),
    ("zero token budget", {"agents": {"bot": {"budget": {"tokens": 0}}}}, "agents.bot.budget.tokens", ""),
    ("usd budget not a number", {"agents": {"bot": {"budget": {"usd": "two"}}}}, "agents.bot.budget.usd", ""),
    ("negative cap", {"agents": {"bot": {"caps": {"llm_calls": -1}}}}, "agents.bot.caps.llm_calls", ""),
    ("on_stop value", {"agents": {"bot": {"on_stop": "explode"}}}, "agents.bot.on_stop", ""),
    ("on_violation value", {"agents": {"bot": {"tools": {"on_violation": "x"}}}}, "agents.bot.tools.on_violation", ""),
    ("retries above 10", {"agents": {"bot": {"output": {"retries": 11}}}}, "agents.bot.output.retries", ""),
    ("tier value", {"agents": {"bot": {"tools": {"tiers": {"t": "root"}}}}}, "agents.bot.tools.tiers.t", ""),
    ("guard without use", {"agents": {"bot": {"guards": [{"options": {}}]}}}, "agents.bot.guards.0.use", ""),
    ("negative price", {"pricing": {"m": {"input_per_mtok": -1, "output_per_mtok": 0}}}, "pricing.m.input_per_mtok", ""),
    ("state backend", {"state": {"backend": "mongo"}}, "state.backend", ""),
    ("negative grace", {"shutdown_grace_s": -1}, "shutdown_grace_s", ""),
    ("section of wrong type", {"providers": ["openai"]}, "providers", ""),
    ("dangling model route", {"models": {"gpt-*": "openai"}}, "models.gpt-*", "openai"),
    ("duplicate agent key", {"agents": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "agents.b.keys.0", "'a'"),
    ("empty agent key", {"agents": {"a": {"keys": [""]}}}, "agents.a.keys.0", "empty"),
    ("approval outside allow", {"agents": {"a": {"tools": {"allow": ["x"], "approval": ["y"]}}}},
     "agents.a.tools.approval.0", "allowed"),
    ("anthropic with a dialect", {"providers": {"a": {"type": "anthropic", "base_url": "https://api.anthropic.com",
                                                      "structured_outputs": "openai"}}},
     "providers.a.structured_outputs", "anthropic takes none"),
    ("base_dir is not a key", {"base_dir": "/elsewhere"}, "base_dir", "unknown key"),
]


@pytest.mark.parametrize(("data", "path", "fragment"), [(d, p, f) for _, d, p, f in ERRORS],
                         ids=[n for n, _, _, _ in ERRORS])
def test_errors_name_key_path(data: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    paths = [p for p, _ in info.value.problems]
    assert path in paths, info.value.problems
    message = dict(info.value.problems)[path]
    assert fragment in message
    assert path in str(info.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"listn": 1, "listen": {"port": "x"}, "agents": {"b": {"budget": {"usd": -1}}}}, env={})
    assert {p for p, _ in info.value.problems} == {"listn", "listen.port", "agents.b.budget.usd"}


VALID: list[tuple[str, dict[str, Any]]] = [
    ("empty", {}),
    ("approval inside an allow glob", {"agents": {"a": {"tools": {"allow": ["files/*"], "approval": ["files/rm"]}}}}),
    ("approval without allow-list", {"agents": {"a": {"tools": {"approval": ["anything"]}}}}),
    ("models routed to defined providers", {"providers": {"o": OPENAI}, "models": {"gpt-*": "o", "exact": "o"}}),
    ("https base_url", {"providers": {"o": {**OPENAI, "base_url": "https://api.openai.com/v1"}}}),
    ("port 0 (any free port)", {"listen": {"port": 0}}),
    ("zero prices", {"pricing": {"m": {"input_per_mtok": 0, "output_per_mtok": 0}}}),
    ("an answer cap", {"limits": {"max_answer_bytes": 1}}),
]


@pytest.mark.parametrize("data", [d for _, d in VALID], ids=[n for n, _ in VALID])
def test_valid_configs(data: dict[str, Any]) -> None:
    assert isinstance(parse_config(data, env={}), Config)


def test_defaults() -> None:
    config = parse_config(None, env={})
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    assert (config.admin.host, config.admin.port) == ("127.0.0.1", 9464)
    assert config.limits.max_body_bytes == 33554432 and config.limits.max_json_depth == 64
    assert config.limits.max_answer_bytes == 64 * 1024 * 1024
    assert (config.state.backend, config.state.path) == ("sqlite", "tollgate.db")
    assert config.grammars.dir == "grammars"
    assert config.otel.capture_content is False
    provider = parse_config({"providers": {"o": OPENAI}}, env={}).providers["o"]
    assert (provider.timeouts.connect, provider.timeouts.first_byte, provider.timeouts.idle) == (10, 120, 60)
    assert provider.passthrough_auth is False


def test_root_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["a"], env={})
    assert info.value.problems[0][0] == "<root>"


def test_config_is_frozen() -> None:
    config = parse_config({"providers": {"o": OPENAI}}, env={})
    with pytest.raises(ValidationError):
        config.listen.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.providers["o"].api_key = "stolen"  # type: ignore[misc]


# -- load_config ---------------------------------------------------------------------------------------


def test_load_config_resolves_relative_paths_against_the_file(tmp_path: Path) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    path = sub / "tollgate.yaml"
    path.write_text("state: {path: run.db}\nproviders:\n  o: {type: openai, base_url: '${U:-http://h/v1}'}\n")
    config = load_config(path, env={})
    assert config.base_dir == str(sub.resolve())
    assert config.resolve(config.state.path) == sub.resolve() / "run.db"
    assert config.resolve("/abs/x.db") == Path("/abs/x.db")
    assert config.providers["o"].base_url == "http://h/v1"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("providers: {a: [\n", "invalid YAML"), ("", ""), ("# only a comment\n", "")],
    ids=["invalid yaml", "empty file", "comment only"],
)
def test_load_config_file_contents(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    if not fragment:
        assert load_config(path, env={}).providers == {}
        return
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.problems[0][0] == "<file>"
    assert fragment in info.value.problems[0][1]


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.problems[0][0] == "<file>"


# -- ledger_file_of: the ledger's file without the rest of the config ------------------------------------

FULL = """
providers:
  openai: {type: openai, base_url: https://api.openai.com/v1, api_key: "${OPENAI_API_KEY}"}
agents:
  bot: {keys: ["${BOT_KEY}"]}
"""


@pytest.mark.parametrize(("sections", "env", "expected"), [
    ("", {}, "tollgate.db"),
    ("state: {backend: sqlite, path: data/run.db}", {}, "data/run.db"),
    ("state: {backend: redis, url: '${REDIS_URL}'}", {}, "tollgate-ledger.db"),
    ("state: {backend: memory, path: ignored.db}", {}, "tollgate-ledger.db"),
    ("ledger: {path: '${LEDGER_DIR}/audit.db'}\nstate: {backend: memory}", {"LEDGER_DIR": "logs"}, "logs/audit.db"),
    ("ledger: {path: /abs/audit.db}", {}, "/abs/audit.db"),
    ("state: {path: '${STATE:-s.db}'}", {}, "s.db"),
], ids=["defaults", "state file", "redis", "memory", "ledger path from env", "absolute", "env default"])
def test_ledger_file_of_needs_only_the_keys_that_decide_it(
    tmp_path: Path, sections: str, env: dict[str, str], expected: str
) -> None:
    """The provider and agent keys' variables are unset: the ledger's file is found all the same, and
    it is the file `load_config(...).ledger_file` names once they are set."""
    path = tmp_path / "tollgate.yaml"
    path.write_text(FULL + sections + "\n")
    found = ledger_file_of(path, env=env)
    assert found == tmp_path.resolve() / expected
    full_env = {"OPENAI_API_KEY": "sk-x", "BOT_KEY": "bot-key", "REDIS_URL": "redis://h:6379/0", **env}
    assert load_config(path, env=full_env).ledger_file == found


@pytest.mark.parametrize(("sections", "path", "fragment"), [
    ("ledger: {path: '${LEDGER_FILE}'}", "ledger.path", "environment variable LEDGER_FILE is not set"),
    ("state: {backend: '${BACKEND}'}", "state.backend", "environment variable BACKEND is not set"),
    ("state: {backend: postgres}", "state.backend", "Input should be"),
    ("state: {path: [a, b]}", "state.path", "string"),
    ("ledger: [x.db]", "ledger", "valid dictionary"),
], ids=["unset ledger.path variable", "unset backend variable", "bad backend", "bad path", "not a mapping"])
def test_ledger_file_of_still_checks_the_keys_it_reads(tmp_path: Path, sections: str, path: str,
                                                        fragment: str) -> None:
    file = tmp_path / "tollgate.yaml"
    file.write_text(FULL + sections + "\n")
    with pytest.raises(ConfigError) as info:
        ledger_file_of(file, env={})
    [(where, message)] = info.value.problems
    assert where == path and fragment in message, info.value.problems


def test_ledger_file_of_an_unreadable_or_odd_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ledger_file_of(tmp_path / "missing.yaml", env={})
    assert info.value.problems[0][0] == "<file>"
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        ledger_file_of(tmp_path / "list.yaml", env={})
    assert info.value.problems == [("<root>", "the config must be a mapping")]


# -- a config error never shows a secret ----------------------------------------------------------------

SECRET = "sk-config-probe-4d9e2b7c1a0f5e38"
MCP = {"url": "http://127.0.0.1:1/mcp"}

WRONG_TYPES: list[tuple[str, dict[str, Any], str]] = [
    ("key in a list", {"providers": {"o": {**OPENAI, "api_key": [SECRET]}}}, "providers.o.api_key"),
    ("key as a mapping", {"providers": {"o": {**OPENAI, "api_key": {"k": SECRET}}}}, "providers.o.api_key"),
    ("key for a bool", {"providers": {"o": {**OPENAI, "passthrough_auth": SECRET}}},
     "providers.o.passthrough_auth"),
    ("key for a provider", {"providers": {"o": SECRET}}, "providers.o"),
    ("key for the type", {"providers": {"o": {**OPENAI, "type": SECRET}}}, "providers.o.type"),
    ("key for the url", {"providers": {"o": {**OPENAI, "base_url": SECRET}}}, "providers.o.base_url"),
    ("admin token in a list", {"admin": {"token": [SECRET]}}, "admin.token"),
    ("admin token for admin", {"admin": SECRET}, "admin"),
    ("agent key nested", {"agents": {"a": {"keys": [[SECRET]]}}}, "agents.a.keys.0"),
    ("agent keys as one string", {"agents": {"a": {"keys": SECRET}}}, "agents.a.keys"),
    ("header value in a list", {"mcp_servers": {"m": {**MCP, "headers": {"Authorization": [SECRET]}}}},
     "mcp_servers.m.headers.Authorization"),
    ("headers as one string", {"mcp_servers": {"m": {**MCP, "headers": SECRET}}}, "mcp_servers.m.headers"),
]


@pytest.mark.parametrize(("data", "path"), [(d, p) for _, d, p in WRONG_TYPES],
                         ids=[n for n, _, _ in WRONG_TYPES])
def test_a_wrong_typed_secret_is_named_by_its_path_never_shown(data: dict[str, Any], path: str) -> None:
    """Validation errors carry the offending value (pydantic's `input_value`): only the path and the rule
    may be reported."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    assert path in [where for where, _ in info.value.problems], info.value.problems
    assert SECRET not in str(info.value) and SECRET[-12:] not in str(info.value)


def test_a_wrong_typed_key_in_a_file_is_not_shown(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"providers:\n  o:\n    type: openai\n    base_url: http://x/v1\n    api_key: [{SECRET}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.problems == [("providers.o.api_key", "Input should be a valid string")]


# -- default_config ------------------------------------------------------------------------------------

DEFAULTS: list[tuple[str, dict[str, str], dict[str, tuple[str, str | None]], set[str]]] = [
    ("no keys", {}, {}, set()),
    ("empty key ignored", {"OPENAI_API_KEY": ""}, {}, set()),
    ("openai", {"OPENAI_API_KEY": "sk-o"}, {"openai": ("https://api.openai.com/v1", "sk-o")}, {"gpt-*"}),
    ("anthropic", {"ANTHROPIC_API_KEY": "sk-a"}, {"anthropic": ("https://api.anthropic.com", "sk-a")}, {"claude-*"}),
    ("both", {"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a"},
     {"openai": ("https://api.openai.com/v1", "sk-o"), "anthropic": ("https://api.anthropic.com", "sk-a")},
     {"gpt-*", "claude-*"}),
    ("upstream override", {"OPENAI_API_KEY": "sk-o", "OPENAI_BASE_URL_UPSTREAM": "http://127.0.0.1:9/v1"},
     {"openai": ("http://127.0.0.1:9/v1", "sk-o")}, {"gpt-*"}),
]


@pytest.mark.parametrize(("env", "providers", "routes"), [(e, p, r) for _, e, p, r in DEFAULTS],
                         ids=[n for n, _, _, _ in DEFAULTS])
def test_default_config_from_env(env: dict[str, str], providers: dict[str, tuple[str, str | None]],
                                 routes: set[str]) -> None:
    config = default_config(env)
    assert {n: (p.base_url, p.api_key) for n, p in config.providers.items()} == providers
    assert routes <= set(config.models)
    assert set(config.models.values()) <= set(config.providers)
    assert (config.state.backend, config.state.path) == ("sqlite", "tollgate.db")
    assert config.agents == {}


def test_default_config_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert set(default_config().providers) == {"openai"}
    assert default_config().providers["openai"].api_key == "sk-from-env"


@pytest.mark.parametrize(("env", "named"), [
    ({"OPENAI_API_KEY": "sk-o-123456789", "OPENAI_BASE_URL_UPSTREAM": "localhost:9900/v1"}, "OPENAI_BASE_URL_UPSTREAM"),
    ({"ANTHROPIC_API_KEY": "sk-a-123456789", "ANTHROPIC_BASE_URL_UPSTREAM": "http://[::1:9/"},
     "ANTHROPIC_BASE_URL_UPSTREAM"),
    ({"OPENAI_API_KEY": "sk-o-123\n456789"}, "OPENAI_API_KEY"),
])
def test_a_bad_value_of_the_embedded_default_names_its_environment_variable(env: dict[str, str], named: str) -> None:
    """With no config file, the user wrote no `providers.openai.base_url`: the error names the variable."""
    with pytest.raises(ConfigError) as caught:
        default_config(env)
    [(where, _)] = caught.value.problems
    assert where.startswith(f"{named} (providers.")
