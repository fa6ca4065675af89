"""Processes below a pid, read from ``/proc`` (Linux), written apart from
:mod:`spececd.processes`' own walk so that the tests of what it ends do not share its bugs."""

from __future__ import annotations

from pathlib import Path

Process = tuple[int, str]  # a pid and its start time: a reused pid is another process
HAS_PROC = Path("/proc/self/stat").is_file()


def _fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` from its 3rd field (the state) on; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(pid: int) -> set[Process]:
    """Every process below ``pid`` now."""
    parent_of: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        fields = _fields(entry.name) if entry.name.isdigit() else None
        if fields is not None:
            parent_of[int(entry.name)] = (int(fields[1]), fields[19])
    found: set[Process] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start) in parent_of.items():
            if ppid == parent:
                found.add((child, start))
                todo.append(child)
    return found


def running(process: Process) -> bool:
    """Whether ``process`` still runs (a zombie has ended)."""
    fields = _fields(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def command(process: Process) -> str:
    """Its command line (as its process title may have rewritten it), "" once gone."""
    try:
        return Path(f"/proc/{process[0]}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
