"""NPU-IPC weight transfer for a trainer colocated with the engine on the same chip.

No weight crosses a wire. The trainer owns a small ring of staging buffers (``packed_num_buffers``
of them, each large enough for the largest bucket), exported once as device IPC handles (on CPU
hosts: POSIX shared memory, mode 0600, random per-trainer names). The engine maps each buffer
once and caches it. Per bucket the trainer copies tensors into a free buffer and rings a
host-local doorbell; the engine copies the bucket out and acknowledges, so the buffer is reused
while the engine loads. Handles travel as explicit JSON fields of ``update_weights`` (never
pickled: no ``VLLM_ALLOW_INSECURE_SERIALIZATION``). Shared-memory names are unlinked as soon as
the engine has mapped them (after the first update) or when the trainer exits.

Trainer side::

    vllm_ascend_rl.register()
    engine = WeightTransferTrainerFactory.trainer_init(NPUIPCTrainerInitInfo(rank=0),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights(weight_version="step-7")
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
)

from vllm_ascend_rl._registration import registered_name
from vllm_ascend_rl.device import ExportedBuffer, ImportedBuffer, IpcHandleError
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    TensorSpec,
    iter_bucket_tensors,
    pack_into,
)
from vllm_ascend_rl.weight_transfer.doorbell import Doorbell, DoorbellListener
from vllm_ascend_rl.weight_transfer.engine_base import (
    DEFAULT_TIMEOUT_S,
    PROTOCOL_VERSION,
    CheckpointEngine,
    CheckpointUpdateInfo,
    check_wire,
    storage_use_count,
    wire_signature,
)
from vllm_ascend_rl.weight_transfer.trainer_side import (
    BackgroundCall,
    CheckpointTrainer,
    Progress,
    WeightSyncError,
)

logger = get_logger(__name__)

# Staging copies stream best in cache-friendly pieces: with a 1 GB model on CPU, 16-32 MiB
# buckets moved the data in 1.8-2.3x one memcpy, 256 MiB buckets in 2.8x (benchmarks/).
DEFAULT_BUCKET_BYTES = 32 << 20
DEFAULT_NUM_BUFFERS = 4


@dataclass(kw_only=True)
class NPUIPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info; the trainer fills it in."""

    doorbell: str
    zero_copy: bool = True  # load from the staging buffer; False copies each bucket out
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_wire(self)
        if not isinstance(self.doorbell, str) or not self.doorbell:
            raise ValueError(f"doorbell must be the trainer's socket name, got {self.doorbell!r}")


@dataclass
class NPUIPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``rank`` (keyword-only; 0 sends), ``packed``, bucket bytes."""

    backend: ClassVar[str] = registered_name("weight_transfer_trainer", "npu_ipc")

    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        check_wire(self)


@dataclass
class NPUIPCWeightTransferUpdateInfo(CheckpointUpdateInfo):
    """Metadata plus the staging buffers' handles, as plain JSON."""

    buffers: list[dict[str, Any]] = field(default_factory=list)
    update_id: int = 0


