"""The deployment files in deploy/ agree with the settings they share (spececd.deploy):
ports, the replicas' command, probes, the drain and its grace period, the affinity hash.

No image is built and no cluster runs here: each file is parsed and checked for what it
would do. The nginx configuration is the one file also run, by tests/e2e/test_balancer.py,
rendered by the same function from loopback replicas.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from spececd.cli import build_parser
from spececd.deploy import DEFAULT, nginx_conf
from spececd.edge.transport import AFFINITY_HEADER

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PORTS = DEFAULT.replicas[0].ports
HASH_VARIABLE = "$http_" + AFFINITY_HEADER.lower().replace("-", "_")


def test_the_replicas_command_is_a_valid_serve_command() -> None:
    args = build_parser().parse_args(["serve", *DEFAULT.serve_args()])
    assert (args.port, args.grpc_port, args.http_port) == (PORTS.websocket, PORTS.grpc,
                                                           PORTS.http)
    assert args.drain_timeout == DEFAULT.drain_timeout


def test_nginx_conf_is_rendered_from_the_settings() -> None:
    text = (DEPLOY / "nginx.conf").read_text()
    assert text == nginx_conf(), "deploy/nginx.conf is stale: write nginx_conf() to it"
    for replica in DEFAULT.replicas:
        assert f"server {replica.host}:{replica.ports.http} " in text
    assert f"map $http_{AFFINITY_HEADER.lower().replace('-', '_')} $spececd_affinity" in text


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_installs_pinned_torch_first_and_runs_the_replicas_command() -> None:
    steps = dockerfile()
    runs = [args for op, args in steps if op == "RUN"]
    torch_step = next(i for i, args in enumerate(runs) if "torch==2.13.0" in args)
    package_step = next(i for i, args in enumerate(runs) if re.search(r"pip install .* \.$",
                                                                      args))
    assert torch_step < package_step
    (base,) = [args for op, args in steps if op == "FROM"]
    assert re.fullmatch(r"python:3\.(1[0-9])-slim", base)
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["spececd", "serve"]
    assert json.loads(dict(steps)["CMD"]) == DEFAULT.serve_args()
    assert {int(p) for p in dict(steps)["EXPOSE"].split()} == {PORTS.websocket, PORTS.grpc,
                                                              PORTS.http}
    assert f"127.0.0.1:{PORTS.websocket}/healthz" in dict(steps)["HEALTHCHECK"]
    assert dict(steps)["STOPSIGNAL"] == "SIGTERM"
    copied = [args.split()[0] for op, args in steps if op == "COPY"]
    root = DEPLOY.parent
    assert all((root / path).exists() for path in copied), copied


def test_compose_runs_three_replicas_behind_the_rendered_nginx() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services: dict[str, Any] = compose["services"]
    balancer = services.pop("balancer")
    assert sorted(services) == sorted(r.host for r in DEFAULT.replicas)
    for service in services.values():
        assert service["command"] == DEFAULT.serve_args()
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / service["build"]["context"] / "deploy" / "Dockerfile").is_file()
        grace = float(service["stop_grace_period"].rstrip("s"))
        assert grace > DEFAULT.drain_timeout
        assert f":{PORTS.websocket}/healthz" in " ".join(service["healthcheck"]["test"])
    assert "./nginx.conf:/etc/spececd/nginx.conf:ro" in balancer["volumes"]
    assert balancer["command"] == ["nginx", "-c", "/etc/spececd/nginx.conf"]
    listen = DEFAULT.listen
    assert sorted(balancer["ports"]) == sorted(
        f"{p}:{p}" for p in (listen.websocket, listen.grpc, listen.http))
    assert set(balancer["depends_on"]) == set(services)


def kubernetes() -> dict[str, list[dict[str, Any]]]:
    docs: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "spececd.yaml").read_text()):
        docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_kubernetes_probes_drain_and_ports_follow_the_settings() -> None:
    (deployment,) = kubernetes()["Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"] == DEFAULT.serve_args()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"websocket": PORTS.websocket, "grpc": PORTS.grpc, "http": PORTS.http}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "websocket"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "websocket"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "websocket"}
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    script = shlex.split(command[2].replace(";", " ; "))
    assert script[:2] == ["sleep", f"{DEFAULT.deregister_delay:g}"]
    assert "kill -TERM 1" in command[2]  # the server is PID 1 (the image's ENTRYPOINT)
    assert spec["terminationGracePeriodSeconds"] > DEFAULT.deregister_delay + \
        DEFAULT.drain_timeout
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    assert deployment["spec"]["replicas"] == len(DEFAULT.replicas)


def test_kubernetes_service_and_ingresses_route_with_affinity() -> None:
    docs = kubernetes()
    (service,) = docs["Service"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "websocket": PORTS.websocket, "grpc": PORTS.grpc, "http": PORTS.http}
    selector = service["spec"]["selector"]
    (deployment,) = docs["Deployment"]
    assert deployment["spec"]["template"]["metadata"]["labels"] == selector
    routes: dict[str, str] = {}
    for ingress in docs["Ingress"]:
        annotations = ingress["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == HASH_VARIABLE
        assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 90
        ports = set()
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == service["metadata"]["name"]
                routes[f"{rule['host']}{path['path']}"] = backend["port"]["name"]
                ports.add(backend["port"]["name"])
        grpc = annotations.get("nginx.ingress.kubernetes.io/backend-protocol") == "GRPC"
        assert grpc == (ports == {"grpc"})  # gRPC alone, and said so
    assert routes["spececd.example.com/v1/links"] == "http"
    assert routes["spececd.example.com/v1/sessions"] == "http"
    assert routes["spececd.example.com/"] == "websocket"
    assert routes["grpc.spececd.example.com/"] == "grpc"


def test_envoy_hashes_on_the_affinity_header_over_the_replicas() -> None:
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())["static_resources"]
    listen = DEFAULT.listen
    listeners = {x["name"]: x for x in config["listeners"]}
    assert {name: x["address"]["socket_address"]["port_value"]
            for name, x in listeners.items()} == {
        "websocket": listen.websocket, "grpc": listen.grpc, "http": listen.http}
    for name, listener in listeners.items():
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (host,) = manager["route_config"]["virtual_hosts"]
        (route,) = host["routes"]
        assert route["route"]["cluster"] == f"spececd_{name}"
        assert route["route"]["hash_policy"] == [{"header": {
            "header_name": AFFINITY_HEADER.lower()}}]
        if name == "websocket":
            assert manager["upgrade_configs"] == [{"upgrade_type": "websocket"}]
    for cluster in config["clusters"]:
        assert cluster["lb_policy"] == "RING_HASH"
        port = getattr(PORTS, cluster["name"].removeprefix("spececd_"))
        endpoints = [e["endpoint"] for e in
                     cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
        assert [(e["address"]["socket_address"]["address"],
                 e["address"]["socket_address"]["port_value"]) for e in endpoints] == [
            (r.host, port) for r in DEFAULT.replicas]
        assert all(e["health_check_config"]["port_value"] == PORTS.websocket
                   for e in endpoints)
        assert cluster["health_checks"][0]["http_health_check"]["path"] == "/readyz"
    grpc = next(c for c in config["clusters"] if c["name"] == "spececd_grpc")
    assert "http2_protocol_options" in json.dumps(grpc)
