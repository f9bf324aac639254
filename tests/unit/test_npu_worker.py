"""SleepableNPUWorker's routing, on a MOCKED vllm-ascend NPUWorker (we have no Ascend host).

The mock stands in for the hardware-bound base class only; the allocator under the worker is
the real ``CaMemAllocator`` on the host back end, so the test checks that the subclass really
tags the model and KV cache into the sleep pools and that sleep/wake move real memory.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from vllm.utils.import_utils import resolve_obj_by_qualname

from vllm_ascend_rl.sleep.allocator import CaMemAllocator


class _MockNPUWorker:  # MOCK of vllm_ascend.worker.worker.NPUWorker
    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)
        self.model: torch.nn.Module | None = None
        self.kv: torch.Tensor | None = None

    def load_model(self) -> None:
        self.model = torch.nn.Linear(256, 256, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(torch.arange(256 * 256, dtype=torch.float32).view(256, 256))
        self.model.register_buffer("rope", torch.ones(8))

    def initialize_from_config(self, _config) -> None:
        self.kv = torch.zeros(1 << 20, dtype=torch.uint8)


@pytest.fixture()
def worker_cls(monkeypatch):
    for name in ("vllm_ascend", "vllm_ascend.worker", "vllm_ascend.worker.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm_ascend.worker.worker"].NPUWorker = _MockNPUWorker
    import vllm_ascend_rl.worker.npu_worker as npu_worker

    monkeypatch.setattr(npu_worker, "_cls", None)
    # The ACL back end is hardware; the host back end stands in for it.
    monkeypatch.setattr(CaMemAllocator, "_instance", CaMemAllocator("host"))
    return resolve_obj_by_qualname("vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker")


def _config(enable_sleep_mode: bool = False):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=enable_sleep_mode)
    )


def test_resolves_lazily_as_a_subclass_of_the_npu_worker(worker_cls):
    assert issubclass(worker_cls, _MockNPUWorker)
    assert worker_cls.__module__ == "vllm_ascend_rl.worker.npu_worker"


def test_refuses_vllm_ascends_own_sleep_mode(worker_cls):
    with pytest.raises(ValueError, match="drop --enable-sleep-mode"):
        worker_cls(_config(enable_sleep_mode=True))


def test_weights_and_kv_cache_sleep_and_wake_through_the_camem_backend(worker_cls):
    worker = worker_cls(_config())
    worker.load_model()
    worker.initialize_from_config(None)
    alloc = worker.allocator
    assert alloc.tags() >= {"weights", "kv_cache"}
    weight_ptr = worker.model.weight.data_ptr()
    expected = worker.model.weight.clone()
    held = alloc.get_current_usage()

    worker.sleep(level=1)
    assert alloc.get_current_usage() == 0 and held >= (1 << 20) + 256 * 256 * 4
    worker.wake_up(["weights"])
    assert alloc.is_awake("weights") and not alloc.is_awake("kv_cache")
    worker.wake_up(["kv_cache"])
    assert worker.model.weight.data_ptr() == weight_ptr
    assert torch.equal(worker.model.weight, expected)  # level 1 keeps the weights

    worker.sleep(level=2)
    worker.model.rope.fill_(0)  # buffers are saved apart at level 2 ...
    worker.wake_up(None)
    assert torch.equal(worker.model.rope, torch.ones(8))  # ... and restored on wake
    assert worker.model.weight.abs().sum() == 0  # level 2 discarded the weights: reload them
