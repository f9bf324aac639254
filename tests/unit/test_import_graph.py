"""The package's import graph has no circle, lazy and ``TYPE_CHECKING`` imports included: every
module can be read from its imports downwards."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "vllm_ascend_rl"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
