"""HCCL weight transfer, engine side and infos (docs/weight-transfer.md#hccl): the trainer,
rank 0, broadcasts to every engine worker, rank ``dp_index * world_size + rank + rank_offset``;
gloo on CPU. The trainer side is :mod:`vllm_ascend_rl.weight_transfer.hccl_trainer`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, ClassVar

import torch
from pydantic import Field
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from vllm_ascend_rl._registration import HCCL_BACKEND
from vllm_ascend_rl.device import worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import Bucket, ReceivePool, pieces
from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel, ChannelError
from vllm_ascend_rl.weight_transfer.engine import AscendRLEngine, refused
from vllm_ascend_rl.weight_transfer.session import TransferFailed
from vllm_ascend_rl.weight_transfer.validation import WeightUpdateRefused
from vllm_ascend_rl.weight_transfer.wire import (
    CheckpointUpdateInfo,
    EngineInitInfo,
    Verdict,
    WireParams,
    plan_signature,
    wire_dataclass,
    wire_signature,
)

if TYPE_CHECKING:
    from torch.distributed import Work

logger = get_logger(__name__)

# Packed, a tensor above this is broadcast alone from its own memory: staging would only add a
# memcpy to a transfer long enough to amortize its collective.
DIRECT_BYTES = 8 << 20


@wire_dataclass
class HCCLTrainerInitInfo(TrainerInitInfo, WireParams):
    """Trainer-side init info; ``world_size`` = 1 trainer + every engine worker (TP*PP*DP)."""

    backend: ClassVar[str] = HCCL_BACKEND

    master_address: Annotated[str, Field(min_length=1)]
    master_port: Annotated[int, Field(gt=0, lt=65536)]
    world_size: Annotated[int, Field(ge=2)]


@wire_dataclass
class AscendRLHCCLWeightTransferInitInfo(EngineInitInfo):
    """Engine-side init info; the trainer fills it in (rank 0 hosts the rendezvous)."""

    master_address: Annotated[str, Field(min_length=1)]
    master_port: Annotated[int, Field(gt=0, lt=65536)]
    world_size: Annotated[int, Field(ge=2)]
    rank_offset: Annotated[int, Field(ge=1)] = 1


@wire_dataclass
class AscendRLHCCLWeightTransferUpdateInfo(CheckpointUpdateInfo):
    """One update's metadata, in the order the trainer broadcasts the tensors."""


class HCCLLink:
    """This worker's end of the broadcast group (an :class:`EngineLink`)."""

    def __init__(
        self, channel: BroadcastChannel, info: AscendRLHCCLWeightTransferInitInfo, pool: ReceivePool
    ) -> None:
        self.channel, self.info, self.pool = channel, info, pool

    def opened(self) -> None:
        self.channel.mark_up()  # the trainer's init returns once every rank has said so

    def peer_gone(self) -> str | None:
        return self.channel.peer_gone()

    def close(self) -> None:
        self.channel.close()

    def agree(
        self,
        verdict: Verdict,
        reason: str | None,
        plan: list[Bucket],
        info: AscendRLHCCLWeightTransferUpdateInfo | None = None,
    ) -> None:
        """The update handshake; raises unless every rank goes ahead with the same plan."""
        try:
            outcome = self.channel.agree(verdict, plan_signature(plan), "update handshake")
        except ChannelError as e:
            if reason is not None:  # an update_weights no trainer takes part in
                raise WeightUpdateRefused(f"{reason} (and no trainer joined: {e})") from e
            raise TransferFailed(f"the trainer did not join the update: {e}") from e
        refusal = refused(*outcome, reason)
        if refusal is not None:
            raise refusal

    def buckets(self, plan: list[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Buckets i+1.. are in flight while bucket i loads. A larger bucket (one tensor) comes
        in bucket-sized pieces assembled in host memory: no device buffer exceeds a bucket."""
        depth, piece = self.info.packed_num_buffers, self.info.packed_buffer_size_bytes
        in_flight: deque = deque()
        for bucket in plan:
            whole = (
                self.channel.device.host_buffer(bucket.nbytes) if bucket.nbytes > piece else None
            )
            for start, n in pieces(bucket.nbytes, piece):
                # Never a buffer whose views layerwise reload still holds (see ReceivePool).
                buf = self.pool.take(n)
                in_flight.append((bucket, buf, self.channel.broadcast(buf), whole, start))
                if len(in_flight) >= depth:
                    yield from self._landed(*in_flight.popleft())
        while in_flight:
            yield from self._landed(*in_flight.popleft())

    def _landed(
        self, bucket: Bucket, buf: torch.Tensor, work: Work, whole: torch.Tensor | None, start: int
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        self.channel.wait(work, f"receiving bucket {bucket.index}")
        if whole is None:
            yield bucket, buf
            return
        whole[start : start + buf.numel()].copy_(buf)  # waits for the device-to-host copy
        if start + buf.numel() == bucket.nbytes:
            yield bucket, whole


class AscendRLHCCLWeightTransferEngine(
    AscendRLEngine[
        AscendRLHCCLWeightTransferInitInfo, AscendRLHCCLWeightTransferUpdateInfo, HCCLLink
    ]
):
    """Engine (worker) side of the HCCL transport."""

    init_info_cls = AscendRLHCCLWeightTransferInitInfo
    update_info_cls = AscendRLHCCLWeightTransferUpdateInfo
    backend = HCCL_BACKEND
    alone_bytes = DIRECT_BYTES  # large tensors are broadcast from their own memory
    connects_in_background = True  # the init returns before the rendezvous (timeout_s from now)

    def dial(self, info: AscendRLHCCLWeightTransferInitInfo) -> Callable[[float], HCCLLink]:
        rank = worker_index(self.parallel_config) + info.rank_offset
        if rank >= info.world_size:  # refused before any rendezvous: no wait
            raise ValueError(
                f"world_size={info.world_size} leaves no rank for engine worker "
                f"{rank - info.rank_offset} (rank_offset={info.rank_offset}): "
                "world_size must count the trainer and every engine worker (TP x PP x DP)"
            )

        def connect(deadline: float) -> HCCLLink:  # the rendezvous and the init handshake
            channel = BroadcastChannel.open(
                self.hw,
                info.master_address,
                info.master_port,
                rank,
                info.world_size,
                info.timeout_s,
                within_s=max(0.0, deadline - time.monotonic()),
            )
            try:
                sig = wire_signature(info, DIRECT_BYTES)
                left = max(0.0, deadline - time.monotonic())
                # The init handshake's code: what holds this worker's steps (readiness.StepHold).
                _, same = channel.agree(self.step_hold, sig, "init handshake", timeout_s=left)
                if not same:
                    raise ValueError(
                        "trainer and engine disagree on the weight-transfer protocol or wire "
                        f"parameters (engine: {info}); upgrade one side or re-run trainer_init"
                    )
            except Exception:
                channel.close()
                raise
            logger.info(
                "HCCL weight transfer ready: rank %d of %d over %s, packed=%s, bucket=%d MiB x %d",
                rank,
                info.world_size,
                self.hw.collective_backend,
                info.packed,
                info.packed_buffer_size_bytes >> 20,
                info.packed_num_buffers,
            )
            return HCCLLink(channel, info, self.session.pool)

        return connect
