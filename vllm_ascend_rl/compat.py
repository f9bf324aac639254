"""Where the vLLM releases we support differ.

Version differences (0.27.1, what vllm-ascend ``main`` pins, through 0.32.0), detected by
feature, never by version string; the tests' probes are in ``tests/support/vllm_features.py``:

- ``WeightTransferEngine.trainer_send_weights``: abstract in 0.27.1, gone in 0.32;
  :class:`EngineCompat` supplies it where it is still abstract.
- ``SleepModeBackend.discard``, ``/release_kv_cache_memory``, ``/shutdown_weight_transfer_engine``,
  ``/weight_checker``: 0.32 only; our backend and workers define ``discard`` either way.
- ``/weight_checker``'s worker methods: 0.32's GPU ``Worker`` has them, vllm-ascend's
  ``NPUWorker`` does not; :func:`weight_checker_methods` lends it vLLM's own.
- ``stateless_init_torch_distributed_process_group(timeout=)``: not in 0.27.1; unused, as
  :mod:`vllm_ascend_rl.device.group` builds the group itself.
- ``/inference/v1/generate``: always on in 0.27.1, behind ``--enable-scale-out`` in 0.32; its
  ``weight_versions`` spans: 0.32 only. ``/sleep?level=``: 0.32 refuses levels outside 0..2,
  0.27.1 passes any on (our workers refuse them).
- The worker's sleep-backend accessor (``_get_sleep_mode_backend()`` in 0.27.1, a
  ``sleep_mode_backend`` property in 0.32): unused; both workers build ours through
  ``SleepModeBackendFactory.create_backend`` (``attach_sleep_backend``).

Every upstream internal we depend on is listed in ``docs/upstream-internals.md``, each guarded
on both vLLM legs by ``tests/unit/test_upstream_internals.py``.
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
