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
from typing import ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from vllm_ascend_rl._registration import registered_name
from vllm_ascend_rl.device import Device, current_device, device_for
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    TensorSpec,
    as_bytes,
    dtype_name,
    iter_bucket_tensors,
    pack_into,
    plan_buckets,
    total_bytes,
    unpack_views,
)
from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel, ChannelError, signature
from vllm_ascend_rl.weight_transfer.reload import LayerwiseReload
from vllm_ascend_rl.weight_transfer.trainer_side import (
    BackgroundCall,
    Progress,
    SyncResult,
    WeightSyncError,
    call,
    check_world_size,
)
from vllm_ascend_rl.weight_transfer.validation import (
    WeightUpdateRefused,
    expected_params,
    parse_specs,
    validate_update,
)

logger = init_logger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 120.0


def _check_wire(packed: bool, bucket: int, buffers: int, timeout_s: float) -> None:
    if not isinstance(packed, bool):
        raise ValueError(f"packed must be a bool, got {packed!r}")
    if not isinstance(bucket, int) or bucket <= 0:
        raise ValueError(f"packed_buffer_size_bytes must be a positive int, got {bucket!r}")
    if not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"packed_num_buffers must be >= 1, got {buffers!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")


def _wire_signature(info) -> int:
    return signature(
        PROTOCOL_VERSION, info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers
    )


DIRECT_BYTES = 8 << 20  # tensors above this skip the staging copy even when packed


def _plan(specs: list[TensorSpec], packed: bool, bucket_bytes: int) -> list[Bucket]:
    # Unpacked: one tensor per collective, straight from/into the tensor. Packed: small
    # tensors share buckets (one collective each), large ones go straight from their memory;
    # a staging copy would only add a memcpy to a transfer already long enough to amortize
    # the per-collective cost.
    return plan_buckets(specs, bucket_bytes if packed else 1, alone_bytes=DIRECT_BYTES)


def _update_signature(specs: list[TensorSpec]) -> int:
    return signature([(s.name, dtype_name(s.dtype), s.shape) for s in specs])


@dataclass(kw_only=True)
class HCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info; the trainer fills it in (rank 0 hosts the rendezvous)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_wire(
            self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers, self.timeout_s
        )
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port!r}")
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

    backend: ClassVar[str] = registered_name("weight_transfer_trainer", "hccl")

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        _check_wire(
            self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers, self.timeout_s
        )


@dataclass
class HCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update's metadata, in the order the trainer will send the tensors."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @classmethod
    def from_specs(cls, specs: list[TensorSpec]) -> HCCLWeightTransferUpdateInfo:
        return cls(
            [s.name for s in specs],
            [dtype_name(s.dtype) for s in specs],
            [list(s.shape) for s in specs],
        )


