"""A tensor larger than the bucket (N13): both sides of either transport cut it into pieces of
the bucket size, so no device buffer is larger than a bucket, and the tensor arrives whole.
HCCL: the engine's receive pool never holds more than (buffers + 1) buckets (real trainer and
engine code over a gloo group, in threads). NPU IPC: the trainer's ring slots are bucket-sized
(real trainer and engine code over shared memory and a doorbell, in threads)."""

from __future__ import annotations

import json
import threading
import types
from typing import Any

import pytest
import torch

from tests.support.stand_in_config import engine_config
from tests.unit.test_channel import run_ranks
from tests.unit.test_ipc_transport import doorbell_pair
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec, pieces
from vllm_ascend_rl.weight_transfer.hccl import (
    DIRECT_BYTES,
    AscendRLHCCLWeightTransferEngine,
    AscendRLHCCLWeightTransferInitInfo,
    AscendRLHCCLWeightTransferUpdateInfo,
    HCCLLink,
)
from vllm_ascend_rl.weight_transfer.hccl_trainer import AscendRLHCCLTrainerWeightTransferEngine
from vllm_ascend_rl.weight_transfer.npu_ipc import (
    AscendRLNPUIPCWeightTransferEngine,
    AscendRLNPUIPCWeightTransferInitInfo,
    IPCLink,
    NPUIPCTrainerInitInfo,
)
from vllm_ascend_rl.weight_transfer.npu_ipc_trainer import (
    AscendRLNPUIPCTrainerWeightTransferEngine,
)
from vllm_ascend_rl.weight_transfer.wire import Verdict, plan_for

MiB = 1 << 20
BUCKET, BUFFERS = 1 * MiB, 2


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(25_000),  # 100 KB, packed
        "embed": torch.randn(5 * MiB // 4 + 3),  # 5 MiB + 12 bytes, alone, in 6 pieces
        "b": torch.randn(1000),
    }


def _engine(cls, info):
    config = engine_config()
    engine = cls(None, config, torch.device("cpu"), torch.nn.Linear(2, 2))
    engine.session.reconnect(
        info.on_failure, info.packed_num_buffers, info.packed_buffer_size_bytes, info.timeout_s
    )
    return engine


def _receive(link, plan) -> dict[str, torch.Tensor]:
    got = {}
    for bucket, buf in link.buckets(plan):
        for spec, off in zip(bucket.specs, bucket.offsets, strict=True):
            got[spec.name] = buf[off : off + spec.nbytes].clone()
        del buf  # loaded: as the engine's receive_weights drops it
    return got


def _hccl_case() -> tuple[dict[str, torch.Tensor], list[TensorSpec], Any]:
    tensors = _tensors()
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    info = AscendRLHCCLWeightTransferInitInfo(
        master_address="127.0.0.1",
        master_port=1,
        world_size=2,
        packed_buffer_size_bytes=BUCKET,
        packed_num_buffers=BUFFERS,
    )
    return tensors, specs, info


def test_pieces_cover_every_byte_once():
    assert pieces(0, 4) == []
    assert pieces(3, 4) == [(0, 3)]
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]


