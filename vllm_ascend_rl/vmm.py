"""The package's native library (``csrc/``, built by every install as ``vllm_ascend_rl.libvmm``)
through ctypes, which releases the GIL for every call: the sleep allocator's allocation table
(vmm_table.h) over virtual-memory back ends (vmm.h): its own (``acl``), or another library's
added by :func:`add_backend` (the CPU stand-in's ``host``).

A failing back-end call raises ``VmmError(code, message)``, whose ``op`` names it
(``"host.map"``). Addresses, sizes and handles must be ints in ``[0, 2**64)``: ctypes would wrap
-1 to 2**64-1 silently."""

from __future__ import annotations

import ctypes
import importlib.util
from ctypes import CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_int32, c_size_t
from ctypes import c_uint64 as u64

_SPEC = importlib.util.find_spec("vllm_ascend_rl.libvmm")
if _SPEC is None or not _SPEC.origin:
    raise ImportError("vllm_ascend_rl.libvmm is not built: reinstall the package")
LIBRARY: str = _SPEC.origin
# The pluggable-allocator entry points (torch_npu's NPUPluggableAllocator).
NPU_MALLOC, NPU_FREE = "vllm_ascend_rl_npu_malloc", "vllm_ascend_rl_npu_free"
TAG_BYTES = 64  # VMM_TAG_BYTES: a tag is at most 63 bytes


class VmmError(RuntimeError):
    """A virtual-memory call failed: ``args`` are (code, message); ``op`` names the call."""

    def __init__(self, code: int, message: str, op: str = "") -> None:
        super().__init__(code, message)
        self.op = op


class _Backend(Structure):  # VmmBackend, vmm.h
    _fields_ = [
        ("name", c_char_p),
        ("maps_zeroed", c_int),
        ("granularity", CFUNCTYPE(c_int, c_int, POINTER(c_size_t))),
        ("reserve", CFUNCTYPE(c_int, c_size_t, c_int, POINTER(u64))),
        ("release", CFUNCTYPE(c_int, u64, c_size_t, c_int)),
        ("create", CFUNCTYPE(c_int, c_size_t, c_int, c_int, POINTER(u64))),
        ("free_handle", CFUNCTYPE(c_int, u64, c_int)),
        ("map", CFUNCTYPE(c_int, u64, c_size_t, u64, c_int, c_int)),
        ("unmap", CFUNCTYPE(c_int, u64, c_size_t, c_int)),
        ("zero", CFUNCTYPE(c_int, u64, c_size_t, c_int)),
        ("synchronize", CFUNCTYPE(c_int, c_int)),
        ("describe", CFUNCTYPE(c_char_p, c_int)),
    ]


_BackendP = POINTER(_Backend)


class _Entry(Structure):  # VmmEntry, vmm_table.h
    _fields_ = [
        ("backend", _BackendP),
        ("addr", u64),
        ("size", u64),
        ("handle", u64),
        ("id", u64),
        ("device", c_int32),
        ("mapped", c_int32),
        ("tag", c_char * TAG_BYTES),
    ]


class _Status(Structure):  # VmmStatus, vmm_table.h
    _fields_ = [
        ("found", c_int32),
        ("err", c_int32),
        ("op", c_char_p),
        ("backend", _BackendP),
    ]


_lib = ctypes.CDLL(LIBRARY)
for _name, _res, _args in (
    ("vmm_backend", _BackendP, [c_char_p]),
    ("vmm_table_set_tag", None, [c_char_p, c_char_p]),
    ("vmm_table_entries", c_size_t, [_BackendP, POINTER(_Entry), c_size_t]),
    ("vmm_table_allocate", _Status, [_BackendP, u64, c_int, c_int, c_char_p, POINTER(_Entry)]),
    ("vmm_table_sleep", _Status, [u64, u64]),
    ("vmm_table_unmap", _Status, [u64, u64]),
    ("vmm_table_wake", _Status, [u64, u64, c_int]),
    ("vmm_table_free", _Status, [u64, u64]),
    ("vmm_table_retag", c_int, [u64, u64, c_char_p]),
):
    getattr(_lib, _name).restype, getattr(_lib, _name).argtypes = _res, _args


def checked_u64(value: int) -> int:
    """``value``, if an int in ``[0, 2**64)`` (ctypes would wrap -1 silently); else raises."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        raise ValueError(f"expected a non-negative int below 2**64, got {value}")
    return value


def _tag(tag: str) -> bytes:
    raw = tag.encode()
    if len(raw) >= TAG_BYTES or b"\0" in raw:
        raise ValueError(f"a memory tag is at most {TAG_BYTES - 1} bytes without NUL: {tag!r}")
    return raw


_ADDED: dict[str, ctypes._Pointer[_Backend]] = {}


def add_backend(name: str, address: int) -> None:
    """Make the vmm.h ``VmmBackend`` at ``address``, another library's, the back end ``name``."""
    _ADDED[name] = ctypes.cast(address, _BackendP)


