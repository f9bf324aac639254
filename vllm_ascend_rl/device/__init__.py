"""The one hardware seam: everything device-specific goes through a :class:`Device`:
``cpu`` (the stand-in of :mod:`.cpu`: gloo, shared memory, host virtual memory; what CI runs) or
``npu`` (HCCL, torch_npu IPC, CANN VMM; imported only when asked for). No product module
outside this package calls torch_npu or imports the CPU stand-in."""

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
        from vllm_ascend_rl.device.cpu.device import CpuDevice

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


def current_device() -> Device:
    """This thread's device, read once: the current NPU, or this process's emulated chip."""
    return device_for(device_kind())


def device_for(torch_device: torch.device | str) -> Device:
    """The :class:`Device` for a torch device: ``npu:N``; ``npu``, the current NPU; ``cpu``,
    this process's emulated chip (:func:`.cpu.chip.current_chip`)."""
    kind, _, index = str(torch_device).partition(":")
    if kind == "cpu":
        from vllm_ascend_rl.device.cpu.chip import current_chip

        return get_device(kind, current_chip())
    if kind == "npu" and not index:
        from vllm_ascend_rl.device.npu import current_index

        return get_device(kind, current_index())
    return get_device(kind, int(index or 0))
