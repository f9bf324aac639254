"""Engine side both transports share: each engine class (``hccl.py``, ``npu_ipc.py``) binds the
functions below "vLLM's engine methods" by name and keeps its state in an ``UpdateSession``.

A transport provides ``init_transfer_engine``, which claims the channel for its trainer
(``owner.py``, whose engine interface it implements, ``disconnect(why)`` included), and three
steps: ``agree(verdict, reason, plan, info)``, the handshake, which raises unless every side
goes ahead; ``buckets(plan)``, yielding ``(bucket, uint8 buffer)``; ``disconnect(why)``, called
first when bytes may be out of step. Every method vLLM calls holds the engine's ``lock``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_ascend_rl import metrics
from vllm_ascend_rl.device import Device, device_for, worker_index
from vllm_ascend_rl.weight_transfer.buckets import Bucket, TensorSpec, total_bytes
from vllm_ascend_rl.weight_transfer.owner import require_owner, require_up
from vllm_ascend_rl.weight_transfer.session import UpdateSession
from vllm_ascend_rl.weight_transfer.validation import (
    WeightUpdateRefused,
    expected_params,
    validate_update,
)
from vllm_ascend_rl.weight_transfer.wire import (
    CheckpointUpdateInfo,
    Verdict,
    WireParams,
    parse_wire,
    plan_for,
)


class TransferFailed(RuntimeError):
    """Bytes stopped arriving mid-update; the connection is gone."""

    cause = "transfer"


def engine_setup(engine: Any, device: torch.device, backend: str) -> tuple[Device, UpdateSession]:
    """An engine's device and session; ValueError now, not at the first sync, on a stack that
    would refuse every update."""
    parallel = engine.parallel_config
    worker = worker_index(parallel)
    hw = device_for(device)
    refusal = hw.weight_update_refusal()
    if refusal:
        raise ValueError(refusal)
    metrics.engine_worker(engine.vllm_config, worker)
    session = UpdateSession(engine.model, engine.model_config, hw, parallel.world_size, backend)
    return hw, session


def check_init(vllm_config: Any, wire: WireParams) -> None:
    """Refuse, before any rendezvous, ``hold`` without the plugin scheduler (it refuses
    ``/resume`` while the weights are not whole)."""
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    if wire.on_failure == "hold" and not getattr(scheduler, "refuses_resume_when_not_whole", False):
        raise ValueError(
            f"on_failure='hold' needs the plugin scheduler to refuse /resume while the weights "
            f"are not whole (this engine runs {scheduler.__name__}): start it with "
            "--scheduler-cls vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler, "
            "or use on_failure='restore'"
        )


def vet_update(
    engine: Any, info: CheckpointUpdateInfo, wire: WireParams
) -> tuple[Verdict, str | None]:
    """The engine's verdict on an update's metadata, and the reason if it is not GO."""
    if not hasattr(engine, "_expected"):  # the model's checkpoint parameters, read once
        engine._expected = expected_params(engine.model_config)
    try:
        packed_modules = getattr(engine.model, "packed_modules_mapping", None)
        validate_update(info.specs, engine._expected, wire.validation, packed_modules)
    except WeightUpdateRefused as e:
        return Verdict.REFUSED, str(e)
    return Verdict.GO, None


def refused(verdict: int, same: bool, reason: str | None) -> WeightUpdateRefused | None:
    """The refusal an update handshake's outcome means for this engine, or None to go on."""
    if verdict == Verdict.GO and same:
        return None
    if reason is None and verdict == Verdict.GO:
        reason = "the trainer's plan differs from update_info"
    if reason is None:
        return WeightUpdateRefused("another side refused it", cause="refused_by_peer")
    return WeightUpdateRefused(reason)


