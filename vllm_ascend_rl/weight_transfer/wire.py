"""The wire: what the trainer and the engine agree on.

The init-time wire parameters (checked once, signed by both sides), the bucket plan both sides
derive from them, and one update's metadata. Shared by both transports, trainer side and
engine side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo

from vllm_ascend_rl.weight_transfer.buckets import Bucket, TensorSpec, dtype_name, plan_buckets
from vllm_ascend_rl.weight_transfer.channel import signature
from vllm_ascend_rl.weight_transfer.fields import FieldError, check_field_types
from vllm_ascend_rl.weight_transfer.validation import (
    DEFAULT_VALIDATION,  # noqa: F401 (the transports take their defaults from here)
    VALIDATION,
    WeightUpdateRefused,
    parse_specs,
)

# 2: NPU-IPC rings per chip; 3: delta updates (the delta flag is signed); 4: HCCL sends a
# bucket larger than the bucket size in pieces of that size; 5: so does NPU IPC, through ring
# slots of at most the bucket size, piece k in slot k % len(ring)
PROTOCOL_VERSION = 5
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 120.0
MAX_BUCKET_BYTES = 1 << 36  # 64 GiB: a bucket is staged whole on both sides
MAX_NUM_BUFFERS = 64
MAX_TIMEOUT_S = 24 * 3600.0
# What a failed update leaves: "restore" puts the old weights back from a host copy kept for
# the update's duration; "hold" keeps no copy and holds generation until an update completes.
ON_FAILURE = ("restore", "hold")
DEFAULT_ON_FAILURE = "restore"
# Fields every init info carries, trainer side and engine side (checked by check_wire).
WIRE_FIELDS = (
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
    "timeout_s",
    "on_failure",
    "validation",
    "delta",
)


def check_wire(info) -> None:
    """Validate an init info's fields (ValueError naming the field): types first, then the
    wire parameters, which are agreed once, at init."""
    check_field_types(info)
    bucket, buffers, timeout_s = (
        info.packed_buffer_size_bytes,
        info.packed_num_buffers,
        info.timeout_s,
    )
    if not 0 < bucket <= MAX_BUCKET_BYTES:
        raise ValueError(
            f"packed_buffer_size_bytes must be in 1..{MAX_BUCKET_BYTES}, got {bucket!r}"
        )
    if not 1 <= buffers <= MAX_NUM_BUFFERS:
        raise ValueError(f"packed_num_buffers must be in 1..{MAX_NUM_BUFFERS}, got {buffers!r}")
    if info.validation not in VALIDATION:
        raise ValueError(f"validation must be one of {list(VALIDATION)}, got {info.validation!r}")
    if info.on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {list(ON_FAILURE)}, got {info.on_failure!r}")
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}] s, got {timeout_s!r}")


def engine_wire(info) -> dict:
    """The wire parameters a trainer's init info hands on to the engine's."""
    return {k: getattr(info, k) for k in WIRE_FIELDS}


def wire_signature(info) -> int:
    return signature(
        PROTOCOL_VERSION,
        info.packed,
        info.packed_buffer_size_bytes,
        info.packed_num_buffers,
        info.delta,
    )


def plan_for(info, specs: list[TensorSpec], alone_bytes: int | None = None) -> list[Bucket]:
    """The bucket plan both sides derive from the agreed wire parameters. Unpacked: one tensor
    per bucket; packed: tensors share buckets, and one above ``alone_bytes`` goes alone."""
    bucket_bytes = info.packed_buffer_size_bytes if info.packed else 1
    return plan_buckets(specs, bucket_bytes, alone_bytes=alone_bytes)


def update_signature(specs: list[TensorSpec]) -> int:
    return signature([(s.name, dtype_name(s.dtype), s.shape) for s in specs])


@dataclass
class CheckpointUpdateInfo(WeightTransferUpdateInfo):
    """One update's metadata, in the order the trainer sends the tensors."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # The version being loaded (the trainer's send_weights(weight_version=...)), so that a
    # failed update can say which version is partly loaded; finish_weight_update sets it.
    weight_version: str | None = None
    # Delta updates (init with delta=True; see delta.py): per tensor the number of changed
    # elements sent (-1: whole), the base they refer to, and the version they make.
    nnz: list[int] | None = None
    base_version: str | None = None
    delta_version: str | None = None

    def __post_init__(self) -> None:
        """Refuse inconsistent metadata at construction, as vLLM's own update infos do."""
        try:
            check_field_types(self)
        except FieldError as e:
            raise WeightUpdateRefused(str(e)) from None
        parse_specs(self.names, self.dtype_names, self.shapes)
        if self.nnz is not None and len(self.nnz) != len(self.names):
            raise WeightUpdateRefused(
                f"nnz has {len(self.nnz)} entries for {len(self.names)} tensors"
            )

    @classmethod
    def fields_from_specs(cls, specs: list[TensorSpec]) -> dict:
        return {
            "names": [s.name for s in specs],
            "dtype_names": [dtype_name(s.dtype) for s in specs],
            "shapes": [list(s.shape) for s in specs],
        }
