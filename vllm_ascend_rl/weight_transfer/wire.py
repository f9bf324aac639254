"""What trainer and engine agree on, type-checked on construction: the wire parameters (signed
at init), one update's metadata, the handshake's :class:`Verdict`, and the bucket plan (signed
at every update; docs/failure-semantics.md#agreement-before-any-byte-moves)."""

from __future__ import annotations

import os
import secrets
import socket
import zlib
from dataclasses import fields
from enum import IntEnum
from functools import cached_property
from typing import Annotated, Any, Literal, dataclass_transform

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from vllm_ascend_rl.weight_transfer.buckets import (
    ALIGN_BYTES,
    Bucket,
    TensorSpec,
    dtype_name,
    plan_buckets,
)
from vllm_ascend_rl.weight_transfer.validation import parse_specs

PROTOCOL_VERSION = 8  # bump when what travels, or what is signed, changes
MAX_BUCKET_BYTES = 1 << 36  # 64 GiB: a bucket is staged whole on both sides
MAX_TIMEOUT_S = 24 * 3600.0

# Every wire type: strict types (no "5" for 5, no 1 for True) and no unknown field.
WIRE_CONFIG = ConfigDict(strict=True, extra="forbid", hide_input_in_errors=True)


@dataclass_transform(kw_only_default=True, field_specifiers=(Field,))  # what mypy sees
def wire_dataclass(cls: type[Any]) -> type[Any]:
    return pydantic_dataclass(cls, kw_only=True, config=WIRE_CONFIG)


_identity: tuple[int, str] = (0, "")


def trainer_id() -> str:
    """This process's identity as a trainer (host, pid, random), new in a forked child."""
    global _identity
    if _identity[0] != os.getpid():
        pid = os.getpid()
        _identity = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
    return _identity[1]


BucketBytes = Annotated[int, Field(gt=0, le=MAX_BUCKET_BYTES)]
NumBuffers = Annotated[int, Field(ge=1, le=64)]


@wire_dataclass
class WireParams:
    """The trainer's choices both sides share, in every init info (the fields:
    docs/failure-semantics.md#parameters). ``packed_num_buffers`` is the buckets in flight;
    ``timeout_s`` bounds every rendezvous, collective and doorbell wait."""

    packed: bool = True
    packed_buffer_size_bytes: BucketBytes = 256 << 20
    packed_num_buffers: NumBuffers = 2
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)] = 120.0
    on_failure: Literal["restore", "hold"] = "restore"
    validation: Literal["partial", "complete"] = "complete"


WIRE_FIELDS = tuple(f.name for f in fields(WireParams))


@wire_dataclass
class EngineInitInfo(WeightTransferInitInfo, WireParams):
    """What every engine-side init info carries: the wire parameters and which trainer sends
    it (the channel's owner-to-be, connection.py)."""

    trainer_id: str = ""


def parse_wire(cls: type, body: Any, what: str) -> Any:
    """``cls(**body)``, as vLLM builds the ``what`` body (``init_info for <engine>``, ...);
    ValueError ``Invalid <what>: ...`` (vLLM's own wording) lists each ``field[index]:
    problem``."""
    if not isinstance(body, dict):
        raise ValueError(f"Invalid {what}: not an object of {cls.__name__} fields: {body!r:.80}")
    try:
        return cls(**body)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where.lstrip('.')}: {msg}" if where else msg)
        raise ValueError(f"Invalid {what}: {'; '.join(problems)}") from None


def wire_params(info: WireParams) -> dict[str, Any]:
    """The wire parameters of ``info``, as a trainer hands them to the engine's init info."""
    return {name: getattr(info, name) for name in WIRE_FIELDS}


def signature(*parts: object) -> int:
    """A 30-bit digest of ``parts``, small enough to negate inside an int32 all-reduce."""
    return zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF


def wire_signature(info: WireParams, alone_bytes: int | None) -> int:
    """What both sides sign at init: protocol, wire parameters, constants shaping the plan."""
    return signature(PROTOCOL_VERSION, ALIGN_BYTES, alone_bytes, *wire_params(info).values())


def plan_for(info: WireParams, specs: list[TensorSpec], alone_bytes: int | None) -> list[Bucket]:
    """The bucket plan both sides derive from the agreed wire parameters. Unpacked: one tensor
    per bucket; packed: tensors share buckets, and one above ``alone_bytes`` goes alone."""
    bucket_bytes = info.packed_buffer_size_bytes if info.packed else 1
    return plan_buckets(specs, bucket_bytes, alone_bytes=alone_bytes)


def plan_signature(plan: list[Bucket]) -> int:
    """What both sides sign at every update: every bucket and every tensor's place in it."""
    rows = []
    for b in plan:
        tensors = [(s.name, dtype_name(s.dtype), s.shape) for s in b.specs]
        rows.append((b.nbytes, b.oversized, b.offsets, tensors))
    return signature(rows)


class Verdict(IntEnum):
    """A side's answer in an update's handshake. Lower wins: an HCCL handshake all-reduces the
    minimum, and the NPU-IPC trainer takes the minimum of its ranks' and workers' answers."""

    REFUSED = 0  # the metadata does not fit a side (the reason is in its HTTP answer)
    GO = 1


@wire_dataclass
class CheckpointUpdateInfo(WeightTransferUpdateInfo):
    """One update's metadata, in send order; ``weight_version`` names it in failure messages."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    weight_version: str | None = None
    trainer_id: str = ""  # who sends it: only the channel's owner may (connection.py)

    def __post_init__(self) -> None:
        _ = self.specs  # malformed metadata is refused at construction, as vLLM's infos are

    @cached_property
    def specs(self) -> list[TensorSpec]:
        return parse_specs(self.names, self.dtype_names, self.shapes)

    @staticmethod
    def fields_from_specs(specs: list[TensorSpec]) -> dict[str, Any]:
        return {
            "trainer_id": trainer_id(),
            "names": [s.name for s in specs],
            "dtype_names": [dtype_name(s.dtype) for s in specs],
            "shapes": [list(s.shape) for s in specs],
        }
