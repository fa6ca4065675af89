"""Verifier replicas behind a standard load balancer: the settings the deployment files
share, and the nginx configuration rendered from them.

Nothing here routes a request: the operator's balancer does. What it must do, for each
transport the replicas serve:

- WebSocket: proxy the upgrade (HTTP/1.1 with the ``Upgrade`` and ``Connection``
  headers) and keep idle connections open (both sides ping every 20 s). The connection
  pins its session to a replica.
- HTTP links (``/v1/links``) and sessions (``/v1/sessions``): every request of one link
  must reach the replica that holds it. The edge sends a random
  :data:`~spececd.edge.transport.AFFINITY_HEADER` per link, and the balancer hashes on it
  (consistently, so a replica leaving moves only its own links). Requests without the
  header are spread at random.
- gRPC: HTTP/2 to the replicas; a ``Session`` stream pins itself, unary calls hash on the
  header's lowercase metadata.
- A replica that refuses connections (dead, restarting) is skipped for the next. A
  session whose replica died, drained or hung reconnects through the balancer, lands on
  another replica and re-sends its history: its output is unchanged.

``deploy/nginx.conf`` is :func:`nginx_conf` of the defaults (a test keeps them equal);
the docker-compose file, the Kubernetes manifests and the Dockerfile in ``deploy/`` are
checked against :class:`Deployment` by tests/test_deploy.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spececd.edge.transport import AFFINITY_HEADER


@dataclass(frozen=True)
class Ports:
    """Where one process listens: WebSocket, gRPC and HTTP."""

    websocket: int = 8765
    grpc: int = 50051
    http: int = 8080


@dataclass(frozen=True)
class Replica:
    host: str
    ports: Ports = Ports()


@dataclass(frozen=True)
class Deployment:
    """What every deployment file agrees on."""

    replicas: tuple[Replica, ...] = tuple(Replica(f"verifier-{i}") for i in (1, 2, 3))
    listen: Ports = Ports()  # the balancer's own ports
    drain_timeout: float = 30.0  # `spececd serve --drain-timeout`
    # Seconds between a replica being taken out of rotation and SIGTERM starting its drain,
    # for the balancer to stop sending it new sessions (Kubernetes' preStop hook).
    deregister_delay: float = 5.0
    # Seconds a connection may stay silent. WebSocket and gRPC sessions between
    # generations are quiet but for pings; an HTTP long-poll waits 60 s at most.
    idle_timeout: float = 3600.0
    max_body_bytes: int = 16 << 20  # frames up to the replicas' own limit

    def serve_args(self) -> list[str]:
        """`spececd serve`'s arguments on a replica."""
        ports = self.replicas[0].ports
        return ["--host", "0.0.0.0", "--port", str(ports.websocket),
                "--grpc-port", str(ports.grpc), "--http-port", str(ports.http),
                "--drain-timeout", f"{self.drain_timeout:g}"]


DEFAULT = Deployment()


def nginx_conf(deployment: Deployment = DEFAULT, runtime_dir: str = "/tmp/nginx",
               listen_host: str = "0.0.0.0") -> str:
    """A complete ``nginx.conf`` that runs in the foreground (``nginx -c FILE``) with its
    pid file and temporary files under ``runtime_dir`` and its errors on stderr."""
    d = deployment
    header = AFFINITY_HEADER.lower().replace("-", "_")

    def upstream(name: str, port_of: str, keepalive: bool) -> str:
        servers = "".join(f"        server {r.host}:{getattr(r.ports, port_of)} "
                          f"max_fails=1 fail_timeout=2s;\n" for r in d.replicas)
        return (f"    upstream {name} {{\n"
                f"        hash $spececd_affinity consistent;\n{servers}"
                + ("        keepalive 32;\n" if keepalive else "") + "    }\n")

    idle = f"{d.idle_timeout:g}s"
    return f"""\
# SpecECD verifier replicas behind nginx: rendered by spececd.deploy.nginx_conf from the
# settings the other deployment files share. Run in the foreground: nginx -c THIS_FILE
daemon off;
worker_processes auto;
pid {runtime_dir}/nginx.pid;
error_log stderr warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    client_body_temp_path {runtime_dir}/body;
    proxy_temp_path {runtime_dir}/proxy;
    fastcgi_temp_path {runtime_dir}/fastcgi;
    uwsgi_temp_path {runtime_dir}/uwsgi;
    scgi_temp_path {runtime_dir}/scgi;
    client_max_body_size {d.max_body_bytes};

    # The edge's per-connection affinity key; a request without one goes anywhere.
    map $http_{header} $spececd_affinity {{
        ""      $request_id;
        default $http_{header};
    }}
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ""      close;
    }}

{upstream("spececd_websocket", "websocket", False)}
{upstream("spececd_http", "http", True)}
{upstream("spececd_grpc", "grpc", True)}
    # A replica that refuses the connection or does not answer the opening is skipped.
    proxy_connect_timeout 2s;
    proxy_next_upstream error timeout;
    grpc_connect_timeout 2s;
    grpc_next_upstream error timeout;

    server {{
        listen {listen_host}:{d.listen.websocket};
        location / {{
            proxy_pass http://spececd_websocket;
            proxy_http_version 1.1;
            # The host the browser asked for: the replica lets in pages of that origin
            proxy_set_header Host $http_host;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_read_timeout {idle};
            proxy_send_timeout {idle};
        }}
    }}

    server {{
        listen {listen_host}:{d.listen.http};
        location / {{
            proxy_pass http://spececd_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 90s;  # a long-poll waits 60 s at most
        }}
    }}

    server {{
        listen {listen_host}:{d.listen.grpc} http2;
        location / {{
            grpc_pass grpc://spececd_grpc;
            grpc_read_timeout {idle};
            grpc_send_timeout {idle};
        }}
    }}
}}
"""


def loopback(ports: Sequence[Ports], listen: Ports, drain_timeout: float = 30.0) -> Deployment:
    """Replicas on 127.0.0.1, each on its own ports (a test's, or a benchmark's)."""
    return Deployment(replicas=tuple(Replica("127.0.0.1", p) for p in ports), listen=listen,
                      drain_timeout=drain_timeout)
