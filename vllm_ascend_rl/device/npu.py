"""Ascend NPU: HCCL collectives and NPU IPC; the only Python module that touches torch_npu.
Imported lazily, on NPU hosts only. Not yet run on Ascend hardware; CI covers the same engine
code through :mod:`vllm_ascend_rl.device.cpu`."""

from __future__ import annotations

import base64
import os
import re
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from vllm_ascend_rl.device.base import (
    Device,
    ExportedBuffer,
    GroupBackend,
    ImportedBuffer,
    IpcHandleError,
    check_same_location,
    host_identity,
    ipc_buffer_id,
)
from vllm_ascend_rl.device.group import exec_timeout_s

# torch_npu 2.10.0.post4 ProcessGroupHCCL.hpp: enum class WatchdogStatus {INIT, RUN, STOP}.
_WATCHDOG_STOP = 2
# vllm-ascend's default HCCL buffer for its own groups (_DEFAULT_BUFFER_SIZE, utils.py:70).
HCCL_BUFFER_MB = 200


def nz_weight_mode() -> int:
    """vllm-ascend's FRACTAL_NZ weight mode in this process (default 1): ``main`` (182b75e)
    keeps it in ``get_ascend_config().weight_nz_mode`` (``ascend_config.py:238-245``;
    ``rl_config.enabled`` forces 0, ``:579-600``); releases up to v0.26 read only
    ``VLLM_ASCEND_ENABLE_NZ`` (``envs.py``)."""
    try:
        from vllm_ascend.ascend_config import get_ascend_config

        return int(get_ascend_config().weight_nz_mode)
    except (ImportError, AttributeError, RuntimeError):
        return int(os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1"))


def nz_format_refusal() -> str | None:
    """Why vllm-ascend's ``NPUWorker`` will refuse ``start_weight_update`` and ``wake_up`` (NZ
    on: ``_check_nz_disabled``, ``worker.py:247-255, 288-310``), to say at engine start."""
    mode = nz_weight_mode()
    if not mode:
        return None
    return (
        f"vllm-ascend's FRACTAL_NZ weight format is on (weight_nz_mode={mode}), and "
        "vllm-ascend refuses every weight update and wake_up while it is. Start the server "
        """with --additional-config '{"rl_config": {"enabled": true}}' (which also turns off """
        "expandable segments and sets VLLM_SERVER_DEV_MODE=1), or with "
        """--additional-config '{"weight_nz_mode": 0}', or with VLLM_ASCEND_ENABLE_NZ=0."""
    )


def current_index() -> int:
    """The calling thread's current NPU."""
    return _torch_npu().npu.current_device()


def chips_and_cann() -> tuple[int, str]:
    """The NPUs this process sees (``torch.npu.device_count``, torch_npu ``npu/__init__.py:437``)
    and the CANN version (``torch_npu.npu.utils.get_cann_version("CANN")``, ``utils.py:37-45``),
    for the doctor."""
    torch_npu = _torch_npu()
    return torch_npu.npu.device_count(), str(torch_npu.npu.utils.get_cann_version("CANN"))


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

    def __init__(self, index: int = 0) -> None:
        _torch_npu()
        super().__init__(index)

    def torch_device(self) -> torch.device:
        return torch.device("npu", self.index)

    def bind_thread(self) -> None:
        torch.npu.set_device(self.index)

    def synchronize(self) -> None:
        torch.npu.synchronize(self.index)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def memory_in_use(self) -> int:
        free, total = torch.npu.mem_get_info(self.index)
        return total - free

    def weight_update_refusal(self) -> str | None:
        return nz_format_refusal()

    # -- the weight-broadcast group --------------------------------------------------------
    def group_backend(
        self, store, rank: int, world_size: int, timeout_s: float, group_id: str
    ) -> GroupBackend:
        """``ProcessGroupHCCL`` with explicit options, as vllm-ascend's netloader builds its
        group (``netloader_pg.py:113-130`` at vllm-ascend@182b75e). Its watchdog is STOPped:
        with the default ``HCCL_ASYNC_ERROR_HANDLING=1`` it rethrows a failed collective "to take
        the entire process down" (``ProcessGroupHCCL.cpp:1024-1041``, torch_npu 2.10.0.post4),
        killing the engine when a trainer dies. STOP (``set_watchdog_status``, per group,
        ``:3710-3717``) keeps our works out of it (``workEnqueue`` returns early, ``:3517-3519``;
        the loop skips the group, ``:2216-2218``); :class:`BroadcastChannel` polls
        ``is_completed`` against ``timeout_s`` and aborts the communicator itself."""
        from torch.distributed import ProcessGroup
        from torch.distributed.distributed_c10d import Backend
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=timeout_s)
        options.global_ranks_in_group = []  # a group of its own, not a subgroup of the world
        options.group_id = group_id  # as netloader: the rendezvous, the same on every rank
        # Buffer in MB, bounded as vllm-ascend bounds its groups' (vllm_ascend/utils.py:960-991).
        # "group_name": the rendezvous in plain characters, for HCCL's logs (hcclUdi,
        # ProcessGroupHCCL.cpp:3935-3948). The exec timeout (int seconds, :3998-4013) bounds how
        # long a collective hung on a dead peer holds the HCCL stream, and with it every
        # device-wide synchronize, empty_cache and the exit sync (else 1836 s, :77).
        comm_name = re.sub(r"[^A-Za-z0-9_]+", "_", group_id).strip("_")
        options.hccl_config = {
            "hccl_buffer_size": HCCL_BUFFER_MB,
            "group_name": comm_name,
            "hccl_exec_timeout": exec_timeout_s(timeout_s),
        }
        hccl = ProcessGroupHCCL(store, rank, world_size, options)
        hccl.set_watchdog_status(_WATCHDOG_STOP)
        return GroupBackend(
            hccl,
            Backend.backend_type_map[Backend("hccl")],
            ProcessGroup.BackendType.CUSTOM,
            torch.device("npu"),
        )

    def close_group(self, pg, broken: bool) -> None:
        """A healthy group shuts down (which synchronizes its HCCL streams); a broken one
        aborts its communicators instead: ``shutdown()`` would wait on a collective hung on
        a dead peer until ``HCCL_EXEC_TIMEOUT`` (``ProcessGroupHCCL.cpp:1445-1472``)."""
        if not broken:
            pg.shutdown()
            return
        backend = pg._get_backend(torch.device("npu"))
        backend.abort_hccl_comm("vllm_ascend_rl: weight-transfer channel broken")

    def read_device(self, addr: int, out: torch.Tensor) -> None:
        _acl_memcpy(out.data_ptr(), addr, out.numel() * out.element_size(), _D2H)

    def write_device(self, addr: int, src: torch.Tensor) -> None:
        _acl_memcpy(addr, src.data_ptr(), src.numel() * src.element_size(), _H2D)

    def location(self) -> dict[str, str]:
        """Physical chip: ASCEND_RT_VISIBLE_DEVICES maps logical indices to chips (the same
        mapping as vllm-ascend's ``npu_generate_uuid``, npu_ipc_engine.py:63)."""
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        chip = visible.split(",")[self.index].strip() if visible else str(self.index)
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
            "id": ipc_buffer_id(storage_handle, int(storage_offset)),
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
                # As the producer sends (reductions.py:98-150, torch_npu 2.10.0.post4); only the
                # TypedStorage wrapper absorbs a cache hit's device= (utils/storage.py:85-90).
                torch.TypedStorage,
                torch.uint8,
                self.index,  # the receiver's own device, never the ambient one
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


