"""The CPU stand-in for an NPU: gloo collectives, POSIX shared memory for IPC. Used by CI."""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import sys
import threading
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from torch.distributed import Store
from torch.distributed.distributed_c10d import ProcessGroupGloo

from npu_standin.chip import check_own_chip, current_chip, host_chip
from npu_standin.host_pool import HostAllocationMode
from npu_standin.native import host_copy
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

SHM_PREFIX = "vllm_ascend_rl_"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}[0-9a-f]{{16}}$")


PARALLEL_COPY_BYTES = 8 << 20  # smaller copies stay on the calling thread
COPY_THREADS = min(4, os.cpu_count() or 1)


class CpuDevice(Device):
    kind = "cpu"
    collective_backend = "gloo"
    vmm_backend = "host"

    @classmethod
    def current_index(cls) -> int:
        return current_chip()  # this process's emulated chip

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._carver = SegmentCarver()
        self._queued = QueuedCollectives()

    def collective_issued(self, work: Any, exec_timeout_s: float) -> None:
        self._queued.add(work, exec_timeout_s)

    def synchronize(self) -> None:
        check_own_chip(self.index)
        self._queued.drain()

    def location(self) -> dict[str, str]:
        return {**host_identity(), "chip": f"{self.kind}{host_chip(self.index)}"}

    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # host memory already: nothing to pin

    def group_backend(
        self, store: Store, rank: int, world_size: int, timeout_s: float, group_id: str
    ) -> ProcessGroupGloo:
        return ProcessGroupGloo(store, rank, world_size, timeout=timedelta(seconds=timeout_s))

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Not torch's copy_: its OpenMP pool stalls for milliseconds per call while a colocated
        # vLLM CPU worker holds the cores. Small copies: numpy's memcpy on this thread; large
        # ones: native.host_copy on plain threads, as one thread does not reach memory bandwidth.
        n = dst.numel()
        if n >= PARALLEL_COPY_BYTES and dst.is_contiguous() and src.is_contiguous():
            if src.numel() != n:
                raise ValueError(f"copy_bytes: {src.numel()} bytes into {n}")
            host_copy(dst.data_ptr(), src.data_ptr(), n, COPY_THREADS)
        else:
            dst.numpy()[:] = src.numpy()

    def memory_in_use(self) -> int:
        check_own_chip(self.index)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def empty_cache(self) -> None:
        self.synchronize()  # torch_npu's emptyCache synchronizes the device first
        # glibc keeps freed chunks below its (dynamic, up to 32 MiB) mmap threshold in its
        # arenas; malloc_trim hands them back to the kernel. (torch's Linux wheels need glibc.)
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    # -- raw host memory (the host VMM back end) --------------------------------------------
    def memory_pool(self, allocator: SleepPool, tag: str) -> AbstractContextManager[None]:
        return HostAllocationMode(allocator, tag)

    def read_device(self, addr: int, out: torch.Tensor) -> None:
        check_own_chip(self.index)
        ctypes.memmove(out.data_ptr(), addr, out.nbytes)

    def write_device(self, addr: int, src: torch.Tensor) -> None:
        check_own_chip(self.index)
        ctypes.memmove(addr, src.data_ptr(), src.nbytes)

    # -- IPC over POSIX shared memory ------------------------------------------------------
    def create_ipc_buffer(self, nbytes: int) -> ExportedBuffer:
        """A block of a shared segment; the handle carries its offset (:class:`SegmentCarver`)."""
        return self._carver.carve(nbytes, self.location())

    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        if not isinstance(handle, dict) or handle.get("kind") != "shm":
            raise IpcHandleError(f"not a shared-memory handle: {handle!r}")
        name = handle.get("name")
        if not isinstance(name, str) or not _SHM_NAME.match(name):
            # Only our own segments: another name could map any process's segment.
            raise IpcHandleError(f"malformed shared-memory handle: name {name!r}")
        nbytes = _byte_count(handle, "nbytes", None)
        offset = _byte_count(handle, "offset", 0)
        check_same_location(handle.get("location"), self.location())
        try:
            shm = _attach(name)
        except FileNotFoundError:
            raise IpcHandleError(
                f"shared-memory segment {name!r} does not exist (the trainer exited, or it "
                "was unlinked before this engine mapped it)"
            ) from None
        if shm.size < offset + nbytes:
            _close(shm)
            raise IpcHandleError(
                f"segment {name!r} holds {shm.size} bytes, handle says {nbytes} at offset {offset}"
            )
        return ImportedBuffer(_bytes_of(shm, offset, nbytes), lambda: _close(shm))


