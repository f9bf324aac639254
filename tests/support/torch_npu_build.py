"""The torch_npu build vllm-ascend pins, read from its wheel without importing it (it needs
CANN), and the torch_npu APIs our code uses, read from our sources with ``ast``.

- :func:`pinned_wheel` fetches ``torch-npu==2.10.0.post4`` by package name (no dependencies)
  into ``.cache/wheels`` once; ``VLLM_ASCEND_RL_TORCH_NPU_WHEEL`` names a wheel instead.
- :class:`Build` answers from the wheel: Python definitions and their signatures
  (``torch_npu/**/*.py``), and the names its extension binds: the whole NUL-terminated strings
  of ``libtorch_npu.so``'s ``.rodata.str*`` sections, where pybind11 keeps method, field and
  dictionary-key names (a substring search would accept prefixes and suffixes of real names).
- :func:`uses` lists what a source file uses, typed by the values it flows through: a call's
  arguments, an attribute read or written on an instance, a string key read from a result.
"""

from __future__ import annotations

import ast
import inspect
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PIN = "torch-npu==2.10.0.post4"  # vllm-ascend@182b75e requirements.txt:17
WHEEL = "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_x86_64.whl"
EXTENSION = "torch_npu/lib/libtorch_npu.so"
ROOT = Path(__file__).resolve().parents[2]

# torch names torch_npu replaces at import (torch_npu/multiprocessing/reductions.py:207).
PATCHED = {
    "torch.multiprocessing.reductions.reduce_tensor": (
        "torch_npu.multiprocessing.reductions._npu_reduce_tensor"
    )
}
# Classes the extension binds on torch's c10d bases (ProcessGroupHCCL.hpp:282, :464): members
# the extension does not name come from these, checked on the installed torch.
NATIVE_BASES = {
    "ProcessGroupHCCL": "Backend",
    "ProcessGroupHCCL.Options": "Backend.Options",
}
# Helpers of ours that return the torch_npu module (device/npu.py).
MODULE_HELPERS = {"_torch_npu": "torch_npu"}
# Modules our code calls that the wheel does not ship, and why they cannot be checked here.
NOT_IN_WHEEL = {"acl": "pyACL ships with CANN, not with torch_npu"}


def pinned_wheel() -> Path:
    explicit = os.environ.get("VLLM_ASCEND_RL_TORCH_NPU_WHEEL")
    if explicit:
        return Path(explicit)
    cache = ROOT / ".cache" / "wheels"
    wheel = cache / WHEEL
    if not wheel.exists():
        pip = (sys.executable, "-m", "pip", "download", "--quiet", "--no-deps")
        build = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")
        subprocess.run(
            [*pip, *build, "--only-binary=:all:", "--dest", str(cache), PIN],
            check=True,
            timeout=900,
        )
    return wheel


@dataclass(frozen=True)
class Use:
    """One use of an API: ``name`` is a dotted path (``torch_npu.npu.memory.MemPool``), with
    ``()`` for an instance (``...MemPool().id``) and ``[]`` for an element of a result."""

    name: str
    kind: str  # "call", "load", "store" or "key"
    where: str
    args: int | None = None  # positional arguments of a call; None with *args
    keywords: tuple[str, ...] = ()


class Build:
    def __init__(self, wheel: Path) -> None:
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


# -- our uses ----------------------------------------------------------------------------------
def uses(source: str, filename: str) -> list[Use]:
    """Every torch_npu use in ``source`` (and in the Python scripts its strings hold)."""
    tree = ast.parse(source)
    found = [*_scope_uses(tree, tree.body, {}, filename)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "npu" in node.value:
            try:
                script = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            found += _scope_uses(script, script.body, {}, f"{filename}:{node.lineno} (script)")
    return sorted(set(found), key=lambda u: (u.where, u.name))


def _scope_uses(scope, body: list[ast.stmt], outer: dict[str, str], filename: str):
    """Uses in one module or function body; nested functions get this scope's names."""
    env = dict(outer)
    own = [n for stmt in body for n in _walk_scope(stmt)]
    for node in own:  # names bound to APIs, in source order
        _bind(node, env)
    for node in own:
        yield from _record(node, env, filename)
    for node in own:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inner = dict(env)
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if arg.annotation is not None and (api := _api(arg.annotation, env)):
                    inner[arg.arg] = api + "()"
            yield from _scope_uses(node, node.body, inner, filename)


def _walk_scope(stmt: ast.stmt) -> Iterator[ast.AST]:
    """The nodes of ``stmt`` outside nested function bodies (those are scopes of their own)."""
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node is not stmt:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            stack.extend(node.decorator_list)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _bind(node: ast.AST, env: dict[str, str]) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in ("torch", "torch_npu", *NOT_IN_WHEEL):
                env[alias.asname or alias.name.split(".")[0]] = alias.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module:
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            dotted = PATCHED.get(dotted, dotted)
            if dotted.startswith("torch_npu."):
                env[alias.asname or alias.name] = dotted
    elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(
        target := node.targets[0] if isinstance(node, ast.Assign) else node.target, ast.Name
    ):
        if isinstance(node, ast.AnnAssign) and (api := _api(node.annotation, env)):
            env[target.id] = api + "()"
        elif isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id in MODULE_HELPERS:
                env[target.id] = MODULE_HELPERS[func.id]
            elif api := _api(func, env):
                env[target.id] = api + "()"
    elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):  # noqa: SIM102
        if isinstance(node.iter, ast.Call) and (api := _api(node.iter.func, env)):
            env[node.target.id] = api + "()[]"


