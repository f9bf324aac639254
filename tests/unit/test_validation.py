"""Metadata validation: every weight update is checked against the model before any byte."""

from __future__ import annotations

import pytest
import torch
from vllm.config import ModelConfig

from tests.support.tiny_model import parameter_shapes
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.validation import (
    WeightUpdateRefused,
    expected_params,
    parse_specs,
    validate_update,
)


@pytest.fixture(scope="module")
def expected(tiny_model):
    return expected_params(ModelConfig(model=str(tiny_model), dtype="bfloat16"))


@pytest.fixture
def good_specs(tiny_model):
    from tests.support.tiny_model import TinyModelSpec

    return [TensorSpec(n, torch.bfloat16, s) for n, s in parameter_shapes(TinyModelSpec())]


def test_expected_params_come_from_the_checkpoint_headers(expected, good_specs):
    assert set(expected) == {s.name for s in good_specs}
    for s in good_specs:
        assert expected[s.name].shape == s.shape
        assert torch.bfloat16 in expected[s.name].dtypes


def test_a_complete_update_passes(expected, good_specs):
    validate_update(good_specs, expected)


def replace(specs, target, **kw):
    return [
        TensorSpec(kw.get("name", s.name), kw.get("dtype", s.dtype), kw.get("shape", s.shape))
        if s.name == target
        else s
        for s in specs
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "model.layers.0.mlp.extra.weight"}, "unknown parameter"),
        ({"shape": (640, 128)}, "shape [640, 128] does not match the model's [256, 128]"),
        ({"shape": (128, 256)}, "shape [128, 256] does not match"),
        ({"dtype": torch.float32}, "dtype float32, expected bfloat16"),
        ({"dtype": torch.int32}, "dtype int32"),
    ],
)
def test_mismatch_names_the_first_offending_parameter(expected, good_specs, change, message):
    target = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(WeightUpdateRefused) as e:
        validate_update(replace(good_specs, target, **change), expected)
    assert message in str(e.value)
    assert (change.get("name") or target) in str(e.value)


def test_missing_and_duplicate_parameters_are_refused(expected, good_specs):
    with pytest.raises(WeightUpdateRefused, match=r"'lm_head\.weight' is missing"):
        validate_update([s for s in good_specs if s.name != "lm_head.weight"], expected)
    with pytest.raises(WeightUpdateRefused, match="sent twice"):
        validate_update([*good_specs, good_specs[0]], expected)


def test_without_known_parameters_only_form_is_checked(good_specs):
    validate_update(good_specs, None)
    with pytest.raises(WeightUpdateRefused, match="sent twice"):
        validate_update([good_specs[0], good_specs[0]], None)


@pytest.mark.parametrize(
    "names, dtypes, shapes, message",
    [
        (["a"], ["bfloat16", "float32"], [[1]], "differ in length"),
        (["a"], ["bfloat17"], [[1]], "unknown dtype 'bfloat17'"),
        (["a"], ["bfloat16"], [[-1, 2]], "malformed shape"),
        (["a"], ["bfloat16"], [["x"]], "malformed shape"),
    ],
)
def test_malformed_wire_metadata(names, dtypes, shapes, message):
    with pytest.raises(WeightUpdateRefused, match=message):
        parse_specs(names, dtypes, shapes)


def test_wire_dtype_names_may_carry_the_torch_prefix():
    specs = parse_specs(["w"], ["torch.bfloat16"], [[2, 3]])
    assert specs == [TensorSpec("w", torch.bfloat16, (2, 3))]
