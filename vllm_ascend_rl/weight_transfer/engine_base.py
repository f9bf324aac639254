"""The engine (worker) side shared by the HCCL and NPU-IPC engines.

Both receive checkpoint-format weights the same way; only the transport differs. One update:

1. validate the metadata against the model (nothing is loaded yet);
2. agree with the trainer that the update goes ahead (a refusal on either side stops both);
3. receive bucket after bucket, loading each through vLLM's layerwise reload;
4. on any failure, restore every layer that had not received all its weights, drop the
   connection (its byte stream is out of step) and say exactly what state the model is in.

A transport implements ``_connected``, ``_agree``, ``_buckets`` and ``_disconnect``.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_ascend_rl.compat import EngineCompat
from vllm_ascend_rl.core.hold import HoldPublisher, hold_supported
from vllm_ascend_rl.device import Device, device_for, worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import Bucket, TensorSpec, total_bytes
from vllm_ascend_rl.weight_transfer.delta import (
    DeltaRefused,
    EngineBase,
    fingerprint,
    wire_specs,
)
from vllm_ascend_rl.weight_transfer.probe import EngineTransportProbe
from vllm_ascend_rl.weight_transfer.receive_pool import ReceivePool
from vllm_ascend_rl.weight_transfer.reload import LayerwiseReload
from vllm_ascend_rl.weight_transfer.validation import (
    WeightUpdateRefused,
    expected_params,
    parse_specs,
    validate_update,
)
from vllm_ascend_rl.weight_transfer.wire import plan_for

logger = get_logger(__name__)

# vllm-ascend releases v0.22-v0.26 (and tag v0.23.0) drive engines the pre-lifecycle way: the
# worker runs layerwise reload itself and calls receive_weights(info, load_weights=...), so our
# start/finish never run. The lifecycle we implement arrived on vllm-ascend main in 9eabafb0c8.
LEGACY_WORKER = (
    "this vllm-ascend release calls receive_weights(info, load_weights=...) and never "
    "start_weight_update/finish_weight_update on the engine; vllm_ascend_rl's engines need "
    "vllm-ascend main at or after commit 9eabafb0c8 ('[Refactor] Align weight transfer "
    "lifecycle with vLLM (#12876)'). No weight was loaded."
)


class CheckpointEngine(EngineCompat, EngineTransportProbe, WeightTransferEngine):
    """Template for engines that receive checkpoint-format weights in buckets."""

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.hw: Device = device_for(device, cpu_chip=self.worker_index)
        refusal = self.hw.weight_update_refusal()
        if refusal:  # fail at engine start, not at the trainer's first sync
            raise ValueError(refusal)
        self.init_info = None
        self.reload = LayerwiseReload()
        # Sized at init from the wire params; given back after every update.
        self.pool = ReceivePool(device, 0)
        self._expected = None
        self._expected_loaded = False
        self._guard = None  # forward pre-hook while an update is open
        self._cancelled: str | None = None  # why the open update was ended early
        self._received = False  # the open update's update_weights completed
        self._mixed = False  # on_failure=hold: a failed update left new and old layers
        self._loading: str | None = None  # the version update_weights is loading, if named
        # Until then a failed collective may still be queued on the device (until its exec
        # timeout), and a device-wide sync such as empty_cache would wait behind it.
        self.device_busy_until = 0.0
        self.hold = HoldPublisher(vllm_config, enabled=self.parallel_config.rank == 0)
        self.base: EngineBase | None = None  # delta=True: the weights we hold, in host memory

    @property
    def worker_index(self) -> int:
        return worker_index(self.parallel_config)

    # -- transport hooks ---------------------------------------------------------------
    @abstractmethod
    def _connected(self) -> bool: ...

    @abstractmethod
    def _agree(
        self, refusal: WeightUpdateRefused | None, specs: list[TensorSpec], update_info
    ) -> str | None:
        """Tell the trainer whether we go ahead, learn whether it does; the reason not to."""

    @abstractmethod
    def _buckets(self, plan: list[Bucket], update_info) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Yield each bucket with a uint8 buffer this engine owns (loading keeps views)."""

    @abstractmethod
    def _disconnect(self) -> None: ...

    alone_bytes: ClassVar[int | None] = None  # see plan_for; the trainer side uses the same

    def _plan(self, specs: list[TensorSpec]) -> list[Bucket]:
        return plan_for(self.init_info, specs, self.alone_bytes)

    # -- lifecycle ---------------------------------------------------------------------
    def _check_init(self, init_info) -> None:
        """Refusals that need this engine's config: before any rendezvous, so immediate."""
        if init_info.on_failure != "hold":
            return
        unsupported = hold_supported(self.vllm_config)
        if unsupported:
            raise ValueError(unsupported)
        scheduler = self.vllm_config.scheduler_config.get_scheduler_cls()
        from vllm_ascend_rl.core.recompute_scheduler import RecomputeScheduler

        if not issubclass(scheduler, RecomputeScheduler):
            raise ValueError(
                f"on_failure='hold' needs the plugin scheduler to hold generation (this engine "
                f"runs {scheduler.__name__}): start it with --scheduler-cls "
                "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler, or use "
                "on_failure='restore'"
            )

    def _before_init(self) -> None:
        if self.reload.active:
            self._cancel_update("init_weight_transfer_engine was called during it")
        self._disconnect()
        self.pool.release()

    def _after_init(self, init_info) -> None:
        """Record the agreed wire parameters; size the receive pool from them."""
        self.init_info = init_info
        if init_info.delta and self.base is None:
            self.base = EngineBase()
        self.pool.max_bytes = (
            init_info.packed_num_buffers + 2
        ) * init_info.packed_buffer_size_bytes

    @property
    def holds(self) -> bool:
        return self.init_info is not None and self.init_info.on_failure == "hold"

    def start_weight_update(self) -> None:
        self._require_connected()
        self._cancelled, self._received = None, False
        if self.holds:  # no copy of the old weights: no step may run until the update ends
            timeout_s = self.init_info.timeout_s
            # Until update_weights starts receiving, the model is whole: if no call comes
            # (a trainer died after start), the hold lapses after timeout_s and the first
            # forward pass ends the abandoned update.
            self.hold.hold(
                f"a weight update is in progress (on_failure=hold); unless weights start to "
                f"arrive within timeout_s={timeout_s:.0f}s, it is abandoned",
                lapses_after_s=timeout_s,
            )
        self._check_base()
        self.reload.begin(
            self.model,
            self.model_config,
            keep_old=not self.holds,
            workers_on_host=self.parallel_config.world_size,
        )
        # No forward pass may run on half-loaded layers: one that starts while the update is
        # open (generation was not paused) first cancels the update, restoring the old weights.
        self._guard = self.model.register_forward_pre_hook(self._forward_during_update)

    def finish_weight_update(self) -> None:
        if not self.reload.active and self._cancelled:
            # The worker still counts the update as open; end it. The model is the old one.
            logger.warning("finish_weight_update: nothing applied, %s", self._cancelled)
            self._cancelled = None
            return
        if self.reload.active and not self._received:
            # Nothing complete arrived (an abandoned update): finalizing would process partly
            # loaded layers. End it with the old weights instead.
            state = self._abort_update()
            logger.warning("finish_weight_update without a complete update: %s", state)
            return
        self._drop_guard()
        self.reload.finish(self.model_config)
        self._end_pool()
        if self.base is not None:
            self.base.commit(self.model)
            logger.info(
                "delta base %s: %.1f MiB of host memory",
                self.base.version,
                self.base.nbytes / 2**20,
            )
        self._mixed = False
        self.hold.release()

    def shutdown(self) -> None:
        if self.reload.active:
            self._cancel_update("the weight transfer engine was shut down")
        self._disconnect()
        self.release_buffers()

    def release_buffers(self) -> None:
        """Give back the receive pool (e.g. before the engine sleeps)."""
        self.pool.release()

    def _require_connected(self) -> None:
        if not self._connected():
            raise RuntimeError(
                f"{type(self).__name__} is not initialized: call init_weight_transfer_engine first"
            )

    def _forward_during_update(self, module, args) -> None:
        if self.reload.active:
            self._cancel_update(
                "no weight arrived within timeout_s and generation resumed (on_failure=hold)"
                if self.holds
                else "generation ran while it was open: pause generation (/pause) before "
                "start_weight_update"
            )

    def _cancel_update(self, why: str) -> None:
        """End the open update and remember why, for its caller."""
        state = self._abort_update()
        self._cancelled = f"the weight update was cancelled because {why}; {state}"
        logger.error("%s", self._cancelled)

    def _abort_update(self) -> str:
        """End the open update; return what the model holds now (for messages)."""
        self._drop_guard()
        if self.base is not None:
            self.base.rollback()
        restored, kept = self.reload.abort(self.model_config)
        self._end_pool()
        if kept or self._mixed:
            self._mixed = True
            version = f" of version {self._loading!r}" if self._loading else ""
            reason = (
                f"the weights are not whole: a weight update{version} failed after "
                f"{kept} layer(s) had taken new weights (on_failure=hold); generation waits "
                "until a weight update completes"
                if kept
                else "the weights are still not whole from an earlier failed update"
            )
            self.hold.hold(reason)
            return reason
        self.hold.release()
        return "model unchanged" + (
            f" (the old weights were restored in {restored} layer(s))" if restored else ""
        )

    def _end_pool(self) -> None:
        """Give the receive pool back and log what it took.

        The device's cache is emptied only after an update that completed, and not while a
        failed collective may still be queued (``device_busy_until``). ``empty_cache`` is a
        device-wide synchronize: it would wait for a broadcast still queued on a dead trainer
        (until the communicator's exec timeout). The freed blocks then stay in the allocator's
        cache until a later update empties it.
        """
        allocated, peak = self.pool.end_update()
        if allocated and self._received and time.monotonic() >= self.device_busy_until:
            self.hw.empty_cache()  # released blocks go back to the device, not the allocator
        logger.info(
            "receive pool: %.1f MiB allocated by this update, peak %.1f MiB of device memory "
            "(bound %.1f MiB)",
            allocated / 2**20,
            peak / 2**20,
            self.pool.max_bytes / 2**20,
        )

    def _drop_guard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.remove()

    # -- one update --------------------------------------------------------------------
    def parse_update_info(self, update_dict):
        try:
            return super().parse_update_info(update_dict)
        except ValueError as e:
            raise WeightUpdateRefused(f"refused weight update, model unchanged: {e}") from None

    def update_weights(self, update_info) -> None:
        """vLLM's parse-receive-synchronize, except that any failure (a malformed body
        included) ends the update with the old weights instead of leaving it open."""
        try:
            super().update_weights(update_info)
        except BaseException:
            if self.reload.active:
                self._abort_update()
            raise

    def receive_weights(self, update_info, **legacy) -> None:
        if "load_weights" in legacy:
            raise RuntimeError(LEGACY_WORKER)
        if legacy:
            raise TypeError(f"receive_weights() got unexpected arguments {sorted(legacy)}")
        self._require_connected()
        if not self.reload.active:
            raise RuntimeError(
                self._cancelled or "update_weights called without start_weight_update"
            )
        refusal: WeightUpdateRefused | None = None
        specs: list[TensorSpec] = []
        try:
            specs = parse_specs(update_info.names, update_info.dtype_names, update_info.shapes)
            packed_modules = getattr(self.model, "packed_modules_mapping", None)
            validate_update(
                specs, self._expected_params(), self.init_info.validation, packed_modules
            )
            specs = self._delta_wire(specs, update_info)
        except (WeightUpdateRefused, DeltaRefused) as e:
            refusal = e if isinstance(e, WeightUpdateRefused) else WeightUpdateRefused(str(e))
        try:
            reason = self._agree(refusal, specs, update_info)
        except Exception as e:
            self._disconnect()  # first: nothing may wait behind a collective on a dead peer
            self._abort_update()
            if refusal is not None:
                raise WeightUpdateRefused(
                    f"refused weight update, model unchanged: {refusal}"
                ) from e
            raise RuntimeError(f"the trainer did not join the update: {e}") from e
        if reason is not None:
            self._abort_update()  # nothing loaded: the old weights stay
            raise WeightUpdateRefused(f"refused weight update, model unchanged: {reason}")
        self._loading = update_info.weight_version
        if self.base is not None:
            self.base.begin(update_info.delta_version or update_info.weight_version)
        if self.holds:  # weights are about to land: from now on the hold never lapses
            self.hold.hold("a weight update is in progress (on_failure=hold)")
        received = 0
        try:
            for bucket, buf in self._buckets(self._plan(specs), update_info):
                self._load(bucket, buf)
                received += bucket.nbytes
                del buf  # a transport may check that nothing refers to its buffer any more
        except Exception as e:
            self._disconnect()  # first: nothing may wait behind a collective on a dead peer
            state = self._abort_update()
            raise RuntimeError(
                f"weight transfer failed after {received} of {total_bytes(specs)} bytes "
                f"({type(e).__name__}: {e}); {state}. Call init_weight_transfer_engine "
                "again before the next update."
            ) from e
        self._received = True

    def _load(self, bucket: Bucket, buf: torch.Tensor) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        from vllm_ascend_rl.weight_transfer.buckets import unpack_views

        views = unpack_views(buf, bucket)
        with disable_mtp_completeness_check():
            self.model.load_weights(views if self.base is None else self.base.stage(views))

    def _check_base(self) -> None:
        """Forget a delta base the model no longer matches (reload, sleep level 2)."""
        base = self.base
        if base is None or base.version is None:
            return
        if fingerprint(self.model) != base.model_fingerprint:
            logger.warning(
                "the weights changed since delta base %r: the next update must send every "
                "tensor whole",
                base.version,
            )
            base.drop()

    def _delta_wire(self, specs: list[TensorSpec], update_info) -> list[TensorSpec]:
        """The tensors on the wire: ``specs``, or their delta encoding (checked against
        this engine's base before any byte moves)."""
        nnz = update_info.nnz
        if nnz is None:
            return specs
        if self.base is None:
            raise DeltaRefused("this engine was initialized without delta=True")
        self.base.check(specs, nnz, update_info.base_version)
        return wire_specs(specs, nnz)

    def _expected_params(self):
        if not self._expected_loaded:
            self._expected = expected_params(self.model_config)
            self._expected_loaded = True
        return self._expected
