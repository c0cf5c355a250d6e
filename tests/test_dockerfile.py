"""The Dockerfile (it cannot be built here: no Docker engine) names the right base, build, user, ports,
health check and command, and its health check command behaves as Docker expects."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEALTH_URL = "http://127.0.0.1:9464/healthz"

Instruction = tuple[str, str]  # (KEYWORD, arguments), continuation lines joined


def instructions(text: str) -> list[Instruction]:
    result: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit inside a continued instruction too
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def stages() -> list[list[Instruction]]:
    """Instructions per build stage; index 0 holds the global ARGs before the first FROM."""
    found: list[list[Instruction]] = [[]]
    for keyword, args in instructions((ROOT / "Dockerfile").read_text()):
        if keyword == "FROM":
            found.append([])
        found[-1].append((keyword, args))
    return found


def args_of(stage: list[Instruction], keyword: str) -> list[str]:
    return [args for k, args in stage if k == keyword]


def test_two_stages_on_slim_python_311() -> None:
    head, *built = stages()
    assert len(built) >= 2
    defaults = dict(a.split("=", 1) for a in args_of(head, "ARG") if "=" in a)
    for stage in built:
        base = args_of(stage, "FROM")[0].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], base)
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base


def test_builder_makes_wheels_and_final_installs_only_them() -> None:
    builder, final = stages()[1], stages()[-1]
    assert "AS builder" in args_of(builder, "FROM")[0]
    assert any("pip wheel '.[speed]' -w /wheels" in run for run in args_of(builder, "RUN"))
    installs = [run for run in args_of(final, "RUN") if "pip install" in run]
    assert installs and all("--no-index" in r and "/wheels" in r and "tollgate" in r for r in installs)
    # uvloop, the loop the README's figures are measured on, is in the image
    assert all("'tollgate[speed]'" in r for r in installs)
    assert not any("pip wheel" in r for r in args_of(final, "RUN")), "no build tools in the final image"


def test_final_stage_runs_as_the_tollgate_user_not_root() -> None:
    final = stages()[-1]
    users = args_of(final, "USER")
    assert users, "the final stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    created = " ".join(args_of(final, "RUN"))
    uid = re.search(r"useradd [^&]*--uid (\d+)[^&]* tollgate\b", created)
    assert uid, "the final stage creates the tollgate user"
    assert user in ("tollgate", uid.group(1))
    assert "chown tollgate:tollgate /var/lib/tollgate" in created
    assert args_of(final, "WORKDIR")[-1] == "/var/lib/tollgate"  # relative state files land there


def test_ports_command_and_config_location() -> None:
    final = stages()[-1]
    assert set(" ".join(args_of(final, "EXPOSE")).split()) == {"8080", "9464"}
    assert json.loads(args_of(final, "ENTRYPOINT")[-1]) == ["tollgate", "serve"]
    assert json.loads(args_of(final, "CMD")[-1]) == [
        "--config", "/etc/tollgate/tollgate.yaml", "--host", "0.0.0.0"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "tollgate" in scripts


def healthcheck_command() -> list[str]:
    (check,) = args_of(stages()[-1], "HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv: list[str] = json.loads(command)
    return argv


def test_healthcheck_asks_the_admin_port_with_python_only() -> None:
    argv = healthcheck_command()
    assert argv[:2] == ["python", "-c"]
    assert HEALTH_URL in argv[2] and "urllib" in argv[2]
    assert not any(tool in " ".join(argv) for tool in ("curl", "wget"))


@contextmanager
def health_server(status: int) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/healthz" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/healthz"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/healthz"


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False), (None, False)])
def test_healthcheck_exit_code_follows_healthz(status: int | None, healthy: bool) -> None:
    argv = healthcheck_command()

    def run(url: str) -> int:
        code = argv[2].replace(HEALTH_URL, url)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode

    if status is None:
        assert (run(closed_port_url()) == 0) is healthy
    else:
        with health_server(status) as url:
            assert (run(url) == 0) is healthy


def test_dockerignore_lets_in_what_the_wheel_needs() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: ignore everything, then let in what the build needs"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in packages} <= allowed
    assert {"pyproject.toml", project["project"]["readme"]} <= allowed
    assert not allowed & {".venv", ".git", "tests"}


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        ["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
