"""The package's import graph has no circle, lazy and ``TYPE_CHECKING`` imports included: every
module can be read from its imports downwards."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "vllm_ascend_rl"
MODULES = {  # dotted name -> file
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
    for p in PACKAGE.rglob("*.py")
}


def imports_of(path: Path, modules: set[str] | None) -> set[str]:
    """The modules ``path`` imports (``from m import n`` also as ``m.n``), of ``modules``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found if modules is None else found & modules


def test_no_import_circle():
    graph = {m: imports_of(p, set(MODULES)) - {m} for m, p in MODULES.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in graph[module]:
            assert target not in path, "import circle: " + " -> ".join([*path, target])
            if target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in graph:
        visit(module, [module])


def test_the_seam_imports_nothing_above_it_and_nothing_imports_the_stand_in():
    """``device/`` imports nothing of the package but leaves (``vmm``: modules that import
    none of it), and the product reaches the CPU stand-in (a test double, ``standin/``) only
    through the seam's entry points, never by import."""
    for path in MODULES.values():
        found = imports_of(path, None)
        assert not {m for m in found if m.split(".")[0] == "npu_standin"}, path
        if path.parent.name == "device":
            above = imports_of(path, set(MODULES)) - {"vllm_ascend_rl"}
            above -= {m for m in MODULES if m.startswith("vllm_ascend_rl.device")}
            for module in above:
                assert not imports_of(MODULES[module], set(MODULES)), (path, module)
