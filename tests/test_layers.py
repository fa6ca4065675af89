"""The layers of docs/how-it-works.md ("Layers"), checked: every import in src/spececd,
function-level and ``TYPE_CHECKING`` ones included, points up the list or within its own
layer, and the edge and the cloud never import each other; and no module imports itself
through others (imports for annotations alone aside).

:data:`LAYERS` is the documented order written as a table; the page is its source, and a
change to one is a change to the other. Top-level modules sit in the layer of what they
need, as the page says: ``errors`` and ``processes`` under everything, ``grammar``,
``text``, ``healing`` and ``convert`` beside the backends (each works on a tokenizer or a
model file), the rest with the entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "spececd"

# Each top-level module or package of spececd, by its layer: it may import from its own
# layer and the ones with a lower number, never from a higher one.
LAYERS = {
    "errors": 0,  # the exception roots every layer raises
    "processes": 0,  # the processes a command starts end with it (spececd serve)
    "core": 1,
    "protocol": 2,
    "backends": 3, "grammar": 3, "text": 3, "healing": 3, "convert": 3,
    "edge": 4, "cloud": 4,
    "transports": 5,
    # entry points
    "generator": 6, "api": 6, "openai_api": 6, "bench": 6, "cli": 6, "config": 6,
    "deploy": 6, "__init__": 6, "__main__": 6,
}
NEVER = {("edge", "cloud"), ("cloud", "edge")}  # one layer, but they never meet

# Arrows against the order that are known and owned by other work, each naming its owner
# (none now). Remove an entry with the arrow: an entry whose arrow is gone fails the test.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str:
    """The module of ours that ``name`` (a module, or a name in one) is in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations alone."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


def imports_in(source: str, module: str, package: str, annotations: bool = True) -> set[str]:
    """The modules of ours that ``source`` (the text of ``module``, in ``package``)
    imports, anywhere in it; ``annotations``: those under ``if TYPE_CHECKING:`` too."""
    found = set()
    tree = ast.parse(source)
    skipped = set() if annotations else type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = parts[:len(parts) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(resolve(name) for name in names
                     if name == "spececd" or name.startswith("spececd."))
    return found - {module}


def imports(module: str, annotations: bool = True) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imports_in(path.read_text(), module, package, annotations)


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph``: its strongly connected components of two modules
    or more (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def against_the_order(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The arrows of ``graph`` (module -> the modules it imports) that point down the
    layers, or between the edge and the cloud."""
    bad = set()
    for module, targets in graph.items():
        for target in targets:
            here, there = top(module), top(target)
            if here not in LAYERS or there not in LAYERS:
                continue  # test_every_module_has_a_layer names it
            if LAYERS[there] > LAYERS[here] or (here, there) in NEVER:
                bad.add((module, target))
    return bad


def test_every_module_has_a_layer() -> None:
    assert {top(module) for module in MODULES} <= set(LAYERS), \
        "a new top-level module: give it its layer here and in docs/how-it-works.md"


def test_imports_follow_the_documented_layers() -> None:
    bad = against_the_order({module: imports(module) for module in MODULES})
    unexplained = sorted(bad - set(ALLOWED))
    assert not unexplained, "imports against docs/how-it-works.md's layers:\n" + "\n".join(
        f"  {a} -> {b} ({top(a)} is layer {LAYERS[top(a)]}, {top(b)} layer {LAYERS[top(b)]})"
        for a, b in unexplained)
    stale = sorted(set(ALLOWED) - bad)
    assert not stale, f"allowed arrows that are gone: remove them from ALLOWED: {stale}"


def test_no_module_imports_itself_through_others() -> None:
    """No import loops, function-level imports included (they only hide a loop); imports
    for annotations alone (``if TYPE_CHECKING:``) do not count."""
    found = loops({module: imports(module, annotations=False) for module in MODULES})
    assert not found, f"import loops: {found}"


def test_the_check_catches_planted_arrows() -> None:
    """A function-level import, a relative one and a name imported from a module all
    count; an arrow down the layers and one between edge and cloud are caught."""
    source = ("import numpy\n"
              "from spececd.core.params import SamplingParams\n"
              "def f():\n    from ..cli import main\n"
              "def g():\n    from spececd import cloud\n")
    found = imports_in(source, "spececd.edge.planted", "spececd.edge")
    assert found == {"spececd.core.params", "spececd.cli", "spececd.cloud"}
    assert against_the_order({"spececd.edge.planted": found}) == {
        ("spececd.edge.planted", "spececd.cli"), ("spececd.edge.planted", "spececd.cloud")}
    typed = ("from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n    from spececd.cli import main\n")
    assert imports_in(typed, "spececd.core.x", "spececd.core") == {"spececd.cli"}
    assert imports_in(typed, "spececd.core.x", "spececd.core", annotations=False) == set()
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_table_is_the_documented_one() -> None:
    """docs/how-it-works.md names the packages in the order of the table."""
    page = (SRC.parent / "docs" / "how-it-works.md").read_text()
    layers = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    order = [layers.index(f"**`{name}`**") for name in
             ("core", "protocol", "backends", "edge", "cloud", "transports")]
    assert order == sorted(order)
    for name in LAYERS:
        if name not in ("__init__", "__main__") and "." not in name and \
                (PACKAGE / f"{name}.py").exists():
            assert f"`{name}.py`" in layers, f"the Layers section does not place {name}.py"
