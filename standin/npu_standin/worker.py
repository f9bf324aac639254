"""SleepableCPUWorker: vLLM's CPU worker with a real /sleep and /wake_up (docs/sleep-mode.md).
The weights and the KV cache (one buffer every layer views) live in the sleep allocator's host
memory, as on NPU, and keep their addresses through every sleep: level 1 backs the weights up
and releases both (the KV cache wakes zero-filled); level 2 releases the weights too, and drops
the CPU linear layers' packed copies, so they must be reloaded before the KV cache may wake."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

from vllm.v1.worker.cpu_worker import CPUWorker

from npu_standin.chip import ChipMemory, StartupMemory, claim_chip, host_chip
from vllm_ascend_rl.device import worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import RELOAD_HINT, Readiness
from vllm_ascend_rl.sleep.allocator import CaMemAllocator
from vllm_ascend_rl.worker import (
    SleepableMixin,
    attach_sleep_backend,
    confine_kv_pool,
    release_for_sleep,
)
from vllm_ascend_rl.worker.ledger import StartupAddressLedger, served_modules

logger = get_logger(__name__)


def _discarded_linear(*_args: object, **_kwargs: object) -> NoReturn:
    raise RuntimeError(f"linear layer used after its weights were discarded: {RELOAD_HINT}")


class ChipCPUWorker(StartupAddressLedger, CPUWorker):
    """vLLM's CPU worker on one emulated chip (:mod:`.chip`), sizing its start-up from
    the chip's device-wide memory as vllm-ascend's NPU worker does, so servers started together
    on one chip fail as on NPU. Test servers that name no worker class run it."""

    def init_device(self) -> None:
        super().init_device()
        index = worker_index(self.parallel_config)
        claim_chip(index)  # one emulated chip per worker
        self.chip_memory = StartupMemory.take(
            ChipMemory(host_chip(index)), self.cache_config.gpu_memory_utilization
        )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.chip_memory.chip.record(_weight_bytes(self))

    def determine_available_memory(self) -> int:
        kv_bytes = super().determine_available_memory()
        # As on NPU: the KV cache gets what the profile leaves of the request (less what
        # others took meanwhile), so the worker then holds the whole request.
        self.chip_memory.kv_budget(own_bytes=_weight_bytes(self))
        self.chip_memory.chip.record(self.chip_memory.requested)
        return kv_bytes


def _weight_bytes(worker: CPUWorker) -> int:
    model = worker.model_runner.get_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


class NPUWorkerLifecycle:
    """STAND-IN for vllm-ascend's ``NPUWorker`` weight-update lifecycle (``worker.py:297-336``
    at 182b75e), where it departs from vLLM's ``Worker``: no ``reset_weight_update_target``
    hook, no ``set_current_vllm_config``, one update_info per call; the worker's record of the
    update ends when ``update_weights`` raises and stays when ``finish_weight_update`` raises."""

    weight_transfer_engine: Any
    _weight_update_active: bool

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()  # type: ignore[attr-defined]
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call "
                "finish_weight_update first."
            )
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()  # type: ignore[attr-defined]
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()  # type: ignore[attr-defined]
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before finish_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False


class SleepableCPUWorker(SleepableMixin, NPUWorkerLifecycle, ChipCPUWorker):
    """The stand-in of ``SleepableNPUWorker``: vLLM's CPU worker on an emulated chip, with the
    sleep allocator and NPUWorker's weight-update lifecycle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.camem_backend = attach_sleep_backend(self)

    @property
    def allocator(self) -> CaMemAllocator:
        # Made on first use, for this worker's chip, as the NPU worker makes its own.
        return CaMemAllocator.get_instance(device=worker_index(self.parallel_config))

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # The weights and the KV cache come from the sleep pools, as on NPU: a level-1 sleep
        # backs the weights up allocation by allocation, level 2 releases them where they are.
        pooled = tag in ("weights", "kv_cache")
        return self.allocator.use_memory_pool(tag) if pooled else nullcontext()

    def initialize_from_config(self, *args: Any, **kwargs: Any) -> None:
        # vLLM pools the KV allocation (0.30: through kv_cache_allocation_context).
        super().initialize_from_config(*args, **kwargs)
        confine_kv_pool(self)

    # -- sleep / wake ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.check_sleep_level(level)
        released = release_for_sleep(self, self.camem_backend, level)  # all or nothing
        if level >= 2:
            self._discard_packed_linears()
        logger.info("sleep level %d: released %.1f MiB", level, released / 2**20)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.refuse_kv_wake_before_reload(tags)
        self.camem_backend.resume(tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        self.camem_backend.discard(tags)
        if "weights" in tags:
            self._discard_packed_linears()

    def _discard_packed_linears(self) -> None:
        """The weights' pool memory is gone (a wake maps zeroes at the same addresses); the
        packed copies vLLM's CPU linear layers keep outside the pool go too, rebuilt by the
        reload's post-load processing."""
        for _, module in served_modules(self.model_runner):  # the drafter's too: one pool
            if hasattr(module, "cpu_linear"):  # a plain attribute vLLM's CPU linear sets
                vars(module)["cpu_linear"] = _discarded_linear
        self.readiness.set(Readiness.DISCARDED)
        self.allocator.device.empty_cache()  # the host heap gives the packed copies back
