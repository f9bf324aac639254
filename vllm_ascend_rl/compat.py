"""How vLLM 0.27.1 (vllm-ascend ``main``'s pin) to 0.32.0 differ, by feature, never by version:
the table is docs/ascend-conformance.md §2 (probes: ``tests/support/vllm_features.py``;
internals we rely on: docs/upstream-internals.md). Here: ``trainer_send_weights``, abstract in
0.27.1 and gone in 0.32 (:class:`EngineCompat`), and ``/weight_checker``'s worker methods, in
0.32's GPU ``Worker`` but not in vllm-ascend's ``NPUWorker`` (:func:`weight_checker_methods`)."""

from __future__ import annotations

from typing import Any


class EngineCompat:
    """Mixed into our worker-side engines, before vLLM's base class."""

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:  # abstract in <= 0.27
        raise NotImplementedError(
            "vllm_ascend_rl engines send from a trainer engine: use "
            "WeightTransferTrainerFactory.trainer_init(...).send_weights()"
        )


WEIGHT_CHECKER_METHODS = ("compute_weight_checksums", "_weight_checksum_prefix", "reset_weights")


def weight_checker_methods(base: type) -> dict[str, Any]:
    """vLLM's ``/weight_checker`` worker methods that ``base`` lacks (none before 0.32), lent
    from the GPU ``Worker``: they only read the parallel ranks and ``model_runner.get_model()``."""
    from vllm.v1.worker.gpu_worker import Worker

    return {
        name: vars(Worker)[name]
        for name in WEIGHT_CHECKER_METHODS
        if name in vars(Worker) and not hasattr(base, name)
    }
