"""NPU-IPC weight transfer for a trainer colocated on the engine's chips: engine side and infos
(docs/weight-transfer.md#npu-ipc-colocated-trainer; trainer side: ``npu_ipc_trainer.py``).

Each trainer rank exports a ring of ``packed_num_buffers`` bucket-sized staging buffers on its
chip once (CPU: POSIX shared memory); the sender ships ``{chip: handles}``, as vLLM's and
vllm-ascend's IPC engines gather handles per device, and each worker maps its chip's ring once.
Per bucket the trainer fills a free slot and rings a host-local doorbell; the worker loads and
acknowledges. Handles are JSON fields of ``update_weights``, never pickled (no
``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, cast

import torch
from pydantic import Field
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferEngine,
)

from vllm_ascend_rl._registration import NPU_IPC_BACKEND
from vllm_ascend_rl.compat import EngineCompat
from vllm_ascend_rl.device import ImportedBuffer, IpcHandleError, worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer import engine_side
from vllm_ascend_rl.weight_transfer.buckets import Bucket, pieces, slot_bytes
from vllm_ascend_rl.weight_transfer.doorbell import Doorbell
from vllm_ascend_rl.weight_transfer.engine_side import check_init, engine_setup, refused
from vllm_ascend_rl.weight_transfer.ipc_messages import Done, Filled, Go, Hello, Ready, Welcome
from vllm_ascend_rl.weight_transfer.owner import Owner, OwnerState, claim, serve
from vllm_ascend_rl.weight_transfer.receive_pool import storage_use_count
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

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

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


class AscendRLNPUIPCWeightTransferEngine(
    EngineCompat,
    WeightTransferEngine[
        AscendRLNPUIPCWeightTransferInitInfo, AscendRLNPUIPCWeightTransferUpdateInfo
    ],
):
    """Engine (worker) side: maps the trainer's staging buffers once, loads bucket by bucket."""

    init_info_cls = AscendRLNPUIPCWeightTransferInitInfo
    update_info_cls = AscendRLNPUIPCWeightTransferUpdateInfo
    supports_draft_weight_update = False  # vetted against, and loaded into, the target model
    alone_bytes = None  # a tensor larger than a bucket crosses the ring in pieces
    # vLLM's methods that are the same on every transport (engine_side).
    parse_init_info = engine_side.parse_init_info
    parse_update_info = engine_side.parse_update_info
    start_weight_update = engine_side.start_weight_update
    update_weights = engine_side.update_weights
    receive_weights = engine_side.receive_weights
    finish_weight_update = engine_side.finish_weight_update
    shutdown = engine_side.shutdown
    release_buffers = engine_side.release_buffers

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.hw, self.session = engine_setup(self, device, NPU_IPC_BACKEND)
        self.lock = threading.RLock()  # see owner.py
        self.owner: Owner | None = None
        self.init_info: AscendRLNPUIPCWeightTransferInitInfo | None = None
        self.doorbell: Doorbell | None = None
        self._mapped: dict[str, ImportedBuffer] = {}  # handle id -> mapping, imported once
        self._idle: dict[int, int | None] = {}  # id(mapping) -> storage use count when unused
        self._ring: list[ImportedBuffer] = []

    def init_transfer_engine(self, init_info: AscendRLNPUIPCWeightTransferInitInfo) -> None:
        """Connects to this chip's trainer rank, which listens already (a local socket: it
        answers at once or refuses), then watches it on the owner's thread."""
        check_init(self.vllm_config, init_info)
        rank, here = worker_index(self.parallel_config), self.hw.location()
        address = init_info.doorbells.get(here["chip"])
        if address is None:
            raise IpcHandleError(
                f"no trainer rank on chip {here['chip']} of host {here['host']} (trainer ranks "
                f"on chips {sorted(init_info.doorbells)}): NPU IPC needs a trainer rank on "
                "every chip that hosts an engine worker; use the hccl backend otherwise."
            )
        with self.lock:
            owner = claim(self, init_info)
            try:
                doorbell = self._connect(init_info, rank, here, address)
            except Exception as e:
                owner.end(OwnerState.FAILED, f"{type(e).__name__}: {e}")
                raise
            self.doorbell, owner.state = doorbell, OwnerState.UP
        serve(self, owner)

    def _connect(
        self, info: AscendRLNPUIPCWeightTransferInitInfo, rank: int, here: dict, address: str
    ) -> Doorbell:
        doorbell = Doorbell.connect(address, info.timeout_s)
        doorbell.send(Hello(worker=rank, wire=wire_signature(info, None), location=here))
        try:
            refusal = doorbell.expect(Welcome, None, "init handshake").reason
            if refusal is not None:
                raise IpcHandleError(refusal)
        except Exception:
            doorbell.close()
            raise
        logger.info(
            "NPU-IPC weight transfer ready: worker %d, packed=%s, bucket=%d MiB x %d, zero_copy=%s",
            rank,
            info.packed,
            info.packed_buffer_size_bytes >> 20,
            info.packed_num_buffers,
            info.zero_copy,
        )
        return doorbell

    def peer_gone(self) -> str | None:
        return None if self.doorbell is None else self.doorbell.peer_gone()

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
                self._map(info.buffers, plan)
            except IpcHandleError as e:
                verdict, reason = Verdict.REFUSED, str(e)
        assert self.doorbell is not None  # receive_weights: require_up()
        self.doorbell.send(
            Ready(id=info.update_id, verdict=verdict, plan=plan_signature(plan), reason=reason)
        )
        if verdict == Verdict.GO:  # a worker that refused waits for no verdict
            go = self.doorbell.expect(Go, info.update_id, "update handshake")
            verdict, reason = go.verdict, go.reason or "another worker refused it"
        refusal = refused(verdict, True, reason)
        if refusal is not None:
            raise refusal

    def _map(self, buffers: Any, plan: list[Bucket]) -> None:
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
        ring = []
        for h in handles:
            if h["id"] not in self._mapped:
                mapped = self._mapped[h["id"]] = self.hw.open_ipc_buffer(h)
                assert mapped.tensor is not None  # just opened
                self._idle[id(mapped)] = storage_use_count(mapped.tensor)
            ring.append(self._mapped[h["id"]])
        for stale in set(self._mapped) - {h["id"] for h in handles}:
            mapped = self._mapped.pop(stale)
            self._idle.pop(id(mapped), None)
            mapped.close()
        assert self.init_info is not None  # receive_weights: require_up()
        need = slot_bytes(plan, self.init_info.packed_buffer_size_bytes)
        small = min(cast(torch.Tensor, b.tensor).numel() for b in ring)  # open: just mapped
        if small < need:
            raise IpcHandleError(f"staging buffers hold {small} bytes but a bucket needs {need}")
        self._ring = ring

    def buckets(self, plan: list[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Piece k of the update is in slot k % len(ring); a bucket larger than a slot (one
        tensor) arrives in slot-sized pieces, assembled in host memory."""
        assert self.doorbell is not None and self.init_info is not None  # as in agree
        doorbell, ring, piece = self.doorbell, self._ring, self.init_info.packed_buffer_size_bytes
        received = 0
        for bucket in plan:
            whole = self.hw.host_buffer(bucket.nbytes) if bucket.nbytes > piece else None
            for start, n in pieces(bucket.nbytes, piece):
                doorbell.expect(Filled, bucket.index, f"waiting for bucket {bucket.index}")
                slot = ring[received % len(ring)]
                assert slot.tensor is not None  # mapped in agree
                received += 1
                if whole is not None:
                    self.hw.copy_bytes(whole[start : start + n], slot.tensor[:n])
                    self.hw.synchronize()
                    doorbell.send(Done(id=bucket.index))
                elif self.init_info.zero_copy:
                    # Load straight from the trainer's buffer; before handing it back, copy
                    # out only what layerwise reload still holds (tensors of incomplete layers).
                    yield bucket, slot.tensor[:n]
                    self._hand_back(slot)
                    doorbell.send(Done(id=bucket.index))
                else:
                    out = self.session.pool.take(n)
                    self.hw.copy_bytes(out, slot.tensor[:n])
                    self.hw.synchronize()
                    doorbell.send(Done(id=bucket.index))
                    yield bucket, out
            if whole is not None:
                yield bucket, whole

    def _hand_back(self, staging: ImportedBuffer) -> None:
        """A zero-copy bucket is loaded: nothing may still refer to the trainer's buffer."""
        assert staging.tensor is not None  # mapped in agree
        self.session.reload.evacuate(staging.tensor)
        self.hw.synchronize()
        if storage_use_count(staging.tensor) != self._idle[id(staging)]:
            raise RuntimeError(
                "a loaded tensor still refers to the trainer's staging buffer: this model's "
                "loader keeps what it is given, so init with zero_copy=False"
            )

    def disconnect(self, why: str) -> None:
        """Close the doorbell and unmap the trainer's ring (any thread, lock held)."""
        if self.owner is not None:
            self.owner.end(OwnerState.GONE, why)
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self._idle.clear()
        self._ring = []
