"""vLLM's layerwise reload, with an abort that leaves the old model, never a mix.

Checkpoint-format weights must go through layerwise reload: a plain ``load_weights`` into
processed parameters (on CPU, or wherever ``process_weights_after_loading`` repacks) fails
halfway and corrupts the model. On abort, every layer that received anything gets back what
``begin`` kept: a host copy of every kernel tensor and the layer's plain attributes, as
processing may replace objects the forward pass uses (vLLM CPU's ``cpu_linear`` closure over
packed oneDNN weights), and a partial layer forgets what it buffered too, as some of its tensors
may have been written at once (vLLM CPU's fused ``qkv_proj.bias``). Objects mutated in place
are not restored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)


class LayerwiseReload:
    """One weight update's reload state on one worker: begin, then finish or abort."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self._pending: list[torch.nn.Module] = []
        self._backup: dict[torch.nn.Module, _LayerBackup] = {}
        self._derived: dict[tuple[torch.nn.Module, str], torch.Tensor] = {}

    def begin(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        keep_old: bool = True,
        workers_on_host: int = 1,
    ) -> None:
        """Open an update. ``keep_old`` takes a host copy of this worker's shard now, to restore
        on abort; MemoryError before any copy if the host cannot hold ``workers_on_host``."""
        self._derived = derived_tensors(model)  # as a captured graph reads them
        initialize_layerwise_reload(model)
        self.model = model
        self._pending = [m for m in model.modules() if _expects_weights(m)]
        if not keep_old:
            return
        started = time.monotonic()
        try:
            nbytes = sum(t.nbytes for layer in self._pending for t in _kernel_tensors(layer))
            check_host_memory(nbytes, workers_on_host)
            self._backup = {layer: _LayerBackup.of(layer) for layer in self._pending}
        except BaseException:
            self.abort(model_config)  # nothing loaded yet: the old tensors go back
            raise
        logger.info(
            "weight update open (on_failure=restore): %.1f MiB of old weights copied to host "
            "memory in %.2f s, to restore them if the update fails",
            nbytes / (1 << 20),
            time.monotonic() - started,
        )

    def finish(self, model_config: ModelConfig) -> None:
        """Process what is left of the new weights (vLLM's layerwise reload copies each layer
        into its kernel tensors); then :func:`keep_derived_in_place` as of ``begin``. If that
        raises, the update stays open here for :meth:`abort`."""
        finalize_layerwise_reload(self.model, model_config)
        keep_derived_in_place(self._derived)
        self._forget()

    def _forget(self) -> None:
        self.model, self._pending, self._backup, self._derived = None, [], {}, {}

    def evacuate(self, storage: torch.Tensor) -> int:
        """Clone the received tensors of incomplete layers that alias ``storage``; return how
        many. Layerwise reload holds them until the layer is complete, so a transport loading
        from a buffer it must hand back (the NPU-IPC staging ring) calls this per bucket."""
        ptr, copied = storage.untyped_storage().data_ptr(), 0
        for layer in self._pending:
            info = get_layerwise_info(layer)
            if not info.can_load():
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if torch.is_tensor(value) and value.untyped_storage().data_ptr() == ptr:
                        bound.arguments[key] = value.clone()
                        copied += 1
        return copied

    def abort(self, model_config: ModelConfig) -> tuple[int, int, int]:
        """End the update; return (layers that received weights and were restored from the
        host copy, such layers that keep new weights as no copy was kept, bytes restored).
        Finalize then puts a partial layer's kernel tensors back in place."""
        if self.model is None:
            return 0, 0, 0
        restored = kept = nbytes = 0
        for layer in self._pending:
            info = get_layerwise_info(layer)
            if info.can_load():  # partial, or nothing arrived
                if info.load_numel <= 0:
                    continue
                info.loaded_weights.clear()  # forget what it buffered
                info.load_numel = 0
            backup = self._backup.get(layer)
            if backup is None:
                kept += 1
            else:
                nbytes += backup.restore(layer)
                restored += 1
        try:
            self.finish(model_config)
        finally:
            self._forget()
        if restored or kept:
            logger.warning(
                "weight update aborted: %d layer(s) restored, %d keep new weights", restored, kept
            )
        return restored, kept, nbytes


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # _parameters, hooks, training, ...


@dataclass
class _LayerBackup:
    """What a layer's forward pass uses, as it was before the update."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (kernel tensor, host copy of its value)
    attrs: dict[str, Any]  # plain instance attributes (handles, closures, flags)

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerBackup:
        tensors = [(t, t.detach().to("cpu", copy=True)) for t in _kernel_tensors(layer)]
        attrs = {k: v for k, v in vars(layer).items() if k not in _MODULE_INTERNALS}
        return cls(tensors, attrs)

    def restore(self, layer: torch.nn.Module) -> int:
        """Put the old values and attributes back; the bytes copied."""
        for kernel, old in self.tensors:
            kernel.data.copy_(old)
        state = vars(layer)
        for k in [k for k in state if k not in _MODULE_INTERNALS and k not in self.attrs]:
            del state[k]  # added by processing the new weights
        state.update(self.attrs)
        return sum(old.nbytes for _, old in self.tensors)


def plain_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``module`` keeps as plain attributes, not parameters or buffers: derived
    from its weights by post-load processing (repacked, transposed, upcast copies, scales)."""
    return ((name, v) for name, v in vars(module).items() if isinstance(v, torch.Tensor))


def derived_tensors(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor]:
    return {(m, name): t for m in model.modules() for name, t in plain_tensors(m)}


def keep_derived_in_place(before: dict[tuple[torch.nn.Module, str], torch.Tensor]) -> None:
    """Post-load processing may re-create a layer's derived tensors (vLLM's attention layers
    make new host copies of their scales): copy each new value into the tensor the engine
    started with, which a captured graph reads, and put that one back. RuntimeError, naming
    the layer, for a derived tensor whose shape, dtype or device changed."""
    for (module, name), old in before.items():
        new = vars(module).get(name)
        if new is old or not isinstance(new, torch.Tensor):
            continue
        if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
            raise RuntimeError(
                f"{type(module).__name__}.{name} changed from {tuple(old.shape)} {old.dtype} "
                f"on {old.device} to {tuple(new.shape)} {new.dtype} on {new.device} in "
                "post-load processing: it cannot be refreshed where a captured graph reads it"
            )
        old.copy_(new)
        setattr(module, name, old)


def _kernel_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    params, buffers = get_layerwise_info(layer).kernel_tensors or ({}, {})
    return [*params.values(), *buffers.values()]


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_host_memory(shard_bytes: int, workers_on_host: int) -> None:
    """Refuse a restore backup the host cannot hold (every worker of the engine on this host
    takes one at the same moment), instead of letting the kernel's OOM killer decide."""
    need, free = shard_bytes * workers_on_host, available_host_bytes()
    if free and need > free:
        raise MemoryError(
            f"on_failure='restore' copies each worker's weights to host memory at every "
            f"update: {need / 2**30:.1f} GiB for {workers_on_host} worker(s), but only "
            f"{free / 2**30:.1f} GiB is available. Free host memory, or init with "
            "on_failure='hold' (no copy; a failed update holds generation until a complete "
            "one). Nothing was changed."
        )


def _expects_weights(layer: torch.nn.Module) -> bool:
    info = get_layerwise_info(layer)
    return info.can_load() and bool(info.load_numel_total)
