"""Ascend NPU: HCCL collectives and NPU IPC; the only Python module that touches torch_npu.
Imported lazily, on NPU hosts only. Not yet run on Ascend hardware; CI covers the same engine
code through the CPU stand-in (``standin/``)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vllm_ascend_rl.device.base import (
    Device,
    ExportedBuffer,
    ImportedBuffer,
    IpcHandleError,
    SleepPool,
    check_same_location,
    host_identity,
    ipc_buffer_id,
)
from vllm_ascend_rl.device.group import hccl_config

if TYPE_CHECKING:
    import torch.npu  # registered by torch_npu at import; untyped
    from torch._C._distributed_c10d import Backend as C10dBackend
    from torch.distributed import ProcessGroup, Store


# torch_npu 2.10.0.post4 ProcessGroupHCCL.hpp: enum class WatchdogStatus {INIT, RUN, STOP}.
_WATCHDOG_STOP = 2


# The additional config an RL engine starts with: NZ off, and nothing vllm-ascend's frontend
# rewrites PYTORCH_NPU_ALLOC_CONF for (``rl_config`` would; docs/ascend-conformance.md §6).
RL_ADDITIONAL_CONFIG = {"weight_nz_mode": 0}


def rl_config_enabled(additional_config: dict | None) -> bool:
    """Whether ``--additional-config`` turns vllm-ascend's ``rl_config`` on."""
    return bool(((additional_config or {}).get("rl_config") or {}).get("enabled"))


def nz_weight_mode(additional_config: dict | None = None) -> int:
    """vllm-ascend's FRACTAL_NZ weight mode (default 1): in a vLLM process, its config's
    (``get_ascend_config().weight_nz_mode``, ``ascend_config.py:238-245`` at 182b75e); elsewhere
    what an engine started with ``additional_config`` gets: ``rl_config.enabled`` forces 0
    (``:582-587``), else ``weight_nz_mode`` wins over ``VLLM_ASCEND_ENABLE_NZ``
    (``:361-372``; releases up to v0.26 read only the variable)."""
    try:
        from vllm_ascend.ascend_config import get_ascend_config

        return int(get_ascend_config().weight_nz_mode)
    except (ImportError, AttributeError, RuntimeError):
        pass
    config = additional_config or {}
    if rl_config_enabled(config):
        return 0
    return int(config.get("weight_nz_mode", os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1")))


def nz_format_refusal(additional_config: dict | None = None) -> str | None:
    """Why vllm-ascend's ``NPUWorker`` will refuse ``start_weight_update`` and ``wake_up`` (NZ
    on: ``_check_nz_disabled``, ``worker.py:247-255, 288-310``), to say at engine start."""
    mode = nz_weight_mode(additional_config)
    if not mode:
        return None
    return (
        f"vllm-ascend's FRACTAL_NZ weight format is on (weight_nz_mode={mode}), and "
        "vllm-ascend refuses every weight update and wake_up while it is. Start the server "
        f"with --additional-config '{json.dumps(RL_ADDITIONAL_CONFIG)}'."
    )


def chips_and_cann() -> tuple[int, str]:
    """The NPUs this process sees (``torch.npu.device_count``, torch_npu ``npu/__init__.py:437``)
    and the CANN version (``torch_npu.npu.utils.get_cann_version("CANN")``, ``utils.py:37-45``),
    for the doctor."""
    torch_npu = _torch_npu()
    return torch_npu.npu.device_count(), str(torch_npu.npu.utils.get_cann_version("CANN"))


def _torch_npu() -> ModuleType:
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
        raise ValueError(f"{field} is not base64") from None


class NpuDevice(Device):
    kind = "npu"
    collective_backend = "hccl"
    vmm_backend = "acl"

    @classmethod
    def current_index(cls) -> int:
        return _torch_npu().npu.current_device()

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
        self, store: Store, rank: int, world_size: int, timeout_s: float, group_id: str
    ) -> C10dBackend:
        """``ProcessGroupHCCL`` with explicit options, as vllm-ascend's netloader builds its
        group (``netloader_pg.py:122-128`` at vllm-ascend@182b75e), plus the communicator
        settings of :func:`~vllm_ascend_rl.device.group.hccl_config` (exec timeout, buffer,
        name), which the netloader does not set. Its watchdog is STOPped: with the default
        ``HCCL_ASYNC_ERROR_HANDLING=1`` it rethrows a failed collective "to take the entire
        process down" (``ProcessGroupHCCL.cpp:1024-1041``, torch_npu 2.10.0.post4), killing the
        engine when a trainer dies. STOP (``set_watchdog_status``, per group, ``:3710-3717``)
        keeps our works out of it (``workEnqueue`` returns early, ``:3517-3519``; the loop skips
        the group, ``:2216-2218``); :class:`BroadcastChannel` polls ``is_completed`` against
        ``timeout_s`` and aborts the communicator itself."""
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=timeout_s)
        options.global_ranks_in_group = []  # a group of its own, not a subgroup of the world
        options.group_id = group_id  # the rendezvous, the same on every rank, as netloader's
        options.hccl_config = hccl_config(timeout_s, group_id)
        hccl = ProcessGroupHCCL(store, rank, world_size, options)
        hccl.set_watchdog_status(_WATCHDOG_STOP)
        return hccl

    def close_group(self, pg: ProcessGroup, broken: bool) -> None:
        """A healthy group shuts down (which synchronizes its HCCL streams); a broken one
        aborts its communicators instead: ``shutdown()`` would wait on a collective hung on
        a dead peer until ``HCCL_EXEC_TIMEOUT`` (``ProcessGroupHCCL.cpp:1445-1472``)."""
        if not broken:
            pg.shutdown()
            return
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        backend: ProcessGroupHCCL = pg._get_backend(torch.device("npu"))
        backend.abort_hccl_comm("vllm_ascend_rl: weight-transfer channel broken")

    def memory_pool(self, allocator: SleepPool, tag: str) -> AbstractContextManager[None]:
        return pluggable_pool(allocator)

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
        handle = ipc_handle(args, nbytes, self.location())
        # The buffer holds the only reference: closing it frees the memory.
        return ExportedBuffer(tensor, handle, unlink=lambda: None, release=lambda: None)

    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        from torch_npu.multiprocessing.reductions import rebuild_npu_tensor

        if not isinstance(handle, dict) or handle.get("kind") != "npu_ipc":
            raise IpcHandleError(f"not an NPU IPC handle: {handle!r}")
        check_same_location(handle.get("location"), self.location())
        try:
            tensor = rebuild_npu_tensor(*rebuild_args(handle, self.index))
        except (KeyError, TypeError, ValueError) as e:
            raise IpcHandleError(f"malformed NPU IPC handle: {e}") from e
        except RuntimeError as e:
            raise IpcHandleError(f"cannot open NPU IPC handle {handle.get('id')}: {e}") from e
        return ImportedBuffer(tensor, release=lambda: None)  # closing it drops the mapping


