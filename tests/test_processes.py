"""``spececd.processes``: what a command starts ends with it. Each case runs in a Python
process of its own (ending descendants here would end this test run's other servers), which
starts a tree of sleepers; the tree is read by :mod:`tests.proctree`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.proctree import HAS_PROC, Process, command, running, tree

if not HAS_PROC:
    pytest.skip("descendants are found through /proc (Linux)", allow_module_level=True)

# A child that starts a grandchild ignoring SIGTERM, then ignores SIGTERM itself: only
# SIGKILL ends them, and the grandchild must be found before its parent dies.
TREE = textwrap.dedent("""
    import signal, subprocess, sys, time
    SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

    def start_tree():
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        child = subprocess.Popen([sys.executable, "-c", f'''
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", {SLEEPER!r}])
    exec({SLEEPER!r})
    '''], **quiet)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **quiet)
        grandchildren = f"/proc/{child.pid}/task/{child.pid}/children"
        while not open(grandchildren).read().split():
            time.sleep(0.05)
    """)


def wait_for_tree(proc: subprocess.Popen[str], size: int) -> set[Process]:
    deadline = time.monotonic() + 30
    while len(found := tree(proc.pid)) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(found) == size, found
    return found


def test_end_descendants_ends_a_tree_that_ignores_sigterm() -> None:
    script = TREE + textwrap.dedent("""
        from spececd.processes import end_descendants
        start_tree()
        print("started", flush=True)
        input()  # once the test has seen the tree
        started = time.monotonic()
        ended = end_descendants(grace=1.0)
        print(len(ended), round(time.monotonic() - started, 1))
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    before = wait_for_tree(proc, 3)
    out, _ = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0
    count, seconds = out.split()
    # all three: the polite one at SIGTERM, the two that ignore it at SIGKILL after the grace
    assert int(count) == 3 and 1.0 <= float(seconds) < 3.0
    assert not [p for p in before if running(p)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_within_ends_the_command_and_its_tree(signum: int) -> None:
    script = TREE + textwrap.dedent("""
        from spececd.processes import ended_with_this_one
        with ended_with_this_one(grace=1.0):
            start_tree()
            print("started", flush=True)
            time.sleep(600)  # a start-up that takes long
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    before = wait_for_tree(proc, 3)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    # SystemExit(128 + signal), for SIGINT too (vLLM's start-up swallows KeyboardInterrupt)
    assert proc.returncode == 128 + signum, err
    assert not [p for p in before if running(p)]


def test_what_ran_before_is_spared() -> None:
    """A caller with processes of its own (a test process and its servers) keeps them."""
    script = TREE + textwrap.dedent("""
        from spececd.processes import ended_with_this_one
        start_tree()
        with ended_with_this_one(grace=1.0):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print("started", flush=True)
            input()  # once the test has seen the tree
        print("left", flush=True)
        input()  # until the test has looked
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    before: set[Process] = set()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "started\n"
        before = wait_for_tree(proc, 4)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "left\n"
        assert len([p for p in before if running(p)]) == 3  # the three started before
    finally:
        proc.kill()
        proc.wait()
        for pid, _ in [p for p in before if running(p)]:
            os.kill(pid, signal.SIGKILL)


# Processes started as vLLM starts its engine process, and that process its workers: by
# multiprocessing's spawn, from the main thread; each binds itself to its parent as it starts
# (spececd.processes.end_with_parent, called by spececd.cloud.vllm_executor and the
# proposer), then starts the next generation. ``delay``: seconds a child waits before it binds.
SPAWNED = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from spececd.processes import end_with_parent

    def child(generations, delay):
        time.sleep(delay)
        bound = end_with_parent()
        if generations > 1:
            spawn(generations - 1, 0.0)
        print("bound" if bound else "not bound", os.getpid(), flush=True)
        time.sleep(600)

    def spawn(generations, delay):
        multiprocessing.get_context("spawn").Process(
            target=child, args=(generations, delay)).start()

    if __name__ == "__main__":
        spawn(int(sys.argv[1]), float(sys.argv[2]))
        print("started", flush=True)
        time.sleep(600)
    """)


def spawning(tmp_path: Path, generations: int, delay: float) -> subprocess.Popen[str]:
    script = tmp_path / "spawning.py"  # a file: spawn's children import their target from it
    script.write_text(SPAWNED)
    return subprocess.Popen([sys.executable, str(script), str(generations), str(delay)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def end_all(processes: set[Process]) -> list[Process]:
    """Those of ``processes`` that still ran 10 s after (each SIGKILLed, for the next
    tests)."""
    deadline = time.monotonic() + 10
    while (left := [p for p in processes if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_spawned_children_end_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """A parent SIGKILLed (no handler of its own runs) takes its spawned children and theirs
    with it, as a SIGKILLed ``spececd serve`` takes vLLM's engine process and its workers."""
    proc = spawning(tmp_path, generations=2, delay=0.0)
    seen: set[Process] = set()
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert sorted(line.split()[0] for line in lines) == ["bound", "bound", "started"]
        seen = tree(proc.pid)  # both generations, and multiprocessing's resource tracker
        assert len(seen) >= 2
    finally:
        proc.kill()
        proc.wait()
        left = end_all(seen)
    assert not left, f"left running: {left}"


def test_a_child_whose_parent_ended_before_it_bound_ends_as_it_binds(tmp_path: Path) -> None:
    """A parent SIGKILLed before its child called ``end_with_parent``: the child ends there
    (the kernel's flag would never fire, the parent being gone already)."""
    proc = spawning(tmp_path, generations=1, delay=2.0)
    seen: set[Process] = set()
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "started\n"
        seen = tree(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert seen
    assert not end_all(seen)


@pytest.mark.parametrize("stage", ["starting", "running"])
def test_a_sigkilled_bench_leaves_no_process(tiny_models: dict[str, Path], stage: str) -> None:
    """``spececd bench`` SIGKILLed (no handler of its own runs) as its first child starts,
    or once its server and workers all run: every process it started ends with it (each
    is started bound to it, :func:`spececd.processes.bound`). Before, its servers ran on."""
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spececd", "bench", "--draft-model", str(tiny_models["draft"]),
         "--target-model", str(tiny_models["llama"]), "--num-prompts", "1", "--iterations",
         "1", "--max-tokens", "400", "--rtt-ms", "0", "--k", "2", "--proactive", "off",
         "--out", str(tiny_models["llama"].parent / f"killed-{stage}")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: set[Process] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen |= (found := tree(proc.pid))
            serving = any("spececd serve" in command(p) or " serve " in command(p)
                          for p in found)
            if (stage == "starting" and found) or (stage == "running" and serving
                                                    and len(found) >= 3):
                break
            time.sleep(0.02)
        assert seen, "the bench started no process"
    finally:
        proc.kill()
        proc.wait()
        left = end_all(seen)
    assert not left, f"left running: {[command(p) or p for p in left]}"
