"""The bucket planner and pack/unpack shared by the HCCL and NPU-IPC engines."""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_rl.weight_transfer.buckets import (
    ALIGN_BYTES,
    TensorSpec,
    as_bytes,
    dtype_from_name,
    dtype_name,
    iter_bucket_tensors,
    pack_into,
    plan_buckets,
    total_bytes,
    unpack_views,
)


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: misaligns
        "b.f32": torch.randn(7, generator=g),
        "c.i64": torch.arange(5, dtype=torch.int64),
        "d.big": torch.randn(40, 40, generator=g).to(torch.bfloat16),  # 3200 bytes
        "e.f16": torch.randn(2, 3, generator=g).to(torch.float16),
        "f.scalar": torch.tensor(1.5),
        "g.empty": torch.empty(0, 4),
    }


def test_dtype_names_round_trip_and_accept_torch_prefix():
    for dt in (torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
        assert dtype_from_name(dtype_name(dt)) is dt
        assert dtype_from_name(str(dt)) is dt  # "torch.bfloat16" from str(dtype)
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("Tensor")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("bf17")


def test_plan_keeps_order_aligns_and_respects_bucket_size():
    specs = specs_of(mixed_tensors())
    plan = plan_buckets(specs, bucket_bytes=1024)
    assert [s for b in plan for s in b.specs] == specs  # every tensor once, in order
    for b in plan:
        assert all(off % ALIGN_BYTES == 0 for off in b.offsets)
        if not b.oversized:
            assert b.nbytes <= 1024
        ends = [o + s.nbytes for o, s in zip(b.offsets, b.specs, strict=True)]
        assert b.nbytes == max(ends)
        assert all(e <= o for e, o in zip(ends, b.offsets[1:], strict=False))  # no overlap


def test_tensor_larger_than_a_bucket_goes_alone():
    specs = specs_of(mixed_tensors())
    plan = plan_buckets(specs, bucket_bytes=1024)
    big = [b for b in plan if any(s.name == "d.big" for s in b.specs)]
    assert len(big) == 1 and big[0].oversized and len(big[0].specs) == 1
    assert big[0].nbytes == 3200 and big[0].offsets == (0,)
    assert sum(b.oversized for b in plan) == 1


def test_alone_bytes_sends_large_tensors_directly_and_one_byte_buckets_mean_per_tensor():
    specs = specs_of(mixed_tensors())
    plan = plan_buckets(specs, bucket_bytes=1 << 20, alone_bytes=100)
    assert {s.name for b in plan if b.oversized for s in b.specs} == {"d.big"}
    per_tensor = plan_buckets(specs, bucket_bytes=1)
    assert len(per_tensor) == len(specs)
    with pytest.raises(ValueError):
        plan_buckets(specs, bucket_bytes=0)


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1024, 1 << 20])
def test_pack_unpack_round_trip_is_bit_exact(bucket_bytes):
    tensors = mixed_tensors()
    plan = plan_buckets(specs_of(tensors), bucket_bytes)
    received = {}
    for bucket, ts in iter_bucket_tensors(plan, iter(tensors.items())):
        buf = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        pack_into(buf, bucket, ts, lambda dst, src: dst.copy_(src))
        received.update(unpack_views(buf, bucket))
    assert list(received) == list(tensors)
    for name, t in tensors.items():
        got = received[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(as_bytes(got), as_bytes(t))
    assert total_bytes(specs_of(tensors)) == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )


def test_pack_from_parameters_that_require_grad():
    p = torch.nn.Parameter(torch.randn(4, 4))
    plan = plan_buckets([TensorSpec("p", p.dtype, (4, 4))], 1024)
    buf = torch.empty(plan[0].nbytes, dtype=torch.uint8)
    pack_into(buf, plan[0], [p], lambda dst, src: dst.copy_(src))
    assert torch.equal(unpack_views(buf, plan[0])[0][1], p.detach())


def test_source_that_disagrees_with_its_metadata_is_named():
    tensors = mixed_tensors()
    plan = plan_buckets(specs_of(tensors), 1024)
    lying = dict(tensors)
    lying["b.f32"] = lying["b.f32"].double()
    with pytest.raises(ValueError, match=r"declared 'b\.f32' float32.*got 'b\.f32' float64"):
        list(iter_bucket_tensors(plan, iter(lying.items())))
    short = list(tensors.items())[:-1]
    with pytest.raises(ValueError, match=r"ended early: expected 'g\.empty'"):
        list(iter_bucket_tensors(plan, iter(short)))
    extra = [*tensors.items(), ("z", torch.ones(1))]
    with pytest.raises(ValueError, match="yielded 'z' beyond"):
        list(iter_bucket_tensors(plan, iter(extra)))


def test_receive_pool_recycles_a_buffer_only_when_no_view_is_alive():
    from vllm_ascend_rl.weight_transfer.buckets import ReceivePool

    pool = ReceivePool(torch.device("cpu"), max_bytes=2000)
    a = pool.take(1000)
    held = a[10:20]  # what layerwise reload does: keep a view until the layer is complete
    del a
    b = pool.take(1000)
    assert b.data_ptr() != held.data_ptr() - 10, "a buffer still viewed was handed out again"
    del held
    c = pool.take(800)  # the first buffer is idle again: reused, no new allocation
    assert len(pool.buffers) == 2
    assert c.data_ptr() in {buf.data_ptr() for buf, _ in pool.buffers}
    del b, c
    big = pool.take(1500)  # full pool: a larger buffer replaces the idle ones
    assert big.numel() == 1500 and [b.numel() for b, _ in pool.buffers] == [1500]
    assert pool.take(5000).numel() == 5000 and pool.nbytes <= 2000  # too big to keep
    pool.release()
    assert pool.buffers == []


def test_receive_pool_evicts_buffers_of_different_sizes():
    from vllm_ascend_rl.weight_transfer.buckets import ReceivePool

    pool = ReceivePool(torch.device("cpu"), max_bytes=3000)
    for n in (1000, 500, 1200):  # idle buffers of unequal sizes, then a larger request
        pool.take(n)
    assert pool.take(2500).numel() == 2500
    assert [b.numel() for b, _ in pool.buffers] == [2500]


def test_receive_pool_is_given_back_after_every_update_and_reports_its_peak():
    """Device memory taken after KV sizing must not outlive the update (D7, N13); the peak
    counts buffers the pool handed out but could not keep."""
    from vllm_ascend_rl.weight_transfer.buckets import ReceivePool

    pool = ReceivePool(torch.device("cpu"), max_bytes=2000)
    in_use = [pool.take(1000), pool.take(1000), pool.take(1000)]  # the third is not kept
    assert pool.peak_bytes == 3000
    del in_use
    pool.take(1000)  # a kept buffer, reused: nothing new
    assert pool.end_update() == (3000, 3000) and pool.buffers == []
    assert pool.end_update() == (0, 0)
