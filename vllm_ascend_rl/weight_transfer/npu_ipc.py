"""NPU-IPC weight transfer for a trainer colocated on the engine's chips: engine side and infos
(docs/weight-transfer.md#npu-ipc-colocated-trainer; trainer side: ``npu_ipc_trainer.py``).

Each trainer rank exports a ring of ``packed_num_buffers`` bucket-sized staging buffers on its
chip once (CPU: POSIX shared memory); the sender ships ``{chip: handles}``, as vLLM's and
vllm-ascend's IPC engines gather handles per device, and each worker maps its chip's ring once.
Per bucket the trainer fills a free slot and rings a host-local doorbell; the worker loads and
acknowledges. Handles are JSON fields of ``update_weights``, never pickled (no
``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import cycle
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from vllm_ascend_rl._registration import NPU_IPC_BACKEND
from vllm_ascend_rl.device import Device, ImportedBuffer, IpcHandleError, worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import Bucket, pieces, slot_bytes, storage_use_count
from vllm_ascend_rl.weight_transfer.doorbell import (
    Done,
    Doorbell,
    Filled,
    Go,
    Hello,
    Ready,
    Welcome,
)
from vllm_ascend_rl.weight_transfer.engine import AscendRLEngine, refused
from vllm_ascend_rl.weight_transfer.session import UpdateSession
from vllm_ascend_rl.weight_transfer.wire import (
    BucketBytes,
    CheckpointUpdateInfo,
    EngineInitInfo,
    NumBuffers,
    Verdict,
    WireParams,
    plan_signature,
    wire_dataclass,
    wire_signature,
)

logger = get_logger(__name__)

# Staging copies stream best in cache-sized pieces (benchmarks/README.md).
DEFAULT_BUCKET_BYTES = 32 << 20
DEFAULT_NUM_BUFFERS = 4


@wire_dataclass
class NPUIPCTrainerInitInfo(TrainerInitInfo, WireParams):
    """Trainer-side init info; ``rank`` 0 sends. ``zero_copy``: the engine loads straight from
    the ring instead of copying each bucket out first (fixed at init)."""

    backend: ClassVar[str] = NPU_IPC_BACKEND

    packed_buffer_size_bytes: BucketBytes = DEFAULT_BUCKET_BYTES
    packed_num_buffers: NumBuffers = DEFAULT_NUM_BUFFERS
    zero_copy: bool = True


@wire_dataclass
class AscendRLNPUIPCWeightTransferInitInfo(EngineInitInfo):
    """Engine-side init info; the trainer fills it in."""

    doorbells: Annotated[dict[str, str], Field(min_length=1)]  # chip -> that rank's doorbell
    packed_buffer_size_bytes: BucketBytes = DEFAULT_BUCKET_BYTES
    packed_num_buffers: NumBuffers = DEFAULT_NUM_BUFFERS
    zero_copy: bool = True


@wire_dataclass
class AscendRLNPUIPCWeightTransferUpdateInfo(CheckpointUpdateInfo):
    """Metadata plus the staging buffers' handles per chip, as plain JSON."""

    # {chip: [handle, ...]}, typed Any: _map refuses a bad one in the handshake (connection kept)
    buffers: Any = field(default_factory=dict)
    update_id: int = 0


