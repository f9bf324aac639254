"""The torch_npu APIs our code uses, read from our sources with ``ast`` (:func:`uses`), and
checked against the pinned build (:func:`check`). A use is typed by the values it flows
through: a call's arguments, an attribute read or written on an instance (made by a
constructor, annotated, or a loop over a result), a string key read from a result."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

from tests.support.torch_npu_wheel import Build, signature

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


@dataclass(frozen=True)
class Use:
    """One use of an API: ``name`` is a dotted path (``torch_npu.npu.memory.MemPool``), with
    ``()`` for an instance (``...MemPool().id``) and ``[]`` for an element of a result."""

    name: str
    kind: str  # "call", "load", "store" or "key"
    where: str
    args: int | None = None  # positional arguments of a call; None with *args
    keywords: tuple[str, ...] = ()


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
