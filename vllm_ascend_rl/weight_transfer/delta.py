"""Delta (sparse) weight updates: send only the elements that changed since the engine's weights.

One RL step at typical learning rates leaves most bf16 elements bit-identical. With
``delta=True`` at init, both sides keep a host copy of the checkpoint-format weights the engine
holds (the *base*, tagged with a version). An update then carries, per tensor, either the flat
indices and new values of the elements that differ from the base, or the whole tensor where
that is cheaper. The engine rebuilds each full tensor from its base and loads it through the
same validated, transactional layerwise reload as a dense update; its base moves only when the
update completes, and a failed update puts it back.

On the wire a sparse tensor ``w`` travels as two tensors, ``w@idx`` (int32, or int64 above 2**31
elements) and ``w@val`` (its dtype), planned into buckets like any other: the transports are
unchanged. The update info lists the logical tensors (validated against the model as usual),
``nnz`` per tensor (-1: whole) and the ``base_version`` the indices refer to; an engine whose
base is another version refuses before any byte moves.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.receive_pool import sole_owner

INDEX_SUFFIX, VALUE_SUFFIX = "@idx", "@val"
WHOLE = -1  # nnz of a tensor sent whole
STALE_BASE = "the trainer must send whole tensors (its base is stale)"
# Sparse costs index + value bytes per changed element; whole costs every element. Below this
# share of the whole tensor's bytes a sparse encoding is chosen.
SPARSE_BELOW = 0.8
FINGERPRINT_SAMPLES = 64  # elements read per tensor to notice weights changed behind our back
# A strided sample of this many elements decides "whole" before the full scan when far more
# than the sparse limit changed (a wrong guess only costs bytes, never correctness).
SAMPLE, SAMPLE_MARGIN = 4096, 0.05
ENCODE_THREADS = min(4, os.cpu_count() or 1)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def wire_specs(specs: Sequence[TensorSpec], nnz: Sequence[int]) -> list[TensorSpec]:
    """The tensors on the wire for logical ``specs`` encoded with ``nnz`` (both sides)."""
    out = []
    for spec, n in zip(specs, nnz, strict=True):
        if n == WHOLE:
            out.append(spec)
        else:
            out.append(TensorSpec(spec.name + INDEX_SUFFIX, index_dtype(spec.numel), (n,)))
            out.append(TensorSpec(spec.name + VALUE_SUFFIX, spec.dtype, (n,)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, as integers of its width: equal bits compare equal (NaN, -0.0 included)."""
    flat = t.detach().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return flat.view(width)


def _kernels():
    from vllm_ascend_rl import _host

    return _host


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, contiguous, in host memory: what the kernels may read by address."""
    return t.detach().reshape(-1).to("cpu").contiguous()


def _copy_into(held: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, written into ``held`` when it has the same shape and dtype."""
    if held is None or held.shape != t.shape or held.dtype != t.dtype:
        return t.detach().to("cpu", copy=True)
    return held.copy_(t.detach())


def sparse_limit(numel: int, elem: int) -> int:
    """Most changed elements for which indices + values still cost less than ``SPARSE_BELOW``
    of the whole tensor."""
    per_element = index_dtype(numel).itemsize + elem
    return int(SPARSE_BELOW * numel * elem) // per_element


