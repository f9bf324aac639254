"""vLLM's layerwise reload, with a clean abort.

Checkpoint-format weights must go through layerwise reload: on CPU (and for any layer whose
``process_weights_after_loading`` repacks weights) a plain ``load_weights`` into the processed
parameters fails halfway and corrupts the model. A layer is rebuilt and copied into its kernel
tensors as soon as all its weights have arrived; a layer that received only part of its weights
would be processed with uninitialised memory at finalize. :meth:`LayerwiseReload.abort` drops
such partial layers first, so finalize puts their old kernel tensors back.
"""

from __future__ import annotations

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

    @property
    def active(self) -> bool:
        return self.model is not None

    def begin(self, model: torch.nn.Module) -> None:
        if self.active:
            raise RuntimeError("a weight update is already in progress on this worker")
        initialize_layerwise_reload(model)
        self.model = model
        self._pending = [m for m in model.modules() if _expects_weights(m)]

    def finish(self, model_config: ModelConfig) -> None:
        if not self.active:
            raise RuntimeError("no weight update in progress: call start_weight_update first")
        model, self.model = self.model, None
        finalize_layerwise_reload(model, model_config)
        self._pending = []

    def evacuate(self, storage: torch.Tensor) -> int:
        """Make buffered weights stop aliasing ``storage``; return how many were copied.

        Layerwise reload keeps a layer's received tensors until the layer is complete. A
        transport that loads straight from a buffer it must hand back (the NPU-IPC staging
        ring) calls this after each bucket: tensors of still-incomplete layers that point into
        the buffer are cloned, everything else has already been consumed.
        """
        ptr, copied = storage.untyped_storage().data_ptr(), 0
        for layer in self._pending:
            info = get_layerwise_info(layer)
            if not info.can_load():
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.untyped_storage().data_ptr() == ptr
                    ):
                        bound.arguments[key] = value.clone()
                        copied += 1
        return copied

    def abort(self, model_config: ModelConfig) -> int:
        """Undo what has not been applied yet; return how many layers already hold new weights.

        Layers that received all their weights were processed during the transfer and keep
        them; every other layer gets its old kernel tensors back, untouched.
        """
        if not self.active:
            return 0
        updated = 0
        for layer in self._pending:
            info = get_layerwise_info(layer)
            if not info.can_load():
                updated += 1  # fully received and processed
            elif info.load_numel > 0:
                info.loaded_weights.clear()  # partial: forget, restore old at finalize
                info.load_numel = 0
        self.finish(model_config)
        if updated:
            logger.warning("weight update aborted after %d layer(s) took new weights", updated)
        return updated


def _expects_weights(layer: torch.nn.Module) -> bool:
    info = get_layerwise_info(layer)
    return info.can_load() and bool(info.load_numel_total)
