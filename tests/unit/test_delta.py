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
    changed,
    encode,
    fingerprint,
    scatter,
    sparse_limit,
    wire_specs,
)


def adam_like_step(w: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    """``w`` with about ``share`` of its bf16 elements moved (the rest bit-identical)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(w.shape, generator=g) < share
    return torch.where(mask, w + 0.5 * w.abs().clamp_min(1e-3), w)


def test_changed_compares_bits():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0, float("nan"), 3.0], dtype=torch.bfloat16)
    idx, values = changed(b, a, limit=4)
    assert idx.tolist() == [0, 3]  # -0.0 differs in bits; NaN == NaN
    assert values.view(torch.int16).tolist() == b[[0, 3]].view(torch.int16).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 7, 8, 4099])  # tails that do not fill an 8-byte word
def test_changed_matches_a_torch_reference(dtype, numel):
    """The one-pass kernel against compare + nonzero, word boundaries and tails included."""
    g = torch.Generator().manual_seed(numel)
    base = torch.randint(0, 100, (numel,), generator=g).to(dtype)
    new = base.clone()
    moved = torch.rand(numel, generator=g) < 0.05
    moved[-1] = True  # the last element lies in the tail whenever there is one
    new[moved] += 1
    want = torch.nonzero(new != base).reshape(-1)
    idx, values = changed(new, base, limit=numel)
    assert idx.dtype == torch.int32 and idx.tolist() == want.tolist()
    assert torch.equal(values, new[want])


def test_changed_gives_up_once_whole_is_cheaper():
    base = torch.zeros(1000, dtype=torch.bfloat16)
    limit = sparse_limit(1000, 2)  # int32 + bf16 per element against 80% of 2 bytes
    assert limit == 266
    new = base.clone()
    new[:limit] = 1
    assert changed(new, base)[0].numel() == limit
    new[limit] = 1
    assert changed(new, base) is None


def test_changed_reads_views_and_strided_tensors():
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    new = base.clone()
    new[3, 5] = -1
    idx, _ = changed(new.t(), base.t())  # not contiguous: compared in its own order
    assert idx.tolist() == [5 * 8 + 3]


def test_scatter_checks_every_index_before_writing():
    dst = torch.zeros(10, dtype=torch.bfloat16)
    values = torch.ones(3, dtype=torch.bfloat16)
    for bad in ([1, 2, 10], [1, 1, 2], [3, 2, 5], [-1, 2, 3]):
        with pytest.raises(ValueError, match=r"out of range|not above"):
            scatter(dst, torch.tensor(bad, dtype=torch.int32), values)
        assert not dst.any(), f"{bad} wrote before it was refused"
    old = scatter(dst, torch.tensor([0, 4, 9], dtype=torch.int64), values, keep_old=True)
    assert dst.tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 0, 1] and not old.any()
    scatter(dst, torch.tensor([0, 4, 9]), old)  # the undo puts it back
    assert not dst.any()
    with pytest.raises(ValueError, match="contiguous host"):
        scatter(dst[::2], torch.tensor([0]), values[:1])
    with pytest.raises(ValueError, match="sparse indices"):
        scatter(dst, torch.tensor([0, 1]), values)


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
    assert not base.tensors["a"].any()


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
    base.apply(first)
    base.commit()
    v2 = {"a": adam_like_step(v1["a"], 0.02), "b": v1["b"]}
    plan = base.encode(v2.items())
    assert plan.base_version == first.version and plan.nnz[0] > 0 and plan.nnz[1] == 0
    whole = base.whole(plan)
    assert whole.nnz == [WHOLE, WHOLE] and whole.base_version is None
    assert base.version is None and not base.tensors
    sent = dict(whole.wire_pairs())
    assert torch.equal(sent["a"], v2["a"]) and torch.equal(sent["b"], v2["b"])


def test_trainer_base_follows_the_engine_only_when_it_accepts():
    """The trainer stages what it sent while the engine loads: an engine that fails the
    update leaves the trainer's base where the engine's is (rolled back, version too)."""
    from vllm_ascend_rl.weight_transfer.delta import TrainerBase

    v1 = {"a": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    base = TrainerBase()
    base.apply(base.encode(v1.items()))
    base.commit()
    first = base.version
    v2 = {"a": adam_like_step(v1["a"], 0.05), "b": v1["b"] + 1}
    plan = base.encode(v2.items())
    assert plan.nnz[0] > 0 and plan.nnz[1] == WHOLE
    base.apply(plan)
    assert torch.equal(base.tensors["a"], v2["a"]) and torch.equal(base.tensors["b"], v2["b"])
    base.rollback()  # the engine refused
    assert base.version == first
    assert torch.equal(base.tensors["a"], v1["a"]) and torch.equal(base.tensors["b"], v1["b"])
    base.apply(plan)
    base.commit()  # the engine took it
    assert base.version == plan.version and torch.equal(base.tensors["a"], v2["a"])
    v2["a"].add_(1)  # the trainer trains on: the base holds copies, not its tensors
    assert not torch.equal(base.tensors["a"], v2["a"])


def test_engine_base_reuses_only_tensors_nothing_else_holds():
    """A whole tensor replaced by an update is written over by the next one (no fresh
    allocation), unless something else still refers to it (a loader that aliased it)."""
    model = torch.nn.Linear(2, 2)
    base = EngineBase()
    for version in ("v1", "v2"):
        base.begin(version)
        dict(base.stage([("a", torch.zeros(64)), ("b", torch.zeros(64))]))
        base.commit(model)
    held_elsewhere = base.tensors["b"].view(8, 8)  # what an aliasing loader would keep
    a_before = base.tensors["a"].data_ptr()
    base.begin("v3")
    dict(base.stage([("a", torch.ones(64)), ("b", torch.ones(64))]))
    base.commit(model)
    base.begin("v4")
    dict(base.stage([("a", torch.full((64,), 2.0)), ("b", torch.full((64,), 2.0))]))
    base.commit(model)
    assert base.tensors["a"].data_ptr() == a_before  # v2's tensor, reused for v4
    assert not held_elsewhere.any()  # v2's "b" was not written over
    assert base.tensors["a"].eq(2).all() and base.tensors["b"].eq(2).all()


def test_delta_scan_on_many_elements_decides_whole_from_a_sample():
    base = torch.zeros(1 << 16, dtype=torch.bfloat16)
    new = base.clone()
    new[::2] = 1  # 50% changed
    assert changed(new, base) is None
    new = base.clone()
    new[: 1 << 12] = 1  # 6% changed, all at the start: the sample sees 6%, the scan agrees
    idx, _ = changed(new, base)
    assert idx.tolist() == list(range(1 << 12))
