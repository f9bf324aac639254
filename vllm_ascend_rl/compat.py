"""Where vLLM releases differ, and every upstream internal we depend on: one place for both.

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

Upstream internals (34, 7 NPU only): names outside upstream's exports (a leading underscore,
or a module no package ``__all__`` exports) and attributes of upstream objects that are not
API. Each entry: ``key``: what -- where we use it -- why. ``test_<key>`` in
``tests/unit/test_upstream_internals.py`` guards it on both vLLM legs ("+": other tests that
cover it too); "(NPU)": no CPU test, checked on NPU only (``make test-npu``) and cited in
``docs/ascend-conformance.md`` (section). Not counted: the plugin APIs vLLM offers
(weight-transfer engines and factories, ``SleepModeBackend`` and its factory,
``initialize_/finalize_layerwise_reload``, ``init_logger``: test_register.py) and the dev-mode
HTTP routes (the e2e suites).

vLLM, scheduler and engine core (``vllm.v1``: no ``__all__``):

- ``scheduler_classes``: ``Scheduler``/``AsyncScheduler(vllm_config, ...)``, their
  ``schedule``, ``update_from_output``, ``has_requests``, ``set_pause_state``,
  ``reset_prefix_cache``, ``pause_state``; ``PauseState`` -- core/recompute_scheduler.py --
  subclass, never copy (+ test_recompute_scheduler.py)
- ``preempt_request``: ``Scheduler._preempt_request(request, timestamp, drop_stale_output)``,
  called in ``schedule()`` -- recompute_scheduler.py:_preempt_request -- bounce a KV-starved
  victim (+ test_bounce_policy.py)
- ``free_request``: ``Scheduler._free_request(request)`` (frees blocks, ``finished_req_ids``)
  -- recompute_scheduler.py:_bounce -- finish the victim (+ test_bounce_policy.py)
- ``request_finish``: ``Request.status = RequestStatus.FINISHED_ABORTED``,
  ``get_finished_reason()``, ``stop_reason``, ``take_events()``, ``trace_headers``,
  ``client_index`` -- recompute_scheduler.py:_bounce, update_from_output -- end it as abort
- ``engine_core_output``: ``EngineCoreOutput(request_id, new_token_ids, finish_reason,
  stop_reason, events, trace_headers)``, ``EngineCoreOutputs(outputs=)`` --
  recompute_scheduler.py:update_from_output -- deliver the bounce
- ``engine_core_calls``: ``EngineCore.sleep(level)``, ``wake_up(tags)``, ``resume_scheduler``,
  ``release_kv_cache_memory`` reach the scheduler; ``EngineCore.scheduler``; ``sys._getframe``
  -- core/engine_calls.py:engine_core_call -- vLLM never tells the scheduler about sleep
  (+ test_engine_calls.py)
- ``model_executor``: ``EngineCore.model_executor.collective_rpc(fn)`` --
  recompute_scheduler.py:workers_not_whole -- refuse a resume on weights that are not whole

vLLM, weight transfer and layerwise reload:

- ``info_bases``: ``weight_transfer.base.WeightTransferInitInfo``, ``WeightTransferUpdateInfo``,
  ``TrainerInitInfo`` (``backend``, ``rank``, ``is_sender``), not in ``weight_transfer.__all__``
  -- weight_transfer/hccl*.py, npu_ipc*.py, wire.py -- our infos extend them
- ``layerwise_info``: ``model_loader.reload.layerwise.get_layerwise_info(layer)``, not in
  ``reload.__all__`` -- weight_transfer/reload.py -- per-layer reload state
- ``can_load``: ``LayerReloadingInfo.can_load()`` -- reload.py:_expects_weights, evacuate,
  abort -- a layer still loading vs one processed
- ``load_numel``: ``.load_numel``, and finalize putting back the kernel tensors of a layer at 0
  -- reload.py:abort -- a failed update never leaves a half-loaded layer
- ``load_numel_total``: ``.load_numel_total`` -- reload.py:_expects_weights -- layers that
  take weights
- ``loaded_weights``: ``.loaded_weights``, a list of ``(name, BoundArguments)`` --
  reload.py:evacuate, abort -- un-alias the NPU-IPC ring; forget partial layers
- ``kernel_tensors``: ``.kernel_tensors`` ``(parameters, buffers)`` --
  reload.py:_LayerBackup.of, _kernel_bytes -- host copy of the old weights (on_failure=restore)
- ``mtp_check``: ``model_loader.mtp_validation.disable_mtp_completeness_check()`` --
  weight_transfer/session.py:UpdateSession.load -- partial updates of MTP models, as vLLM's
  own engines load
- ``packed_modules``: model classes' ``packed_modules_mapping`` --
  weight_transfer/engine_side.py:vet_update -- refuse an update that fills part of a fused layer

vLLM, workers and sleep:

- ``memory_pool_hook``: ``Worker._maybe_get_memory_pool_context(tag)``, called by
  ``initialize_from_config`` with ``"kv_cache"`` -- worker/cpu_worker.py:SleepableCPUWorker --
  only the KV cache goes to the sleep allocator
- ``worker_rpcs``: ``v1.worker.cpu_worker.CPUWorker``'s ``sleep``, ``wake_up``, ``discard``,
  ``init_device``, ``load_model``, ``initialize_from_config``, ``determine_available_memory``,
  ``finish_weight_update``, ``reload_weights`` (called by name) -- worker/*.py -- our
  sleepable workers override them
- ``worker_attributes``: ``Worker.weight_transfer_engine``, ``model_runner.get_model()`` --
  worker/__init__.py:release_for_sleep, session.py:weights_not_whole, cpu_worker.py -- free
  the receive pool before sleep, ask whether weights are whole, reach the model
- ``kv_caches``: ``model_runner.kv_caches`` -- worker/__init__.py:kv_cache_tensors --
  confine the ``kv_cache`` sleep pool to the KV cache
- ``dp_index``: ``ParallelConfig.data_parallel_index`` (derived, ``init=False``) --
  device/__init__.py:worker_index -- number engine workers as vLLM's own engines do
- ``cpu_linear``: ``layer.cpu_linear`` (vLLM CPU's packed GEMM) -- cpu_worker.py:
  _discard_weights; reload.py restores it -- level-2 sleep frees it
- ``checksum_methods``: ``v1.worker.gpu_worker.Worker._weight_checksum_prefix`` (with
  ``compute_weight_checksums``, ``reset_weights``; 0.32) -- :func:`weight_checker_methods` for
  worker/npu_worker.py -- ``/weight_checker`` on NPU (+ test_npu_worker.py, stand-in)
- ``sleep_mode_backend``: ``ModelConfig.sleep_mode_backend`` (no CLI flag) assigned after
  construction -- worker/__init__.py:attach_sleep_backend -- select ``ascend_rl_camem``

torch and the standard library:

- ``storage_use_count``: ``torch._C._storage_Use_Count(storage._cdata)`` --
  weight_transfer/receive_pool.py, npu_ipc.py:_map, _hand_back -- reuse a buffer only when no
  view is alive (+ test_buckets.py)
- ``c10d_group``: ``ProcessGroup._set_default_backend``, ``_register_backend``,
  ``_get_backend``, ``Backend._set_sequence_number_for_group`` -- device/group.py:open_group,
  npu.py:close_group -- a group of our own; vLLM's distributed/utils.py does the same
  (+ test_channel.py)
- ``resource_tracker``: ``multiprocessing.resource_tracker.unregister``, ``SharedMemory._name``
  (Python < 3.13) -- device/cpu.py:_attach -- an importer must not unlink the trainer's segment
  (+ test_ipc_transport.py)

vllm-ascend (182b75e) and torch_npu (2.10.0.post4), in device/npu.py and worker/npu_worker.py:

- ``npu_worker`` (NPU): ``vllm_ascend.worker.worker.NPUWorker``: ``load_model``,
  ``initialize_from_config`` -> ``model_runner.initialize_kv_cache`` (wrapped per call),
  ``device.index``, ``model_runner.kv_caches`` tuples, ``post_kv_cache_wake_up`` --
  npu_worker.py -- pooling and sleep (section 5; + test_npu_worker.py, stand-in)
- ``nz_mode`` (NPU): ``vllm_ascend.ascend_config.get_ascend_config().weight_nz_mode`` --
  npu.py:nz_weight_mode -- refuse at start what NZ refuses (section 5; + test_vllm_ascend_contract)
- ``hccl_options`` (NPU): ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``,
  ``Options._timeout``, ``hccl_config`` keys -- npu.py:group_backend -- our timeouts (section 3)
- ``watchdog_stop`` (NPU): ``set_watchdog_status(2)``, STOP of an enum torch_npu does not expose
  -- npu.py:group_backend -- a dead trainer must not kill the engine (section 3)
- ``abort_comm`` (NPU): ``ProcessGroupHCCL.abort_hccl_comm(reason)`` -- npu.py:close_group --
  drop a broken group without waiting for a hung collective (section 3)
- ``ipc_rebuild`` (NPU): the 15 rebuild arguments of ``reduce_tensor`` and
  ``rebuild_npu_tensor``'s -- npu.py:create_ipc_buffer, open_ipc_buffer -- handles as JSON
  (section 3)
- ``pluggable_pool`` (NPU): ``NPUPluggableAllocator._allocator``, ``memory_snapshot()``
  segment fields -- npu.py:pluggable_pool, _trim -- VMM-backed pools (section 3)
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