# Every pool ever entered lives until exit, so torch_npu 2.10 never frees our VMM memory with a
# plain aclrtFree: a private pool's blocks reach release_block (aclrtFree,
# NPUCachingAllocator.cpp:2858-2897) only once its MemPool is gone (use_count 0, :2186-2210);
# while it lives, empty_cache skips it (:2815-2840). Also pytorch#146431.
_POOLS: list = []
# The process's one NPUPluggableAllocator over the ACL entry points, shared by every pool.
_PLUGGABLE: list = []


@contextmanager
def pluggable_pool(allocator):
    """Route torch_npu allocations inside the block through ``vllm_ascend_rl.libvmm``'s ACL VMM
    entry points, which record each in the allocation table with the tag
    ``allocator.use_memory_pool`` set, and run no Python. Each entry gets a fresh pool, never
    allocated from after the block, so the segments it caches unused (freed during loading,
    format conversion, quantization) are given back at the end, as vLLM's cumem allocator
    trims its pools (vllm/device_allocator/cumem.py:402-435, vLLM 0.32.0); kept, they would be
    backed up every sleep and hide from KV-cache sizing."""
    from vllm_ascend_rl import vmm

    _torch_npu()
    if not _PLUGGABLE:
        _PLUGGABLE.append(
            torch.npu.memory.NPUPluggableAllocator(vmm.LIBRARY, vmm.NPU_MALLOC, vmm.NPU_FREE)
        )
    pool = torch.npu.memory.MemPool(_PLUGGABLE[0]._allocator)
    _POOLS.append(pool)
    with torch.npu.memory.use_mem_pool(pool, device=allocator.device_index):
        yield
    _trim(pool, allocator)


def _trim(pool, allocator) -> None:
    """Release the pool's segments that hold no live block (torch_npu's snapshot fields,
    torch_npu/csrc/npu/Module.cpp:1478-1533 in 2.10.0.post4)."""
    torch.npu.synchronize(allocator.device_index)
    known = allocator.allocations
    for segment in torch.npu.memory_snapshot():
        unused = not segment["allocated_size"] and segment["address"] in known
        if unused and tuple(segment["segment_pool_id"]) == tuple(pool.id):
            allocator.free(segment["address"])
