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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from vllm_ascend_rl.weight_transfer.buckets import TensorSpec

INDEX_SUFFIX, VALUE_SUFFIX = "@idx", "@val"
WHOLE = -1  # nnz of a tensor sent whole
STALE_BASE = "the trainer must send whole tensors (its base is stale)"
# Sparse costs index + value bytes per changed element; whole costs every element. Below this
# share of the whole tensor's bytes a sparse encoding is chosen.
SPARSE_BELOW = 0.8
FINGERPRINT_SAMPLES = 64  # elements read per tensor to notice weights changed behind our back


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


def changed_indices(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64) of the elements whose bits differ."""
    return torch.nonzero(_bits(new) != _bits(base)).reshape(-1)


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
    idx = changed_indices(new.to(base.device), base)
    numel, elem = new.numel(), new.element_size()
    sparse_bytes = idx.numel() * (index_dtype(numel).itemsize + elem)
    if sparse_bytes >= SPARSE_BELOW * numel * elem:
        return Encoded(name, WHOLE, [new])
    values = new.reshape(-1)[idx.to(new.device)]
    return Encoded(name, idx.numel(), [idx.to(index_dtype(numel)), values])


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
    """A delta update that does not fit this engine's base; nothing was loaded."""


@dataclass
class EngineBase:
    """The engine side's base: checkpoint-format host tensors and their version.

    ``stage`` rebuilds the update's full tensors in the base itself, keeping what it
    overwrote; ``commit`` keeps the result, ``rollback`` restores the base as it was.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    model_fingerprint: int | None = None
    _undo: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )  # (name, indices or None for whole, old values or old tensor)
    _pending_version: str | None = None
    _index: torch.Tensor | None = None  # a w@idx waiting for its w@val

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

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
                f"holds {have}: {STALE_BASE}"
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

    def begin(self, version: str | None) -> None:
        self._undo, self._pending_version, self._index = [], version, None

    def stage(
        self, pairs: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Received ``(wire name, tensor)`` -> ``(name, full tensor in the base)`` to load."""
        for name, t in pairs:
            if name.endswith(INDEX_SUFFIX):
                self._index = t.to("cpu", torch.int64)
                continue
            if name.endswith(VALUE_SUFFIX):
                name = name.removesuffix(VALUE_SUFFIX)
                idx, self._index = self._index, None
                if idx is None:
                    raise DeltaRefused(f"{name}{VALUE_SUFFIX} arrived without its indices")
                if idx.numel() and (
                    int(idx.min()) < 0 or int(idx.max()) >= self.tensors[name].numel()
                ):
                    raise DeltaRefused(f"parameter {name!r}: a sparse index is out of range")
                flat = self.tensors[name].view(-1)
                self._undo.append((name, idx, flat[idx].clone()))
                flat[idx] = t.to("cpu")
                yield name, self.tensors[name]
            else:
                self._undo.append((name, None, self.tensors.get(name)))
                self.tensors[name] = t.to("cpu", copy=True)
                yield name, self.tensors[name]

    def commit(self, model: torch.nn.Module) -> None:
        self.version, self._undo = self._pending_version, []
        self.model_fingerprint = fingerprint(model)

    def rollback(self) -> None:
        for name, idx, old in reversed(self._undo):
            if idx is not None:
                self.tensors[name].view(-1)[idx] = old
            elif old is None:
                self.tensors.pop(name, None)
            else:
                self.tensors[name] = old
        self._undo, self._index = [], None

    def drop(self) -> None:
        """Forget the base (the engine's weights changed some other way)."""
        self.tensors, self.version, self.model_fingerprint = {}, None, None
        self._undo, self._index = [], None


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
class TrainerBase:
    """The trainer side's copy of what the engine holds (host memory), and its version."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def encode(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> DeltaPlan:
        """Every source tensor against the base (all whole while there is none)."""
        import uuid

        base = self.tensors if self.version is not None else {}
        encoded = [encode(name, t, base.get(name)) for name, t in pairs]
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
            full.view(-1)[idx.to("cpu", torch.int64)] = values.to("cpu")
            encoded.append(Encoded(e.name, WHOLE, [full]))
        self.drop()
        return DeltaPlan([WHOLE] * len(encoded), encoded, None, plan.version)

    def commit(self, plan: DeltaPlan) -> None:
        """The engine took ``plan``: the base follows."""
        for e in plan.encoded:
            if e.nnz == WHOLE:
                self.tensors[e.name] = e.tensors[0].detach().to("cpu", copy=True)
            else:
                idx, values = e.tensors
                self.tensors[e.name].view(-1)[idx.to("cpu", torch.int64)] = values.to("cpu")
        self.version = plan.version

    def drop(self) -> None:
        self.tensors, self.version = {}, None
