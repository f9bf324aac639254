"""Ascend NPU: HCCL collectives and NPU IPC through torch_npu. The only Python module that
touches torch_npu.

Imported lazily by :func:`vllm_ascend_rl.device.get_device` on NPU hosts only. This code has
not run on Ascend hardware yet (no NPU was available to us); CI covers the same engine code
through :mod:`vllm_ascend_rl.device.cpu`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from contextlib import contextmanager
from typing import Any

import torch

from vllm_ascend_rl.device import (
    Device,
    ExportedBuffer,
    ImportedBuffer,
    IpcHandleError,
    check_same_location,
    host_identity,
)


def _torch_npu():
    try:
        import torch_npu
    except ImportError as e:
        raise RuntimeError("device 'npu' needs torch_npu from your Ascend software stack") from e
    return torch_npu


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: Any, field: str) -> bytes | None:
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise IpcHandleError(f"malformed NPU IPC handle: {field} is not base64") from None


class NpuDevice(Device):
    kind = "npu"
    collective_backend = "hccl"

    def __init__(self) -> None:
        _torch_npu()

    def torch_device(self, index: int | None = None) -> torch.device:
        if index is None:
            index = torch.npu.current_device()
        return torch.device("npu", index)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def read_device(self, addr: int, out: torch.Tensor) -> None:
        _acl_memcpy(out.data_ptr(), addr, out.numel() * out.element_size(), _D2H)

    def write_device(self, addr: int, src: torch.Tensor) -> None:
        _acl_memcpy(addr, src.data_ptr(), src.numel() * src.element_size(), _H2D)

    def location(self) -> dict[str, str]:
        """Physical chip: ASCEND_RT_VISIBLE_DEVICES maps logical indices to chips."""
        logical = torch.npu.current_device()
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        chip = visible.split(",")[logical].strip() if visible else str(logical)
        return {**host_identity(), "chip": chip}

    def create_ipc_buffer(self, nbytes: int) -> ExportedBuffer:
        from torch.multiprocessing.reductions import reduce_tensor  # torch_npu patches it

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device())
        _, args = reduce_tensor(tensor)
        # The rebuild arguments of an NPU storage, as explicit JSON fields (never pickled).
        (
            _cls,
            _size,
            _stride,
            _offset,
            _storage_cls,
            _dtype,
            _device,
            storage_handle,
            storage_size,
            storage_offset,
            _grad,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = args
        handle = {
            "kind": "npu_ipc",
            "id": hashlib.sha256(storage_handle).hexdigest()[:32],
            "nbytes": nbytes,
            "location": self.location(),
            "storage_handle": _b64(storage_handle),
            "storage_size_bytes": int(storage_size),
            "storage_offset_bytes": int(storage_offset),
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync),
        }
        holder = [tensor]
        return ExportedBuffer(tensor, handle, unlink=lambda: None, release=holder.clear)

    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        from torch_npu.multiprocessing.reductions import rebuild_npu_tensor

        if not isinstance(handle, dict) or handle.get("kind") != "npu_ipc":
            raise IpcHandleError(f"not an NPU IPC handle: {handle!r}")
        check_same_location(handle.get("location"), self.location())
        try:
            nbytes = int(handle["nbytes"])
            tensor = rebuild_npu_tensor(
                torch.Tensor,
                (nbytes,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                torch.npu.current_device(),  # the receiver's own device index
                _unb64(handle["storage_handle"], "storage_handle"),
                int(handle["storage_size_bytes"]),
                int(handle["storage_offset_bytes"]),
                False,
                _unb64(handle["ref_counter_handle"], "ref_counter_handle"),
                int(handle["ref_counter_offset"]),
                _unb64(handle.get("event_handle"), "event_handle"),
                bool(handle["event_sync_required"]),
            )
        except IpcHandleError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise IpcHandleError(f"malformed NPU IPC handle: {e}") from e
        except RuntimeError as e:
            raise IpcHandleError(f"cannot open NPU IPC handle {handle.get('id')}: {e}") from e
        holder = [tensor]
        return ImportedBuffer(tensor, holder.clear)


# ACL memcpy kinds (aclrtMemcpyKind): host-to-device 1, device-to-host 2.
_H2D, _D2H = 1, 2


def _acl_memcpy(dst: int, src: int, nbytes: int, kind: int) -> None:
    import acl  # pyACL, shipped with CANN

    ret = acl.rt.memcpy(dst, nbytes, src, nbytes, kind)
    if ret != 0:
        raise RuntimeError(f"aclrtMemcpy of {nbytes} bytes failed with ACL error {ret}")


_POOLS: dict = {}  # tag -> (pool, allocator): kept alive for the process (pytorch#146431)


@contextmanager
def pluggable_pool(allocator):
    """Route torch_npu allocations inside the block through the ACL VMM entry points of
    ``vllm_ascend_rl._C``, which report each allocation to ``allocator`` (tagged)."""
    from vllm_ascend_rl import _C

    _torch_npu()
    tag = allocator._current_tag
    if tag not in _POOLS:
        _C.acl_set_callbacks(allocator._on_malloc, allocator._on_free)
        pluggable = torch.npu.memory.NPUPluggableAllocator(_C.__file__, _C.NPU_MALLOC, _C.NPU_FREE)
        _POOLS[tag] = (torch.npu.memory.MemPool(pluggable._allocator), pluggable)
    pool, _ = _POOLS[tag]
    with torch.npu.memory.use_mem_pool(pool):
        yield
