"""SleepableNPUWorker's routing, on a MOCKED vllm-ascend NPUWorker (we have no Ascend host).

The mock stands in for the hardware-bound base class only, shaped like vllm-ascend@182b75e's
``NPUWorker`` where our subclass touches it (``initialize_from_config`` runs the KV connector,
then ``model_runner.initialize_kv_cache``, then the KV-zeroing bookkeeping). The allocator under
the worker is the real ``CaMemAllocator`` on the host back end, so the test checks that the
subclass really tags the model and only the KV cache into the sleep pools and that sleep/wake
move real memory.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_standin.device import CpuDevice
from vllm.utils.import_utils import resolve_obj_by_qualname

import vllm_ascend_rl.device as device_mod
from vllm_ascend_rl.sleep.allocator import PERSISTENT_TAG, CaMemAllocator, SleepError


class _MockRunner:  # MOCK of vllm-ascend's NPUModelRunner
    def __init__(self, worker) -> None:
        self.worker, self.kv_caches = worker, []

    def get_model(self):
        return self.worker.model

    def initialize_kv_cache(self, _config) -> None:
        kv = torch.zeros(1 << 20, dtype=torch.uint8)
        self.kv_caches = [(kv[: 1 << 19], kv[1 << 19 :])]  # vllm-ascend keeps (k, v) pairs
        self.worker.metadata = torch.zeros(64).fill_(1)  # e.g. an attention builder's buffer


class _MockNPUWorker:  # MOCK of vllm_ascend.worker.worker.NPUWorker
    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config
        self.device = torch.device("cpu")
        self.model_runner = _MockRunner(self)
        self.model: torch.nn.Module | None = None
        self.updates = 0

    def load_model(self) -> None:
        self.model = torch.nn.Linear(256, 256, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(torch.arange(256 * 256, dtype=torch.float32).view(256, 256))
        self.model.register_buffer("rope", torch.ones(8))
        self.model_runner.drafter = types.SimpleNamespace(model=torch.nn.Linear(256, 256))
        self.model_runner.drafter.model.register_buffer("rope", torch.full((8,), 2.0))

    def initialize_from_config(self, config) -> None:
        self.connector = torch.zeros(16)  # ensure_kv_transfer_initialized
        self.model_runner.initialize_kv_cache(config)
        self.zero_meta = torch.zeros(16)  # _init_kv_zero_meta

    def finish_weight_update(self) -> None:
        self.updates += 1

    def reload_weights(self, *args, **kwargs) -> None:
        self.updates += 1


@pytest.fixture()
def worker_cls(monkeypatch):
    for name in ("vllm_ascend", "vllm_ascend.worker", "vllm_ascend.worker.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm_ascend.worker.worker"].NPUWorker = _MockNPUWorker
    import vllm_ascend_rl.worker.npu_worker as npu_worker

    npu_worker._build_class.cache_clear()  # built on this test's mock
    # The ACL back end is hardware; the host back end stands in for it.
    monkeypatch.setattr(CaMemAllocator, "_instance", CaMemAllocator("host"))
    yield resolve_obj_by_qualname("vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker")
    npu_worker._build_class.cache_clear()


def _config(enable_sleep_mode: bool = False):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=enable_sleep_mode),
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        instance_id="npu-worker-test",  # no engine core listens: its step gate is not there
    )


def _owner(alloc: CaMemAllocator, t: torch.Tensor) -> str | None:
    p = t.data_ptr()
    return next((a.tag for a in alloc.allocations.values() if a.addr <= p < a.addr + a.size), None)


@pytest.fixture()
def worker(worker_cls):
    w = worker_cls(_config())
    w.load_model()
    w.initialize_from_config(None)
    yield w
    for addr in list(w.allocator.allocations):
        w.allocator.free(addr)


def test_resolves_lazily_as_a_subclass_of_the_npu_worker(worker_cls):
    assert issubclass(worker_cls, _MockNPUWorker)
    assert worker_cls.__module__ == "vllm_ascend_rl.worker.npu_worker"


def test_refuses_vllm_ascends_own_sleep_mode(worker_cls):
    with pytest.raises(ValueError, match="drop --enable-sleep-mode"):
        worker_cls(_config(enable_sleep_mode=True))


def test_weights_that_bypass_the_pool_fail_the_load(worker_cls, monkeypatch):
    """[N8] With torch_npu's expandable segments on, allocations skip the pool: the load must
    fail with the setting to change instead of leaving a sleep that frees nothing. Stand-in:
    ``torch.ones`` is not served by the host pool, as an expandable segment is not by ours."""
    from vllm_ascend_rl.worker.npu_worker import NOT_POOLED

    def load_outside_the_pool(self) -> None:
        self.model = torch.nn.Module()
        self.model.weight = torch.nn.Parameter(torch.ones(256, 256))

    monkeypatch.setattr(_MockNPUWorker, "load_model", load_outside_the_pool)
    w = worker_cls(_config())
    with pytest.raises(RuntimeError) as e:
        w.load_model()
    assert str(e.value) == NOT_POOLED and "expandable_segments:False" in NOT_POOLED


def test_only_the_kv_cache_is_pooled_as_kv_cache(worker):
    """[A5] Connector state and zeroing bookkeeping stay outside the pool; what KV
    initialization allocated besides the KV cache is kept across sleep."""
    alloc = worker.allocator
    assert _owner(alloc, worker.model_runner.kv_caches[0][0]) == "kv_cache"
    assert _owner(alloc, worker.connector) is None and _owner(alloc, worker.zero_meta) is None
    assert _owner(alloc, worker.metadata) == PERSISTENT_TAG
    assert "initialize_kv_cache" not in vars(worker.model_runner)  # the hook is gone again
    worker.sleep(level=1)
    assert torch.equal(worker.metadata, torch.ones(64))
    worker.wake_up(None)


@pytest.mark.parametrize("where", ["outside_the_pool", "not_in_kv_caches"])
def test_a_kv_cache_the_pool_does_not_hold_fails_start_up_naming_the_runner(
    worker_cls, monkeypatch, where
):
    """[V10] A model runner that allocates its KV cache elsewhere (vllm-ascend's
    ``NPUModelRunnerV2`` when a user or a release turns it on, worker.py:470-473 at 182b75e)
    would leave level-1 sleep freeing no KV cache: start-up fails instead, naming the runner."""

    class _MockRunnerV2(_MockRunner):  # MOCK: the KV cache made before the pool is entered
        def __init__(self, worker) -> None:
            super().__init__(worker)
            self.early = torch.zeros(1 << 20, dtype=torch.uint8)

        def initialize_kv_cache(self, _config) -> None:
            if where == "outside_the_pool":
                self.kv_caches = [(self.early[: 1 << 19], self.early[1 << 19 :])]

    w = worker_cls(_config())
    w.model_runner = _MockRunnerV2(w)
    w.load_model()
    try:
        with pytest.raises(RuntimeError, match=r"KV cache of .*_MockRunnerV2 is not in the sleep"):
            w.initialize_from_config(None)
    finally:
        for addr in list(w.allocator.allocations):
            w.allocator.free(addr)


def test_weights_and_kv_cache_sleep_and_wake_through_the_camem_backend(worker):
    alloc = worker.allocator
    assert alloc.tags() >= {"weights", "kv_cache"}
    weight_ptr = worker.model.weight.data_ptr()
    expected = worker.model.weight.clone()
    held = alloc.get_current_usage()

    worker.sleep(level=1)
    assert alloc.get_current_usage() < held and held >= (1 << 20) + 256 * 256 * 4
    worker.wake_up(["weights"])
    assert alloc.is_awake("weights") and not alloc.is_awake("kv_cache")
    worker.wake_up(["kv_cache"])
    assert worker.model.weight.data_ptr() == weight_ptr
    assert torch.equal(worker.model.weight, expected)  # level 1 keeps the weights


def test_level_2_refuses_the_kv_cache_until_the_weights_are_reloaded(worker):
    """What SleepableCPUWorker guards, the NPU worker guards too: no request may run on
    discarded weights."""
    worker.sleep(level=2)
    drafter = worker.model_runner.drafter.model  # vllm-ascend's runner keeps it so
    worker.model.rope.fill_(0)  # buffers are saved apart at level 2, the drafter's too ...
    drafter.rope.fill_(0)
    worker.wake_up(["weights"])
    assert torch.equal(worker.model.rope, torch.ones(8))  # ... and restored on wake
    assert torch.equal(drafter.rope, torch.full((8,), 2.0))
    assert worker.model.weight.abs().sum() == 0  # level 2 discarded the weights
    with pytest.raises(RuntimeError, match="refusing to wake the KV cache"):
        worker.wake_up(["kv_cache"])
    worker.finish_weight_update()  # a finish that loaded nothing: still discarded
    with pytest.raises(RuntimeError, match="refusing to wake the KV cache"):
        worker.wake_up(["kv_cache"])
    worker.reload_weights()  # new weights (vLLM's reload; a completed transfer does the same)
    worker.wake_up(["kv_cache"])
    assert worker.allocator.is_awake("kv_cache")


def test_a_failed_level_2_sleep_leaves_the_worker_awake_and_whole(worker):
    """A sleep that fails (here: unmapping the KV cache, after the weights) is rolled back by
    the allocator; the worker must not then count its weights discarded, or the KV cache
    could never wake again without a reload the weights do not need."""
    from tests.unit.test_sleep_hardening import Vmm
    from vllm_ascend_rl import vmm

    def busy(real, *args):
        raise vmm.VmmError(16, "Device or resource busy", "host.unmap")

    held, expected = worker.allocator.get_current_usage(), worker.model.weight.clone()
    worker.allocator.vmm = Vmm(table_unmap=busy)
    with pytest.raises(SleepError, match="failed unmapping allocation 1 of"):
        worker.sleep(level=2)
    worker.allocator.vmm = vmm
    assert worker.allocator.get_current_usage() == held
    worker.wake_up(None)  # what vLLM's /wake_up would do next: nothing to refuse
    assert torch.equal(worker.model.weight, expected)


def test_wake_up_keeps_vllm_ascends_nz_refusal(worker, monkeypatch):
    class NZOn(CpuDevice):  # stands in for an NPU whose vllm-ascend has NZ on
        def weight_update_refusal(self):
            return "FRACTAL_NZ is on: set weight_nz_mode=0"

    worker.sleep(level=1)
    with monkeypatch.context() as m:
        m.setattr(device_mod, "device_for", lambda *a, **k: NZOn())
        with pytest.raises(ValueError, match="weight_nz_mode=0"):
            worker.wake_up(None)
    worker.wake_up(None)


def test_answers_the_weight_checker_with_vllms_own_digests(worker, monkeypatch):
    """/weight_checker (vLLM >= 0.32) calls compute_weight_checksums on every worker;
    vllm-ascend's NPUWorker has none, so ours borrows vLLM's. The parallel groups are
    MOCKED (no distributed state in a unit test); the digests are vLLM's, of the real model."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
    except ImportError:  # vLLM 0.30.0: no /weight_checker, nothing to borrow
        assert not hasattr(worker, "compute_weight_checksums")
        return
    import vllm.v1.worker.gpu_worker as gpu_worker

    rank = types.SimpleNamespace(rank_in_group=0)
    for group in ("get_pp_group", "get_pcp_group", "get_tp_group"):
        monkeypatch.setattr(gpu_worker, group, lambda: rank)
    worker.parallel_config = types.SimpleNamespace(data_parallel_index=1)
    before = worker.compute_weight_checksums()
    assert before == {
        f"dp1:pp0:pcp0:tp0:{k}": v for k, v in compute_tensor_digests(worker.model).items()
    }
    with torch.no_grad():
        worker.model.weight[0, 0] += 1
    after = worker.compute_weight_checksums()
    assert after.keys() == before.keys() and after != before
    worker.reset_weights()
    assert not worker.model.weight.any()
