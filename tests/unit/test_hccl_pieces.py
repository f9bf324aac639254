"""HCCL transfer of a tensor larger than the bucket (N13): both sides cut it into pieces of the
bucket size, so the engine's receive pool never holds more than (buffers + 1) buckets of device
memory, and the tensor arrives whole. Real trainer and engine code over a gloo group (threads)."""

from __future__ import annotations

import types

import torch

from tests.unit.test_channel import run_ranks
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.hccl import (
    AscendRLHCCLTrainerWeightTransferEngine,
    AscendRLHCCLWeightTransferEngine,
    AscendRLHCCLWeightTransferInitInfo,
    pieces,
)

MiB = 1 << 20
BUCKET, BUFFERS = 1 * MiB, 2


def _engine(info) -> AscendRLHCCLWeightTransferEngine:
    parallel = types.SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)
    config = types.SimpleNamespace(parallel_config=parallel, model_config=None)
    engine = AscendRLHCCLWeightTransferEngine(
        None, config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )
    engine._after_init(info)
    return engine


def test_pieces_cover_every_byte_once():
    assert pieces(0, 4) == []
    assert pieces(3, 4) == [(0, 3)]
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]


def test_a_tensor_larger_than_the_bucket_keeps_the_receive_pool_within_its_bound():
    tensors = {
        "a": torch.randn(25_000),  # 100 KB, packed
        "embed": torch.randn(5 * MiB // 4 + 3),  # 5 MiB + 12 bytes, alone, in 6 pieces
        "b": torch.randn(1000),
    }
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    info = AscendRLHCCLWeightTransferInitInfo(
        master_address="127.0.0.1",
        master_port=1,
        world_size=2,
        packed_buffer_size_bytes=BUCKET,
        packed_num_buffers=BUFFERS,
    )
    poll = types.SimpleNamespace(raise_if_failed=lambda: None)
    bar = types.SimpleNamespace(update=lambda n: None)

    def body(ch):
        if ch.rank == 0:
            trainer = object.__new__(AscendRLHCCLTrainerWeightTransferEngine)
            trainer.channel, trainer.init_info = ch, info
            trainer.hw, trainer._staging = get_device("cpu"), []
            trainer._send(trainer._plan(specs), iter(tensors.items()), poll, bar)
            return None
        engine = _engine(info)
        engine.channel = ch
        got = {}
        for bucket, buf in engine._buckets(engine._plan(specs), None):
            for spec, off in zip(bucket.specs, bucket.offsets, strict=True):
                got[spec.name] = buf[off : off + spec.nbytes].clone()
            del buf  # loaded: as the engine's receive_weights drops it
        return got, engine.pool.end_update()

    trainer_error, (got, (_, peak)) = run_ranks(2, body, timeout_s=20)
    assert trainer_error is None
    for name, t in tensors.items():
        assert torch.equal(got[name], t.view(-1).view(torch.uint8)), name
    assert peak <= (BUFFERS + 1) * BUCKET, peak  # whole, the tensor alone would be 5 MiB