class QueuedCollectives:
    """Stand-in for collectives queued on an NPU's HCCL stream: unlike a gloo one, an HCCL
    collective stays queued until it completes or its exec timeout passes, and device-wide waits
    wait for it (``torch.npu.synchronize``; ``emptyCache`` via ``npuSynchronizeDevice``,
    NPUCachingAllocator.cpp:1651-1660 in 2.10.0.post4). So an unsuccessful collective holds
    :meth:`drain` until its exec deadline. (The NPU's exit sync waits too; this does not.)"""

    def __init__(self) -> None:
        self._works: list[tuple[Any, float]] = []  # (work, exec deadline)
        self._lock = threading.Lock()

    def add(self, work: Any, exec_timeout_s: float) -> None:
        with self._lock:
            self._prune()
            self._works.append((work, time.monotonic() + exec_timeout_s))

    def drain(self) -> None:
        """Return once no collective is queued: each has succeeded or reached its deadline."""
        while True:
            with self._lock:
                if not self._prune():
                    return
            time.sleep(0.01)

    def _prune(self) -> int:
        """Forget the collectives that left the queue; how many remain (lock held)."""
        now = time.monotonic()
        self._works = [
            (work, deadline)
            for work, deadline in self._works
            if now < deadline and not (work.is_completed() and work.exception() is None)
        ]
        return len(self._works)


# torch_npu's caching allocator (2.10.0.post4): a request grows by a 32-byte pad on A2/A3
# (AddPadSize, NPUCachingAllocator.cpp:193-208) and rounds up to 512 bytes (round_size,
# :2120-2133; kMinBlockSize :95); up to 1 MiB comes from 2 MiB segments, up to
# 10 MiB from 20 MiB segments, larger sizes get a segment of their own rounded up to 2 MiB
# (get_allocation_size, :2536-2545; kSmallBuffer/kLargeBuffer, NPUAllocatorConfig.h:45-46).
MIN_BLOCK, PAD = 512, 32
SMALL_SIZE, SMALL_SEGMENT = 1 << 20, 2 << 20
MIN_LARGE_ALLOC, LARGE_SEGMENT = 10 << 20, 20 << 20
ROUND_LARGE = 2 << 20


class _Segment:
    def __init__(self, size: int) -> None:
        self.name = f"{SHM_PREFIX}{secrets.token_hex(8)}"
        self.shm = shared_memory.SharedMemory(name=self.name, create=True, size=size)
        self.size, self.used = size, 0
        self.blocks: set[int] = set()  # the offsets of its blocks not yet released
        self.linked = True

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            self.shm.unlink()  # also unregisters it from this process's resource tracker


class SegmentCarver:
    """Stand-in for torch_npu's caching allocator under NPU IPC: blocks are carved from shared
    segments of the allocator's sizes, and a handle names the segment with the block's offset
    beside it, as ``shareIpcHandle`` exports a block's *base allocation*
    (NPUCachingAllocator.cpp:1557-1586 in 2.10.0.post4); an importer keying mappings by segment
    alone reads the wrong slot, as on an NPU. A segment is carved from until unlinked (no new
    importer could reach it), and closed and unlinked when its last block is released."""

    def __init__(self) -> None:
        self._open: dict[int, _Segment] = {}  # segment size -> the segment carved from now
        self._lock = threading.Lock()

    def carve(self, nbytes: int, location: dict[str, str]) -> ExportedBuffer:
        block = -(-(nbytes + PAD) // MIN_BLOCK) * MIN_BLOCK
        if block <= SMALL_SIZE:
            size = SMALL_SEGMENT
        elif block < MIN_LARGE_ALLOC:
            size = LARGE_SEGMENT
        else:
            size = -(-block // ROUND_LARGE) * ROUND_LARGE
        with self._lock:
            seg = self._open.get(size)
            if seg is None or not seg.linked or seg.used + block > seg.size:
                seg = self._open[size] = _Segment(size)
            offset = seg.used
            seg.used += block
            seg.blocks.add(offset)

        def release() -> None:  # idempotent: closing and unlinking again do nothing
            with self._lock:
                seg.blocks.discard(offset)
                if seg.blocks:
                    return
                if self._open.get(size) is seg:
                    del self._open[size]
            _close(seg.shm)
            seg.unlink()

        handle = {
            "kind": "shm",
            "id": ipc_buffer_id(seg.name.encode(), offset),
            "name": seg.name,
            "offset": offset,
            "nbytes": nbytes,
            "location": location,
        }
        return ExportedBuffer(_bytes_of(seg.shm, offset, nbytes), handle, seg.unlink, release)


def _byte_count(handle: dict[str, Any], key: str, default: int | None) -> int:
    value = handle.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IpcHandleError(f"malformed shared-memory handle: {key} {value!r}")
    return value


def _bytes_of(shm: shared_memory.SharedMemory, offset: int, nbytes: int) -> torch.Tensor:
    if not nbytes:  # frombuffer refuses an empty view
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without letting this process's resource tracker unlink it at
    exit (Python < 3.13 registers attached segments too)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _close(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view of the mapping is still alive; the OS unmaps at exit
        pass
