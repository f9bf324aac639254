"""Type checks for the wire dataclasses our engines build from JSON.

vLLM builds an init or update info with ``cls(**body)``: a dataclass checks neither types nor
nesting, so a shape that is an int or a name that is a list used to surface deep inside an
update as a bare Python error ("'int' object is not iterable") after the update had opened.
Every info therefore checks each field against its annotation when it is constructed, and the
message names the class and the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

_MAX_SHOWN = 80


class FieldError(ValueError):
    """A wire field of the wrong type; the message names the field."""


def check_field_types(obj: Any) -> None:
    """Raise :class:`FieldError` for the first field whose value does not match its type."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        problem = _mismatch(value, hints[f.name], f.name)
        if problem:
            raise FieldError(f"{type(obj).__name__}: {problem}")


def _mismatch(value: Any, hint: Any, where: str) -> str | None:
    """Why ``value`` is not a ``hint`` (``where`` locates it), or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (Union, types.UnionType):
        if any(_mismatch(value, a, where) is None for a in args):
            return None
        return _expected(where, " or ".join(_name(a) for a in args), value)
    if origin is list:
        if not isinstance(value, list):
            return _expected(where, _name(hint), value)
        for i, item in enumerate(value):
            problem = _mismatch(item, args[0], f"{where}[{i}]") if args else None
            if problem:
                return problem
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return _expected(where, _name(hint), value)
        key_t, value_t = args or (Any, Any)
        for k, v in value.items():
            problem = _mismatch(k, key_t, f"{where} key")
            problem = problem or _mismatch(v, value_t, f"{where}[{k!r}]")
            if problem:
                return problem
        return None
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is type(None):
        ok = value is None
    else:
        ok = isinstance(value, hint)
    return None if ok else _expected(where, _name(hint), value)


def _expected(where: str, want: str, value: Any) -> str:
    shown = repr(value)
    if len(shown) > _MAX_SHOWN:
        shown = shown[:_MAX_SHOWN] + "..."
    return f"field {where!r} must be {want}, got {type(value).__name__} {shown}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint)