@dataclass(eq=False)
class IPCLink:
    """This worker's doorbell to its chip's trainer rank and its mapping of that rank's ring
    (an :class:`EngineLink`)."""

    doorbell: Doorbell
    info: AscendRLNPUIPCWeightTransferInitInfo
    hw: Device
    session: UpdateSession
    # _mapped: handle id -> (mapping, its storage's use count when nothing else uses it), each
    # handle mapped once; _ring: this update's slots
    _mapped: dict[str, tuple[ImportedBuffer, int | None]] = field(default_factory=dict, init=False)
    _ring: list[tuple[torch.Tensor, int | None]] = field(default_factory=list, init=False)

    def opened(self) -> None:
        pass  # the trainer counted this worker's hello when its init call returned

    def peer_gone(self) -> str | None:
        return self.doorbell.peer_gone()

    def close(self) -> None:
        """Close the doorbell and unmap the trainer's ring."""
        self.doorbell.close()
        for mapped, _ in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self._ring = []

    def agree(
        self,
        verdict: Verdict,
        reason: str | None,
        plan: list[Bucket],
        info: AscendRLNPUIPCWeightTransferUpdateInfo,
    ) -> None:
        """The update handshake over the doorbell: this worker's verdict (after mapping the
        ring) and plan go to its trainer rank, which answers with everyone's verdict."""
        if verdict == Verdict.GO:
            try:
                self.map(info.buffers, plan)
            except IpcHandleError as e:
                verdict, reason = Verdict.REFUSED, str(e)
        self.doorbell.send(
            Ready(id=info.update_id, verdict=verdict, plan=plan_signature(plan), reason=reason)
        )
        if verdict == Verdict.GO:  # a worker that refused waits for no verdict
            go = self.doorbell.expect(Go, info.update_id, "update handshake")
            verdict, reason = go.verdict, go.reason or "another worker refused it"
        refusal = refused(verdict, True, reason)
        if refusal is not None:
            raise refusal

    def map(self, buffers: Any, plan: list[Bucket]) -> None:
        """Map this worker's chip's ring (each handle imported once); IpcHandleError if unfit."""
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
        for h in handles:
            if h["id"] not in self._mapped:
                mapped = self.hw.open_ipc_buffer(h)
                self._mapped[h["id"]] = mapped, storage_use_count(mapped.open_tensor())
        for stale in set(self._mapped) - {h["id"] for h in handles}:
            self._mapped.pop(stale)[0].close()
        ring = [(m.open_tensor(), idle) for m, idle in (self._mapped[h["id"]] for h in handles)]
        need = slot_bytes(plan, self.info.packed_buffer_size_bytes)
        small = min(t.numel() for t, _ in ring)
        if small < need:
            raise IpcHandleError(f"staging buffers hold {small} bytes but a bucket needs {need}")
        self._ring = ring

    def buckets(self, plan: list[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Piece k of the update is in slot k % len(ring); a bucket larger than a slot (one
        tensor) arrives in slot-sized pieces, assembled in host memory."""
        doorbell, piece = self.doorbell, self.info.packed_buffer_size_bytes
        slots = cycle(self._ring)
        for bucket in plan:
            whole = self.hw.host_buffer(bucket.nbytes) if bucket.nbytes > piece else None
            for start, n in pieces(bucket.nbytes, piece):
                doorbell.expect(Filled, bucket.index, f"waiting for bucket {bucket.index}")
                slot, idle = next(slots)
                if whole is None and self.info.zero_copy:
                    # Load straight from the trainer's buffer; before handing it back, copy
                    # out only what layerwise reload still holds (tensors of incomplete layers).
                    yield bucket, slot[:n]
                    self._hand_back(slot, idle)
                    doorbell.send(Done(id=bucket.index))
                    continue
                out = self.session.pool.take(n) if whole is None else whole[start : start + n]
                self.hw.copy_bytes(out, slot[:n])
                self.hw.synchronize()
                doorbell.send(Done(id=bucket.index))
                if whole is None:
                    yield bucket, out
            if whole is not None:
                yield bucket, whole

    def _hand_back(self, staging: torch.Tensor, idle: int | None) -> None:
        """A zero-copy bucket is loaded: nothing may still refer to the trainer's buffer."""
        self.session.reload.evacuate(staging)
        self.hw.synchronize()
        if storage_use_count(staging) != idle:
            raise RuntimeError(
                "a loaded tensor still refers to the trainer's staging buffer: this model's "
                "loader keeps what it is given, so init with zero_copy=False"
            )


class AscendRLNPUIPCWeightTransferEngine(
    AscendRLEngine[
        AscendRLNPUIPCWeightTransferInitInfo, AscendRLNPUIPCWeightTransferUpdateInfo, IPCLink
    ]
):
    """Engine (worker) side of the NPU-IPC transport."""

    init_info_cls = AscendRLNPUIPCWeightTransferInitInfo
    update_info_cls = AscendRLNPUIPCWeightTransferUpdateInfo
    backend = NPU_IPC_BACKEND
    alone_bytes = None  # a tensor larger than a bucket crosses the ring in pieces
    connects_in_background = False  # the trainer listens already: it answers at once or refuses

    def dial(self, info: AscendRLNPUIPCWeightTransferInitInfo) -> Callable[[float], IPCLink]:
        rank, here = worker_index(self.parallel_config), self.hw.location()
        address = info.doorbells.get(here["chip"])
        if address is None:
            raise IpcHandleError(
                f"no trainer rank on chip {here['chip']} of host {here['host']} (trainer ranks "
                f"on chips {sorted(info.doorbells)}): NPU IPC needs a trainer rank on "
                "every chip that hosts an engine worker; use the hccl backend otherwise."
            )

        def connect(deadline: float) -> IPCLink:
            doorbell = Doorbell.connect(address, max(0.001, deadline - time.monotonic()))
            try:
                wire, hold = wire_signature(info, None), self.step_hold
                doorbell.send(Hello(worker=rank, wire=wire, location=here, step_hold=hold))
                refusal = doorbell.expect(Welcome, None, "init handshake").reason
                if refusal is not None:
                    raise IpcHandleError(refusal)
            except Exception:
                doorbell.close()
                raise
            logger.info(
                "NPU-IPC weight transfer ready: worker %d, packed=%s, bucket=%d MiB x %d, "
                "zero_copy=%s",
                rank,
                info.packed,
                info.packed_buffer_size_bytes >> 20,
                info.packed_num_buffers,
                info.zero_copy,
            )
            return IPCLink(doorbell, info, self.hw, self.session)

        return connect
