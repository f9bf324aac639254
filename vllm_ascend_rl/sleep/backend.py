"""The ``ascend_rl_camem`` sleep-mode backend: vLLM's /sleep and /wake_up on
:class:`CaMemAllocator`. Levels as in vLLM: 1 offloads the weights to host memory and releases
the KV cache; 2 releases everything, and the weights must be reloaded after waking them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

if TYPE_CHECKING:
    from vllm.device_allocator.sleep_mode_backend import SleepModeState

from vllm_ascend_rl import metrics
from vllm_ascend_rl.sleep.allocator import CaMemAllocator


class CaMemSleepBackend(SleepModeBackend):
    """Built by vLLM's factory in the worker's ``__init__``, before ``init_device``, so the
    allocator is looked up at first use, once the worker has made it for its device. After
    each sleep, wake or discard, ``on_released`` (the worker's) gets the tags not resident."""

    on_released: Callable[[list[str]], None] | None = None

    @property
    def allocator(self) -> CaMemAllocator:
        return CaMemAllocator.get_instance()

    def suspend(self, level: int = 1) -> None:
        started = time.perf_counter()
        with self._announcing():
            self.allocator.sleep(offload_tags=("weights",) if level == 1 else ())
        took = time.perf_counter() - started
        metrics.record({"sleeps": 1, "sleep_seconds": took}, level=str(level))

    def resume(self, tags: list[str] | None = None) -> None:
        started = time.perf_counter()
        with self._announcing():
            self.allocator.wake_up(tags)
        took = time.perf_counter() - started
        metrics.record({"wakes": 1, "wake_seconds": took}, tags=",".join(sorted(tags or ["all"])))

    def discard(self, tags: tuple[str, ...]) -> None:
        with self._announcing():
            self.allocator.discard(tags)

    @contextmanager
    def _announcing(self) -> Iterator[None]:
        """Run a residency change, then tell ``on_released`` what it left (also if it failed
        part way)."""
        try:
            yield
        finally:
            if self.on_released is not None:
                allocator = self.allocator
                self.on_released([t for t in allocator.tags() if not allocator.is_awake(t)])

    def state(self) -> SleepModeState:
        """``RUNNING`` while every tag is resident (also before the allocator exists)."""
        allocator = CaMemAllocator._instance
        if allocator is None or all(allocator.is_awake(t) for t in allocator.tags()):
            return "RUNNING"
        return "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # collective groups are not allocated from the sleep pools

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True  # every tensor keeps its address across sleep and wake
