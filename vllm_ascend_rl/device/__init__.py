"""The one hardware seam: everything device-specific goes through a :class:`Device`.

``cpu`` (gloo, shared memory, host virtual memory) is what CI exercises; ``npu`` (HCCL,
torch_npu IPC, CANN VMM) lives in :mod:`vllm_ascend_rl.device.npu`, which imports torch_npu
lazily and only when an NPU device is asked for. Nothing outside this package calls torch_npu.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.distributed import ProcessGroup


class IpcHandleError(ValueError):
    """An IPC handle is malformed, points nowhere, or belongs to another chip or host."""


class ExportedBuffer:
    """A staging buffer the trainer owns and shares; ``handle`` is plain JSON."""

    def __init__(
        self,
        tensor: torch.Tensor,
        handle: dict[str, Any],
        unlink: Callable[[], None],
        release: Callable[[], None],
    ) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.handle = handle
        self.unlink = unlink  # unreachable for new importers; existing mappings stay valid
        self._release = release

    def close(self) -> None:
        self.tensor = None  # drop our view first: a live view pins the mapping
        self._release()


class ImportedBuffer:
    """A trainer's staging buffer mapped into this process."""

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor: torch.Tensor | None = tensor
        self._release = release

    def close(self) -> None:
        self.tensor = None
        self._release()


def host_identity() -> dict[str, str]:
    """This host, as two processes on it must agree: hostname and kernel boot id."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"host": socket.gethostname(), "boot_id": boot}


def check_same_location(theirs: Any, ours: dict[str, str]) -> None:
    if not isinstance(theirs, dict):
        raise IpcHandleError(f"IPC handle has no valid location: {theirs!r}")
    if theirs != ours:
        raise IpcHandleError(
            f"trainer and engine are not on the same chip: trainer on {_where(theirs)}, "
            f"engine on {_where(ours)}. NPU IPC needs them colocated; use the hccl backend "
            "across chips or hosts."
        )


def _where(loc: dict) -> str:
    return f"chip {loc.get('chip', '?')} of host {loc.get('host', '?')}"


class Device(ABC):
    """What the engines need from an accelerator (or from the host standing in for one)."""

    kind: str  # "cpu" or "npu"
    collective_backend: str  # torch.distributed backend name for weight broadcasts

    @abstractmethod
    def torch_device(self, index: int | None = None) -> torch.device: ...

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device queues work)
        """Wait for queued device work (no-op on CPU)."""

    def empty_cache(self) -> None:  # noqa: B027 (nothing to do unless the device caches)
        """Return memory that the process's allocators cache but no longer use."""

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the flat uint8 tensor ``src`` into ``dst`` (same size), asynchronously where the
        device queues work; :meth:`synchronize` waits for it."""
        dst.copy_(src, non_blocking=True)

    @abstractmethod
    def read_device(self, addr: int, out: torch.Tensor) -> None:
        """Copy ``out.numel()`` bytes at device address ``addr`` into the host tensor ``out``."""

    @abstractmethod
    def write_device(self, addr: int, src: torch.Tensor) -> None:
        """Copy the host tensor ``src`` to device address ``addr``."""

    def location(self) -> dict[str, str]:
        """Where this process's device is: host identity plus the physical chip."""
        return {**host_identity(), "chip": self.kind}

    @abstractmethod
    def create_ipc_buffer(self, nbytes: int) -> ExportedBuffer:
        """A uint8 staging buffer another process on the same chip can map."""

    @abstractmethod
    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        """Map a buffer exported by :meth:`create_ipc_buffer`; IpcHandleError if impossible."""

    def new_process_group(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> ProcessGroup:
        """A process group of its own (outside torch.distributed's default group), formed
        over a TCP store hosted by rank 0, whose collectives fail after ``timeout_s``."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        return stateless_init_torch_distributed_process_group(
            host,
            port,
            rank,
            world_size,
            self.collective_backend,
            timeout=timedelta(seconds=timeout_s),
        )


@cache
def get_device(kind: str) -> Device:
    if kind == "cpu":
        from vllm_ascend_rl.device.cpu import CpuDevice

        return CpuDevice()
    if kind == "npu":
        from vllm_ascend_rl.device.npu import NpuDevice

        return NpuDevice()
    raise ValueError(f"unsupported device kind {kind!r}; expected 'cpu' or 'npu'")


def current_device() -> Device:
    """The device of this process: ``VLLM_ASCEND_RL_DEVICE`` if set, else NPU when torch_npu
    is installed, else CPU."""
    kind = os.environ.get("VLLM_ASCEND_RL_DEVICE")
    if not kind:
        import importlib.util

        kind = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    return get_device(kind)


def device_for(torch_device: torch.device | str) -> Device:
    """The :class:`Device` for a torch device handed to us by vLLM (``cpu`` or ``npu:N``)."""
    return get_device(str(torch_device).split(":")[0])


__all__ = [
    "Device",
    "ExportedBuffer",
    "ImportedBuffer",
    "IpcHandleError",
    "current_device",
    "device_for",
    "get_device",
]
