"""Bucket planning and packing shared by the HCCL and NPU-IPC weight-transfer engines, and the
engine side's landing buffers (:class:`ReceivePool`). Both sides compute the same plan from the
same ``(name, dtype, shape)`` list and bucket size, so no chunk boundary travels on the wire;
tensors are packed in metadata order at aligned offsets."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

ALIGN_BYTES = 64  # every tensor starts at a multiple of this inside its bucket


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError otherwise."""
    attr = name.removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors sent in one collective (or one staging copy); ``offsets[i]`` is in bytes."""

    index: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    oversized: bool = False  # one tensor larger than a bucket: sent from/into itself


def plan_buckets(
    specs: Sequence[TensorSpec], bucket_bytes: int, alone_bytes: int | None = None
) -> list[Bucket]:
    """Greedy, order-preserving packing of ``specs`` into buckets of ``bucket_bytes``. A tensor
    larger than ``alone_bytes`` (default: the bucket size) gets an ``oversized`` bucket of its
    own, which a transport may send straight from the tensor, skipping the staging copy."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alone = bucket_bytes if alone_bytes is None else min(alone_bytes, bucket_bytes)
    groups: list[tuple[list[TensorSpec], list[int]]] = []  # each bucket's specs and offsets
    end: int | None = None  # where the open bucket ends; None: no bucket is open
    for spec in specs:
        start = 0 if end is None else -(-end // ALIGN_BYTES) * ALIGN_BYTES
        if end is None or spec.nbytes > alone or start + spec.nbytes > bucket_bytes:
            groups.append(([], []))
            start = 0
        groups[-1][0].append(spec)
        groups[-1][1].append(start)
        end = start + spec.nbytes if spec.nbytes <= alone else None  # alone: closed at once
    return [
        Bucket(i, tuple(g), tuple(offs), offs[-1] + g[-1].nbytes, oversized=g[0].nbytes > alone)
        for i, (g, offs) in enumerate(groups)
    ]


def total_bytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t`` (copied only if ``t`` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the transfers that carry ``nbytes`` in pieces of at most ``piece``
    bytes (the bucket size), cut the same way on both sides; empty for 0."""
    return [(start, min(piece, nbytes - start)) for start in range(0, nbytes, piece)]


def slot_bytes(plan: Sequence[Bucket], piece: int) -> int:
    """The staging slot an update needs: its largest bucket, at most a piece."""
    return max((min(b.nbytes, piece) for b in plan), default=0)


def pack_into(
    buffer: torch.Tensor,
    bucket: Bucket,
    tensors: Sequence[torch.Tensor],
    copy_bytes: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Copy ``tensors`` (in ``bucket.specs`` order) into ``buffer`` at the bucket's offsets."""
    for spec, off, t in zip(bucket.specs, bucket.offsets, tensors, strict=True):
        copy_bytes(buffer[off : off + spec.nbytes], as_bytes(t))


def unpack_views(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a received uint8 ``buffer``; they alias the buffer."""
    return [
        (spec.name, buffer[off : off + spec.nbytes].view(spec.dtype).view(spec.shape))
        for spec, off in zip(bucket.specs, bucket.offsets, strict=True)
    ]


def iter_bucket_tensors(
    buckets: Sequence[Bucket], pairs: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
    """Group a ``(name, tensor)`` stream by bucket, checking it follows the plan exactly."""
    for bucket in buckets:
        tensors = []
        for spec in bucket.specs:
            if (pair := next(pairs, None)) is None:
                raise ValueError(f"weight source ended early: expected {spec.name!r} next")
            name, t = pair
            if name != spec.name or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"weight source disagrees with its metadata: declared {spec.name!r} "
                    f"{dtype_name(spec.dtype)}{list(spec.shape)}, got {name!r} "
                    f"{dtype_name(t.dtype)}{list(t.shape)}"
                )
            tensors.append(t)
        yield bucket, tensors
    if (extra := next(pairs, None)) is not None:
        raise ValueError(f"weight source yielded {extra[0]!r} beyond its declared metadata")


# -- landing buffers for received buckets ----------------------------------------------------
def storage_use_count(t: torch.Tensor) -> int | None:
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else fn(t.untyped_storage()._cdata)


class ReceivePool:
    """Landing buffers recycled once no view of them is alive (layerwise reload keeps views
    until a layer is complete; the storage use count tells). Warm buffers, up to ``max_bytes``,
    are kept: first-touch page faults make a copy into fresh host memory several times slower.
    Device memory taken after vLLM sized the KV cache is outside its budget, so
    :meth:`end_update` gives every buffer back (on CPU too)."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        self.device, self.max_bytes = device, max_bytes
        self.buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when idle)
        self.allocated_bytes = 0  # fresh memory taken since the last end_update
        self.peak_bytes = 0  # most bytes alive at once since end_update, kept or not
        self._alive: list[tuple[weakref.ref, int]] = []  # every buffer of this update

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b, _ in self.buffers)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes``; always a view, so the pool can see it in use."""
        idle = [b for b, use in self.buffers if storage_use_count(b) == use]
        best = min((b for b in idle if b.numel() >= nbytes), key=lambda b: b.numel(), default=None)
        if best is not None:
            return best[:nbytes]
        # Every idle buffer is too small for this request: give them back before taking more.
        del idle
        self.buffers = [(b, use) for b, use in self.buffers if storage_use_count(b) != use]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.allocated_bytes += nbytes
        self._alive = [(ref, n) for ref, n in self._alive if ref() is not None]
        self._alive.append((weakref.ref(buf), nbytes))
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._alive))
        use = storage_use_count(buf)
        if use is not None and self.nbytes + nbytes <= self.max_bytes:
            self.buffers.append((buf, use))
        return buf[:nbytes]

    def release(self) -> None:
        self.buffers.clear()

    def end_update(self) -> tuple[int, int]:
        """An update ended: give every buffer back; (bytes it allocated, peak bytes)."""
        allocated, self.allocated_bytes = self.allocated_bytes, 0
        peak, self.peak_bytes = self.peak_bytes, 0
        self._alive = []
        self.release()
        return allocated, peak
