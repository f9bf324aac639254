"""SleepableCPUWorker: vLLM's CPU worker with a real /sleep and /wake_up (docs/sleep-mode.md).
The weights and the KV cache (one buffer every layer views) live in the sleep allocator's host
memory, as on NPU: level 1 backs the weights up and releases both, waking them at the same
addresses (the KV cache zero-filled); level 2 also discards the weights (parameters and CPU
linear layers' packed copies), which must be reloaded before the KV cache may wake."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, NoReturn

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ascend_rl.device import worker_index
from vllm_ascend_rl.device.cpu.chip import ChipMemory, StartupMemory, claim_chip, host_chip
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import RELOAD_HINT, Readiness
from vllm_ascend_rl.sleep.allocator import CaMemAllocator
from vllm_ascend_rl.worker import (
    SleepableMixin,
    attach_sleep_backend,
    confine_kv_pool,
    release_for_sleep,
)

logger = get_logger(__name__)


def _discarded_linear(*_args: object, **_kwargs: object) -> NoReturn:
    raise RuntimeError(f"linear layer used after its weights were discarded: {RELOAD_HINT}")


class ChipCPUWorker(CPUWorker):
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


class SleepableCPUWorker(SleepableMixin, ChipCPUWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.camem_backend = attach_sleep_backend(self)
        # param -> (size, stride, bytes) to restore
        self._discarded: dict[torch.nn.Parameter, tuple[torch.Size, tuple[int, ...], int]] = {}

    @property
    def allocator(self) -> CaMemAllocator:
        # Made on first use, for this worker's chip, as the NPU worker makes its own.
        return CaMemAllocator.get_instance("host", device=worker_index(self.parallel_config))

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # The weights and the KV cache come from the sleep pools, as on NPU: a level-1 sleep
        # backs the weights up allocation by allocation. (vLLM's packed linear copies are
        # made outside the pool: level 2 drops them with the parameters' storage.)
        pooled = tag in ("weights", "kv_cache")
        return self.allocator.use_memory_pool(tag) if pooled else nullcontext()

    def initialize_from_config(self, *args: Any, **kwargs: Any) -> None:
        # vLLM 0.27.1 pools all of initialize_kv_cache, 0.32 only the KV allocation.
        super().initialize_from_config(*args, **kwargs)
        confine_kv_pool(self)

    # -- sleep / wake ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.check_sleep_level(level)
        released = release_for_sleep(self, self.camem_backend, level)  # all or nothing
        if level >= 2:
            self._discard_weights()
        logger.info(
            "sleep level %d: released %.1f MiB of the sleep pools%s",
            level,
            released / 2**20,
            f" and {sum(n for *_, n in self._discarded.values()) / 2**20:.1f} MiB of parameters"
            if level >= 2
            else "",
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if "weights" in wanted and self._discarded:
            self._restore_weight_storage()
        self.refuse_kv_wake_before_reload(tags)
        self.camem_backend.resume(tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags:
            self._discard_weights()
        self.camem_backend.discard(tuple(t for t in tags if t != "weights"))

    # -- level-2 weight discard --------------------------------------------------------
    @torch.no_grad()
    def _discard_weights(self) -> None:
        if self._discarded:
            return
        model = self.model_runner.get_model()
        for module in model.modules():
            if hasattr(module, "cpu_linear"):  # the packed (oneDNN/SGL) copy of the weight
                module.cpu_linear = _discarded_linear  # type: ignore[assignment]
        for param in model.parameters():
            if nbytes := param.untyped_storage().nbytes():
                self._discarded[param] = (param.size(), param.stride(), nbytes)
                # A new, empty storage, not resize_(0): a storage numpy has seen (vLLM's
                # /weight_checker digests through .numpy()) can never be resized again. The
                # old storage is freed with its last reference.
                param.set_()  # type: ignore[call-overload]
        self.readiness.set(Readiness.DISCARDED)
        self.allocator.device.empty_cache()  # the host heap gives the storage back

    @torch.no_grad()
    def _restore_weight_storage(self) -> None:
        """Give every discarded parameter zeroed storage of its old shape, for a reload to
        fill (layerwise reload copies into these same tensors and rebuilds the packed linears)."""
        for param, (size, stride, _) in self._discarded.items():
            zeros = torch.empty_strided(size, stride, dtype=param.dtype).zero_()
            param.set_(zeros)  # type: ignore[call-overload]
        self._discarded.clear()
