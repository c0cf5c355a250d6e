"""deploy/: compose stack, Prometheus config and alert rules, example config, Kubernetes sidecar example.

promtool (Debian package `prometheus`) and kubernetes-validate (PyPI) are used when installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Config, parse_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes" / "agent-with-sidecar.yaml"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def required_vars(text: str) -> set[str]:
    """Environment variables a tollgate config needs: `${VAR}` without a `:-default` in its values."""

    def strings(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [s for v in node.values() for s in strings(v)]
        if isinstance(node, list):
            return [s for v in node for s in strings(v)]
        return [node] if isinstance(node, str) else []

    return {m.group(1) for s in strings(yaml.safe_load(text)) for m in _VAR.finditer(s) if m.group(2) is None}


def check_config(text: str, env: dict[str, str]) -> Config:
    config = parse_config(yaml.safe_load(text), env)
    from grammars.library import GrammarLibrary

    library = GrammarLibrary.load()
    for agent in config.agents.values():
        if agent.output.grammar is not None:
            library.resolve(agent.output.grammar)  # raises for an unknown grammar
    return config


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("*.y*ml")))
def test_every_yaml_file_parses(path: str) -> None:
    documents = list(yaml.safe_load_all((ROOT / path).read_text()))
    assert documents and all(isinstance(d, dict) for d in documents)


def test_compose_runs_tollgate_jaeger_and_prometheus() -> None:
    services = load(DEPLOY / "docker-compose.yml")["services"]
    assert {"tollgate", "jaeger", "prometheus"} <= set(services)

    def published(name: str) -> set[int]:
        return {int(str(p).split(":")[-1].split("/")[0]) for p in services[name]["ports"]}

    tollgate = services["tollgate"]
    build = tollgate["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"
    assert published("tollgate") == {8080, 9464}
    assert tollgate["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert tollgate["command"] == ["--config", "/etc/tollgate/tollgate.yaml", "--host", "0.0.0.0"]
    assert "./tollgate.yaml:/etc/tollgate/tollgate.yaml:ro" in tollgate["volumes"]
    assert any(str(v).endswith(":/var/lib/tollgate") for v in tollgate["volumes"])

    jaeger = services["jaeger"]
    assert re.fullmatch(r"cr\.jaegertracing\.io/jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"])
    assert published("jaeger") == {4317, 4318, 16686}

    prometheus = services["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"] if v.startswith("./")}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    assert mounts["/etc/prometheus/alerts.yml"] == "./alerts.yml"
    for service in services.values():  # every bind-mounted file exists
        for volume in service.get("volumes", []):
            if str(volume).startswith("./"):
                assert (DEPLOY / volume.split(":")[0]).is_file(), volume


def test_compose_sets_every_variable_the_config_requires() -> None:
    environment = load(DEPLOY / "docker-compose.yml")["services"]["tollgate"]["environment"]
    assert required_vars((DEPLOY / "tollgate.yaml").read_text()) <= set(environment)


def test_prometheus_scrapes_the_admin_port_and_loads_the_rules() -> None:
    config = load(DEPLOY / "prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tollgate"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["tollgate:9464"]


def rules() -> dict[str, dict[str, Any]]:
    groups = load(DEPLOY / "alerts.yml")["groups"]
    found: dict[str, dict[str, Any]] = {}
    for group in groups:
        assert set(group) == {"name", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
            assert rule["alert"] not in found
            found[rule["alert"]] = rule
    return found


@pytest.mark.parametrize("alert, severity, duration, needles", [
    ("TollgateToolNotAllowed", "page", "0m",
     ['tollgate_guard_decisions_total{reason="tool_not_allowed"}', "increase(", "tollgate_tool_calls_total"]),
    ("TollgateRunStopRateHigh", "warning", None, ["rate(tollgate_runs_stopped_total[5m])"]),
    ("TollgateReaskRateHigh", "warning", None,
     ["rate(tollgate_reasks_total[5m])", "rate(gen_ai_client_operation_duration_seconds_count[5m])"]),
])
def test_expected_alerts(alert: str, severity: str, duration: str | None, needles: list[str]) -> None:
    rule = rules()[alert]
    assert rule["labels"]["severity"] == severity
    if duration is not None:
        assert rule["for"] == duration
    for needle in needles:
        assert needle in rule["expr"]
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alerts_use_only_metrics_tollgate_exports() -> None:
    from otel.metrics import Metrics

    exposition = Metrics().render()[0].decode()
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, flags=re.MULTILINE))
    for rule in rules().values():
        for name in set(re.findall(r"\b(?:tollgate|gen_ai)_[a-z_]+", rule["expr"])):
            base = re.sub(r"_(count|sum|bucket)$", "", name)
            assert name in families or families.get(base) == "histogram", f"{rule['alert']}: {name}"


def promtool(*args: str) -> None:
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize("args", [
    ("check", "rules", "alerts.yml"),
    ("check", "config", "prometheus.yml"),
    ("test", "rules", "alerts.test.yml"),  # the rules' behaviour, incl. the first violation paging
])
def test_promtool(args: tuple[str, ...]) -> None:
    promtool(*args)


def test_example_config_is_valid() -> None:
    text = (DEPLOY / "tollgate.yaml").read_text()
    config = check_config(text, {name: f"value-of-{name}" for name in required_vars(text)})  # distinct: keys may not coincide
    assert config.admin.host == "0.0.0.0" and config.admin.port == 9464
    assert config.state.path.startswith("/var/lib/tollgate/")  # the image's writable directory
    agent = config.agents["support-bot"]
    assert agent.budget.usd and agent.caps.llm_calls and agent.loop is not None
    assert agent.tools.allow and agent.output.grammar


def k8s_documents() -> dict[str, dict[str, Any]]:
    documents = [d for d in yaml.safe_load_all(K8S.read_text()) if d is not None]
    for document in documents:
        assert {"apiVersion", "kind", "metadata"} <= set(document)
    return {d["kind"]: d for d in documents}


def pod() -> dict[str, Any]:
    spec: dict[str, Any] = k8s_documents()["Deployment"]["spec"]["template"]["spec"]
    return spec


def container(name: str) -> dict[str, Any]:
    spec = pod()
    found: list[dict[str, Any]] = [
        c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_kubernetes_documents() -> None:
    assert {"ConfigMap", "Secret", "Deployment"} <= set(k8s_documents())


def test_sidecar_probes_ports_and_config() -> None:
    tollgate = container("tollgate")
    ports = {p["name"]: p["containerPort"] for p in tollgate["ports"]}
    assert ports == {"proxy": 8080, "admin": 9464}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = tollgate[probe]["httpGet"]
        assert get["path"] == path and ports.get(get["port"], get["port"]) == 9464
    assert tollgate["args"][:2] == ["--config", "/etc/tollgate/tollgate.yaml"]
    mounts = {m["mountPath"]: m for m in tollgate["volumeMounts"]}
    assert mounts["/etc/tollgate"]["readOnly"] is True and "/var/lib/tollgate" in mounts
    assert tollgate["securityContext"]["runAsUser"] != 0 and pod()["securityContext"]["runAsNonRoot"]


def test_provider_keys_come_from_the_secret_and_stay_in_the_sidecar() -> None:
    secret = k8s_documents()["Secret"]["metadata"]["name"]
    sidecar = env(container("tollgate"))
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        assert sidecar[key]["secretKeyRef"]["name"] == secret
    agent = env(container("agent"))
    assert agent["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/v1"
    assert agent["OPENAI_API_KEY"]["secretKeyRef"]["key"] == "AGENT_KEY"  # its tollgate key only
    assert sidecar["AGENT_KEY"]["secretKeyRef"]["key"] == "AGENT_KEY"


def test_configmap_config_is_valid_and_needs_only_the_sidecar_env() -> None:
    text = k8s_documents()["ConfigMap"]["data"]["tollgate.yaml"]
    assert required_vars(text) <= set(env(container("tollgate")))
    config = check_config(text, {name: f"value-of-{name}" for name in required_vars(text)})  # distinct: keys may not coincide
    assert config.listen.host == "127.0.0.1" and config.admin.port == 9464
    volumes = {v["name"]: v for v in pod()["volumes"]}
    mounts = container("tollgate")["volumeMounts"]
    config_volume = next(m["name"] for m in mounts if m["mountPath"] == "/etc/tollgate")
    assert volumes[config_volume]["configMap"]["name"] == k8s_documents()["ConfigMap"]["metadata"]["name"]


def test_kubernetes_schema() -> None:
    validate = pytest.importorskip("kubernetes_validate")
    for document in yaml.safe_load_all(K8S.read_text()):
        validate.validate(document, "1.31.0", strict=True)