class HCCLWeightTransferEngine(
    WeightTransferEngine[HCCLWeightTransferInitInfo, HCCLWeightTransferUpdateInfo]
):
    """Engine (worker) side. Loads through vLLM's layerwise reload; refuses bad updates whole."""

    init_info_cls = HCCLWeightTransferInitInfo
    update_info_cls = HCCLWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.hw: Device = device_for(device)
        self.channel: BroadcastChannel | None = None
        self.init_info: HCCLWeightTransferInitInfo | None = None
        self.reload = LayerwiseReload()
        self._expected = None
        self._expected_loaded = False

    # -- lifecycle -------------------------------------------------------------------
    def init_transfer_engine(self, init_info: HCCLWeightTransferInitInfo) -> None:
        if self.reload.active:
            raise RuntimeError(
                "cannot re-initialize weight transfer during a weight update; finish it first"
            )
        self._close_channel()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
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
            all_ok, same = channel.agree(ok, _wire_signature(init_info), "init handshake")
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
        self.channel, self.init_info = channel, init_info
        logger.info(
            "HCCL weight transfer ready: rank %d of %d over %s, packed=%s, bucket=%d MiB x %d",
            rank,
            init_info.world_size,
            self.hw.collective_backend,
            init_info.packed,
            init_info.packed_buffer_size_bytes >> 20,
            init_info.packed_num_buffers,
        )

    def start_weight_update(self) -> None:
        self._require_channel()
        self.reload.begin(self.model)

    def finish_weight_update(self) -> None:
        self.reload.finish(self.model_config)

    def shutdown(self) -> None:
        if self.reload.active:
            self.reload.abort(self.model_config)
        self._close_channel()

    # -- one update ------------------------------------------------------------------
    def receive_weights(self, update_info: HCCLWeightTransferUpdateInfo) -> None:
        channel = self._require_channel()
        if not self.reload.active:
            raise RuntimeError("update_weights called without start_weight_update")
        refusal: WeightUpdateRefused | None = None
        specs: list[TensorSpec] = []
        try:
            specs = parse_specs(update_info.names, update_info.dtype_names, update_info.shapes)
            validate_update(specs, self._expected_params())
        except WeightUpdateRefused as e:
            refusal = e
        sig = 0 if refusal else _update_signature(specs)
        try:
            all_ok, same = channel.agree(refusal is None, sig, "update handshake")
        except ChannelError as e:
            self._fail_before_data()
            if refusal is not None:
                raise WeightUpdateRefused(
                    f"refused weight update, model unchanged: {refusal}"
                ) from e
            raise RuntimeError(f"the trainer did not join the update: {e}") from e
        if not (all_ok and same):
            self.reload.abort(self.model_config)  # nothing loaded: old weights stay
            if refusal is not None:
                raise WeightUpdateRefused(f"refused weight update, model unchanged: {refusal}")
            raise WeightUpdateRefused(
                "refused weight update, model unchanged: "
                + (
                    "the trainer aborted it"
                    if not all_ok
                    else "the trainer's metadata differs from update_info"
                )
            )
        assert self.init_info is not None
        plan = _plan(specs, self.init_info.packed, self.init_info.packed_buffer_size_bytes)
        received = 0
        try:
            for bucket, buf in self._receive(channel, plan):
                self._load(bucket, buf)
                received += bucket.nbytes
        except Exception as e:
            updated = self.reload.abort(self.model_config)
            self._close_channel()
            state = (
                f"{updated} layer(s) already hold new weights: do not resume generation "
                "before a complete update"
                if updated
                else "model unchanged"
            )
            raise RuntimeError(
                f"weight transfer failed after {received} of {total_bytes(specs)} bytes "
                f"({type(e).__name__}: {e}); {state}. Call init_weight_transfer_engine "
                "again before the next update."
            ) from e

    def _receive(self, channel: BroadcastChannel, plan: list[Bucket]):
        """Yield (bucket, received buffer); bucket i+1.. are in flight while i is loaded."""
        in_flight: deque = deque()
        depth = self.init_info.packed_num_buffers if self.init_info else 1
        for bucket in plan:
            if bucket.nbytes == 0:
                continue
            # A fresh buffer per bucket: layerwise reload keeps the views until a layer is
            # complete, so a reused buffer would be overwritten under it.
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            in_flight.append((bucket, buf, channel.broadcast(buf)))
            if len(in_flight) > depth - 1:
                yield self._landed(channel, *in_flight.popleft())
        while in_flight:
            yield self._landed(channel, *in_flight.popleft())

    @staticmethod
    def _landed(channel: BroadcastChannel, bucket: Bucket, buf: torch.Tensor, work):
        channel.wait(work, f"receiving bucket {bucket.index}")
        return bucket, buf

    def _load(self, bucket: Bucket, buf: torch.Tensor) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            self.model.load_weights(unpack_views(buf, bucket))

    # -- helpers ---------------------------------------------------------------------
    def _expected_params(self):
        if not self._expected_loaded:
            self._expected = expected_params(self.model_config)
            self._expected_loaded = True
        return self._expected

    def _require_channel(self) -> BroadcastChannel:
        if self.channel is None or self.channel.broken:
            raise RuntimeError(
                "HCCL weight transfer is not initialized: call init_weight_transfer_engine first"
            )
        return self.channel

    def _fail_before_data(self) -> None:
        self.reload.abort(self.model_config)
        self._close_channel()

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class HCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine[HCCLTrainerInitInfo]):
    """Trainer side. Rank 0 drives start/update/finish over ``client`` and broadcasts;
    other trainer ranks only iterate the source (its gathers are collectives)."""

    init_info_cls = HCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: HCCLTrainerInitInfo,
        device: Device | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.hw = device or current_device()
        self.channel: BroadcastChannel | None = None
        self._staging: list[torch.Tensor] = []

    @classmethod
    def trainer_init(
        cls,
        init_info: HCCLTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("HCCL weight transfer needs a WeightSource (e.g. ModuleSource)")
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            engine._connect()
        return engine

    def _connect(self) -> None:
        info = self.init_info
        check_world_size(self.client, info.world_size)
        worker_info = HCCLWeightTransferInitInfo(
            master_address=info.master_address,
            master_port=info.master_port,
            world_size=info.world_size,
            packed=info.packed,
            packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers,
            timeout_s=info.timeout_s,
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
                True, _wire_signature(info), "init handshake", init_call.raise_if_failed
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

    def send_weights(
        self, weight_version: str | None = None, progress: bool | None = None
    ) -> SyncResult:
        """Push every weight of the source into the engine: start, update, finish.

        Returns bytes, seconds and GB/s. ``weight_version`` is passed to
        ``finish_weight_update`` and tags subsequent outputs. ``progress`` shows a byte
        progress bar (default: for transfers of 512 MiB or more on a terminal).
        """
        assert self.source is not None
        meta = self.source.metadata()
        specs = [TensorSpec(m.name, m.dtype, tuple(m.shape)) for m in meta]
        plan = _plan(specs, self.init_info.packed, self.init_info.packed_buffer_size_bytes)
        if not self.is_sender:
            for _ in self.source:  # stay in the source's gather collectives
                pass
            return SyncResult(0, 0.0, len(specs), len(plan), weight_version)
        channel = self.channel
        if channel is None or channel.broken:
            raise WeightSyncError(
                "weight-transfer channel is not usable"
                + (f" ({channel.broken})" if channel else "")
                + ": call trainer_init again"
            )
        nbytes = total_bytes(specs)
        timeout_s = self.init_info.timeout_s
        started = time.perf_counter()
        call("start_weight_update", self.client.start_weight_update)
        update = BackgroundCall(
            "update_weights",
            self.client.update_weights,
            asdict(HCCLWeightTransferUpdateInfo.from_specs(specs)),
        )
        try:
            all_ok, same = channel.agree(
                True, _update_signature(specs), "update handshake", update.raise_if_failed
            )
        except ChannelError as e:
            channel.close()
            raise WeightSyncError(f"update handshake failed: {update.failure(5) or e}") from e
        if not (all_ok and same):  # refused before any byte moved; the channel stays usable
            raise WeightSyncError(f"engine refused the update: {update.failure(timeout_s)}")
        bar = Progress(nbytes, progress, "weights -> engine")
        try:
            self._broadcast(channel, plan, update, bar)
            transfer_s = bar.close()
            update.result(timeout_s)
        except ChannelError as e:
            channel.close()
            reason = update.failure(min(timeout_s, 30.0))  # fast: the channel is closed
            raise WeightSyncError(f"weight broadcast failed: {reason or e}") from e
        except Exception:
            channel.close()  # tells the engine at once instead of after its timeout
            raise
        finally:
            bar.close()
        call("finish_weight_update", self.client.finish_weight_update, weight_version)
        return SyncResult(
            nbytes, time.perf_counter() - started, len(specs), len(plan), weight_version, transfer_s
        )

    def _broadcast(
        self, channel: BroadcastChannel, plan: list[Bucket], update: BackgroundCall, bar: Progress
    ) -> None:
        depth = self.init_info.packed_num_buffers
        staging = self._staging_buffers(plan, depth)
        in_flight: deque = deque()
        poll = update.raise_if_failed
        for i, (bucket, tensors) in enumerate(iter_bucket_tensors(plan, iter(self.source))):
            if bucket.nbytes == 0:
                continue
            if len(in_flight) >= depth:  # the oldest buffer must be free before reuse
                b, work, _ = in_flight.popleft()
                channel.wait(work, f"sending bucket {b.index}", poll)
                bar.update(b.nbytes)
            if bucket.oversized:
                send = as_bytes(tensors[0])
            else:
                send = staging[i % depth][: bucket.nbytes]
                pack_into(send, bucket, tensors, self.hw.copy_bytes)
                self.hw.synchronize()
            in_flight.append((bucket, channel.broadcast(send), send))
        while in_flight:
            b, work, _ = in_flight.popleft()
            channel.wait(work, f"sending bucket {b.index}", poll)
            bar.update(b.nbytes)

    def _staging_buffers(self, plan: list[Bucket], depth: int) -> list[torch.Tensor]:
        need = max((b.nbytes for b in plan if not b.oversized), default=0)
        if len(self._staging) != depth or (self._staging and self._staging[0].numel() < need):
            self._staging = [
                torch.empty(need, dtype=torch.uint8, device=self.hw.torch_device())
                for _ in range(depth)
            ]
        return self._staging

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