def _backend(name: str) -> ctypes._Pointer[_Backend]:
    found = _ADDED.get(name) or _lib.vmm_backend(name.encode())
    if not found:
        raise ValueError(f"VMM back end {name!r} is not built in this extension")
    return found


def _check(backend: ctypes._Pointer[_Backend], op: str, err: int) -> None:
    if err:
        b = backend.contents
        raise VmmError(err, b.describe(err).decode(), f"{b.name.decode()}.{op}")


def _found(status: _Status) -> bool:
    """False if the entry is gone, VmmError if a back-end call failed, else True."""
    _check(status.backend, (status.op or b"").decode(), status.err)  # err is 0 if not found
    return bool(status.found)


def _row(e: _Entry) -> tuple[int, int, int, int, bool, str, int]:
    """(address, size, device, handle, mapped, tag, id); handle 0 means none."""
    return (e.addr, e.size, e.device, e.handle, bool(e.mapped), e.tag.decode(), e.id)


def backends() -> tuple[str, ...]:
    return (*_ADDED, *(n for n in ("acl",) if _lib.vmm_backend(n.encode())))


def maps_zeroed(backend: str) -> bool:
    """Whether fresh physical memory of this back end reads as zero."""
    return bool(_backend(backend).contents.maps_zeroed)


def reserve(backend: str, size: int, device: int = 0) -> int:
    b, addr = _backend(backend), u64()
    _check(b, "reserve", b.contents.reserve(checked_u64(size), device, ctypes.byref(addr)))
    return addr.value


def map(
    backend: str, addr: int, size: int, handle: int, populate: bool = False, device: int = 0
) -> None:
    b = _backend(backend)
    addr, size, handle = (checked_u64(v) for v in (addr, size, handle))
    _check(b, "map", b.contents.map(addr, size, handle, populate, device))


def zero(backend: str, addr: int, size: int, device: int = 0) -> None:
    b = _backend(backend)
    _check(b, "zero", b.contents.zero(checked_u64(addr), checked_u64(size), device))


def free(backend: str, handle: int, device: int = 0) -> None:
    b = _backend(backend)
    _check(b, "free", b.contents.free_handle(checked_u64(handle), device))


def table_set_tag(tag: str) -> str:
    """Set the tag of allocations the entry points make; returns the previous one."""
    previous = ctypes.create_string_buffer(TAG_BYTES)
    _lib.vmm_table_set_tag(_tag(tag), previous)
    return previous.value.decode()


def table_entries(backend: str) -> list[tuple]:
    b = _backend(backend)
    while True:
        room = _lib.vmm_table_entries(b, None, 0) + 16
        out = (_Entry * room)()
        n = _lib.vmm_table_entries(b, out, room)
        if n <= room:
            return [_row(e) for e in out[:n]]


def table_allocate(
    backend: str, size: int, tag: str, device: int = 0, populate: bool = True
) -> tuple:
    """Reserve, back and map; recorded in the table. Returns the entry."""
    entry = _Entry()
    args = (checked_u64(size), device, populate, _tag(tag), ctypes.byref(entry))
    _found(_lib.vmm_table_allocate(_backend(backend), *args))
    return _row(entry)


def table_sleep(addr: int, id_: int) -> bool:
    """Unmap and free the entry's physical memory; False if there is no such entry."""
    return _found(_lib.vmm_table_sleep(checked_u64(addr), checked_u64(id_)))


def table_unmap(addr: int, id_: int) -> bool:
    """Unmap the entry, keeping its physical memory and contents; False if there is none."""
    return _found(_lib.vmm_table_unmap(checked_u64(addr), checked_u64(id_)))


def table_wake(addr: int, id_: int, populate: bool = True) -> bool:
    """Map an unmapped entry: its kept physical memory, else new; False if there is none."""
    return _found(_lib.vmm_table_wake(checked_u64(addr), checked_u64(id_), populate))


def table_free(addr: int, id_: int = 0) -> bool:
    """Release everything, then forget the entry; False if there is no such entry."""
    return _found(_lib.vmm_table_free(checked_u64(addr), checked_u64(id_)))


def table_retag(addr: int, id_: int, tag: str) -> bool:
    return bool(_lib.vmm_table_retag(checked_u64(addr), checked_u64(id_), _tag(tag)))
