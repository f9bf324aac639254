"""``reload_weights`` from a checkpoint directory, under the rule our weight updates follow:
the checkpoint's safetensors headers are checked against the model before a byte is read (path,
names, shapes, dtypes), the load goes through layerwise reload with a host copy of the old
weights, and a load that fails restores them (vLLM's own reload leaves the model on the meta
device)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm_ascend_rl.compat import mtp_check_off
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.reload import LayerwiseReload
from vllm_ascend_rl.weight_transfer.session import State
from vllm_ascend_rl.weight_transfer.validation import (
    checkpoint_files,
    checkpoint_params,
    expected_params,
    validate_update,
)

if TYPE_CHECKING:
    import torch


def reload_from_disk(worker: Any, weights_path: str, keep_old: bool) -> None:
    """Load ``weights_path`` (a directory of ``*.safetensors``) into the worker's model.
    ValueError, with nothing changed, if it does not fit; RuntimeError after a failed load,
    with the old weights back (``keep_old``; after a level-2 sleep there is nothing to keep)."""
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config

    session = getattr(getattr(worker, "weight_transfer_engine", None), "session", None)
    if session is not None and session.state is not State.IDLE:
        raise RuntimeError(f"reload_weights refused: a weight update is {session.state.value}")
    files = checkpoint_files(weights_path)
    if not files:
        where = "does not exist" if not os.path.exists(weights_path) else "has no *.safetensors"
        raise ValueError(f"reload_weights: {weights_path!r} {where} on the server; nothing changed")
    model, model_config = worker.model_runner.get_model(), worker.vllm_config.model_config
    try:
        specs = [TensorSpec(n, d, s) for n, (d, s) in checkpoint_params(files).items()]
        packed = getattr(model, "packed_modules_mapping", None)
        validate_update(specs, expected_params(model_config), "partial", packed)
    except Exception as e:  # a refusal, or a header that cannot be read
        raise ValueError(f"reload_weights refused {weights_path!r}, nothing changed: {e}") from e

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)

    reload = LayerwiseReload()
    with set_current_vllm_config(worker.vllm_config):
        reload.begin(model, model_config, keep_old, worker.parallel_config.world_size)
        try:
            with mtp_check_off():
                model.load_weights(tensors())
        except Exception as e:
            restored, _, _ = reload.abort(model_config)
            raise RuntimeError(
                f"reload_weights from {weights_path!r} failed ({type(e).__name__}: {e}); the "
                f"old weights were restored ({restored} layer(s) had taken new ones)"
            ) from e
        reload.finish(model_config)
