"""The build's one step beyond setuptools' own (the metadata is pyproject.toml's): the
playground's page (the browser edge's too), built by npm from web/, ships in the wheel as
``spececd/webpage``, so that ``pip install spececd`` serves it (``spececd api`` and
``spececd serve``, docs/guide/browser.md) with no npm on the machine. An editable install
serves the checkout's ``web/dist`` instead. Where the page cannot be built (no npm, nothing
built before), building fails unless ``SPECECD_ALLOW_NO_PAGE=1``."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WEB = Path(__file__).resolve().parent / "web"
# Set to 1 to build a wheel without the page where it cannot be built (no npm, and no
# web/dist built before): otherwise such a build fails, rather than ship a wheel whose
# `spececd serve` has no page.
ALLOW_NO_PAGE = "SPECECD_ALLOW_NO_PAGE"
log = logging.getLogger("spececd.build")


def built_page() -> Path | None:
    """web/dist, built now where npm is at hand (its packages installed first if they are
    not), else as it was built before (also where npm fails: offline, an old Node.js);
    None where there is none."""
    if (WEB / "package.json").is_file() and shutil.which("npm"):
        try:
            if not (WEB / "node_modules").is_dir():
                subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=WEB, check=True)
            subprocess.run(["npm", "run", "build"], cwd=WEB, check=True)
        except subprocess.CalledProcessError as exc:
            log.warning("building the browser page failed (%s): using web/dist as it is", exc)
    page = WEB / "dist"
    return page if (page / "index.html").is_file() else None


class BuildWithPage(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "spececd" / "webpage"
        shutil.rmtree(target, ignore_errors=True)  # never an earlier build's
        page = built_page()
        if page is None:
            why = ("the browser page cannot be built here: install Node.js 18 or newer "
                   "with npm, or run `npm ci && npm run build` in web/ first")
            if os.environ.get(ALLOW_NO_PAGE) != "1":
                raise SystemExit(f"{why}; or set {ALLOW_NO_PAGE}=1 to build the wheel "
                                 "without it")
            log.warning("%s: the wheel has no browser page", why)
            return
        shutil.copytree(page, target)


setup(cmdclass={"build_py": BuildWithPage})
