"""torch_npu builds, read from their wheels without importing them (they need CANN):
:func:`wheel` fetches ``torch-npu==<version>`` by package name (no dependencies) into
``.cache/wheels`` once (``VLLM_ASCEND_RL_TORCH_NPU_WHEEL`` names a wheel for every version
instead); :class:`Build` answers from one: Python definitions and their signatures
(``torch_npu/**/*.py``), and the names its extension binds: the whole NUL-terminated strings of
``libtorch_npu.so``'s ``.rodata.str*`` sections, where pybind11 keeps method, field and
dictionary-key names (a substring search would accept prefixes and suffixes of real names).

The builds checked are every one a supported stack pins (``vllm_ascend_rl.stacks``), and
``NEWEST``, the newest on the package index, as a probe of what comes next."""

from __future__ import annotations

import ast
import inspect
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_ascend_rl.stacks import SUPPORTED

PINNED = sorted({build for stack in SUPPORTED for build in stack.torch_npu})
NEWEST = "2.14.0"  # pip index versions torch-npu, 2026-12-06
EXTENSION = "torch_npu/lib/libtorch_npu.so"
ROOT = Path(__file__).resolve().parents[2]


def wheel(version: str) -> Path:
    explicit = os.environ.get("VLLM_ASCEND_RL_TORCH_NPU_WHEEL")
    if explicit:
        return Path(explicit)
    cache = ROOT / ".cache" / "wheels"
    name = f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    if not (cache / name).exists():
        pip = (sys.executable, "-m", "pip", "download", "--quiet", "--no-deps")
        build = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")
        subprocess.run(
            [*pip, *build, "--only-binary=:all:", "--dest", str(cache), f"torch-npu=={version}"],
            check=True,
            timeout=900,
        )
    return cache / name


class Build:
    def __init__(self, wheel: Path) -> None:
        self.version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            self.sources = {n: z.read(n).decode() for n in names if n.endswith(".py")}
            self.headers = {n: z.read(n).decode() for n in names if n.endswith(".hpp")}
            self.strings = rodata_strings(z.read(EXTENSION))
        self._trees: dict[str, ast.Module] = {}

    # -- Python definitions ----------------------------------------------------------------
    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.sources[path])
        return self._trees[path]

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in self.sources), None)

    def definition(self, module: str, name: str, depth: int = 0):
        """``(file, node)`` of ``name`` at the top level of ``module``, following its imports;
        ``(file, None)`` for a submodule; None if the module does not have it."""
        path = self.module_file(module)
        if path is None or depth > 8:
            return None
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in self.tree(path).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                return path, node
            if isinstance(node, ast.ImportFrom):
                source = _absolute(package, node)
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.definition(source, alias.name, depth + 1) or (
                            self._submodule(f"{source}.{alias.name}")
                        )
                    if alias.name == "*" and name in self.exported(source):
                        return self.definition(source, name, depth + 1)
        return self._submodule(f"{module}.{name}")

    def _submodule(self, dotted: str):
        path = self.module_file(dotted)
        return None if path is None else (path, None)

    def exported(self, module: str) -> list[str]:
        path = self.module_file(module)
        for node in self.tree(path).body if path else ():
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                return list(ast.literal_eval(node.value))
        return []

    def resolve(self, dotted: str):
        """``(file, node, rest)``: the definition ``dotted`` names through the wheel's modules
        (``node`` None for a module) and the parts after it (a class's members)."""
        parts = dotted.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
            module = ".".join(parts[:i])
            path = self.module_file(module)
            if path is None:
                continue
            node, rest = None, parts[i:]
            while rest and node is None:
                hit = self.definition(module, rest[0])
                if hit is None:
                    break
                (path, node), rest = hit, rest[1:]
                module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            return path, node, rest
        return None

    def class_has(self, cls: ast.ClassDef, member: str, path: str) -> bool:
        """A method, property or ``self.<member> =`` of ``cls`` or of its bases in the wheel."""
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and node.name == member:
                return True
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):  # noqa: SIM102
                if node.attr == member and getattr(node.value, "id", None) == "self":
                    return True
        for base in cls.bases:
            if isinstance(base, ast.Name):
                module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                path_, node_ = self.definition(module, base.id) or (path, None)
                if isinstance(node_, ast.ClassDef) and self.class_has(node_, member, path_):
                    return True
        return False

    # -- names bound by the extension -------------------------------------------------------
    def binds(self, name: str) -> bool:
        return name.encode() in self.strings

    def created_by_python(self, name: str) -> bool:
        """``name`` is a string constant of the wheel's Python (e.g. a submodule of ``_C`` made
        by ``_create_child_once(_C, "_distributed_c10d", ...)``)."""
        return any(f'"{name}"' in s or f"'{name}'" in s for s in self.sources.values())


def _absolute(package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def rodata_strings(elf: bytes) -> set[bytes]:
    """The NUL-separated strings of an ELF64 little-endian file's ``.rodata.str*`` sections."""
    if elf[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not an ELF64 little-endian file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(count)]
    names_offset = sections[names_index][4]
    strings: set[bytes] = set()
    for name, kind, _, _, offset, size in sections:
        start = names_offset + name
        if kind != 8 and elf[start : elf.index(b"\0", start)].startswith(b".rodata.str"):
            strings.update(elf[offset : offset + size].split(b"\0"))  # kind 8: no bits
    return strings


def signature(node: ast.FunctionDef | ast.ClassDef) -> inspect.Signature | None:
    """The signature of a def (a class: its ``__init__`` without ``self``), defaults elided."""
    drop = 0
    if isinstance(node, ast.ClassDef):
        init = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        if not init:
            return None
        node, drop = init[0], 1
    a, P = node.args, inspect.Parameter
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    params = [
        P(x.arg, P.POSITIONAL_OR_KEYWORD, default=None if i >= first_default else P.empty)
        for i, x in enumerate(positional)
    ][drop:]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [
        P(x.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
        for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)