def _api(node: ast.AST, env: dict[str, str]) -> str | None:
    """The dotted API path an expression names (``torch.npu`` read as ``torch_npu.npu``, as
    torch_npu registers it: ``_init/registry/backend.py:9``), or None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        root = MODULE_HELPERS.get(node.func.id)
    elif isinstance(node, ast.Name):
        root = env.get(node.id)
    else:
        root = None
    if root == "torch":
        if not parts or parts[0] != "npu":
            return None
        root, parts = "torch_npu.npu", parts[1:]
    if root is None or not (root.startswith("torch_npu") or root in NOT_IN_WHEEL):
        return None
    return ".".join([root, *parts])


def _record(node: ast.AST, env: dict[str, str], filename: str) -> Iterator[Use]:
    where = f"{filename}:{getattr(node, 'lineno', '?')}"
    if isinstance(node, ast.Call) and (api := _api(node.func, env)):
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        keywords = tuple(k.arg for k in node.keywords if k.arg)
        yield Use(api, "call", where, None if starred else len(node.args), keywords)
    elif isinstance(node, ast.Attribute) and "()" in (api := _api(node, env) or ""):
        if isinstance(node.ctx, ast.Store):
            yield Use(api, "store", where)
        elif not isinstance(node.ctx, ast.Del):
            yield Use(api, "load", where)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):  # noqa: SIM102
        if (api := _api(node.value, env)) and "()" in api and isinstance(node.slice.value, str):
            yield Use(f"{api}[{node.slice.value!r}]", "key", where)
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
        for target in node.targets:
            if (api := _api(target, env)) and "()" in api:
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        yield Use(f"{api}[{key.value!r}]", "key", where)


# -- checking a use against the build ----------------------------------------------------------
def check(build: Build, use: Use) -> str | None:
    """Why the build lacks ``use`` (a message), or None if it has it."""
    name, key = use.name, None
    if use.kind == "key":
        name, _, literal = name.rpartition("[")
        key = ast.literal_eval(literal[:-1])
    base, instance, members = name.partition("()")
    members = [m for m in members.replace("[]", "").split(".") if m]
    problem = _check_path(build, base)
    if problem:
        return problem
    if not instance:  # the API itself: a call's arguments against its signature
        return _check_call(build, base, use) if use.kind == "call" else None
    for member in members:  # on an instance: a member of its class
        if not _has_member(build, base, member):
            return f"{base}() has no member {member!r} in the build"
    if key is not None and not build.binds(key):
        return f"the build never names the key {key!r} (read from {base}())"
    return None


def _check_path(build: Build, dotted: str) -> str | None:
    if dotted.startswith("torch_npu._C"):  # the extension: every name under it is bound
        for part in dotted.split(".")[2:]:
            if not (build.binds(part) or build.created_by_python(part)):
                return f"{dotted}: the extension binds no {part!r}"
        return None
    found = build.resolve(dotted)
    if found is None:
        return f"{dotted} is not in the build"
    path, node, rest = found
    if rest and node is not None and isinstance(node, ast.ClassDef):
        if not all(build.class_has(node, part, path) for part in rest[:1]):
            return f"{dotted}: {node.name} has no {rest[0]!r}"
        return None
    if rest:
        return f"{dotted}: {'.'.join(rest)} is not in {path}"
    return None


def _definition(build: Build, dotted: str):
    found = None if dotted.startswith("torch_npu._C") else build.resolve(dotted)
    return found if found and found[1] is not None and not found[2] else None


def _check_call(build: Build, dotted: str, use: Use) -> str | None:
    found = _definition(build, dotted)
    if found is None:
        return None  # bound by the extension: its names are checked, its signature cannot be
    path, node, _ = found
    sig = signature(node)
    if sig is None:
        return None
    try:
        if use.args is None:
            sig.bind_partial(**dict.fromkeys(use.keywords))
        else:
            sig.bind(*[None] * use.args, **dict.fromkeys(use.keywords))
    except TypeError as e:
        return f"{dotted}{sig} ({path}:{node.lineno}) does not take this call: {e}"
    return None


def _has_member(build: Build, cls: str, member: str) -> bool:
    found = _definition(build, cls)
    if found is not None:
        path, node, _ = found
        return not isinstance(node, ast.ClassDef) or build.class_has(node, member, path)
    if build.binds(member):
        return True
    short = cls.split("._distributed_c10d.")[-1]
    base = NATIVE_BASES.get(short)
    if base is None:
        return False
    import torch

    target = torch._C._distributed_c10d
    for part in base.split("."):
        target = getattr(target, part)
    return hasattr(target, member)
