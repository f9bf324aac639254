"""HCCL weight transfer: the trainer (rank 0) broadcasts checkpoint-format weights to every
engine worker (rank ``dp_index * world_size + rank + rank_offset``).

On Ascend the collective is HCCL; on CPU hosts the same code runs over gloo (see
:mod:`vllm_ascend_rl.device`). Wire parameters (packed, bucket size, buffers, timeout) are sent
by the trainer at init and confirmed by a signature all-reduce, so the two sides cannot decode
differently. Every update is validated against the model before any byte moves, agreed by all
ranks, then streamed in buckets while the engine loads the previous bucket (double buffering).

Trainer side::

    vllm_ascend_rl.register()
    engine = WeightTransferTrainerFactory.trainer_init(
        HCCLTrainerInitInfo(master_address=ip, master_port=port, world_size=n + 1, rank=0),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    result = engine.send_weights(weight_version="step-7")   # bytes, seconds, GB/s
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
)

from vllm_ascend_rl._registration import HCCL_BACKEND
from vllm_ascend_rl.device.group import exec_timeout_s
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    TensorSpec,
    as_bytes,
    iter_bucket_tensors,
    pack_into,
    pieces,
)
from vllm_ascend_rl.weight_transfer.channel import (
    REFUSAL_GRACE_S,
    STALE_HANDSHAKE,
    BroadcastChannel,
    ChannelError,
)
from vllm_ascend_rl.weight_transfer.engine_base import CheckpointEngine
from vllm_ascend_rl.weight_transfer.trainer_side import (
    BackgroundCall,
    CheckpointTrainer,
    Progress,
    WeightSyncError,
    check_world_size,
)
from vllm_ascend_rl.weight_transfer.wire import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_NUM_BUFFERS,
    DEFAULT_ON_FAILURE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_VALIDATION,
    PROTOCOL_VERSION,
    CheckpointUpdateInfo,
    check_wire,
    engine_wire,
    update_signature,
    wire_signature,
)

logger = get_logger(__name__)

# Packed, small tensors share buckets (one collective each) and tensors above this go straight
# from their own memory: a staging copy would only add a memcpy to a transfer already long
# enough to amortize the per-collective cost. Unpacked: one tensor per collective.
DIRECT_BYTES = 8 << 20


@dataclass(kw_only=True)
class AscendRLHCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info; the trainer fills it in (rank 0 hosts the rendezvous)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
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
        if not self.master_address:
            raise ValueError("master_address must name the trainer's host, got ''")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port!r}")
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 trains), got {self.rank_offset}")
        if self.world_size < 2:
            raise ValueError(
                f"world_size must count the trainer and at least one worker, got {self.world_size}"
            )


@dataclass
class HCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. ``world_size`` = 1 trainer + every engine worker (TP*PP*DP).

    ``timeout_s`` bounds every rendezvous and collective: a dead peer turns into an error
    within it, never a hang.
    """

    backend: ClassVar[str] = HCCL_BACKEND

    master_address: str
    master_port: int
    world_size: int
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
class AscendRLHCCLWeightTransferUpdateInfo(CheckpointUpdateInfo):
    """One update's metadata, in the order the trainer broadcasts the tensors."""


