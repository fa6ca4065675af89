"""The load figure through a balancer (docs/balancer-*.md): `spececd bench load` against one
replica directly, then against Debian's nginx in front of three replicas (the
configuration :func:`spececd.deploy.nginx_conf` renders), the same N-curve, in one run.

    python -m tests.e2e.bench_balancer [CLIENTS [SECONDS [OUT]]]   # default 1,2,4,8,16 10

Writes OUT/direct and OUT/nginx (load.json, load.md, load_curve.png; default bench-out/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spececd.cli.options import default_model
from spececd.deploy import Ports, loopback, nginx_conf
from tests.e2e.server import NginxProcess, ServerProcess, free_ports


def main(clients: str = "1,2,4,8,16", seconds: str = "10", out: str = "bench-out") -> None:
    free = free_ports(12)
    ports = [Ports(*free[i:i + 3]) for i in (0, 3, 6)]
    listen = Ports(*free[9:])
    runtime = Path(tempfile.mkdtemp(prefix="spececd-nginx-"))
    runtime.chmod(0o755)  # nginx's workers write their temporary files here
    replicas: list[ServerProcess] = []
    nginx = None
    try:
        for p in ports:
            replicas.append(ServerProcess(default_model("target"), "--grpc-port", str(p.grpc),
                                          "--http-port", str(p.http), port=p.websocket))
        nginx = NginxProcess(nginx_conf(loopback(ports, listen), str(runtime), "127.0.0.1"),
                             runtime)
        runs = [("direct", replicas[0].url, []),
                ("nginx", f"ws://127.0.0.1:{listen.websocket}",
                 ["--replicas", ",".join(r.url for r in replicas)])]
        for label, url, extra in runs:
            print(f"== {label}: {url}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "spececd", "bench", "load", "--server", url,
                            *extra, "--clients", clients, "--duration", seconds,
                            "--kind", "replay,cloud-only", "--out", f"{out}/{label}"],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        if nginx is not None:
            nginx.stop()
        for replica in replicas:
            replica.stop()
        shutil.rmtree(runtime, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
