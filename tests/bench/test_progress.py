"""The bench is never silent and never hangs: a process that shows no progress within the
stall limit stops the run with an error naming it (a worker's load, a measurement, the
server's start, a load row), while one that reports progress may take longer than the
limit in all. Children here are small Python one-liners, no models."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from spececd.bench import processes
from spececd.bench.child import ChildFailed, Stalled, within
from spececd.bench.processes import Worker
from spececd.bench.runner import BenchConfig


def child(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


# A worker that reads its job, says it is ready, then answers the first request with a
# progress line every 0.2 s for ``SECONDS`` and then its results.
ANSWERS_SLOWLY = """
import json, sys, time
sys.stdin.readline()
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
for i in range(int(SECONDS / 0.2)):
    time.sleep(0.2)
    print(json.dumps({"progress": i + 1}), flush=True)
print(json.dumps({"pass": 1, "results": [{"tokens": 3}]}), flush=True)
time.sleep(60)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie left to an init that does not reap counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z"


def test_a_worker_that_never_loads_is_named_and_stopped(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(Worker, "COMMAND", child("import time; time.sleep(60)"))
    began = time.perf_counter()
    with pytest.raises(Stalled, match=r"the target alone \(big\) showed no progress for "
                       r"0\.5 s while loading"):
        Worker({}, "the target alone (big)", stall_s=0.5)
    assert time.perf_counter() - began < 10


def test_a_measurement_that_hangs_is_named_with_its_pass(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # ready, then one progress line for the pass and nothing more
    monkeypatch.setattr(Worker, "COMMAND", child(ANSWERS_SLOWLY.replace("SECONDS", "0.2")
                                                 .replace('print(json.dumps({"pass"',
                                                          'time.sleep(60); print(json.dumps'
                                                          '({"pass"')))
    worker = Worker({}, "the SpecECD edge (draft)", stall_s=1.0)
    with pytest.raises(Stalled, match=r"the SpecECD edge \(draft\) .* while pass 1 of 3 "
                       r"\(cloud-only @ RTT 0 ms\)"):
        worker.run({"pass": 1}, "pass 1 of 3 (cloud-only @ RTT 0 ms)")
    assert worker.proc.poll() is not None  # stopped, not left running


def test_progress_within_the_limit_lets_a_long_pass_finish(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # 1.6 s of work, a progress line every 0.2 s: the 1 s limit applies to each line
    monkeypatch.setattr(Worker, "COMMAND", child(ANSWERS_SLOWLY.replace("SECONDS", "1.6")))
    worker = Worker({}, "the target alone", stall_s=1.0)
    try:
        assert worker.run({"pass": 1}, "pass 1 of 1") == [{"tokens": 3}]
    finally:
        worker.proc.kill()
        worker.close()


def test_a_worker_that_exits_is_an_error_quoting_its_last_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Worker, "COMMAND", child("print('no such model'); raise "
                                                 "SystemExit(3)"))
    with pytest.raises(ChildFailed, match=r"(?s)exited with status 3 while loading.*no such "
                       r"model"):
        Worker({}, "the bare forward worker", stall_s=30)


def test_a_server_that_never_serves_is_named_and_stopped_with_what_it_started(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    # a "server" that starts a process of its own, logs a line and never says "serving"
    monkeypatch.setattr(processes, "server_command", lambda cfg, transports: list(child(
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
        "print('loading the model', file=sys.stderr, flush=True); time.sleep(60)")))
    cfg = BenchConfig(draft="d", target="models/target.gguf", prompts=[], stall_s=1.0)
    with pytest.raises(Stalled, match=r"the verifier server \(target.gguf, builtin engine\) "
                       r"showed no progress for 1 s while starting"):
        processes.start_server(cfg)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)  # the server's own processes stopped with it


def test_a_load_row_past_its_limit_is_named() -> None:
    with pytest.raises(Stalled, match=r"the run of 16 replay clients did not finish within "
                       r"0\.2 s"):
        within("the run of 16 replay clients", 0.2, time.sleep, 5)
    assert within("a quick one", 5, max, 3, 4) == 4
    with pytest.raises(ZeroDivisionError):  # its own errors come through as they are
        within("a failing one", 5, lambda: 1 / 0)