# The arguments torch_npu's reduce_tensor hands rebuild_npu_tensor for an NPU storage, named
# and ordered as rebuild_npu_tensor's parameters (reductions.py:30-46, 130-149, 2.10.0.post4).
REBUILD_ARGS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def ipc_handle(args: tuple, nbytes: int, location: dict[str, str]) -> dict[str, Any]:
    """The JSON handle (never pickled) of an exported uint8 buffer of ``nbytes``, from its
    rebuild arguments. Its id is the storage's IPC handle *and* the storage offset: the handle
    names the caching allocator's segment, so ring slots carved from one share it."""
    a = dict(zip(REBUILD_ARGS, args, strict=True))
    return {
        "kind": "npu_ipc",
        "id": ipc_buffer_id(a["storage_handle"], int(a["storage_offset_bytes"])),
        "nbytes": nbytes,
        "location": location,
        "storage_handle": _b64(a["storage_handle"]),
        "storage_size_bytes": int(a["storage_size_bytes"]),
        "storage_offset_bytes": int(a["storage_offset_bytes"]),
        "ref_counter_handle": _b64(a["ref_counter_handle"]),
        "ref_counter_offset": int(a["ref_counter_offset"]),
        "event_handle": _b64(a["event_handle"]),
        "event_sync_required": bool(a["event_sync_required"]),
    }


def rebuild_args(handle: dict[str, Any], device_index: int) -> tuple:
    """``rebuild_npu_tensor``'s arguments for ``handle``, mapped on ``device_index`` (the
    receiver's own device, never the ambient one); KeyError, TypeError or ValueError if
    malformed."""
    nbytes = int(handle["nbytes"])
    a = {
        "tensor_cls": torch.Tensor,
        "tensor_size": (nbytes,),
        "tensor_stride": (1,),
        "tensor_offset": 0,
        # As the producer sends; only the TypedStorage wrapper absorbs a cache hit's device=
        # (torch_npu/utils/storage.py:85-90).
        "storage_cls": torch.TypedStorage,
        "dtype": torch.uint8,
        "storage_device": device_index,
        "storage_handle": _unb64(handle["storage_handle"], "storage_handle"),
        "storage_size_bytes": int(handle["storage_size_bytes"]),
        "storage_offset_bytes": int(handle["storage_offset_bytes"]),
        "requires_grad": False,
        "ref_counter_handle": _unb64(handle["ref_counter_handle"], "ref_counter_handle"),
        "ref_counter_offset": int(handle["ref_counter_offset"]),
        "event_handle": _unb64(handle.get("event_handle"), "event_handle"),
        "event_sync_required": bool(handle["event_sync_required"]),
    }
    return tuple(a[name] for name in REBUILD_ARGS)


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
def pluggable_pool(allocator: SleepPool) -> Iterator[None]:
    """Route torch_npu allocations inside the block through ``vllm_ascend_rl.libvmm``'s ACL VMM
    entry points, which record each in the allocation table with the tag
    ``allocator.use_memory_pool`` set, and run no Python. Each entry gets a fresh pool, never
    allocated from after the block, so the segments it caches unused (freed during loading,
    format conversion, quantization) are given back at the end, as vLLM's cumem allocator
    trims its pools (vllm/device_allocator/cumem.py:402-435, vLLM 0.32.0); kept, they would be
    backed up every sleep and hide from KV-cache sizing."""
    from vllm_ascend_rl import vmm

    if not _PLUGGABLE:
        _PLUGGABLE.append(
            torch.npu.memory.NPUPluggableAllocator(vmm.LIBRARY, vmm.NPU_MALLOC, vmm.NPU_FREE)
        )
    pluggable: torch.npu.memory.NPUPluggableAllocator = _PLUGGABLE[0]
    pool = torch.npu.memory.MemPool(pluggable._allocator)
    _POOLS.append(pool)
    with torch.npu.memory.use_mem_pool(pool, device=allocator.device_index):
        yield
    _trim(pool, allocator)


def _trim(pool: torch.npu.memory.MemPool, allocator: SleepPool) -> None:
    """Release the pool's segments that hold no live block (torch_npu's snapshot fields,
    torch_npu/csrc/npu/Module.cpp:1478-1533 in 2.10.0.post4)."""
    torch.npu.synchronize(allocator.device_index)
    known = allocator.allocations
    for segment in torch.npu.memory_snapshot():
        unused = not segment["allocated_size"] and segment["address"] in known
        if unused and tuple(segment["segment_pool_id"]) == tuple(pool.id):
            allocator.free(segment["address"])