def test_a_tensor_larger_than_the_bucket_keeps_the_receive_pool_within_its_bound():
    tensors, specs, info = _hccl_case()
    poll = types.SimpleNamespace(raise_if_failed=lambda: None)

    def body(ch):
        if ch.rank == 0:
            trainer = object.__new__(AscendRLHCCLTrainerWeightTransferEngine)
            trainer.channel, trainer.init_info = ch, info
            trainer.hw, trainer._staging = get_device("cpu"), []
            trainer.send(plan_for(info, specs, DIRECT_BYTES), iter(tensors.items()), poll)
            return None
        engine = _engine(AscendRLHCCLWeightTransferEngine, info)
        got = _receive(HCCLLink(ch, info, engine.session.pool), plan_for(info, specs, DIRECT_BYTES))
        return got, engine.session.pool.end_update()

    trainer_error, (got, (_, peak)) = run_ranks(2, body, timeout_s=20)
    assert trainer_error is None
    for name, t in tensors.items():
        assert torch.equal(got[name], t.view(-1).view(torch.uint8)), name
    assert peak <= (BUFFERS + 1) * BUCKET, peak  # whole, the tensor alone would be 5 MiB


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copy-out"])
def test_npu_ipc_ring_slots_are_bucket_sized_for_a_larger_tensor(zero_copy):
    tensors = _tensors()
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    trainer = object.__new__(AscendRLNPUIPCTrainerWeightTransferEngine)
    trainer.init_info = NPUIPCTrainerInitInfo(
        rank=0, packed_buffer_size_bytes=BUCKET, packed_num_buffers=BUFFERS
    )
    listener, trainer_side, engine_side = doorbell_pair(20)
    trainer.hw, trainer.ring, trainer.group = get_device("cpu"), [], None
    trainer.is_sender, trainer.connected, trainer.update_id = True, True, 0
    trainer.doorbells = [trainer_side]
    info = AscendRLNPUIPCWeightTransferInitInfo(
        doorbells={"chip": listener.address},
        zero_copy=zero_copy,
        packed_buffer_size_bytes=BUCKET,
        packed_num_buffers=BUFFERS,
    )
    engine = _engine(AscendRLNPUIPCWeightTransferEngine, info)
    link = IPCLink(engine_side, info, engine.hw, engine.session)
    try:
        plan = plan_for(trainer.init_info, specs, None)
        assert max(b.nbytes for b in plan) > 5 * MiB  # the tensor travels alone
        handles = trainer._ring_handles(plan)
        assert [b.tensor.numel() for b in trainer.ring] == [BUCKET] * BUFFERS  # not 5 MiB

        engine_plan = plan_for(info, specs, None)
        link.map({trainer.hw.location()["chip"]: handles}, engine_plan)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                trainer._stream(plan, iter(tensors.items()), lambda: None)
            except BaseException as e:
                errors.append(e)

        sender = threading.Thread(target=send)
        sender.start()
        got = _receive(link, engine_plan)
        sender.join(20)
        assert not errors, errors
        for name, t in tensors.items():
            assert torch.equal(got[name], t.view(-1).view(torch.uint8)), name
        _, peak = engine.session.pool.end_update()
        assert peak <= BUCKET, peak  # copy-out takes a bucket per packed bucket, none for pieces
    finally:
        link.close()
        trainer.shutdown()
        listener.close()


def test_the_benchmark_extension_receives_through_the_engines_link():
    """``make bench`` times the transport through ``benchmarks/bench_worker_ext.py``, which
    reaches into the engine (its link, its session): run it on a real engine over a gloo
    group, so a change to the engine cannot silently break the benchmarks."""
    from benchmarks.bench_worker_ext import WeightSyncBenchExtension

    tensors, specs, info = _hccl_case()
    poll = types.SimpleNamespace(raise_if_failed=lambda: None)
    plan = plan_for(info, specs, DIRECT_BYTES)

    def body(ch):
        if ch.rank == 0:
            trainer = object.__new__(AscendRLHCCLTrainerWeightTransferEngine)
            trainer.channel, trainer.init_info = ch, info
            trainer.hw, trainer._staging = get_device("cpu"), []
            assert trainer.agree(plan, poll) is Verdict.GO
            trainer.send(plan, iter(tensors.items()), poll)
            return None
        engine = _engine(AscendRLHCCLWeightTransferEngine, info)
        engine.init_info = info
        connection = engine.connection
        link = HCCLLink(ch, info, engine.session.pool)
        connection.claim("", 30.0)
        connection.start(lambda deadline: link, background=False)
        worker = WeightSyncBenchExtension()
        worker.weight_transfer_engine = engine
        update = AscendRLHCCLWeightTransferUpdateInfo.fields_from_specs(specs)
        seconds = worker.bench_receive_discard(json.dumps(update), keep="1")
        engine.shutdown()  # its connection's thread must not close the group at exit
        return seconds, worker._bench_kept

    trainer_error, (seconds, kept) = run_ranks(2, body, timeout_s=20)
    assert trainer_error is None and seconds > 0
    got = {}
    for bucket, buf in kept:
        for spec, off in zip(bucket.specs, bucket.offsets, strict=True):
            got.setdefault(spec.name, []).append(buf[off : off + spec.nbytes])
    assert [b.index for b, _ in kept] == sorted({b.index for b, _ in kept})
    assert torch.equal(got["a"][0], tensors["a"].view(-1).view(torch.uint8))