class NPUIPCWeightTransferEngine(CheckpointEngine):
    """Engine (worker) side: maps the trainer's staging buffers once, copies buckets out."""

    init_info_cls = NPUIPCWeightTransferInitInfo
    update_info_cls = NPUIPCWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.doorbell: Doorbell | None = None
        self._mapped: dict[str, ImportedBuffer] = {}  # handle id -> mapping, imported once
        self._idle: dict[int, int | None] = {}  # id(mapping) -> storage use count when unused
        self._ring: list[ImportedBuffer] = []

    def init_transfer_engine(self, init_info: NPUIPCWeightTransferInitInfo) -> None:
        self._before_init()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank
        doorbell = Doorbell.connect(init_info.doorbell, init_info.timeout_s)
        doorbell.send(
            hello=rank,
            protocol=init_info.protocol_version,
            wire=wire_signature(init_info),
            location=self.hw.location(),
        )
        try:
            reply = doorbell.recv("init handshake")
        except Exception:
            doorbell.close()
            raise
        if not reply.get("welcome"):
            doorbell.close()
            raise IpcHandleError(reply.get("error") or f"trainer refused us: {reply}")
        self.doorbell = doorbell
        self._after_init(init_info)
        logger.info(
            "NPU-IPC weight transfer ready: worker %d, packed=%s, bucket=%d MiB x %d",
            rank,
            init_info.packed,
            init_info.packed_buffer_size_bytes >> 20,
            init_info.packed_num_buffers,
        )

    # -- transport hooks ---------------------------------------------------------------
    def _connected(self) -> bool:
        return self.doorbell is not None and not self.doorbell.broken

    def _agree(self, refusal, specs, update_info) -> str | None:
        reason = str(refusal) if refusal is not None else None
        if reason is None:
            try:
                self._map(update_info.buffers, self._plan(specs))
            except IpcHandleError as e:
                reason = str(e)
        self.doorbell.send(ready=update_info.update_id, ok=reason is None, error=reason)
        if reason is not None:
            return reason
        go = self.doorbell.expect("go", update_info.update_id, "update handshake")
        return None if go.get("ok") else f"another worker refused it: {go.get('reason')}"

    def _map(self, handles: Any, plan: list[Bucket]) -> None:
        """Map the ring of staging buffers, reusing cached mappings (imported once)."""
        if (
            not isinstance(handles, list)
            or not handles
            or not all(isinstance(h, dict) and isinstance(h.get("id"), str) for h in handles)
        ):
            raise IpcHandleError(f"malformed buffers field: {str(handles)[:200]}")
        ring = []
        for h in handles:
            if h["id"] not in self._mapped:
                mapped = self._mapped[h["id"]] = self.hw.open_ipc_buffer(h)
                self._idle[id(mapped)] = storage_use_count(mapped.tensor)
            ring.append(self._mapped[h["id"]])
        for stale in set(self._mapped) - {h["id"] for h in handles}:
            mapped = self._mapped.pop(stale)
            self._idle.pop(id(mapped), None)
            mapped.close()
        need = max((b.nbytes for b in plan), default=0)
        small = min(b.tensor.numel() for b in ring)
        if small < need:
            raise IpcHandleError(f"staging buffers hold {small} bytes but a bucket needs {need}")
        self._ring = ring

    def _buckets(self, plan: list[Bucket], update_info):
        doorbell, ring = self.doorbell, self._ring
        for bucket in plan:
            if bucket.nbytes == 0:
                continue
            doorbell.expect("bucket", bucket.index, f"waiting for bucket {bucket.index}")
            staging = ring[bucket.index % len(ring)]
            if self.init_info.zero_copy:
                # Load straight from the trainer's buffer; before handing it back, copy out
                # only what layerwise reload still holds (tensors of incomplete layers).
                yield bucket, staging.tensor[: bucket.nbytes]
                self.reload.evacuate(staging.tensor)
                self.hw.synchronize()
                if storage_use_count(staging.tensor) != self._idle[id(staging)]:
                    self.init_info.zero_copy = False  # the next update copies every bucket
                    raise RuntimeError(
                        "a loaded tensor still refers to the trainer's staging buffer; this "
                        "engine switched to copying buckets out, retry the update"
                    )
                doorbell.send(done=bucket.index)
            else:
                out = self.pool.take(bucket.nbytes)
                self.hw.copy_bytes(out, staging.tensor[: bucket.nbytes])
                self.hw.synchronize()
                doorbell.send(done=bucket.index)
                yield bucket, out

    def _disconnect(self) -> None:
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self._idle.clear()
        self._ring = []


def _release(ring: list[ExportedBuffer]) -> None:
    for buf in ring:
        buf.close()
    ring.clear()


