"""Every difference between the vLLM releases we support (0.27.1, what vllm-ascend ``main``
pins, through 0.32.0), in one place and detected by feature, never by version string.

What differs, and how each is handled:

- ``WeightTransferEngine.trainer_send_weights``: an abstract static method in 0.27.1 (the
  trainer side was a static call there), gone in 0.32. :class:`EngineCompat` supplies it where
  the base class still asks for it.
- ``SleepModeBackend.discard`` and the routes that reach it (``/release_kv_cache_memory``),
  ``/shutdown_weight_transfer_engine`` and ``/weight_checker``: 0.32 only. Our backend and
  workers define ``discard`` either way; :func:`has_route` lets tests say what is missing.
- The worker methods behind ``/weight_checker`` (``compute_weight_checksums``,
  ``reset_weights``): 0.32's GPU ``Worker`` has them (the CPU worker inherits them),
  vllm-ascend's ``NPUWorker`` (a ``WorkerBase``) does not. :func:`weight_checker_methods` hands
  vLLM's own to our NPU worker where they exist.
- vLLM's ``stateless_init_torch_distributed_process_group`` gained ``timeout`` after 0.27.1:
  we no longer call it (:mod:`vllm_ascend_rl.device.group` builds the group itself).
- ``/inference/v1/generate`` (token in, token out, with weight-version spans): always served
  by 0.27.1, behind ``--enable-scale-out`` in 0.32 (:func:`scale_out_flags`).
- Per-output weight-version spans (``weight_versions`` in ``/inference/v1/generate``): 0.32
  only (:func:`has_weight_version_spans`); ``/weight_info`` exists in both.
- ``/sleep?level=``: 0.32 refuses a level outside 0..2 with 400; 0.27.1 passes any level to the
  workers (:func:`sleep_route_validates_level`; our workers refuse it themselves).
- The worker's sleep-backend accessor (``sleep_mode_backend`` property in 0.32,
  ``_get_sleep_mode_backend()`` in 0.27.1): not used; both workers build the backend through
  ``SleepModeBackendFactory.create_backend``, which both releases have
  (:func:`vllm_ascend_rl.worker.attach_sleep_backend`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

_ABSTRACT = getattr(WeightTransferEngine, "__abstractmethods__", frozenset())


class EngineCompat:
    """Mixed into our worker-side engines, before vLLM's base class."""

    if "trainer_send_weights" in _ABSTRACT:  # vLLM <= 0.27

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise NotImplementedError(
                "vllm_ascend_rl engines send from a trainer engine: use "
                "WeightTransferTrainerFactory.trainer_init(...).send_weights()"
            )


WEIGHT_CHECKER_METHODS = ("compute_weight_checksums", "_weight_checksum_prefix", "reset_weights")


def weight_checker_methods(base: type) -> dict[str, Any]:
    """vLLM's worker methods behind ``/weight_checker`` that ``base`` lacks (none before 0.32).

    They only read the parallel ranks and ``model_runner.get_model()``, which every worker
    has, so they are borrowed from vLLM's GPU ``Worker`` rather than rewritten.
    """
    from vllm.v1.worker.gpu_worker import Worker

    return {
        name: vars(Worker)[name]
        for name in WEIGHT_CHECKER_METHODS
        if name in vars(Worker) and not hasattr(base, name)
    }
