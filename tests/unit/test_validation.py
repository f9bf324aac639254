"""Metadata validation: every weight update is checked against the model before any byte."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from vllm.config import ModelConfig

from tests.support.tiny_model import parameter_shapes
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.validation import (
    WeightUpdateRefused,
    expected_params,
    parse_specs,
    serving_layer,
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


QWEN2_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def test_complete_validation_refuses_any_missing_tensor_and_both_refuse_duplicates(
    expected, good_specs
):
    without_head = [s for s in good_specs if s.name != "lm_head.weight"]
    with pytest.raises(WeightUpdateRefused, match=r"'lm_head\.weight' is missing") as e:
        validate_update(without_head, expected)  # "complete", the default
    assert "validation='partial'" in str(e.value)
    validate_update(without_head, expected, "partial")  # a whole layer may stay out
    for validation in ("partial", "complete"):
        with pytest.raises(WeightUpdateRefused, match="sent twice"):
            validate_update([*good_specs, good_specs[0]], expected, validation)


def test_partial_validation_lets_whole_layers_stay_out(expected, good_specs):
    """Frozen modules: the embedding, layer 0 entirely, and layer 1's MLP are not sent."""
    frozen = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.mlp.")
    sent = [s for s in good_specs if not s.name.startswith(frozen)]
    assert 0 < len(sent) < len(good_specs)
    validate_update(sent, expected, "partial", QWEN2_PACKED)
    validate_update(sent[:1], expected, "partial", QWEN2_PACKED)


@pytest.mark.parametrize(
    "dropped, layer",
    [
        ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj"),
        ("model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.qkv_proj"),
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj"),
    ],
)
def test_partial_validation_refuses_part_of_a_fused_layer(expected, good_specs, dropped, layer):
    """q/k/v load into one qkv_proj (gate/up into gate_up_proj): rebuilt only when whole."""
    with pytest.raises(WeightUpdateRefused) as e:
        validate_update(
            [s for s in good_specs if s.name != dropped], expected, "partial", QWEN2_PACKED
        )
    assert f"layer {layer!r}" in str(e.value) and dropped in str(e.value)
    assert "never part of one" in str(e.value)


@pytest.mark.parametrize(
    "name, layer",
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.qkv_proj"),
        ("model.layers.3.self_attn.o_proj.weight", "model.layers.3.self_attn.o_proj"),
        ("model.layers.3.mlp.experts.7.gate_proj.weight", "model.layers.3.mlp.experts"),
        ("model.layers.3.mlp.experts.w13_weight", "model.layers.3.mlp.experts"),
        (
            "model.layers.3.mlp.shared_expert.up_proj.weight",
            "model.layers.3.mlp.shared_expert.gate_up_proj",
        ),
        ("model.norm.weight", "model.norm"),
        ("lm_head.weight", "lm_head"),
    ],
)
def test_serving_layer_follows_vllm_fusion(name, layer):
    assert serving_layer(name, QWEN2_PACKED) == layer


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


def test_a_restore_backup_the_host_cannot_hold_is_refused_before_any_copy(monkeypatch):
    """[N16] on_failure='restore' copies every worker's shard to host memory per update: an
    engine whose workers together need more than the host has is refused with the cost and
    the alternative, not left to the OOM killer."""
    from vllm_ascend_rl.weight_transfer import reload

    monkeypatch.setattr(reload, "available_host_bytes", lambda: 10 << 30)
    reload.check_host_memory(2 << 30, workers_on_host=4)  # 8 GiB of 10: fine
    with pytest.raises(MemoryError, match=r"17\.5 GiB for 8 worker\(s\), but only 10\.0 GiB"):
        reload.check_host_memory(int(17.5 * 2**30 / 8), workers_on_host=8)


def test_complete_lets_out_what_vllms_loaders_drop(tmp_path):
    """Old checkpoints carry rotary ``inv_freq`` buffers that vLLM's loaders drop and no
    trainer sends: ``complete`` does not ask for them."""
    names = {"model.norm.weight": [8], "model.layers.0.self_attn.rotary_emb.inv_freq": [4]}
    save_file({n: torch.zeros(shape) for n, shape in names.items()}, tmp_path / "m.safetensors")
    config = SimpleNamespace(
        model=str(tmp_path),
        dtype=torch.float32,
        hf_text_config=SimpleNamespace(tie_word_embeddings=False),
    )
    expected = expected_params(config)
    validate_update([TensorSpec("model.norm.weight", torch.float32, (8,))], expected)
