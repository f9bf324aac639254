"""Landing buffers for received buckets (the engine side of both transports)."""

from __future__ import annotations

import weakref

import torch


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
