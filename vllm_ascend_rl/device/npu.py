"""Ascend NPU: HCCL collectives through torch_npu. The only Python module that touches torch_npu.

Imported lazily by :func:`vllm_ascend_rl.device.get_device` on NPU hosts only. This code has
not run on Ascend hardware yet (no NPU was available to us); CI covers the same engine code
through :mod:`vllm_ascend_rl.device.cpu`.
"""

from __future__ import annotations

import torch

from vllm_ascend_rl.device import Device


def _torch_npu():
    try:
        import torch_npu
    except ImportError as e:
        raise RuntimeError("device 'npu' needs torch_npu from your Ascend software stack") from e
    return torch_npu


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
