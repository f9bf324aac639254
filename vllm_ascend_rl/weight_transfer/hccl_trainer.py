"""HCCL weight transfer, trainer side (engine side: ``hccl.py``): rank 0 drives the update and
broadcasts; other ranks only iterate the source (its gathers are collectives)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict

import torch

from vllm_ascend_rl.readiness import StepHold
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    as_bytes,
    iter_bucket_tensors,
    pack_into,
    pieces,
)
from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel
from vllm_ascend_rl.weight_transfer.hccl import (
    DIRECT_BYTES,
    AscendRLHCCLWeightTransferInitInfo,
    HCCLTrainerInitInfo,
)
from vllm_ascend_rl.weight_transfer.trainer_side import (
    BackgroundCall,
    Pairs,
    TrainerTransport,
    WeightSyncError,
    check_world_size,
)
from vllm_ascend_rl.weight_transfer.wire import (
    Verdict,
    plan_signature,
    trainer_id,
    wire_params,
    wire_signature,
)


class AscendRLHCCLTrainerWeightTransferEngine(TrainerTransport[HCCLTrainerInitInfo]):
    """Trainer side of the HCCL transport: the group is the sender and the engine workers."""

    init_info_cls = HCCLTrainerInitInfo
    transport = "HCCL"
    alone_bytes = DIRECT_BYTES

    channel: BroadcastChannel | None = None  # the sender's, once connected
    _staging: Sequence[torch.Tensor] = ()  # the send's staging slots, kept between updates

    def shutdown(self) -> None:
        self.abort()
        self.channel = None

    def connect(self) -> None:
        """The sender's rendezvous and init handshake with every engine worker, within
        ``timeout_s`` (other ranks only iterate the source). The engine's init call answers once
        it has checked the request (a refusal, e.g. another trainer owns the channel, ends this
        at once); the handshake is where both sides learn the connection is up."""
        if not self.is_sender:
            return
        info = self.init_info
        deadline = time.monotonic() + info.timeout_s
        check_world_size(self.client, info.world_size)
        worker_info = AscendRLHCCLWeightTransferInitInfo(
            master_address=info.master_address,
            master_port=info.master_port,
            world_size=info.world_size,
            trainer_id=trainer_id(),
            **wire_params(info),
        )
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
        while not opening.wait(0.05):
            init_call.raise_if_failed()
            if time.monotonic() > deadline:  # the engine gives up at its own deadline too
                raise WeightSyncError(
                    f"rendezvous: not every engine worker joined at {info.master_address}:"
                    f"{info.master_port} within timeout_s={info.timeout_s:g}s"
                )
        channel = opening.result(0)
        try:
            sig = wire_signature(info, DIRECT_BYTES)
            left = max(0.0, deadline - time.monotonic())
            lowest, same = channel.agree(
                StepHold.GATE, sig, "init handshake", init_call.raise_if_failed, timeout_s=left
            )
            self.step_hold = StepHold(lowest)  # what holds the engine's steps (its workers')
            if not same:
                raise WeightSyncError(
                    "trainer and engine disagree on the weight-transfer protocol or wire "
                    "parameters: upgrade one side"
                )
            init_call.result(max(0.0, deadline - time.monotonic()))
            channel.wait_up(deadline - time.monotonic())  # every engine rank can use it now
        except Exception:
            channel.close()
            raise
        self.channel = channel

    # -- the transport's steps (TrainerTransport) --------------------------------------
    def not_ready(self) -> str | None:
        if not self.is_sender:  # other ranks only iterate the source
            return None
        return "not connected" if self.channel is None else self.channel.broken

    def agree(self, plan: list[Bucket], update: BackgroundCall) -> Verdict:
        assert self.channel is not None  # _send checked not_ready()
        lowest, same = self.channel.agree(
            Verdict.GO, plan_signature(plan), "update handshake", update.raise_if_failed
        )
        return Verdict.GO if lowest == Verdict.GO and same else Verdict.REFUSED

    def send(self, plan: list[Bucket], pairs: Pairs, update: BackgroundCall) -> None:
        channel, depth = self.channel, self.init_info.packed_num_buffers
        piece = self.init_info.packed_buffer_size_bytes
        assert channel is not None  # _send checked not_ready()
        need = max((b.nbytes for b in plan if not b.oversized), default=0)
        if len(self._staging) != depth or self._staging[0].numel() < need:
            self._staging = [
                torch.empty(need, dtype=torch.uint8, device=self.hw.torch_device())
                for _ in range(depth)
            ]
        # (bucket, work, the bytes it sends: alive until it is done, staging slot or None)
        in_flight: deque = deque()

        def oldest_done() -> None:
            bucket, work, _, _ = in_flight.popleft()
            channel.wait(work, f"sending bucket {bucket.index}", update.raise_if_failed)

        for i, (bucket, tensors) in enumerate(iter_bucket_tensors(plan, pairs)):
            slot = None if bucket.oversized else i % depth
            if slot is None:  # sent from its own memory (on the device)
                send = as_bytes(tensors[0].to(self.hw.torch_device()))
            else:
                while any(entry[3] == slot for entry in in_flight):  # free before reuse
                    oldest_done()
                send = self._staging[slot][: bucket.nbytes]  # kept unless a bucket outgrows it
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

    def abort(self) -> None:
        if self.channel is not None:
            self.channel.close()