class AscendRLHCCLWeightTransferEngine(CheckpointEngine):
    """Engine (worker) side. Loads through vLLM's layerwise reload; refuses bad updates whole."""

    init_info_cls = AscendRLHCCLWeightTransferInitInfo
    update_info_cls = AscendRLHCCLWeightTransferUpdateInfo
    alone_bytes = DIRECT_BYTES

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.channel: BroadcastChannel | None = None
        self._owe_stale = False  # a trainer update met a pending refusal; answer its call

    def init_transfer_engine(self, init_info: AscendRLHCCLWeightTransferInitInfo) -> None:
        self._check_init(init_info)
        rank = self.worker_index + init_info.rank_offset
        if rank >= init_info.world_size:  # refused before any rendezvous: no wait
            raise ValueError(
                f"world_size={init_info.world_size} leaves no rank for engine worker "
                f"{self.worker_index} (rank_offset={init_info.rank_offset}): world_size must "
                "count the trainer and every engine worker (TP x PP x DP)"
            )
        # The live connection (if any) stays until the new one is up: a stale trainer's
        # failed init must not break the trainer that is connected.
        channel = BroadcastChannel.open(
            self.hw,
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )
        ok = init_info.protocol_version == PROTOCOL_VERSION
        try:
            all_ok, same = channel.agree(ok, wire_signature(init_info), "init handshake")
        except ChannelError:
            channel.close()
            raise
        if not (all_ok and same):
            channel.close()
            raise ValueError(
                "trainer and engine disagree on the weight-transfer wire parameters "
                f"(engine: protocol {init_info.protocol_version}, packed={init_info.packed}, "
                f"bucket={init_info.packed_buffer_size_bytes}, "
                f"buffers={init_info.packed_num_buffers}); re-run trainer_init"
            )
        self._before_init()
        self.channel = channel
        self._after_init(init_info)
        logger.info(
            "HCCL weight transfer ready: rank %d of %d over %s, packed=%s, bucket=%d MiB x %d",
            rank,
            init_info.world_size,
            self.hw.collective_backend,
            init_info.packed,
            init_info.packed_buffer_size_bytes >> 20,
            init_info.packed_num_buffers,
        )

    # -- transport hooks ---------------------------------------------------------------
    def _connected(self) -> bool:
        return self.channel is not None and not self.channel.broken

    def _agree(self, refusal, specs, update_info) -> str | None:
        channel, sig = self.channel, update_signature(specs) if specs else 0
        # An earlier refusal is pending (nobody joined its handshake in time). A trainer's
        # update meets it: this call is that update's, and the trainer was told "refused".
        # A refusal settles one that is already met too, so a hand-written call that lands
        # between the trainer's handshake and the trainer's own call cannot steal the answer.
        settle = channel.deferred is not None and (refusal is None or channel.deferred_met())
        if settle and not channel.settle_deferred("a refused update's handshake"):
            self._owe_stale = True
        if refusal is not None:
            if not self._owe_stale:  # else the trainer is not in this handshake
                channel.refuse(sig, "update handshake", REFUSAL_GRACE_S)
            if channel.broken:  # NPU: the refusal could not stay pending
                self._disconnect()
                return (
                    f"{refusal}; {channel.broken}, so the connection was closed: call "
                    "init_weight_transfer_engine again"
                )
            return str(refusal)
        if self._owe_stale:
            self._owe_stale = False
            return STALE_HANDSHAKE
        all_ok, same = channel.agree(True, sig, "update handshake")
        if all_ok and same:
            return None
        return (
            "the trainer aborted it"
            if not all_ok
            else "the trainer's metadata differs from update_info"
        )

    def _buckets(self, plan: list[Bucket], update_info):
        """Bucket i+1.. are in flight while bucket i is loaded. A bucket larger than the
        agreed bucket size (a tensor sent alone) travels in pieces of that size, assembled in
        host memory, so no receive buffer on the device is larger than a bucket."""
        depth, piece = self.init_info.packed_num_buffers, self.init_info.packed_buffer_size_bytes
        in_flight: deque = deque()
        for bucket in plan:
            whole = self.hw.host_buffer(bucket.nbytes) if bucket.nbytes > piece else None
            for start, n in pieces(bucket.nbytes, piece):
                # Never a buffer whose views layerwise reload still holds (see ReceivePool).
                buf = self.pool.take(n)
                in_flight.append((bucket, buf, self.channel.broadcast(buf), whole, start))
                if len(in_flight) >= depth:
                    yield from self._landed(*in_flight.popleft())
        while in_flight:
            yield from self._landed(*in_flight.popleft())

    def _landed(self, bucket: Bucket, buf: torch.Tensor, work, whole, start: int):
        self.channel.wait(work, f"receiving bucket {bucket.index}")
        if whole is None:
            yield bucket, buf
            return
        whole[start : start + buf.numel()].copy_(buf)  # waits for the device-to-host copy
        if start + buf.numel() == bucket.nbytes:
            yield bucket, whole

    def _disconnect(self) -> None:
        self._owe_stale = False
        channel, self.channel = self.channel, None
        if channel is None:
            return
        if channel.broken or channel.deferred is not None:  # a collective may stay queued
            deadline = time.monotonic() + exec_timeout_s(channel.timeout_s)
            self.device_busy_until = max(self.device_busy_until, deadline)
        channel.close()


