"""gateway/config_urls.py as tables: every URL and header map of a config is checked when it is parsed, so
what the runtime would trip over on every request (a 500 from `urlsplit(...).port`, a serve that dies with
a traceback, a 400 blaming the client for a configured header) is an error naming its key instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main as cli_main
from gateway.config import Config, parse_config
from gateway.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-pw-4d9e2b7c"


def provider(base_url: str, **more: Any) -> dict[str, Any]:
    return {"providers": {"p": {"type": "openai", "base_url": base_url, **more}}}


def mcp(url: str = "http://127.0.0.1:9/mcp", **more: Any) -> dict[str, Any]:
    return {"mcp_servers": {"m": {"url": url, **more}}}


def state(url: str) -> dict[str, Any]:
    return {"state": {"backend": "redis", "url": url}}


# (name, config, key path, fragment of the message)
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    # providers.<name>.base_url
    ("base_url unclosed IPv6 bracket", provider("http://[::1/v1"), "providers.p.base_url", "[ ]"),
    ("base_url not IPv6 in brackets", provider("http://[zz]/v1"), "providers.p.base_url", "IPv6"),
    ("base_url text after the bracket", provider("http://[::1]x/v1"), "providers.p.base_url", "bracketed host"),
    ("base_url IPv4 in brackets", provider("http://[127.0.0.1]/v1"), "providers.p.base_url", "IPv6"),
    ("base_url IPv6 without brackets", provider("http://::1/v1"), "providers.p.base_url", "without brackets"),
    ("base_url port above 65535", provider("http://127.0.0.1:99999/v1"), "providers.p.base_url", "1 to 65535"),
    ("base_url port 0", provider("http://127.0.0.1:0/v1"), "providers.p.base_url", "1 to 65535"),
    ("base_url port not a number", provider("http://h:http/v1"), "providers.p.base_url", "1 to 65535"),
    ("base_url signed port", provider("http://h:+80/v1"), "providers.p.base_url", "1 to 65535"),
    ("base_url IPv6 port above 65535", provider("http://[::1]:65536/v1"), "providers.p.base_url", "1 to 65535"),
    ("base_url without host", provider("http://:8000/v1"), "providers.p.base_url", "no host"),
    ("base_url without authority", provider("http:/v1"), "providers.p.base_url", "absolute http(s) URL"),
    ("base_url ftp", provider("ftp://h/v1"), "providers.p.base_url", "absolute http(s) URL"),
    ("base_url credentials", provider("https://user:pw@h/v1"), "providers.p.base_url", "api_key"),
    ("base_url query", provider("https://h/v1?api-version=1"), "providers.p.base_url", "query or fragment"),
    ("base_url fragment", provider("https://h/v1#x"), "providers.p.base_url", "query or fragment"),
    ("base_url trailing newline", provider("https://h/v1\n"), "providers.p.base_url", "blanks"),
    ("base_url inner line break", provider("https://h/v\r\n1"), "providers.p.base_url", "control character"),
    ("base_url blank in host", provider("https://a b/v1"), "providers.p.base_url", "blank"),
    # providers.<name>.api_key (sent as a header value)
    ("api_key with its newline", provider("https://h/v1", api_key="sk-key\n"), "providers.p.api_key",
     "control character"),
    ("api_key with NUL", provider("https://h/v1", api_key="sk\x00key"), "providers.p.api_key", "control character"),
    # mcp_servers.<name>.url
    ("mcp url port above 65535", mcp("http://127.0.0.1:99999/mcp"), "mcp_servers.m.url", "1 to 65535"),
    ("mcp url unclosed IPv6 bracket", mcp("http://[::1/mcp"), "mcp_servers.m.url", "[ ]"),
    ("mcp url without host", mcp("https:///mcp"), "mcp_servers.m.url", "no host"),
    ("mcp url credentials", mcp("https://u:pw@h/mcp"), "mcp_servers.m.url", "headers"),
    ("mcp url relative", mcp("files"), "mcp_servers.m.url", "absolute http(s) URL"),
    # mcp_servers.<name>.headers
    ("header value CRLF", mcp(headers={"X-Token": "a\r\nInjected: 1"}), "mcp_servers.m.headers.X-Token",
     "control character"),
    ("header value LF", mcp(headers={"Authorization": "Bearer t\n"}), "mcp_servers.m.headers.Authorization",
     "control character"),
    ("header value NUL", mcp(headers={"X-Token": "a\x00b"}), "mcp_servers.m.headers.X-Token", "control character"),
    ("header value DEL", mcp(headers={"X-Token": "a\x7fb"}), "mcp_servers.m.headers.X-Token", "control character"),
    ("header name with a blank", mcp(headers={"X Token": "v"}), "mcp_servers.m.headers", "RFC 9110 token"),
    ("header name with a colon", mcp(headers={"X-Token:": "v"}), "mcp_servers.m.headers", "a colon"),
    ("header name with CRLF", mcp(headers={"X-A\r\nX-B": "v"}), "mcp_servers.m.headers", "control character"),
    ("header name non-ASCII", mcp(headers={"X-Tökén": "v"}), "mcp_servers.m.headers", "RFC 9110 token"),
    ("header name empty", mcp(headers={"": "v"}), "mcp_servers.m.headers", "empty"),
    ("header name twice", mcp(headers={"X-Token": "a", "x-token": "b"}), "mcp_servers.m.headers", "twice"),
    ("header tollgate writes", mcp(headers={"Host": "internal"}), "mcp_servers.m.headers", "writes itself"),
    ("framing header", mcp(headers={"Transfer-Encoding": "chunked"}), "mcp_servers.m.headers", "writes itself"),
    # state.url
    ("redis port above 65535", state("redis://127.0.0.1:99999/0"), "state.url", "1 to 65535"),
    ("redis port not a number", state("redis://h:abc/0"), "state.url", "1 to 65535"),
    ("redis port 0", state("redis://h:0/0"), "state.url", "1 to 65535"),
    ("redis unclosed IPv6 bracket", state("redis://[::1/0"), "state.url", "[ ]"),
    ("redis IPv6 without brackets", state("redis://::1:6379/0"), "state.url", "without brackets"),
    ("redis without host", state("redis:///0"), "state.url", "no host"),
    ("redis path not a db", state("redis://h:6379/zero"), "state.url", "database number"),
    ("redis bad query value", state("redis://h/0?socket_timeout=abc"), "state.url", "socket_timeout"),
    ("redis unknown query name", state("redis://h/0?sockettimeout=1"), "state.url", "sockettimeout"),
    ("redis query redis-py parses, asyncio refuses", state("redis://h/0?timeout=1"), "state.url", "timeout"),
    ("redis query the store cannot take", state("redis://h/0?decode_responses=true"), "state.url",
     "decode_responses"),
    ("redis TLS option on plain TCP", state("redis://h/0?ssl_certfile=/c.pem"), "state.url", "ssl_certfile"),
    ("unix TCP option", state("unix:///run/redis.sock?socket_keepalive=true"), "state.url", "socket_keepalive"),
    ("unix two slashes", state("unix://run/redis.sock"), "state.url", "three slashes"),
    ("unix without path", state("unix://"), "state.url", "three slashes"),
    ("redis trailing newline", state("redis://h:6379/0\n"), "state.url", "blanks"),
    ("not a redis URL", state("http://nothing"), "state.url", "redis://"),
]


@pytest.mark.parametrize(("data", "path", "fragment"), [(d, p, f) for _, d, p, f in INVALID],
                         ids=[n for n, _, _, _ in INVALID])
def test_an_invalid_url_or_header_is_an_error_naming_its_key(data: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    assert [p for p, _ in info.value.problems] == [path], info.value.problems
    assert fragment in dict(info.value.problems)[path]


VALID: list[tuple[str, dict[str, Any]]] = [
    ("https base_url", provider("https://api.openai.com/v1")),
    ("uppercase scheme", provider("HTTPS://api.openai.com/v1")),
    ("IPv6 base_url with port", provider("http://[::1]:8000/v1")),
    ("IPv6 base_url without port", provider("http://[2001:db8::1]/v1")),
    ("IPv6 with a zone", provider("http://[fe80::1%25eth0]:8000/v1")),
    ("explicit port 1", provider("http://127.0.0.1:1/v1")),
    ("explicit port 65535", provider("http://127.0.0.1:65535/v1")),
    ("empty port (the default)", provider("http://h:/v1")),
    ("trailing slash", provider("https://h/v1/")),
    ("no path", provider("https://api.anthropic.com")),
    ("api_key", provider("https://h/v1", api_key="sk-abc_123")),
    ("mcp url with query", mcp("https://h:8443/mcp?tenant=a")),
    ("mcp url IPv6", mcp("http://[::1]:3000/mcp")),
    ("mcp headers", mcp(headers={"Authorization": "Bearer t0ken", "X-Api-Key": "k", "x-odd!#$%&'*+.^_`|~": "v"})),
    ("mcp header value with a tab and UTF-8", mcp(headers={"X-Note": "a\tb é"})),
    ("redis", state("redis://h:6379/0")),
    ("redis without port or db", state("redis://h")),
    ("redis IPv6", state("redis://[::1]:6379/2")),
    ("redis uppercase scheme", state("REDIS://h:6379/0")),
    ("redis password", state(f"redis://:{SECRET}@h:6379/0")),
    ("redis user and password", state(f"redis://user:{SECRET}@h:6379/0")),
    ("rediss with TLS options", state("rediss://h:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false")),
    ("redis with options", state("redis://h/0?socket_timeout=0.5&health_check_interval=10&client_name=tg")),
    ("redis db in the query", state("redis://h?db=3")),
    ("unix socket", state("unix:///run/redis.sock")),
    ("unix socket with password and db", state(f"unix://:{SECRET}@/run/redis.sock?db=1")),
]


@pytest.mark.parametrize("data", [d for _, d in VALID], ids=[n for n, _ in VALID])
def test_valid_urls_and_headers(data: dict[str, Any]) -> None:
    assert isinstance(parse_config(data, env={}), Config)


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@h:99999/0", f"redis://user:{SECRET}/0",
                                 f"redis://:{SECRET}@[::1/0", f"rediss://:{SECRET}@h/0?nope=1",
                                 f"http://u:{SECRET}@h/v1", f"redis://:{SECRET}@h/0\n"])
def test_an_error_never_shows_a_password_in_the_url(url: str) -> None:
    """`redis://user:password/0` (the `@host` left out) reads as host `user`, port `password`."""
    data = provider(url) if url.startswith("http") else state(url)
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    assert SECRET not in str(info.value) and SECRET[:8] not in str(info.value)


@pytest.mark.parametrize("name", [f"Authorization: Bearer {SECRET}", f"Authorization {SECRET}"])
def test_a_header_name_error_never_shows_what_follows_the_bad_character(name: str) -> None:
    """`headers: {"Authorization: Bearer ${T}"}` in YAML is a name with no value: only its valid start is shown."""
    with pytest.raises(ConfigError) as info:
        parse_config(mcp(headers={name: "v"}), env={})
    assert SECRET not in str(info.value) and "'Authorization...'" in str(info.value)


def test_a_header_value_error_never_shows_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(mcp(headers={"Authorization": f"Bearer {SECRET}\n"}), env={})
    assert SECRET not in str(info.value)


def test_every_bad_url_is_reported_at_once() -> None:
    data = {**provider("http://[::1/v1"), **mcp("http://h:99999/mcp"), **state("redis://h:99999/0")}
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    assert {p for p, _ in info.value.problems} == {"providers.p.base_url", "mcp_servers.m.url", "state.url"}


def test_a_substituted_url_is_checked() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(state("${REDIS_URL}"), env={"REDIS_URL": "redis://h:70000/0"})
    assert [p for p, _ in info.value.problems] == ["state.url"]


# -- through the command line ----------------------------------------------------------------------------

CLI_CASES = [(n, d, p) for n, d, p, _ in INVALID if n in {
    "base_url unclosed IPv6 bracket", "base_url port above 65535", "mcp url port above 65535",
    "header value CRLF", "header name with a blank", "redis port above 65535", "redis port not a number",
    "redis unclosed IPv6 bracket", "redis bad query value", "api_key with its newline",
}]


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "tollgate.yaml"
    path.write_text(json.dumps({"state": {"backend": "memory"}, **data}))  # JSON is YAML
    return path


@pytest.mark.parametrize(("data", "path"), [(d, p) for _, d, p in CLI_CASES], ids=[n for n, _, _ in CLI_CASES])
def test_check_config_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any],
                                    path: str) -> None:
    assert cli_main(["check-config", str(write(tmp_path, data))]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert [line.split(": ", 2)[1] for line in err.splitlines()] == [path], err
    assert err.startswith(f"error: {path}: ")


@pytest.mark.parametrize("data", [d for n, d in VALID if n in {
    "IPv6 base_url with port", "https base_url", "explicit port 65535", "mcp headers", "redis IPv6",
    "unix socket",
}])
def test_check_config_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any]) -> None:
    assert cli_main(["check-config", str(write(tmp_path, data))]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999/0", "redis://127.0.0.1:abc/0", "redis://[::1/0"])
def test_serve_refuses_a_bad_state_url_with_an_error_line_not_a_traceback(tmp_path: Path, url: str) -> None:
    path = tmp_path / "tollgate.yaml"
    path.write_text(json.dumps({"state": {"backend": "redis", "url": url}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0",
                             "--admin-port", "0"], check=False, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: state.url: "), result.stderr
