"""The bench's llama.cpp speculation row (:class:`~spececd.bench.worker.
SpeculativeBinaryRunner`) reads its figures from ``llama-speculative-simple``'s log: here
against a scripted stand-in for the binary that prints known figures, so each one is
checked exactly, and the re-run of a run that lost its closing lines is exercised."""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from spececd.bench.worker import SpeculativeBinaryRunner

LOG = """\
main: n_drafted = 40
main: n_accept  = 23
main: encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s
main: decoded   16 tokens in    1.500 seconds, speed:   10.667 t/s
"""


def fake_binary(tmp_path: Path, runs_without_timings: int = 0, exit_code: int = 0) -> str:
    """An executable that prints :data:`LOG` (to stderr, as llama.cpp's log goes), leaving
    out the timing lines on its first ``runs_without_timings`` runs."""
    counter = tmp_path / "runs"
    script = tmp_path / "llama-speculative-simple"
    script.write_text(f"""#!{sys.executable}
import sys
from pathlib import Path
counter = Path({str(counter)!r})
runs = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(runs))
log = {LOG!r}
if runs <= {runs_without_timings}:
    log = "".join(line for line in log.splitlines(True) if "coded" not in line)
sys.stderr.write(log)
sys.exit({exit_code})
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def job(binary: str) -> dict[str, Any]:
    return {"binary": binary, "target": "t.gguf", "draft": "d.gguf", "max_tokens": 16,
            "temperature": 0, "threads": 1}


def runs(tmp_path: Path) -> int:
    return int((tmp_path / "runs").read_text())


def test_the_figures_are_read_from_the_log(tmp_path: Path) -> None:
    result = SpeculativeBinaryRunner(job(fake_binary(tmp_path))).run("p", 0)
    # wall_s is encoding plus decoding (a regex that took the speed, or one of the two
    # times only, fails this); ttft_s is the prompt and the first token's share.
    assert result["tokens"] == 16
    assert result["wall_s"] == pytest.approx(0.25 + 1.5)
    assert result["ttft_s"] == pytest.approx(0.25 + 1.5 / 16)
    assert result["llama_stats"] == {"drafted": 40, "accepted": 23}
    assert runs(tmp_path) == 1


def test_a_run_that_lost_its_timing_lines_is_run_again(tmp_path: Path) -> None:
    result = SpeculativeBinaryRunner(job(fake_binary(tmp_path, runs_without_timings=2))
                                     ).run("p", 0)
    assert result["wall_s"] == pytest.approx(1.75) and runs(tmp_path) == 3


def test_a_failing_binary_is_an_error_not_a_figure(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed"):
        SpeculativeBinaryRunner(job(fake_binary(tmp_path, exit_code=1))).run("p", 0)
    assert runs(tmp_path) == 1  # a failure is not retried


def test_a_log_that_never_has_its_timings_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed"):
        SpeculativeBinaryRunner(job(fake_binary(tmp_path, runs_without_timings=99))
                                ).run("p", 0)
    assert runs(tmp_path) == SpeculativeBinaryRunner.ATTEMPTS


def test_sampling_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="greedy"):
        SpeculativeBinaryRunner({**job(fake_binary(tmp_path)), "temperature": 0.7}).run("p", 0)
