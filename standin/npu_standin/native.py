"""The stand-in's native library (``standin/csrc``): the host virtual-memory back end, which
importing this module adds to the product's sleep-allocator table as ``host``, and the staging
copy."""

from __future__ import annotations

import ctypes
import importlib.util

from vllm_ascend_rl import vmm

_spec = importlib.util.find_spec("npu_standin.libstandin")
assert _spec is not None and _spec.origin, "npu_standin's library is not built: reinstall it"
_lib = ctypes.CDLL(_spec.origin)
_lib.standin_host_copy.argtypes = [ctypes.c_uint64] * 4
HOST_BACKEND = ctypes.addressof(ctypes.c_char.in_dll(_lib, "vmm_host_backend"))  # a VmmBackend
vmm.add_backend("host", HOST_BACKEND)


def host_copy(dst: int, src: int, nbytes: int, threads: int) -> None:
    """memcpy of host memory the caller owns (contiguous, at least nbytes) on a few threads."""
    args = map(vmm.checked_u64, (dst, src, nbytes, threads))
    if _lib.standin_host_copy(*args):
        raise ValueError("host_copy: a null address, or source and destination overlap")
