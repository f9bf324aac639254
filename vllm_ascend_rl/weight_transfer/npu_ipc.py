"""NPU-IPC weight transfer for trainers colocated with the engine on the same chips.

No weight crosses a wire. Every trainer rank owns a small ring of staging buffers on its own
chip (``packed_num_buffers`` of them, each large enough for the largest bucket), exported once as
device IPC handles (on CPU hosts: POSIX shared memory, mode 0600, random names; each engine
worker and trainer rank emulates a chip of its own). The sender ships ``{chip: handles}``, as
vLLM's and vllm-ascend's IPC engines gather handles per device, and every engine worker maps
the ring of its own chip once and caches it. Per bucket the trainer rank of a chip copies the
tensors into a free buffer and rings a host-local doorbell; the engine loads the bucket and
acknowledges, so the buffer is reused while the engine loads. Handles travel as explicit JSON
fields of ``update_weights`` (never pickled: no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).
Shared-memory names are unlinked as soon as the engine has mapped them (after the first
update) or when the trainer exits.

This module holds the engine side and the init/update infos; the trainer side is
:mod:`vllm_ascend_rl.weight_transfer.npu_ipc_trainer`.

Trainer side (one rank per chip the engine uses; ``torch.distributed`` initialized across the
ranks when there is more than one)::

    vllm_ascend_rl.register()
    engine = WeightTransferTrainerFactory.trainer_init(NPUIPCTrainerInitInfo(rank=rank),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights(weight_version="step-7")   # on every rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferInitInfo,
)

from vllm_ascend_rl._registration import NPU_IPC_BACKEND
from vllm_ascend_rl.device import ImportedBuffer, IpcHandleError
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import Bucket, pieces, slot_bytes
from vllm_ascend_rl.weight_transfer.doorbell import Doorbell
from vllm_ascend_rl.weight_transfer.engine_base import CheckpointEngine
from vllm_ascend_rl.weight_transfer.receive_pool import storage_use_count
from vllm_ascend_rl.weight_transfer.wire import (
    DEFAULT_ON_FAILURE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_VALIDATION,
    PROTOCOL_VERSION,
    CheckpointUpdateInfo,
    check_wire,
    wire_signature,
)

logger = get_logger(__name__)

# Staging copies stream best in cache-friendly pieces: with a 1 GB model on CPU, 16-32 MiB
# buckets moved the data in 1.8-2.3x one memcpy, 256 MiB buckets in 2.8x (benchmarks/).
DEFAULT_BUCKET_BYTES = 32 << 20
DEFAULT_NUM_BUFFERS = 4


@dataclass(kw_only=True)
class AscendRLNPUIPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info; the trainer fills it in."""

    doorbells: dict[str, str]  # chip -> the doorbell of the trainer rank on that chip
    zero_copy: bool = True  # load from the staging buffer; False copies each bucket out
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_failure: str = DEFAULT_ON_FAILURE  # "restore" or "hold": docs/failure-semantics.md
    validation: str = DEFAULT_VALIDATION  # "partial" or "complete": docs/failure-semantics.md
    delta: bool = False  # changed elements only (a host copy each side): docs/weight-transfer.md
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_wire(self)
        if not (
            isinstance(self.doorbells, dict)
            and self.doorbells
            and all(isinstance(k, str) and isinstance(v, str) for k, v in self.doorbells.items())
        ):
            raise ValueError(
                f"doorbells must map chips to the trainer ranks' socket names, got "
                f"{self.doorbells!r}"
            )


@dataclass
class NPUIPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``rank`` (keyword-only; 0 sends), ``packed``, bucket bytes.
    Every trainer rank owns a ring on its own chip."""

    backend: ClassVar[str] = NPU_IPC_BACKEND

    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_failure: str = DEFAULT_ON_FAILURE  # "restore" or "hold": docs/failure-semantics.md
    validation: str = DEFAULT_VALIDATION  # "partial" or "complete": docs/failure-semantics.md
    delta: bool = False  # changed elements only (a host copy each side): docs/weight-transfer.md

    def __post_init__(self) -> None:
        check_wire(self)


@dataclass
class AscendRLNPUIPCWeightTransferUpdateInfo(CheckpointUpdateInfo):
    """Metadata plus the staging buffers' handles per chip, as plain JSON."""

    # {chip: [handle, ...]}: checked by the engine's _map, whose refusal reaches the trainer
    # through the update handshake (the connection stays usable)
    buffers: Any = field(default_factory=dict)
    update_id: int = 0


