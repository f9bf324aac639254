"""The package's import graph has no circle, lazy imports included (``TYPE_CHECKING`` imports,
which never run, excepted): every module can be read from its imports downwards."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "vllm_ascend_rl"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    never = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in never:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def test_no_import_circle():
    files = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {m: imports_of(p, set(files)) - {m} for m, p in files.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in graph[module]:
            assert target not in path, "import circle: " + " -> ".join([*path, target])
            if target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in graph:
        visit(module, [module])
