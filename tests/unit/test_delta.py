"""Delta encoding and the engine's base: pure tensor logic, no server (the e2e is in
tests/e2e/weight_sync_cases.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.delta import (
    INDEX_SUFFIX,
    VALUE_SUFFIX,
    WHOLE,
    DeltaRefused,
    EngineBase,
    changed_indices,
    encode,
    fingerprint,
    wire_specs,
)


def adam_like_step(w: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    """``w`` with about ``share`` of its bf16 elements moved (the rest bit-identical)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(w.shape, generator=g) < share
    return torch.where(mask, w + 0.5 * w.abs().clamp_min(1e-3), w)


def test_changed_indices_compare_bits():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0, float("nan"), 3.0], dtype=torch.bfloat16)
    assert changed_indices(b, a).tolist() == [0, 3]  # -0.0 differs in bits; NaN == NaN


@pytest.mark.parametrize("share, sparse", [(0.0, True), (0.01, True), (0.1, True), (0.5, False)])
def test_encode_picks_the_cheaper_form(share, sparse):
    base = torch.randn(256, 128).to(torch.bfloat16)
    new = adam_like_step(base, share)
    e = encode("w", new, base)
    assert (e.nnz != WHOLE) == sparse
    if sparse:
        idx, val = e.tensors
        assert idx.dtype == torch.int32 and val.dtype == torch.bfloat16
        rebuilt = base.clone().view(-1)
        rebuilt[idx.long()] = val
        assert torch.equal(rebuilt.view(256, 128), new)
    else:
        assert e.tensors[0] is new or torch.equal(e.tensors[0], new)


def test_encode_sends_whole_without_a_matching_base():
    new = torch.ones(4, dtype=torch.bfloat16)
    assert encode("w", new, None).nnz == WHOLE
    assert encode("w", new, torch.ones(5, dtype=torch.bfloat16)).nnz == WHOLE


def test_wire_specs_split_sparse_tensors():
    specs = [TensorSpec("a", torch.bfloat16, (4, 4)), TensorSpec("b", torch.float32, (3,))]
    assert wire_specs(specs, [2, WHOLE]) == [
        TensorSpec("a" + INDEX_SUFFIX, torch.int32, (2,)),
        TensorSpec("a" + VALUE_SUFFIX, torch.bfloat16, (2,)),
        specs[1],
    ]


def _wire(encoded):
    for e in encoded:
        if e.nnz == WHOLE:
            yield e.name, e.tensors[0]
        else:
            yield e.name + INDEX_SUFFIX, e.tensors[0]
            yield e.name + VALUE_SUFFIX, e.tensors[1]


def test_engine_base_applies_commits_and_rolls_back():
    model = torch.nn.Linear(8, 8)
    v1 = {"a": torch.randn(16, 16).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    base = EngineBase()
    base.begin("v1")
    assert [n for n, _ in base.stage(v1.items())] == ["a", "b"]
    base.commit(model)
    assert base.version == "v1" and torch.equal(base.tensors["a"], v1["a"])

    v2 = {"a": adam_like_step(v1["a"], 0.05), "b": adam_like_step(v1["b"], 0.9, seed=1)}
    encoded = [encode(n, t, base.tensors[n]) for n, t in v2.items()]
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in v2.items()]
    nnz = [e.nnz for e in encoded]
    assert nnz[0] != WHOLE and nnz[1] == WHOLE
    base.check(specs, nnz, "v1")
    with pytest.raises(DeltaRefused, match="refer to base 'v0'"):
        base.check(specs, nnz, "v0")

    base.begin("v2")  # a failed update: everything staged goes back
    loaded = dict(base.stage(_wire(encoded)))
    assert torch.equal(loaded["a"], v2["a"]) and torch.equal(loaded["b"], v2["b"])
    base.rollback()
    assert base.version == "v1"
    assert torch.equal(base.tensors["a"], v1["a"]) and torch.equal(base.tensors["b"], v1["b"])

    base.begin("v2")
    dict(base.stage(_wire(encoded)))
    base.commit(model)
    assert base.version == "v2" and torch.equal(base.tensors["a"], v2["a"])


def test_engine_base_refuses_what_it_cannot_rebuild():
    base = EngineBase()
    spec = TensorSpec("a", torch.bfloat16, (4,))
    with pytest.raises(DeltaRefused, match="holds no base"):
        base.check([spec], [1], None)
    base.tensors["a"] = torch.zeros(5, dtype=torch.bfloat16)
    base.version = "v1"
    with pytest.raises(DeltaRefused, match="send it whole"):
        base.check([spec], [1], "v1")
    base.check([spec], [WHOLE], None)  # a whole tensor needs no base
    base.tensors["a"] = torch.zeros(4, dtype=torch.bfloat16)
    base.begin("v2")
    bad = [
        ("a" + INDEX_SUFFIX, torch.tensor([7], dtype=torch.int32)),
        ("a" + VALUE_SUFFIX, torch.ones(1, dtype=torch.bfloat16)),
    ]
    with pytest.raises(DeltaRefused, match="out of range"):
        list(base.stage(bad))


def test_fingerprint_notices_new_weights():
    model = torch.nn.Linear(64, 64)
    before = fingerprint(model)
    assert fingerprint(model) == before
    with torch.no_grad():
        model.weight.add_(1)
    assert fingerprint(model) != before


def test_trainer_base_resends_whole_without_reading_the_source_again():
    """A refused delta is resent whole from the base and the encoded patches alone (a source
    read on a multi-rank trainer is a collective the other ranks would not join)."""
    from vllm_ascend_rl.weight_transfer.delta import TrainerBase

    v1 = {"a": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    base = TrainerBase()
    first = base.encode(v1.items())
    assert first.nnz == [WHOLE, WHOLE] and first.base_version is None
    base.commit(first)
    v2 = {"a": adam_like_step(v1["a"], 0.02), "b": v1["b"]}
    plan = base.encode(v2.items())
    assert plan.base_version == first.version and plan.nnz[0] > 0 and plan.nnz[1] == 0
    whole = base.whole(plan)
    assert whole.nnz == [WHOLE, WHOLE] and whole.base_version is None
    assert base.version is None and not base.tensors
    sent = dict(whole.wire_pairs())
    assert torch.equal(sent["a"], v2["a"]) and torch.equal(sent["b"], v2["b"])
