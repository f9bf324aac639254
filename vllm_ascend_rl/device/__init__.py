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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


class Device(ABC):
    """What the engines need from an accelerator (or from the host standing in for one)."""

    kind: str  # "cpu" or "npu"
    collective_backend: str  # torch.distributed backend name for weight broadcasts

    @abstractmethod
    def torch_device(self, index: int | None = None) -> torch.device: ...

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device queues work)
        """Wait for queued device work (no-op on CPU)."""

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the flat uint8 tensor ``src`` into ``dst`` (same size), asynchronously where the
        device queues work; :meth:`synchronize` waits for it."""
        dst.copy_(src, non_blocking=True)

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


__all__ = ["Device", "current_device", "device_for", "get_device"]
