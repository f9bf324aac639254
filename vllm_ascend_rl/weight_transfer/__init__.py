"""Weight-transfer engines on vLLM's weight-transfer API: HCCL (broadcast) and NPU-IPC.

Submodules are imported lazily by vLLM's factories; importing this package loads nothing heavy.
"""
