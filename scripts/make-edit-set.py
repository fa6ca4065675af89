"""Build ``models/edit_set.json``, the code-edit set of Predicted Outputs' bench rows
(``spececd bench --edit-set``; :mod:`spececd.bench.api`).

    python scripts/make-edit-set.py [COUNT]

Each item is a function from a held-out standard-library file (``models/heldout_files.json``:
files the models never trained on), of 12 to 30 lines, with an instruction to rename one of
its parameters that the body uses: the ``original`` function (what a caller sends as the
prediction: the file before the edit), the ``instruction``, and the ``prompt`` a completion
model continues: the original, the instruction as a comment, and the edited function's
first line (without its line break), from which the model writes the rest.
``max_tokens``: the target's tokens of the original after its first line, and 8 more; an
item whose prompt and ``max_tokens`` do not fit the target's context is skipped. The
files are read from this Python's own standard library (3.11, as the corpus's); the set
holds their text, so it does not change with the Python that reads it.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import sysconfig
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "models"
LINES = (12, 30)  # a function's length, first line to last
COUNT = 12


def functions(source: str) -> list[ast.FunctionDef]:
    """The module's functions and methods of :data:`LINES` lines, in order."""
    found = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.FunctionDef)
             and LINES[0] <= (node.end_lineno or 0) - node.lineno + 1 <= LINES[1]]
    return sorted(found, key=lambda node: node.lineno)


def renamed(node: ast.FunctionDef, text: str) -> tuple[str, str] | None:
    """A parameter the body names at least twice, and its new name; None if none."""
    for arg in node.args.args:
        name = arg.arg
        if name in ("self", "cls") or len(name) < 2:
            continue
        if len(re.findall(rf"\b{re.escape(name)}\b", text)) >= 3:  # the signature, 2 uses
            return name, f"{name}_value" if not name.endswith("s") else f"{name[:-1]}_items"
    return None


def item(path: str, source: str) -> dict[str, object] | None:
    lines = source.splitlines()
    for node in functions(source):
        start = node.lineno - 1 - len(node.decorator_list)
        text = "\n".join(lines[start:node.end_lineno])
        if "\t" in text or not text.isascii():
            continue
        found = renamed(node, text)
        if found is None:
            continue
        old, new = found
        indent = len(text) - len(text.lstrip(" "))
        original = "\n".join(line[indent:] for line in text.split("\n")) + "\n"
        edited = re.sub(rf"\b{re.escape(old)}\b", new, original)
        first, _, _ = edited.partition("\n")
        instruction = f"rename the parameter `{old}` to `{new}`"
        prompt = (f"# {path}, before the edit:\n\n{original}\n\n# The same function, edited: "
                  f"{instruction}.\n\n{first}")
        return {"file": path, "instruction": instruction, "original": original,
                "prompt": prompt}
    return None


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else COUNT
    from spececd.backends.registry import load_tokenizer

    tokenizer, _ = load_tokenizer(str(MODELS / "target"))
    context = json.loads((MODELS / "target" / "config.json").read_text())[
        "max_position_embeddings"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = [f for f in json.loads((MODELS / "heldout_files.json").read_text())
                if f.startswith("stdlib/")]
    items = []
    for path in held_out:
        file = stdlib / path.removeprefix("stdlib/")
        if not file.is_file():
            continue
        try:
            made = item(path, file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if made is None:
            continue
        rest = str(made["original"]).partition("\n")[2]
        made["max_tokens"] = len(tokenizer.encode(rest, bos=False)) + 8
        if len(tokenizer.encode(str(made["prompt"]))) + made["max_tokens"] > context:
            continue  # the prompt and the edited function must fit the target's context
        items.append(made)
        if len(items) == count:
            break
    out = MODELS / "edit_set.json"
    out.write_text(json.dumps(items, indent=1) + "\n")
    print(f"{len(items)} items, {sum(int(str(i['max_tokens'])) for i in items)} tokens at "
          f"most, in {out}")


if __name__ == "__main__":
    main()
