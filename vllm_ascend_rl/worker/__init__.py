"""Sleepable workers: vLLM's CPU worker and vllm-ascend's NPU worker on the ``camem`` backend."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ascend_rl.sleep.backend import CaMemSleepBackend


def release_for_sleep(worker: Any, backend: CaMemSleepBackend, level: int) -> int:
    """What both sleepable workers do once their level-specific preparation is done: give
    back the weight-transfer receive pool, suspend the backend, return what the allocators
    cache. Returns the bytes of sleep-allocator memory released."""
    allocator = backend.allocator
    before = allocator.get_current_usage()
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is not None and hasattr(engine, "release_buffers"):
        engine.release_buffers()
    backend.suspend(level)
    gc.collect()
    allocator.device.empty_cache()
    return before - allocator.get_current_usage()