def load_buckets(
    session: UpdateSession,
    buckets: Iterator[tuple[Bucket, torch.Tensor]],
    specs: list[TensorSpec],
    disconnect: Callable[[str], None],
) -> None:
    """Load every bucket; a broken transfer disconnects first (nothing may wait behind a
    transfer on a dead peer) and raises TransferFailed saying how far it got."""
    received = 0
    try:
        waiting = time.perf_counter()
        for bucket, buf in buckets:
            session.load(bucket, buf, time.perf_counter() - waiting)
            received += bucket.nbytes
            del buf  # the transport reuses a buffer once nothing refers to it
            waiting = time.perf_counter()
    except Exception as e:
        disconnect(f"a transfer failed: {type(e).__name__}: {e}")
        raise TransferFailed(
            f"weight transfer failed after {received} of {total_bytes(specs)} bytes "
            f"({type(e).__name__}: {e}). Call init_weight_transfer_engine again before the "
            "next update"
        ) from e
    session.loaded()


# -- vLLM's engine methods, the same on both transports --------------------------------------
def parse_init_info(engine: Any, init_dict: Any) -> Any:
    return parse_wire(engine.init_info_cls, init_dict, "init_info")


def parse_update_info(engine: Any, update_dict: Any) -> Any:
    return parse_wire(engine.update_info_cls, update_dict, "update_info")


@contextmanager
def _entered(engine: Any) -> Iterator[None]:
    """The engine's lock held and its vLLM config current: vLLM's GPU worker runs the update
    hooks inside ``set_current_vllm_config`` (gpu_worker.py:1514, 1571, 1597 in 0.32.0; 1236,
    1292, 1310 in 0.27.1), vllm-ascend's NPUWorker does not (worker.py:297-336 at 182b75e), so
    the engine sets it: a loader or a layer's post-load processing that reads it works on both."""
    with engine.lock, set_current_vllm_config(engine.vllm_config):
        yield


def start_weight_update(engine: Any) -> None:
    with _entered(engine):
        require_up(engine)
        engine.session.start()


def finish_weight_update(engine: Any) -> None:
    with _entered(engine):
        engine.session.finish()


def update_weights(engine: Any, update_info: Any) -> None:
    """vLLM's parse-receive-synchronize; any failure ends the update (old weights back) and
    its error says what the model holds now."""
    with _entered(engine):
        _update_weights(engine, update_info)


def _update_weights(engine: Any, update_info: Any) -> None:
    try:
        WeightTransferEngine.update_weights(engine, update_info)
    except Exception as e:
        state = engine.session.fail(e)
        if isinstance(e, ValueError):  # refusals and malformed calls: nothing was loaded
            raise WeightUpdateRefused(f"refused weight update, {state}: {e}") from e
        if isinstance(e, RuntimeError):
            raise type(e)(f"{e}; {state}") from e
        raise


def receive_weights(engine: Any, update_info: CheckpointUpdateInfo, **legacy: Any) -> None:
    if "load_weights" in legacy:  # vllm-ascend v0.22-v0.26 and tag v0.23.0
        raise RuntimeError(
            "this vllm-ascend release calls receive_weights(info, load_weights=...) and never "
            "start_weight_update/finish_weight_update on the engine; vllm_ascend_rl's engines "
            "need vllm-ascend main at or after commit 9eabafb0c8 ('[Refactor] Align weight "
            "transfer lifecycle with vLLM (#12876)'). No weight was loaded."
        )
    if legacy:
        raise TypeError(f"receive_weights() got unexpected arguments {sorted(legacy)}")
    require_up(engine)
    require_owner(engine, update_info.trainer_id)
    engine.session.receive(update_info.weight_version)
    verdict, reason = vet_update(engine, update_info, engine.init_info)
    plan = plan_for(engine.init_info, update_info.specs, engine.alone_bytes)
    engine.agree(verdict, reason, plan, update_info)
    load_buckets(engine.session, engine.buckets(plan), update_info.specs, engine.disconnect)


def shutdown(engine: Any) -> None:
    with _entered(engine):
        engine.session.cancel("the weight transfer engine was shut down", "shutdown")
        engine.disconnect("the weight transfer engine was shut down")
        release_buffers(engine)


def release_buffers(engine: Any) -> None:
    """Give back the receive pool (e.g. before the engine sleeps)."""
    with engine.lock:
        engine.session.pool.release()
