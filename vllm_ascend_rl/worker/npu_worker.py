"""SleepableNPUWorker: vllm-ascend's NPU worker with sleep routed through our ``camem`` backend.

UNVERIFIED: written against vllm-ascend's worker interface without an Ascend host to run it;
the CPU twin (:mod:`vllm_ascend_rl.worker.cpu_worker`) is what CI exercises.

Flags on an Ascend host::

    --worker-cls vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker
    # do NOT pass --enable-sleep-mode: vllm-ascend would then tag memory into its own allocator
    PYTORCH_NPU_ALLOC_CONF=expandable_segments:False  # the ACL back end refuses them

The weights are loaded and the KV cache allocated inside our allocator's pools (tags
``weights`` and ``kv_cache``), so ``/sleep?level=1`` backs the weights up to host memory that is
allocated once and reused, and releases all device memory at the same virtual addresses;
``/sleep?level=2`` discards the weights too (reload them after waking ``weights``).

vllm-ascend is imported only when the class is first looked up (``--worker-cls`` resolution in
the worker process), so this module is importable on hosts without it.
"""

from __future__ import annotations

from typing import Any

_cls: type | None = None


def _build_class() -> type:
    import torch
    from vllm_ascend.worker.worker import NPUWorker  # Ascend hosts only

    from vllm_ascend_rl.logs import get_logger
    from vllm_ascend_rl.sleep.allocator import CaMemAllocator
    from vllm_ascend_rl.sleep.backend import CaMemSleepBackend
    from vllm_ascend_rl.worker import release_for_sleep

    logger = get_logger(__name__)

    class SleepableNPUWorker(NPUWorker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            model_config = self.vllm_config.model_config
            if model_config.enable_sleep_mode:
                raise ValueError(
                    "SleepableNPUWorker brings its own sleep allocator: drop --enable-sleep-mode"
                )
            self.allocator = CaMemAllocator.get_instance("acl")
            # Our backend directly: no reliance on how vllm-ascend builds its own.
            self.camem_backend = CaMemSleepBackend(self.allocator)
            self._saved_buffers: dict[str, torch.Tensor] = {}

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            with self.allocator.use_memory_pool("weights"):
                super().load_model(*args, **kwargs)

        def initialize_from_config(self, *args: Any, **kwargs: Any) -> None:
            with self.allocator.use_memory_pool("kv_cache"):
                super().initialize_from_config(*args, **kwargs)

        def sleep(self, level: int = 1) -> None:
            if level >= 2:  # buffers (rotary caches, ...) are not reloaded from a checkpoint
                model = self.model_runner.get_model()
                self._saved_buffers = {n: b.cpu().clone() for n, b in model.named_buffers()}
            freed = release_for_sleep(self, self.camem_backend, level)
            logger.info("sleep level %d released %.1f MiB", level, freed / 2**20)

        def wake_up(self, tags: list[str] | None = None) -> None:
            self.camem_backend.resume(tags)
            if (tags is None or "weights" in tags) and self._saved_buffers:
                model = self.model_runner.get_model()
                for name, buffer in model.named_buffers():
                    if name in self._saved_buffers:
                        buffer.data.copy_(self._saved_buffers[name].to(buffer.device))
                self._saved_buffers = {}
            if (tags is None or "kv_cache" in tags) and hasattr(
                self.model_runner, "post_kv_cache_wake_up"
            ):
                self.model_runner.post_kv_cache_wake_up()

        def discard(self, tags: tuple[str, ...]) -> None:
            self.camem_backend.discard(tags)

    SleepableNPUWorker.__module__ = __name__
    return SleepableNPUWorker


def __getattr__(name: str) -> Any:
    global _cls
    if name == "SleepableNPUWorker":
        if _cls is None:
            _cls = _build_class()
        return _cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