class NPUIPCTrainerWeightTransferEngine(CheckpointTrainer):
    """Trainer side: owns the staging ring and the doorbells; rank 0 drives the update."""

    init_info_cls = NPUIPCTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: NPUIPCTrainerInitInfo,
        device=None,
    ) -> None:
        super().__init__(client=client, source=source, init_info=init_info, device=device)
        self.doorbells: list[Doorbell] = []
        self.ring: list[ExportedBuffer] = []
        self.update_id = 0
        # Unlink and unmap the staging buffers when this engine goes away or the trainer
        # exits, whichever comes first.
        self._finalizer = weakref.finalize(self, _release, self.ring)

    transport: ClassVar[str] = "NPU-IPC"

    def _connect(self) -> None:
        info = self.init_info
        listener = DoorbellListener(info.timeout_s)
        worker_info = NPUIPCWeightTransferInitInfo(
            doorbell=listener.address,
            packed=info.packed,
            packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers,
            timeout_s=info.timeout_s,
        )
        init_call = BackgroundCall(
            "init_weight_transfer_engine",
            self.client.init_weight_transfer_engine,
            asdict(worker_info),
        )
        here, doorbells = self.hw.location(), []
        try:
            # Every worker connects and says hello inside the init call; it returns after all.
            while not init_call.done():
                doorbell = listener.accept(0.05)
                if doorbell is not None:
                    doorbells.append(doorbell)
                    self._welcome(doorbell, worker_info, here)
            init_call.result(info.timeout_s)
            if not doorbells:
                raise WeightSyncError("no engine worker connected to the doorbell")
        except Exception:
            for doorbell in doorbells:
                doorbell.close()
            raise
        finally:
            listener.close()
        self.doorbells = doorbells

    @staticmethod
    def _welcome(doorbell: Doorbell, info: NPUIPCWeightTransferInitInfo, here: dict) -> None:
        hello = doorbell.recv("init handshake")
        error = None
        if hello.get("protocol") != PROTOCOL_VERSION or hello.get("wire") != wire_signature(info):
            error = f"trainer and engine disagree on protocol or wire parameters: {hello}"
        elif hello.get("location") != here:
            where = hello.get("location") or {}
            error = (
                f"trainer and engine are not on the same chip: trainer on chip "
                f"{here.get('chip')} of host {here.get('host')}, engine worker "
                f"{hello.get('hello')} on chip {where.get('chip')} of host "
                f"{where.get('host')}. NPU IPC needs them colocated; use the hccl "
                "backend across chips or hosts."
            )
        doorbell.send(welcome=error is None, error=error)

    # -- transport hooks ---------------------------------------------------------------
    def _not_ready(self) -> str | None:
        if not self.doorbells:
            return "not connected"
        return next((d.broken for d in self.doorbells if d.broken), None)

    def _payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict:
        need = max((b.nbytes for b in plan), default=0)
        if not self.ring or self.ring[0].tensor.numel() < need:
            _release(self.ring)  # exported once; replaced only if a bucket outgrows it
            self.ring.extend(
                self.hw.create_ipc_buffer(max(need, 1))
                for _ in range(self.init_info.packed_num_buffers)
            )
        self.update_id += 1
        return {
            **NPUIPCWeightTransferUpdateInfo.fields_from_specs(specs),
            "buffers": [b.handle for b in self.ring],
            "update_id": self.update_id,
        }

    def _agree(self, specs: list[TensorSpec], update: BackgroundCall) -> bool:
        replies = [
            d.expect("ready", self.update_id, "update handshake", update.raise_if_failed)
            for d in self.doorbells
        ]
        ok = all(r.get("ok") for r in replies)
        reason = next((r.get("error") for r in replies if not r.get("ok")), None)
        for d, r in zip(self.doorbells, replies, strict=True):
            if r.get("ok"):
                d.send(go=self.update_id, ok=ok, reason=reason)
        return ok

    def _send(self, plan: list[Bucket], update: BackgroundCall, bar: Progress) -> None:
        poll, ring = update.raise_if_failed, self.ring
        holder: dict[int, Bucket] = {}  # ring slot -> bucket not yet acknowledged
        in_order: list[Bucket] = []

        def acknowledged() -> None:
            done = in_order.pop(0)
            for d in self.doorbells:
                d.expect("done", done.index, f"bucket {done.index} acknowledgement", poll)
            holder.pop(done.index % len(ring), None)
            bar.update(done.nbytes)

        for bucket, tensors in iter_bucket_tensors(plan, iter(self.source)):
            if bucket.nbytes == 0:
                continue
            slot = bucket.index % len(ring)
            while slot in holder:  # wait until the engine has copied the previous occupant
                acknowledged()
            pack_into(ring[slot].tensor[: bucket.nbytes], bucket, tensors, self.hw.copy_bytes)
            self.hw.synchronize()
            for d in self.doorbells:
                d.send(bucket=bucket.index)
            holder[slot] = bucket
            in_order.append(bucket)
        while in_order:
            acknowledged()

    def _succeeded(self) -> None:
        for buf in self.ring:  # every worker has mapped them: take the names off /dev/shm
            buf.unlink()

    def _abort(self) -> None:
        for d in self.doorbells:
            try:
                d.send(abort="the trainer gave up this update")
            except Exception:  # already gone
                pass
            d.close()

    def shutdown(self) -> None:
        for d in self.doorbells:
            d.close()
        self.doorbells = []
        _release(self.ring)