def changed(
    new: torch.Tensor, base: torch.Tensor, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(indices, values)`` of the elements of ``new`` whose bits differ from ``base``
    (increasing indices of ``index_dtype``; values in host memory), or None when more than
    ``limit`` (default: ``sparse_limit``, beyond which the whole tensor is cheaper) differ.
    One pass of ``_host.diff``, which stops as soon as the answer is None."""
    new, base = _host(new), _host(base)
    if new.numel() != base.numel() or new.dtype != base.dtype:
        raise ValueError("changed() needs two tensors of one size and dtype")
    numel, elem = new.numel(), new.element_size()
    limit = sparse_limit(numel, elem) if limit is None else limit
    if numel >= 4 * SAMPLE:
        step = numel // SAMPLE
        share = (_bits(new[::step]) != _bits(base[::step])).float().mean().item()
        if share > limit / numel + SAMPLE_MARGIN:
            return None
    idx = torch.empty(limit + 8, dtype=index_dtype(numel))  # pages never written cost nothing
    values = torch.empty(limit + 8, dtype=new.dtype)
    count = _kernels().diff(
        new.data_ptr(), base.data_ptr(), numel, elem, limit,
        idx.data_ptr(), idx.element_size(), values.data_ptr(),
    )  # fmt: skip
    if count < 0:
        return None
    return idx[:count].clone(), values[:count].clone()


def scatter(
    dst: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, keep_old: bool = False
) -> torch.Tensor | None:
    """``dst.view(-1)[idx] = values`` in place, in one pass, after checking every index (in
    range and strictly increasing, else ValueError and nothing is written). With ``keep_old``
    it returns the values it overwrote, for an undo."""
    if dst.device.type != "cpu" or not dst.is_contiguous():
        raise ValueError("scatter() writes contiguous host tensors only")
    idx, values = _host(idx), _host(values).to(dst.dtype)
    if idx.dtype not in (torch.int32, torch.int64) or idx.numel() != values.numel():
        raise ValueError(f"{idx.numel()} sparse indices ({idx.dtype}) for {values.numel()} values")
    old = torch.empty_like(values) if keep_old else None
    _kernels().scatter(
        dst.data_ptr(), dst.numel(), dst.element_size(),
        idx.data_ptr(), idx.element_size(), idx.numel(), values.data_ptr(),
        0 if old is None else old.data_ptr(),
    )  # fmt: skip
    return old


@dataclass
class Encoded:
    """One tensor of a delta update, as the trainer sends it."""

    name: str
    nnz: int  # WHOLE or the number of changed elements
    tensors: list[torch.Tensor]  # [whole] or [indices, values]


def encode(name: str, new: torch.Tensor, base: torch.Tensor | None) -> Encoded:
    """Sparse if the changed elements cost less than ``SPARSE_BELOW`` of the whole tensor."""
    new = new.detach()
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return Encoded(name, WHOLE, [new])
    found = changed(new, base)
    if found is None:
        return Encoded(name, WHOLE, [new])
    return Encoded(name, found[0].numel(), list(found))


def fingerprint(model: torch.nn.Module) -> int:
    """A cheap hash of a strided sample of every parameter: a reload or a level-2 wake that
    brought other weights changes it (with overwhelming probability)."""
    h = 0
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        sample = _bits(flat[::step][:FINGERPRINT_SAMPLES].contiguous()).cpu()
        h = hash((h, name, tuple(sample.tolist())))
    return h


class DeltaRefused(ValueError):
    """A delta update that does not fit this engine's base; nothing was loaded. ``stale``:
    the engine holds another base, and the trainer should send every tensor whole."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


@dataclass
class HostBase:
    """Checkpoint-format host tensors the engine holds, and their version: the *base* both
    sides keep.

    ``stage`` applies an update's wire tensors (patches or whole tensors) to the base itself,
    keeping what it overwrote; ``commit`` keeps the result, ``rollback`` restores the base as
    it was. The engine stages what it receives; the trainer stages what it sent while the
    engine is still loading, and commits or rolls back with the engine's answer.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    _undo: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )  # (name, indices or None for whole, old values or old tensor)
    _pending_version: str | None = None
    _index: torch.Tensor | None = None  # a w@idx waiting for its w@val
    # Base tensors replaced by whole ones in the last update, reused by the next one: a fresh
    # host allocation costs a page fault per page, about as much as the copy itself.
    _spare: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def begin(self, version: str | None) -> None:
        self._undo, self._pending_version, self._index = [], version, None

    def stage(
        self, pairs: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Wire ``(name, tensor)`` pairs -> ``(name, full tensor in the base)``."""
        for name, t in pairs:
            if name.endswith(INDEX_SUFFIX):
                self._index = t.to("cpu", copy=True)  # its bucket may be reused
                continue
            if name.endswith(VALUE_SUFFIX):
                name = name.removesuffix(VALUE_SUFFIX)
                idx, self._index = self._index, None
                if idx is None:
                    raise DeltaRefused(f"{name}{VALUE_SUFFIX} arrived without its indices")
                try:
                    old = scatter(self.tensors[name], idx, t, keep_old=True)
                except ValueError as e:
                    raise DeltaRefused(f"parameter {name!r}: {e}") from None
                self._undo.append((name, idx, old))
                yield name, self.tensors[name]
            else:
                self._undo.append((name, None, self.tensors.get(name)))
                self.tensors[name] = _copy_into(self._spare.pop(name, None), t)
                yield name, self.tensors[name]

    def commit(self) -> None:
        # Only what nothing else refers to may be written over (a loader could alias it).
        self._spare = {
            name: old
            for name, idx, old in self._undo
            if idx is None and old is not None and sole_owner(old)
        }
        self.version, self._undo = self._pending_version, []

    def rollback(self) -> None:
        for name, idx, old in reversed(self._undo):
            if idx is not None:
                scatter(self.tensors[name], idx, old)
            elif old is None:
                self.tensors.pop(name, None)
            else:
                self.tensors[name] = old
        self._undo, self._index = [], None

    def drop(self) -> None:
        """Forget the base."""
        self.tensors, self.version = {}, None
        self._undo, self._index, self._spare = [], None, {}


@dataclass
class EngineBase(HostBase):
    """The engine side's base, with a fingerprint of the model it was loaded into."""

    model_fingerprint: int | None = None

    def check(
        self, specs: Sequence[TensorSpec], nnz: Sequence[int], base_version: str | None
    ) -> None:
        """Refuse an update whose sparse tensors do not refer to this base."""
        sparse = [s for s, n in zip(specs, nnz, strict=True) if n != WHOLE]
        if not sparse:
            return
        if base_version is None or base_version != self.version:
            have = "no base" if self.version is None else f"base {self.version!r}"
            raise DeltaRefused(
                f"the update's sparse tensors refer to base {base_version!r} but this engine "
                f"holds {have}: {STALE_BASE}",
                stale=True,
            )
        for s in sparse:
            held = self.tensors.get(s.name)
            if held is None or tuple(held.shape) != s.shape or held.dtype != s.dtype:
                raise DeltaRefused(
                    f"parameter {s.name!r} is sent sparse but the engine's base has no "
                    f"{s.dtype}{list(s.shape)} tensor of that name: send it whole"
                )
        for s, n in zip(specs, nnz, strict=True):
            if n != WHOLE and not 0 <= n <= s.numel:
                raise DeltaRefused(f"parameter {s.name!r}: nnz {n} outside 0..{s.numel}")

    def commit(self, model: torch.nn.Module | None = None) -> None:
        super().commit()
        if model is not None:
            self.model_fingerprint = fingerprint(model)

    def drop(self) -> None:
        """Forget the base (the engine's weights changed some other way)."""
        super().drop()
        self.model_fingerprint = None


@dataclass
class DeltaPlan:
    """One delta update, encoded by the trainer before the engine opens it."""

    nnz: list[int]
    encoded: list[Encoded]
    base_version: str | None
    version: str

    def wire_pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.encoded:
            if e.nnz == WHOLE:
                yield e.name, e.tensors[0]
            else:
                yield e.name + INDEX_SUFFIX, e.tensors[0]
                yield e.name + VALUE_SUFFIX, e.tensors[1]

    @property
    def payload(self) -> dict:
        return {"nnz": self.nnz, "base_version": self.base_version, "delta_version": self.version}


@dataclass
class TrainerBase(HostBase):
    """The trainer side's copy of what the engine holds (host memory), and its version."""

    def encode(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> DeltaPlan:
        """Every source tensor against the base (all whole while there is none). Tensors are
        encoded on a few threads (the scan releases the GIL) while the source is read in
        order on this one, at most ``ENCODE_THREADS`` ahead."""
        import uuid

        base = self.tensors if self.version is not None else {}
        encoded: list[Encoded] = []
        with ThreadPoolExecutor(ENCODE_THREADS) as pool:
            pending: deque[Future[Encoded]] = deque()
            for name, t in pairs:
                pending.append(pool.submit(encode, name, t, base.get(name)))
                if len(pending) > ENCODE_THREADS:
                    encoded.append(pending.popleft().result())
            encoded += [f.result() for f in pending]
        return DeltaPlan(
            [e.nnz for e in encoded],
            encoded,
            self.version if base else None,
            uuid.uuid4().hex,
        )

    def whole(self, plan: DeltaPlan) -> DeltaPlan:
        """``plan`` with every tensor whole (rebuilt from the base, without reading the source
        again: on a multi-rank trainer that is a collective the other ranks would not join);
        the base is dropped."""
        encoded = []
        for e in plan.encoded:
            if e.nnz == WHOLE:
                encoded.append(e)
                continue
            idx, values = e.tensors
            full = self.tensors[e.name].clone()
            scatter(full, idx, values)
            encoded.append(Encoded(e.name, WHOLE, [full]))
        self.drop()
        return DeltaPlan([WHOLE] * len(encoded), encoded, None, plan.version)

    def apply(self, plan: DeltaPlan) -> None:
        """Stage ``plan`` (sent, not yet accepted): ``commit`` or ``rollback`` follows."""
        self.begin(plan.version)
        for _ in self.stage(plan.wire_pairs()):
            pass
