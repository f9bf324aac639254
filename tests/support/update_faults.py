"""A worker extension (``--worker-extension-cls tests.support.update_faults.UpdateFaults``)
that makes the next ``finish_weight_update`` fail in post-load processing, as it can on an NPU
or with vLLM's own layers: the first attention layer's ``process_weights_after_loading`` (which
vLLM's layerwise reload runs only in finish, and which raises ValueError on some attention
configurations) raises once. Reached through ``/collective_rpc``; the model is the real one."""

from __future__ import annotations


class UpdateFaults:
    def fail_next_finish(self) -> str:
        """Arm the fault; the name of the layer that will raise."""
        from vllm.model_executor.layers.attention import Attention

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        name, layer = next((n, m) for n, m in model.named_modules() if isinstance(m, Attention))

        def failing(*args: object, **kwargs: object) -> None:
            del layer.process_weights_after_loading  # once: the class's method is back
            raise ValueError(f"{name}: attention post-processing failed (injected)")

        layer.process_weights_after_loading = failing
        return name
