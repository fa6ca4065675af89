"""How two xdist workers share the suite (``--dist loadfile``), imported by
``tests/conftest.py``.

- **Units.** A file is a unit, run whole by one worker, so its module-scoped servers start
  once. The files that share a session fixture costly to make (the converted models of
  ``tests/backends/conftest.py``) are one unit, so that one worker makes them.
- **Longest first.** Under ``--dist loadfile``, the units run in order of their time in
  the last recorded run (``tests/durations.json``), longest first, so that the workers end
  together instead of one waiting while the other runs a long file it took last. A unit
  without a record goes last. ``python -m pytest -n 2 --dist loadfile --store-durations``
  records a run (a whole one: a file's record is what the run spent on it).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNITS = {f"tests/backends/{name}.py": "tests/backends: converted models"
         for name in ("test_conformance", "test_llamacpp", "test_onnx_openvino")}


def unit(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0]
    return UNITS.get(file, file)


def recorded() -> dict[str, float]:
    """Seconds by file in the last recorded run (setup, call and teardown)."""
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker under ``--dist loadfile``, order ``items`` by their unit's recorded
    time, longest first, keeping the order of the files within a unit and of the tests
    within a file (every worker alike: the controller takes the order of their
    collections). Elsewhere the order stays the command line's."""
    if not getattr(config, "workerinput", {}).get("longest_first"):
        return
    seconds: defaultdict[str, float] = defaultdict(float)
    for file, spent in recorded().items():
        seconds[unit(file)] += spent
    items.sort(key=lambda item: -seconds[unit(item.nodeid)])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker to order its collection longest first (a worker's own ``dist`` is
    ``no``)."""
    node.workerinput["longest_first"] = node.config.getvalue("dist") == "loadfile"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    class Units(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    config.option.loadscopereorder = False  # the collection's order (longest first), not
    return Units(config, log)               # xdist's (the most tests first)


class Recorder:
    """``--store-durations``: each file's seconds, written to ``tests/durations.json`` as
    the run ends (by the process that reports, the controller under xdist), over the
    records of the files this run did not run; a file that is gone loses its record."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return
        root = DURATIONS.parents[1]
        merged = {**recorded(), **{file: round(spent, 1) for file, spent in self.seconds.items()}}
        written = DURATIONS.with_suffix(".json.new")  # then moved in whole: a worker of
        written.write_text(json.dumps(                # another run reads it whole or not
            {file: spent for file, spent in sorted(merged.items()) if (root / file).is_file()},
            indent=0) + "\n")
        os.replace(written, DURATIONS)
