"""The one hardware seam: everything device-specific goes through a :class:`Device`, found by
its kind among the ``vllm_ascend_rl.devices`` entry points: ``npu`` (HCCL, torch_npu IPC, CANN
VMM; imported only when asked for) here, ``cpu`` from the CPU stand-in (``standin/``, what CI
runs). No product module outside this package calls torch_npu."""

from __future__ import annotations

import os
from functools import cache
from importlib.metadata import entry_points
from importlib.util import find_spec
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

DEVICES = "vllm_ascend_rl.devices"  # entry-point group: kind -> Device subclass


@cache
def device_class(kind: str) -> type[Device]:
    found = entry_points(group=DEVICES, name=kind)
    if not found:
        installed = sorted(e.name for e in entry_points(group=DEVICES))
        raise ValueError(f"no device of kind {kind!r} is installed (installed: {installed})")
    return next(iter(found)).load()


@cache
def get_device(kind: str, index: int = 0) -> Device:
    return device_class(kind)(index)


def device_kind() -> str:
    """``VLLM_ASCEND_RL_DEVICE``, else ``npu`` if torch_npu is installed, else ``cpu``."""
    if kind := os.environ.get("VLLM_ASCEND_RL_DEVICE"):
        return kind
    return "npu" if find_spec("torch_npu") is not None else "cpu"


def current_device() -> Device:
    """This thread's device, read once: the current NPU, or this process's emulated chip."""
    return device_for(device_kind())


def device_for(torch_device: torch.device | str) -> Device:
    """The :class:`Device` for a torch device: ``npu:N``, or without an index the kind's
    current one (:meth:`Device.current_index`)."""
    kind, _, index = str(torch_device).partition(":")
    return get_device(kind, int(index) if index else device_class(kind).current_index())
