"""What the sleepable workers share on the ``ascend_rl_camem`` sleep backend: vllm-ascend's NPU
worker (:mod:`.npu_worker`) and the CPU stand-in's (``standin/npu_standin/worker.py``)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, cast

from vllm_ascend_rl.device import worker_index
from vllm_ascend_rl.readiness import (
    RELOAD_HINT,
    ModelReadiness,
    Readiness,
    gate_address,
    worker_readiness,
)
from vllm_ascend_rl.weight_transfer.connection import NotOwner
from vllm_ascend_rl.worker.ledger import StartupAddressLedger, drafter_model, kv_cache_tensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_ascend_rl.sleep.allocator import CaMemAllocator
    from vllm_ascend_rl.sleep.backend import CaMemSleepBackend


def attach_sleep_backend(worker: Any) -> CaMemSleepBackend:
    """Both workers' sleep backend, ``ascend_rl_camem``, built by vLLM's own factory (the same
    call in vLLM 0.30 and 0.32)."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from vllm_ascend_rl import metrics, register
    from vllm_ascend_rl._registration import CAMEM_BACKEND

    register()  # a no-op where vLLM's plugin loading already ran it
    worker.step_gate = gate_address(worker.vllm_config)  # now, while the engine core is built
    metrics.engine_worker(worker.vllm_config, worker_index(worker.vllm_config.parallel_config))
    model_config = worker.vllm_config.model_config
    model_config.sleep_mode_backend = CAMEM_BACKEND
    backend = cast("CaMemSleepBackend", SleepModeBackendFactory.create_backend(model_config))
    backend.on_released = lambda tags: worker.readiness.set_released(tags)  # to the step gate
    return backend


def release_for_sleep(worker: Any, backend: CaMemSleepBackend, level: int) -> int:
    """After a worker's level-specific preparation: release the weight-transfer receive pool,
    suspend the backend, empty the allocators' caches; return the sleep-pool bytes released."""
    allocator = backend.allocator
    before = allocator.get_current_usage()
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is not None and hasattr(engine, "release_buffers"):
        engine.release_buffers()
    backend.suspend(level)
    gc.collect()
    allocator.device.empty_cache()
    return before - allocator.get_current_usage()


def confine_kv_pool(worker: Any) -> int:
    """After KV-cache initialization: the model runner's KV cache must lie in the ``kv_cache``
    pool (a sleep would free none of it otherwise: RuntimeError naming the runner); whatever
    else the pool holds (attention bookkeeping, DSA buffers) is kept across sleep."""
    runner = worker.model_runner
    tensors = list(kv_cache_tensors(runner))
    outside = worker.allocator.outside("kv_cache", tensors)
    if outside or not tensors:
        raise RuntimeError(
            f"the KV cache of {type(runner).__module__}.{type(runner).__name__} is not in the "
            f"sleep allocator's kv_cache pool ({len(outside)} of {len(tensors)} tensors in "
            "kv_caches outside it), so /sleep would free none of it. The sleepable workers "
            "pool what initialize_kv_cache allocates and find the KV cache in kv_caches; with "
            "vllm-ascend, run its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    return worker.allocator.keep_only("kv_cache", tensors)


class SleepableMixin(StartupAddressLedger):
    """Shared by both sleepable workers. After a level-2 sleep the model's readiness is
    DISCARDED, and waking the KV cache (which lets requests run) is refused until new weights
    are loaded. ``memory_in_use`` (via ``/collective_rpc``) reports the device memory the
    worker's process holds."""

    vllm_config: VllmConfig  # the worker class it is mixed into sets it
    step_gate: str  # its engine core's gate_address, set by attach_sleep_backend

    if TYPE_CHECKING:

        @property
        def allocator(self) -> CaMemAllocator: ...  # each worker's, for its device

    @property
    def readiness(self) -> ModelReadiness:
        """The model's readiness; its changes reach the step gate, with or without a
        weight-transfer engine."""
        readiness = worker_readiness(self)
        readiness.announce_to(self.step_gate, worker_index(self.vllm_config.parallel_config))
        return readiness

    @staticmethod
    def check_sleep_level(level: int) -> None:
        """Only levels 1 and 2 reach workers (0 stays in the engine core; 0.30.0 passes any)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not supported: use 1 or 2")

    def refuse_kv_wake_before_reload(self, tags: list[str] | None) -> None:
        discarded = self.readiness.state is Readiness.DISCARDED
        if discarded and (tags is None or "kv_cache" in tags):
            raise RuntimeError(f"refusing to wake the KV cache: {RELOAD_HINT}")

    def update_weights(self, *args: Any, **kwargs: Any) -> None:
        """The base worker's (vLLM's and vllm-ascend's end their record of the update whenever
        it raises); after another trainer's call, refused while the owner's update stays open
        in the engine (cause ``not_owner``), the record stays too: the owner's next call goes
        on."""
        try:
            super().update_weights(*args, **kwargs)  # type: ignore[misc]  # the worker's
        except Exception as e:
            if getattr(e, "cause", None) == NotOwner.cause:
                self._weight_update_active = True
            raise

    def start_draft_weight_update(self) -> None:
        """``/start_draft_weight_update``, which vllm-ascend's ``NPUWorker`` lacks (182b75e):
        the next update loads into the speculative-decoding drafter, as with vLLM's ``Worker``
        (``_set_draft_weight_update_target``); the engine returns to the served model at its
        end. RuntimeError if there is no drafter with weights."""
        engine = getattr(self, "weight_transfer_engine", None)
        drafter = drafter_model(getattr(self, "model_runner", None))
        config = getattr(self.vllm_config.speculative_config, "draft_model_config", None)
        if engine is None or drafter is None or config is None:
            raise RuntimeError(
                "start_draft_weight_update: no drafter to update (no weight transfer engine, no "
                "speculative decoding, or a method without a model of its own such as ngram)"
            )
        engine.set_weight_update_target(drafter, config)
        try:
            self.start_weight_update()  # type: ignore[attr-defined]  # the worker's
        except BaseException:
            engine.reset_weight_update_target()
            raise

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        """From a checkpoint directory (``weights_path=``, the HTTP form): checked first and
        undone on failure (:mod:`.disk_reload`); any other form is vLLM's."""
        if set(kwargs) == {"weights_path"} and not args:
            from vllm_ascend_rl.worker.disk_reload import reload_from_disk

            keep_old = self.readiness.state is not Readiness.DISCARDED
            reload_from_disk(self, kwargs["weights_path"], keep_old=keep_old)
        else:
            super().reload_weights(*args, **kwargs)  # type: ignore[misc]  # the worker's
        self.readiness.set(Readiness.WHOLE)

    def memory_in_use(self) -> dict[str, int]:
        return {
            "bytes": self.allocator.device.memory_in_use(),
            "sleep_pool_bytes": self.allocator.get_current_usage(),
        }
