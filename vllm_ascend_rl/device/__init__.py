"""The one hardware seam: everything device-specific goes through a :class:`Device`:
``cpu`` (gloo, shared memory, host virtual memory; what CI runs) or ``npu`` (HCCL, torch_npu
IPC, CANN VMM; imported only when asked for). Nothing outside this package calls torch_npu."""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING

from vllm_ascend_rl.device.base import (  # noqa: F401 (re-exported)
    Device,
    ExportedBuffer,
    ImportedBuffer,
    IpcHandleError,
    worker_index,
)

if TYPE_CHECKING:
    import torch


@cache
def get_device(kind: str, index: int = 0) -> Device:
    if kind == "cpu":
        from vllm_ascend_rl.device.cpu import CpuDevice

        return CpuDevice(index)
    if kind == "npu":
        from vllm_ascend_rl.device.npu import NpuDevice

        return NpuDevice(index)
    raise ValueError(f"unsupported device kind {kind!r}; expected 'cpu' or 'npu'")


def device_kind() -> str:
    """``VLLM_ASCEND_RL_DEVICE``, else ``npu`` if torch_npu is installed, else ``cpu``."""
    kind = os.environ.get("VLLM_ASCEND_RL_DEVICE")
    if not kind:
        import importlib.util

        kind = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    return kind


def current_device(cpu_chip: int = 0) -> Device:
    """This thread's device, read once: the current NPU, or the emulated chip ``cpu_chip``."""
    kind = device_kind()
    if kind == "npu":
        from vllm_ascend_rl.device.npu import current_index

        return get_device(kind, current_index())
    return get_device(kind, cpu_chip)


def device_for(torch_device: torch.device | str, cpu_chip: int = 0) -> Device:
    """The :class:`Device` for a torch device (``cpu`` or ``npu:N``); CPU is chip ``cpu_chip``."""
    kind, _, index = str(torch_device).partition(":")
    if kind == "cpu":
        return get_device(kind, cpu_chip)
    if not index:
        return current_device()
    return get_device(kind, int(index))
