"""The address ledger and the in-place refresh of derived tensors, on a plain torch module (the
e2e weight-sync and sleep suites check real engines through ``moved_addresses``)."""

from __future__ import annotations

import pytest
import torch

from vllm_ascend_rl.weight_transfer.reload import derived_tensors, keep_derived_in_place
from vllm_ascend_rl.worker.ledger import address_ledger, moved


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)
        self.register_buffer("cos", torch.zeros(8))
        self.scale_host = torch.tensor(1.0)  # a derived tensor: a plain attribute


def model() -> torch.nn.Module:
    return torch.nn.Sequential(Layer(), Layer())


def test_the_ledger_names_every_kind_of_tensor_a_forward_reads():
    m, kv = model(), [torch.zeros(2, 32), torch.zeros(2, 32)]
    ledger = address_ledger(m.named_modules(), kv)
    assert ledger == {
        "parameter:0.weight": m[0].weight.data_ptr(),
        "buffer:0.cos": m[0].cos.data_ptr(),
        "derived:0.scale_host": m[0].scale_host.data_ptr(),
        "parameter:1.weight": m[1].weight.data_ptr(),
        "buffer:1.cos": m[1].cos.data_ptr(),
        "derived:1.scale_host": m[1].scale_host.data_ptr(),
        "kv_cache:0": kv[0].data_ptr(),
        "kv_cache:1": kv[1].data_ptr(),
    }


def test_the_ledger_covers_the_drafter_and_finds_it_as_vllm_and_vllm_ascend_keep_it():
    from types import SimpleNamespace

    from vllm_ascend_rl.worker.ledger import drafter_model, served_modules

    m, drafter = model(), torch.nn.Sequential(Layer())
    runner = SimpleNamespace(get_model=lambda: m, get_draft_model=lambda: drafter)
    ledger = address_ledger(served_modules(runner), [])
    assert ledger["parameter:draft.0.weight"] == drafter[0].weight.data_ptr()
    assert ledger["derived:draft.0.scale_host"] == drafter[0].scale_host.data_ptr()
    assert len(ledger) == 9
    ascend_runner = SimpleNamespace(drafter=SimpleNamespace(model=drafter))  # no get_draft_model
    assert drafter_model(runner) is drafter is drafter_model(ascend_runner)
    assert drafter_model(SimpleNamespace(drafter=SimpleNamespace())) is None  # ngram: no module


def test_moved_names_a_tensor_given_new_storage_not_one_written_in_place():
    m = model()
    start = address_ledger(m.named_modules(), [])
    with torch.no_grad():
        m[0].weight.copy_(torch.full((4, 4), 2.0))  # a reload into the same storage
    assert moved(start, address_ledger(m.named_modules(), [])) == {}
    old = m[1].weight.data_ptr()
    m[1].weight.data = torch.zeros(4, 4)  # what Tensor.set_ / .data = ... does
    assert moved(start, address_ledger(m.named_modules(), [])) == {
        "parameter:1.weight": [old, m[1].weight.data_ptr()]
    }
    del m[0].scale_host
    assert moved(start, address_ledger(m.named_modules(), []))["derived:0.scale_host"][1] is None


def test_a_re_created_derived_tensor_is_copied_back_where_it_was():
    m = model()
    before, start = derived_tensors(m), address_ledger(m.named_modules(), [])
    original = m[0].scale_host
    m[0].scale_host = torch.tensor(3.0)  # as post-load processing re-creates host scales
    assert moved(start, address_ledger(m.named_modules(), []))
    keep_derived_in_place(before)
    assert m[0].scale_host is original and original.item() == 3.0
    assert moved(start, address_ledger(m.named_modules(), [])) == {}


def test_a_derived_tensor_that_changed_shape_is_an_error_naming_the_layer():
    m = model()
    before = derived_tensors(m)
    m[1].scale_host = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"Layer.scale_host changed from \(\) .* to \(2,\)"):
        keep_derived_in_place(before)
