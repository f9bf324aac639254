"""The CPU stand-in for an NPU: gloo collectives, POSIX shared memory for IPC. Used by CI."""

from __future__ import annotations

import ctypes
import os
import re
import secrets
from functools import cache
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from vllm_ascend_rl.device import (
    Device,
    ExportedBuffer,
    GroupBackend,
    ImportedBuffer,
    IpcHandleError,
    check_same_location,
)

SHM_PREFIX = "vllm_ascend_rl_"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}[0-9a-f]{{16}}$")


PARALLEL_COPY_BYTES = 8 << 20  # smaller copies stay on the calling thread
COPY_THREADS = min(4, os.cpu_count() or 1)


@cache
def _host_kernels():
    from vllm_ascend_rl import _host

    return _host


class CpuDevice(Device):
    kind = "cpu"
    collective_backend = "gloo"
    collective_may_stay_pending = True  # gloo runs it on a host thread of its own

    def torch_device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def group_backend(
        self, store, rank: int, world_size: int, timeout_s: float, group_id: str
    ) -> GroupBackend:
        from datetime import timedelta

        from torch.distributed import ProcessGroup
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        gloo = ProcessGroupGloo(store, rank, world_size, timeout=timedelta(seconds=timeout_s))
        kind = ProcessGroup.BackendType.GLOO
        return GroupBackend(gloo, kind, kind, torch.device("cpu"))

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Not torch's copy_: it uses the OpenMP pool, which stalls for milliseconds per call
        # when a co-located vLLM CPU worker holds the cores (measured: 1.6 ms vs 11 us per
        # 32 KB tensor on 2 cores). Small copies: numpy's memcpy on the calling thread. Large
        # ones: our memcpy on plain threads, since one thread does not reach the memory
        # bandwidth (1 GB: 0.085 s on one thread, 0.047 s on two, on the CI host).
        n = dst.numel()
        if n >= PARALLEL_COPY_BYTES and dst.is_contiguous() and src.is_contiguous():
            if src.numel() != n:
                raise ValueError(f"copy_bytes: {src.numel()} bytes into {n}")
            _host_kernels().copy(dst.data_ptr(), src.data_ptr(), n, COPY_THREADS)
        else:
            dst.numpy()[:] = src.numpy()

    def memory_in_use(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def empty_cache(self) -> None:
        # glibc keeps freed chunks below its (dynamic, up to 32 MiB) mmap threshold in its
        # arenas; malloc_trim hands them back to the kernel.
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass

    # -- raw host memory (the host VMM back end) --------------------------------------------
    def read_device(self, addr: int, out: torch.Tensor) -> None:
        ctypes.memmove(out.data_ptr(), addr, out.numel() * out.element_size())

    def write_device(self, addr: int, src: torch.Tensor) -> None:
        ctypes.memmove(addr, src.data_ptr(), src.numel() * src.element_size())

    # -- IPC over POSIX shared memory ------------------------------------------------------
    def create_ipc_buffer(self, nbytes: int) -> ExportedBuffer:
        """A segment under a random name, mode 0600 (Python's default for new segments)."""
        name = f"{SHM_PREFIX}{secrets.token_hex(8)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
        linked = [True]

        def unlink() -> None:
            if linked[0]:
                linked[0] = False
                shm.unlink()  # also unregisters it from this process's resource tracker

        def release() -> None:
            _close(shm)
            unlink()

        tensor = (
            torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        handle = {
            "kind": "shm",
            "id": name,
            "name": name,
            "nbytes": nbytes,
            "location": self.location(),
        }
        return ExportedBuffer(tensor, handle, unlink, release)

    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        name, nbytes = _checked_shm_handle(handle)
        check_same_location(handle.get("location"), self.location())
        try:
            shm = _attach(name)
        except FileNotFoundError:
            raise IpcHandleError(
                f"shared-memory segment {name!r} does not exist (the trainer exited, or it "
                "was unlinked before this engine mapped it)"
            ) from None
        if shm.size < nbytes:
            _close(shm)
            raise IpcHandleError(f"segment {name!r} holds {shm.size} bytes, handle says {nbytes}")
        tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
        return ImportedBuffer(tensor, lambda: _close(shm))


def _checked_shm_handle(handle: Any) -> tuple[str, int]:
    if not isinstance(handle, dict) or handle.get("kind") != "shm":
        raise IpcHandleError(f"not a shared-memory handle: {handle!r}")
    name, nbytes = handle.get("name"), handle.get("nbytes")
    if not isinstance(name, str) or not _SHM_NAME.match(name):
        # Only our own segments may be opened: a handle naming another process's segment
        # would otherwise map it.
        raise IpcHandleError(f"malformed shared-memory handle: name {name!r}")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise IpcHandleError(f"malformed shared-memory handle: nbytes {nbytes!r}")
    return name, nbytes


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without letting this process's resource tracker unlink it at
    exit (Python < 3.13 registers attached segments too)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")
        return shm


def _close(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view of the mapping is still alive; the OS unmaps at exit
        pass
