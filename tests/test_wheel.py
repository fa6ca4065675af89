"""A wheel of SpecECD carries the playground's page (setup.py builds it with npm and ships
web/dist as ``spececd/webpage``): built from the sdist of the sources here, installed in an
environment of its own, its ``spececd serve`` (the browser edge) and its ``spececd api``
serve the page with no npm or Node.js on the PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.builders import MODELS, REPO, requires_default_pair
from tests.e2e.server import ServerProcess

pytest.importorskip("torch")  # the installed server runs on this environment's packages

pytestmark = [
    requires_default_pair,
    pytest.mark.skipif(shutil.which("npm") is None
                       or not (REPO / "web" / "node_modules").is_dir(),
                       reason="building the page needs npm and web/node_modules "
                       "(cd web && npm ci)"),
]


def test_a_wheel_serves_the_page_from_both_servers_without_npm(tmp_path: Path) -> None:
    # The sdist (MANIFEST.in: web/'s sources, not its packages or its build), and a wheel
    # built from it, as pip builds one from PyPI's sdist; npm's packages are this checkout's.
    # (its file list made anew, in a folder of its own: not the checkout's egg-info's)
    (tmp_path / "egg").mkdir()
    sdist = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base",
                            str(tmp_path / "egg"), "sdist", "-d", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    with tarfile.open(next(tmp_path.glob("spececd-*.tar.gz"))) as archive:
        archive.extractall(tmp_path / "sdist", filter="data")
    source = next((tmp_path / "sdist").iterdir())
    assert (source / "web" / "src" / "main.js").is_file()
    assert not (source / "web" / "node_modules").exists()
    assert not (source / "web" / "dist").exists()
    (source / "web" / "node_modules").symlink_to(REPO / "web" / "node_modules")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(source)],
        capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "wheels").glob("spececd-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("index.html", "app.js", "draft-worker.js", "style.css",
                 "ort-wasm-simd-threaded.jsep.wasm"):
        assert f"spececd/webpage/{name}" in names, name

    # Installed beside this environment's packages (torch and the rest), with nothing of
    # this checkout's on its path.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env |= {"PATH": str(venv / "bin"), "PYTHONPATH": ""}  # no npm, no node, no checkout
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                               capture_output=True, text=True, timeout=300, env=env,
                               check=False)
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = subprocess.run([python, "-c", "from spececd.transports import web; print(web.BUILT)"],
                           capture_output=True, text=True, env=env, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    # Both servers serve the one page: `spececd serve` (the browser edge) and `spececd api`
    # (the page asks its API), each saying which it is.
    servers = [ServerProcess(MODELS / "target", python=python, env=env),
               ServerProcess(MODELS / "target", "--draft-model", str(MODELS / "draft"),
                             command="api", scheme="http", python=python, env=env)]
    try:
        for server, serves in zip(servers, ("edge", "api"), strict=True):
            http = server.url.replace("ws://", "http://")
            with urllib.request.urlopen(f"{http}/") as reply:
                assert reply.status == 200 and b'src="app.js"' in reply.read()
                assert reply.headers["X-SpecECD-Serves"] == serves
            for name in ("app.js", "draft-worker.js"):
                with urllib.request.urlopen(f"{http}/{name}") as reply:
                    assert reply.status == 200
                    assert reply.read() == zipfile.ZipFile(wheel).read(
                        f"spececd/webpage/{name}")
    finally:
        for server in servers:
            server.stop()