class AscendRLNPUIPCWeightTransferEngine(CheckpointEngine):
    """Engine (worker) side: maps the trainer's staging buffers once, copies buckets out."""

    init_info_cls = AscendRLNPUIPCWeightTransferInitInfo
    update_info_cls = AscendRLNPUIPCWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.doorbell: Doorbell | None = None
        self._mapped: dict[str, ImportedBuffer] = {}  # handle id -> mapping, imported once
        self._idle: dict[int, int | None] = {}  # id(mapping) -> storage use count when unused
        self._ring: list[ImportedBuffer] = []

    def init_transfer_engine(self, init_info: AscendRLNPUIPCWeightTransferInitInfo) -> None:
        self._check_init(init_info)
        rank, here = self.worker_index, self.hw.location()
        address = init_info.doorbells.get(here["chip"])
        if address is None:
            raise IpcHandleError(
                f"no trainer rank on chip {here['chip']} of host {here['host']} (trainer ranks "
                f"on chips {sorted(init_info.doorbells)}): NPU IPC needs a trainer rank on "
                "every chip that hosts an engine worker; use the hccl backend otherwise."
            )
        doorbell = Doorbell.connect(address, init_info.timeout_s)
        doorbell.send(
            hello=rank,
            protocol=init_info.protocol_version,
            wire=wire_signature(init_info),
            location=here,
        )
        try:
            reply = doorbell.recv("init handshake")
        except Exception:
            doorbell.close()
            raise
        if not reply.get("welcome"):
            doorbell.close()
            raise IpcHandleError(reply.get("error") or f"trainer refused us: {reply}")
        self._before_init()  # only now: a failed init leaves the live connection alone
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

    def _map(self, buffers: Any, plan: list[Bucket]) -> None:
        """Map the ring of staging buffers on this worker's chip, reusing cached mappings
        (imported once)."""
        if not isinstance(buffers, dict):
            raise IpcHandleError(f"malformed buffers field: {str(buffers)[:200]}")
        here = self.hw.location()
        handles = buffers.get(here["chip"])
        if handles is None:
            raise IpcHandleError(
                f"no staging buffers for chip {here['chip']} of host {here['host']} (rings on "
                f"chips {sorted(buffers)[:8]}): every chip that hosts an engine worker needs a "
                "trainer rank with a ring of its own"
            )
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
        need = slot_bytes(plan, self.init_info.packed_buffer_size_bytes)
        small = min(b.tensor.numel() for b in ring)
        if small < need:
            raise IpcHandleError(f"staging buffers hold {small} bytes but a bucket needs {need}")
        self._ring = ring

    def _buckets(self, plan: list[Bucket], update_info):
        """Piece k of the update is in ring slot k % len(ring). A bucket larger than a slot
        (one tensor) arrives in slot-sized pieces, assembled in host memory."""
        doorbell, ring, piece = self.doorbell, self._ring, self.init_info.packed_buffer_size_bytes
        received = 0
        for bucket in plan:
            whole = self.hw.host_buffer(bucket.nbytes) if bucket.nbytes > piece else None
            for start, n in pieces(bucket.nbytes, piece):
                doorbell.expect("bucket", bucket.index, f"waiting for bucket {bucket.index}")
                slot = ring[received % len(ring)]
                received += 1
                if whole is not None:
                    self.hw.copy_bytes(whole[start : start + n], slot.tensor[:n])
                    self.hw.synchronize()
                    doorbell.send(done=bucket.index)
                elif self.init_info.zero_copy:
                    # Load straight from the trainer's buffer; before handing it back, copy
                    # out only what layerwise reload still holds (tensors of incomplete layers).
                    yield bucket, slot.tensor[:n]
                    self._hand_back(slot)
                    doorbell.send(done=bucket.index)
                else:
                    out = self.pool.take(n)
                    self.hw.copy_bytes(out, slot.tensor[:n])
                    self.hw.synchronize()
                    doorbell.send(done=bucket.index)
                    yield bucket, out
            if whole is not None:
                yield bucket, whole

    def _hand_back(self, staging: ImportedBuffer) -> None:
        """A zero-copy bucket is loaded: nothing may still refer to the trainer's buffer."""
        self.reload.evacuate(staging.tensor)
        self.hw.synchronize()
        if storage_use_count(staging.tensor) != self._idle[id(staging)]:
            self.init_info.zero_copy = False  # the next update copies every bucket
            raise RuntimeError(
                "a loaded tensor still refers to the trainer's staging buffer; this engine "
                "switched to copying buckets out, retry the update"
            )

    def _disconnect(self) -> None:
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self._idle.clear()
        self._ring = []
