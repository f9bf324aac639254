"""Check a weight update's names, shapes and dtypes against the model before loading a byte:
vLLM's weight loaders narrow an oversized tensor into its slot silently, so a wrong shape would
succeed and serve garbage. The expected set comes from the checkpoint's safetensors headers or,
without them, the Hugging Face architecture on the meta device."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec, dtype_from_name, dtype_name

logger = get_logger(__name__)


MAX_TENSOR_BYTES = 1 << 40  # a shape beyond this is a malformed request, not a weight
# Checkpoint tensors vLLM's loaders drop (AutoWeightsLoader: REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER,
# models/utils.py:233-240 in 0.32.0; ROTARY_EMBEDS_UNUSED_WEIGHTS, :191-196 in 0.27.1): a trainer
# need not send them.
DROPPED_BY_VLLM = (
    "rotary_pos_emb.inv_freq",
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)


class WeightUpdateRefused(ValueError):
    """The update's metadata does not fit the model (or another side refused it: ``cause``
    ``refused_by_peer``); nothing was loaded."""

    def __init__(self, message: str, cause: str = "invalid_weights") -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class ExpectedParam:
    shape: tuple[int, ...]
    dtypes: frozenset[torch.dtype]  # wire dtypes accepted for this parameter
    required: bool = True


def checkpoint_files(model_dir: str) -> list[str]:
    """The ``*.safetensors`` files of a checkpoint directory (none if it is not one)."""
    return sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))


def checkpoint_params(files: list[str]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor's dtype and shape, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                out[name] = (_ST_DTYPES.get(sl.get_dtype(), torch.uint8), tuple(sl.get_shape()))
    return out


_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def expected_params(model_config: Any) -> dict[str, ExpectedParam] | None:
    """Checkpoint-format parameters of the served model, or None if they cannot be known.
    ``model_config``: vLLM's ModelConfig, whose ``dtype`` its stubs leave unresolved."""
    source = model_config.model
    params: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    if os.path.isdir(source):
        params = checkpoint_params(checkpoint_files(source))
    if not params:
        try:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):  # the architecture, without allocating its weights
                model = AutoModelForCausalLM.from_config(model_config.hf_config)
            params = {n: (p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
        except Exception as e:  # unknown architecture: validate what we can
            logger.warning(
                "cannot derive checkpoint parameters of %s (%s); weight updates "
                "are checked for well-formed metadata only",
                source,
                e,
            )
            return None
    served = model_config.dtype
    tied = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
    out = {}
    for name, (dtype, shape) in params.items():
        accepted = {dtype, served} if dtype.is_floating_point else {dtype}
        optional = tied and name.endswith("lm_head.weight")
        optional = optional or any(dropped in name for dropped in DROPPED_BY_VLLM)
        out[name] = ExpectedParam(shape, frozenset(accepted), required=not optional)
    return out


def parse_specs(
    names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorSpec]:
    """Wire metadata -> specs; WeightUpdateRefused on malformed input."""
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise WeightUpdateRefused(
            f"names, dtype_names and shapes differ in length: {len(names)}, "
            f"{len(dtype_names)}, {len(shapes)}"
        )
    specs = []
    for name, dn, shape in zip(names, dtype_names, shapes, strict=True):
        try:
            dtype = dtype_from_name(dn)
        except ValueError:
            raise WeightUpdateRefused(f"parameter {name!r}: unknown dtype {dn!r}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WeightUpdateRefused(f"parameter {name!r}: malformed shape {shape!r}")
        spec = TensorSpec(name, dtype, tuple(shape))
        if spec.nbytes > MAX_TENSOR_BYTES:
            raise WeightUpdateRefused(
                f"parameter {name!r}: shape {list(shape)} is {spec.nbytes} bytes, more than "
                f"any weight tensor can be ({MAX_TENSOR_BYTES})"
            )
        specs.append(spec)
    return specs


def serving_layer(name: str, packed_modules: dict[str, list[str]] | None = None) -> str:
    """The serving layer a checkpoint tensor loads into, by name: vLLM fuses modules
    (``packed_modules_mapping``: q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) and an MoE
    block's experts into one ``experts`` layer, rebuilt only once all its tensors are in."""
    module = name.rpartition(".")[0]
    if ".experts." in f"{module}.":
        return module[: f"{module}.".index(".experts.") + len(".experts")]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in (packed_modules or {}).items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def validate_update(
    specs: Sequence[TensorSpec],
    expected: dict[str, ExpectedParam] | None,
    validation: str = "complete",
    packed_modules: dict[str, list[str]] | None = None,
) -> None:
    """Raise WeightUpdateRefused naming the first parameter that does not fit the model.
    ``"complete"`` (the default) refuses any missing checkpoint tensor: a trainer whose name
    mapping drops a tensor would otherwise serve a model that is neither version.
    ``validation="partial"`` may omit whole layers (frozen modules keep their weights), never
    part of one."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise WeightUpdateRefused(f"parameter {spec.name!r} is sent twice")
        seen.add(spec.name)
        if expected is None:
            continue
        want = expected.get(spec.name)
        if want is None:
            raise WeightUpdateRefused(
                f"unknown parameter {spec.name!r}: the model has no such checkpoint tensor"
            )
        if spec.shape != want.shape:
            raise WeightUpdateRefused(
                f"parameter {spec.name!r}: shape {list(spec.shape)} "
                f"does not match the model's {list(want.shape)}"
            )
        if spec.dtype not in want.dtypes:
            ok = " or ".join(sorted(dtype_name(d) for d in want.dtypes))
            raise WeightUpdateRefused(
                f"parameter {spec.name!r}: dtype {dtype_name(spec.dtype)}"
                f", expected {ok} (cast before sending)"
            )
    if expected is None:
        return
    missing = [n for n, p in expected.items() if p.required and n not in seen]
    if missing and validation == "complete":
        first = ", ".join(repr(n) for n in missing[:3])
        raise WeightUpdateRefused(
            f"parameter {first} is missing ({len(missing)} missing in all): an update must "
            "carry every checkpoint tensor (validation='complete', the default); to leave "
            "frozen layers out, init with validation='partial'"
        )
    sent_layers = {serving_layer(n, packed_modules) for n in seen}
    for name in missing:
        layer = serving_layer(name, packed_modules)
        if layer in sent_layers:
            absent = [n for n in missing if serving_layer(n, packed_modules) == layer]
            raise WeightUpdateRefused(
                f"layer {layer!r} would receive only part of its weights: {absent} "
                "missing. A partial update may omit whole layers (they keep their weights), "
                "never part of one"
            )
