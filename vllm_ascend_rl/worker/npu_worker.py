"""SleepableNPUWorker: vllm-ascend's NPU worker on our ``ascend_rl_camem`` sleep backend. Flags
(NZ off, no ``--enable-sleep-mode``, no expandable segments) and levels: docs/sleep-mode.md.
UNVERIFIED on hardware: written against vllm-ascend@182b75e's ``NPUWorker``; CI runs the CPU
twin and checks the routing on a labelled mock. vllm-ascend is imported at the class's first
lookup, so this module imports on hosts without it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from vllm_ascend_rl.readiness import Readiness
from vllm_ascend_rl.worker.ledger import served_modules

NOT_POOLED = (
    "the weights were loaded outside the sleep allocator's pool: torch_npu's allocator is "
    "running with expandable segments (vllm-ascend's frontend appends "
    "'expandable_segments:True' to PYTORCH_NPU_ALLOC_CONF unless the value names them, and "
    "with rl_config strips it again only in NPUWorker.__init__), so /sleep could not free "
    "them. Start the server with PYTORCH_NPU_ALLOC_CONF=expandable_segments:False and "
    "--additional-config '{\"weight_nz_mode\": 0}' instead of rl_config; "
    "python -m vllm_ascend_rl.doctor --additional-config '...' shows what the engine gets."
)


@functools.cache
def _build_class() -> type:
    from vllm_ascend.worker.worker import NPUWorker  # Ascend hosts only

    from vllm_ascend_rl import device as devices
    from vllm_ascend_rl.compat import weight_checker_methods
    from vllm_ascend_rl.logs import get_logger
    from vllm_ascend_rl.sleep.allocator import CaMemAllocator
    from vllm_ascend_rl.worker import (
        SleepableMixin,
        attach_sleep_backend,
        confine_kv_pool,
        release_for_sleep,
    )

    logger = get_logger(__name__)

    class SleepableNPUWorker(SleepableMixin, NPUWorker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.vllm_config.model_config.enable_sleep_mode:
                raise ValueError(
                    "SleepableNPUWorker brings its own sleep allocator: drop --enable-sleep-mode"
                )
            self.camem_backend = attach_sleep_backend(self)
            self._saved_buffers: dict[str, torch.Tensor] = {}

        @property
        def allocator(self) -> CaMemAllocator:
            # Made on first use: the worker's device is known only after init_device.
            return CaMemAllocator.get_instance(device=self.device.index)

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            before = self.allocator.get_current_usage()
            with self.allocator.use_memory_pool("weights"):
                super().load_model(*args, **kwargs)
            if self.allocator.get_current_usage() <= before:
                # torch_npu reads PYTORCH_NPU_ALLOC_CONF at its allocator's first use
                # (NPUAllocatorConfig.h) and its expandable branch runs before the pool branch
                # (NPUCachingAllocator.cpp:2707-2724, 2.10.0.post4): anything allocated before
                # vllm-ascend stripped expandable_segments:True sends the weights past our pool.
                raise RuntimeError(NOT_POOLED)

        def initialize_from_config(self, *args: Any, **kwargs: Any) -> None:
            # Only initialize_kv_cache runs in the pool, as in vllm-ascend (worker.py:972-1001):
            # the KV connector before it and the KV-zeroing bookkeeping after it survive sleep.
            # The hook is an instance attribute for this call only: the smallest hook into a
            # method we must not copy (the runner's class defines the method).
            runner = self.model_runner
            initialize_kv_cache = runner.initialize_kv_cache

            def pooled(*a: Any, **k: Any) -> Any:
                with self.allocator.use_memory_pool("kv_cache"):
                    return initialize_kv_cache(*a, **k)

            runner.initialize_kv_cache = pooled
            try:
                super().initialize_from_config(*args, **kwargs)
            finally:
                del runner.initialize_kv_cache
            confine_kv_pool(self)

        def sleep(self, level: int = 1) -> None:
            self.check_sleep_level(level)
            saved = {}
            if level >= 2:  # buffers (rotary caches, ...) are not reloaded from a checkpoint
                saved = {name: b.to("cpu", copy=True) for name, b in _buffers(self.model_runner)}
            freed = release_for_sleep(self, self.camem_backend, level)  # all or nothing
            if level >= 2:
                self._saved_buffers = saved
                self.readiness.set(Readiness.DISCARDED)
            logger.info("sleep level %d released %.1f MiB", level, freed / 2**20)

        def wake_up(self, tags: list[str] | None = None) -> None:
            # vllm-ascend's own wake_up refuses while FRACTAL_NZ is on (worker.py:247-255).
            refusal = devices.device_for(self.device).weight_update_refusal()
            if refusal:
                raise ValueError(refusal)
            self.refuse_kv_wake_before_reload(tags)
            self.camem_backend.resume(tags)
            if (tags is None or "weights" in tags) and self._saved_buffers:
                for name, buffer in _buffers(self.model_runner):
                    if name in self._saved_buffers:
                        buffer.data.copy_(self._saved_buffers[name].to(buffer.device))
                self._saved_buffers = {}
            post_wake = getattr(self.model_runner, "post_kv_cache_wake_up", None)
            if post_wake is not None and (tags is None or "kv_cache" in tags):
                post_wake()

        def discard(self, tags: tuple[str, ...]) -> None:
            self.camem_backend.discard(tags)
            if "weights" in tags:
                self.readiness.set(Readiness.DISCARDED)

    # /weight_checker (vLLM >= 0.32) calls these on every worker; NPUWorker has none of them.
    for name, method in weight_checker_methods(NPUWorker).items():
        setattr(SleepableNPUWorker, name, method)
    SleepableNPUWorker.__module__ = __name__
    return SleepableNPUWorker


def _buffers(runner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The served model's buffers and its drafter's (``draft.``), as vLLM's worker saves them
    at level 2 (``gpu_worker.py:257-267`` in 0.32.0)."""
    for path, module in served_modules(runner):
        yield from module.named_buffers(prefix=path, recurse=False)


def __getattr__(name: str) -> Any:
    if name == "SleepableNPUWorker":
        return _build_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
