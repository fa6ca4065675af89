"""Every public function and method of the checked packages says what it promises.

The rule, read with ast from src/spececd (nothing is imported):

- checked: the functions at the top of each module of :data:`PACKAGES`, and the methods
  (properties included) of their public classes, whose names do not start with ``_``
  (so no private helpers, and no dunders such as ``__init__``: the class docstring says
  what making one means);
- exempt, as their contract is written once where they are declared: a method that a base
  class of its class (a class of src/spececd of that name, and so on up) documents, and a
  method of a class that implements a ``Protocol`` of its own package structurally, where
  that ``Protocol`` documents the method of that name. A ``Protocol``'s own methods are
  checked like any other.

Cloud joined once issue 37's reshaping of it was done (18 written then).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "spececd"
PACKAGES = ("core", "protocol", "edge", "cloud")

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Class:
    package: str
    bases: tuple[str, ...]
    documented: frozenset[str]  # its methods that have a docstring

    @property
    def protocol(self) -> bool:
        return "Protocol" in self.bases


def base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):  # Generic[T], Protocol[T]
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def classes(root: Path) -> dict[str, list[Class]]:
    """Every class under ``root`` by name (names may repeat across modules)."""
    found: dict[str, list[Class]] = {}
    for path in root.rglob("*.py"):
        package = path.relative_to(root).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                documented = frozenset(f.name for f in node.body if isinstance(f, Function)
                                       and ast.get_docstring(f) is not None)
                found.setdefault(node.name, []).append(
                    Class(package, tuple(map(base_name, node.bases)), documented))
    return found


def documented_above(bases: tuple[str, ...], name: str, known: dict[str, list[Class]],
                     seen: frozenset[str] = frozenset()) -> bool:
    """Whether a base class (or one of its bases) documents method ``name``."""
    for base in set(bases) - seen:
        for cls in known.get(base, []):
            if name in cls.documented or documented_above(cls.bases, name, known,
                                                          seen | {base}):
                return True
    return False


def undocumented(root: Path = PACKAGE, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``path:line name`` of every function or method the rule finds without a docstring
    in ``packages`` of the package at ``root``."""
    known = classes(root)
    missing = []
    for package in packages:
        protocols = {name for entries in known.values() for cls in entries
                     if cls.protocol and cls.package == package for name in cls.documented}
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root.parent)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, Function) and not node.name.startswith("_"):
                    if ast.get_docstring(node) is None:
                        missing.append(f"{where}:{node.lineno} {node.name}")
                elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    bases = tuple(map(base_name, node.bases))
                    is_protocol = "Protocol" in bases
                    for f in node.body:
                        if not isinstance(f, Function) or f.name.startswith("_") \
                                or ast.get_docstring(f) is not None \
                                or documented_above(bases, f.name, known) \
                                or (not is_protocol and f.name in protocols):
                            continue
                        missing.append(f"{where}:{f.lineno} {node.name}.{f.name}")
    return missing


def test_every_public_function_and_method_says_what_it_promises() -> None:
    missing = undocumented()
    assert not missing, (f"{len(missing)} public functions and methods without a docstring "
                         "(a line or two on what each promises):\n  " + "\n  ".join(missing))


def test_the_rule_finds_what_it_should(tmp_path: Path) -> None:
    """Planted: an override of a documented base method and a structural implementation
    of a documented Protocol method pass; a Protocol's own undocumented method, a plain
    method and a function are found; private ones, dunders and other packages are not."""
    root = tmp_path / "spececd"
    (root / "edge").mkdir(parents=True)
    (root / "cloud").mkdir()
    (root / "edge" / "planted.py").write_text('''
from typing import Protocol
class Port(Protocol):
    def send(self) -> None:
        """Sends."""
    def recv(self) -> bytes: ...
class Base:
    def close(self) -> None:
        """Closes."""
class Plain(Base):
    def __init__(self) -> None: ...
    def send(self) -> None: ...
    def close(self) -> None: ...
    def flush(self) -> None: ...
    def _own(self) -> None: ...
def helper() -> None: ...
def _private() -> None: ...
''')
    (root / "cloud" / "other.py").write_text("def unchecked() -> None: ...\n")
    found = [entry.split(" ")[1] for entry in undocumented(root, ("edge",))]
    assert found == ["Port.recv", "Plain.flush", "helper"]
