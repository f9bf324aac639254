"""The CPU stand-in for Ascend NPUs, what CI runs; no product module outside
``device/`` imports it.

- ``device.py``: :class:`CpuDevice`: gloo for HCCL, POSIX shared memory for NPU IPC, host
  memory for CANN virtual memory.
- ``chip.py``: emulated chips: one per engine worker, device-wide memory shared by processes.
- ``host_pool.py``: torch_npu's pluggable-allocator pool, for the sleep allocator.
- ``worker.py``: vLLM's CPU worker on an emulated chip, and its sleepable form.
"""