class AscendRLHCCLTrainerWeightTransferEngine(CheckpointTrainer):
    """Trainer side. Rank 0 drives start/update/finish over ``client`` and broadcasts;
    other trainer ranks only iterate the source (its gathers are collectives)."""

    init_info_cls = HCCLTrainerInitInfo
    alone_bytes = DIRECT_BYTES

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: HCCLTrainerInitInfo,
        device=None,
    ) -> None:
        super().__init__(client=client, source=source, init_info=init_info, device=device)
        self.channel: BroadcastChannel | None = None
        self._staging: list[torch.Tensor] = []

    transport: ClassVar[str] = "HCCL"

    def _connect(self) -> None:
        if not self.is_sender:  # the group is the sender and the engine workers
            return
        info = self.init_info
        check_world_size(self.client, info.world_size)
        worker_info = AscendRLHCCLWeightTransferInitInfo(
            master_address=info.master_address,
            master_port=info.master_port,
            world_size=info.world_size,
            **engine_wire(info),
        )
        # The engine blocks in /init_weight_transfer_engine until the group forms, and rank 0
        # (us) hosts the rendezvous: both must run at once, and either may fail first.
        init_call = BackgroundCall(
            "init_weight_transfer_engine",
            self.client.init_weight_transfer_engine,
            asdict(worker_info),
        )
        opening = BackgroundCall(
            "rendezvous",
            BroadcastChannel.open,
            self.hw,
            info.master_address,
            info.master_port,
            0,
            info.world_size,
            info.timeout_s,
        )
        while not opening.wait(0.05):  # BroadcastChannel.open gives up after timeout_s
            init_call.raise_if_failed()
        channel = opening.result(0)
        try:
            all_ok, same = channel.agree(
                True, wire_signature(info), "init handshake", init_call.raise_if_failed
            )
            if not (all_ok and same):
                raise WeightSyncError(
                    f"engine rejected the wire parameters: {init_call.failure(info.timeout_s)}"
                )
            init_call.result(info.timeout_s)
        except Exception:
            channel.close()
            raise
        self.channel = channel

    # -- transport hooks ---------------------------------------------------------------
    def _not_ready(self) -> str | None:
        if self.channel is None:
            return "not connected"
        return self.channel.broken

    def _payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict:
        return AscendRLHCCLWeightTransferUpdateInfo.fields_from_specs(specs)

    def _agree(self, specs: list[TensorSpec], update: BackgroundCall) -> bool:
        all_ok, same = self.channel.agree(
            True, update_signature(specs), "update handshake", update.raise_if_failed
        )
        return all_ok and same

    def _send(self, plan: list[Bucket], pairs, update: BackgroundCall, bar: Progress) -> None:
        channel, depth = self.channel, self.init_info.packed_num_buffers
        piece = self.init_info.packed_buffer_size_bytes
        staging = self._staging_buffers(plan, depth)
        in_flight: deque = deque()  # (bucket, work, the bytes it sends, staging slot or None)
        poll = update.raise_if_failed

        def oldest_done() -> None:
            bucket, work, sent, _ = in_flight.popleft()
            channel.wait(work, f"sending bucket {bucket.index}", poll)
            bar.update(sent.numel())

        for i, (bucket, tensors) in enumerate(iter_bucket_tensors(plan, pairs)):
            slot = None if bucket.oversized else i % depth
            if slot is None:  # from itself (a delta's host-side indices go to the device)
                send = as_bytes(tensors[0].to(self.hw.torch_device()))
            else:
                while any(entry[3] == slot for entry in in_flight):  # free before reuse
                    oldest_done()
                send = staging[slot][: bucket.nbytes]
                # No synchronize: the collective's stream waits for the current stream,
                # where the pack was queued (torch_npu ProcessGroupHCCL.cpp:267-279), and a
                # device-wide sync would also wait for the broadcast in flight.
                pack_into(send, bucket, tensors, self.hw.copy_bytes)
            for start, n in pieces(bucket.nbytes, piece):
                if len(in_flight) >= depth:
                    oldest_done()
                part = send[start : start + n]
                in_flight.append((bucket, channel.broadcast(part), part, slot))
        while in_flight:
            oldest_done()

    def _staging_buffers(self, plan: list[Bucket], depth: int) -> list[torch.Tensor]:
        need = max((b.nbytes for b in plan if not b.oversized), default=0)
        if len(self._staging) != depth or (self._staging and self._staging[0].numel() < need):
            self._staging = [
                torch.empty(need, dtype=torch.uint8, device=self.hw.torch_device())
                for _ in range(depth)
            ]
        return self._staging

    def _abort(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
