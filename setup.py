"""The build's one step beyond setuptools' own (the metadata is pyproject.toml's): the
browser edge's page, built by npm from web/, ships in the wheel as ``spececd/webpage``, so
that ``pip install spececd`` serves it (``spececd serve``, docs/guide/browser.md) with no
npm on the machine. An editable install serves the checkout's ``web/dist`` instead."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WEB = Path(__file__).resolve().parent / "web"
log = logging.getLogger("spececd.build")


def built_page() -> Path | None:
    """web/dist, built now where npm is at hand (its packages installed first if they are
    not), else as it was built before; None where there is none."""
    if (WEB / "package.json").is_file() and shutil.which("npm"):
        if not (WEB / "node_modules").is_dir():
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=WEB, check=True)
        subprocess.run(["npm", "run", "build"], cwd=WEB, check=True)
    page = WEB / "dist"
    return page if (page / "index.html").is_file() else None


class BuildWithPage(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        page = built_page()
        if page is None:
            log.warning("the wheel has no browser page: build it with npm (Node.js 18 or "
                        "newer) on the machine, or `npm ci && npm run build` in web/ first")
            return
        target = Path(self.build_lib) / "spececd" / "webpage"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(page, target)


setup(cmdclass={"build_py": BuildWithPage})
