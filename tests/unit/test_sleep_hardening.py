"""Sleep-mode fixes for what hardware would show and the host back end hides, each shown by
fault injection on the host back end (review findings in brackets). The fakes stand in for
NPU behaviour only: undefined memory after mapping, queued device work, a copy that fails."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch

from tests.unit.test_camem_allocator import fill
from vllm_ascend_rl import _C
from vllm_ascend_rl.device.cpu import CpuDevice
from vllm_ascend_rl.sleep import allocator as allocator_mod
from vllm_ascend_rl.sleep.allocator import PERSISTENT_TAG, CaMemAllocator, SleepError

MiB = 1 << 20


class Vmm:
    """The real extension, with hooks to fail or observe single calls."""

    VmmError = _C.VmmError

    def __init__(self, **hooks) -> None:
        self.hooks, self.calls = hooks, []

    def __getattr__(self, name):
        real = getattr(_C, name)
        if name in ("VmmError", "backends", "maps_zeroed", "granularity"):
            return self.hooks.get(name, real)

        def call(*args):
            self.calls.append(name)
            hook = self.hooks.get(name)
            return hook(real, *args) if hook else real(*args)

        return call


def _allocator(**kw) -> CaMemAllocator:
    return CaMemAllocator("host", **kw)


@pytest.fixture
def cleanup():
    made: list[CaMemAllocator] = []
    yield made.append
    for a in made:
        a.vmm = _C
        for addr in list(a.allocations):
            a.free(addr)


class RecordingDevice(CpuDevice):
    """A CPU device that records the order of drains and copies (on NPU, work queued on the
    device may still write the memory a sleep is about to copy or unmap)."""

    def __init__(self, log: list, fail_write: int = 0) -> None:
        super().__init__(0)
        self.log, self.fail_write, self.writes = log, fail_write, 0

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def read_device(self, addr, out):
        self.log.append("read")
        super().read_device(addr, out)

    def write_device(self, addr, src):
        self.writes += 1
        if self.writes == self.fail_write:  # like pyACL's aclrtMemcpy failing on NPU
            raise RuntimeError("aclrtMemcpy of 1048576 bytes failed with ACL error 507899")
        super().write_device(addr, src)


def _use_device(monkeypatch, device) -> None:
    monkeypatch.setattr(allocator_mod, "get_device", lambda kind, index=0: device)


def test_sleep_drains_the_device_before_backup_and_unmap(monkeypatch, cleanup):
    """[A6] Drain first, then copy, then unmap."""
    log: list[str] = []
    _use_device(monkeypatch, RecordingDevice(log))
    a = _allocator(vmm=Vmm(unmap=lambda real, *args: (log.append("unmap"), real(*args))[1]))
    cleanup(a)
    a.allocate(MiB, "weights")
    a.allocate(MiB, "kv_cache")
    a.sleep(offload_tags=("weights",))
    assert log[0] == "synchronize" and log.index("synchronize") < log.index("read")
    assert log.index("synchronize") < log.index("unmap")
    log.clear()
    a.wake_up()
    a.discard(["kv_cache"])
    assert log[:2] == ["synchronize", "unmap"]


def test_a_wake_that_fails_on_any_error_rolls_back(monkeypatch, cleanup):
    """[S1] A RuntimeError from the restore copy (what NPU's copy raises), not only a
    SleepError, rolls the wake back; the backups survive, so the next wake restores them."""
    device = RecordingDevice([], fail_write=2)
    _use_device(monkeypatch, device)
    a = _allocator()
    cleanup(a)
    weights = [a.allocate(MiB, "weights") for _ in range(3)]
    views = [fill(a, w, i + 1) for i, w in enumerate(weights)]
    a.sleep(offload_tags=("weights",))
    with pytest.raises(SleepError, match=r"rolled back: RuntimeError: aclrtMemcpy"):
        a.wake_up()
    assert all(not w.awake and w.handle is None and w.has_backup for w in weights)
    assert a.get_current_usage() == 0
    a.wake_up()
    assert [int(v[0]) for v in views] == [1, 2, 3]


def test_a_failed_free_after_unmap_leaves_a_consistent_asleep_allocation(cleanup):
    """[S2] Unmap succeeded, free failed: the allocation is recorded as unmapped and without a
    handle at once, and the handle is never freed a second time."""
    fails = iter([True])

    def free(real, *args):
        if next(fails, False):
            real(*args)  # the descriptor is gone either way: a retry would hit a recycled fd
            raise _C.VmmError(5, "Input/output error (injected)")
        return real(*args)

    vmm = Vmm(free=free)
    a = _allocator(vmm=vmm)
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    with pytest.raises(SleepError, match="injected"):
        a.sleep()
    assert not kv.awake and kv.handle is None
    frees = vmm.calls.count("free")
    a.sleep()  # nothing left to release
    a.free(kv.addr)
    assert vmm.calls.count("free") == frees and kv.addr not in a.allocations


def test_free_keeps_the_allocation_known_until_it_is_released(cleanup):
    """[S2] A failing unmap in free() must not forget (leak) the allocation."""
    vmm = Vmm(unmap=lambda real, *args: (_ for _ in ()).throw(_C.VmmError(22, "injected")))
    a = _allocator(vmm=vmm)
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    with pytest.raises(SleepError):
        a.free(kv.addr)
    assert kv.addr in a.allocations and kv.awake


def test_integer_arguments_are_checked():
    """[S3] -1 is refused, not wrapped to 2**64-1; a handle above INT_MAX is not truncated
    into an unrelated file descriptor."""
    with pytest.raises(ValueError, match="non-negative"):
        _C.reserve("host", -1)
    with pytest.raises(TypeError):
        _C.reserve("host", True)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(_C.VmmError) as e:
            _C.free("host", (1 << 32) + fd)
        assert e.value.args[0] == 9  # EBADF
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_allocating_on_another_thread_during_a_sleep_is_safe(cleanup):
    """[S8] An allocation from another thread while sleep() iterates."""
    errors: list[BaseException] = []
    started = threading.Event()
    a: CaMemAllocator | None = None

    def allocate_elsewhere():
        try:
            started.set()
            a.allocate(MiB, "kv_cache")
        except BaseException as e:
            errors.append(e)

    other = threading.Thread(target=allocate_elsewhere)

    def unmap(real, *args):
        if not other.is_alive() and not started.is_set():
            other.start()
            started.wait(5)
            time.sleep(0.2)  # give it every chance to run into the iteration
        return real(*args)

    a = _allocator(vmm=Vmm(unmap=unmap))
    cleanup(a)
    for _ in range(4):
        a.allocate(MiB, "kv_cache")
    a.sleep()
    other.join(10)
    assert not errors and len(a.allocations) == 5
    assert sum(x.awake for x in a.allocations.values()) == 1  # made after the sleep


def test_discarding_an_asleep_backup_drops_it(cleanup):
    """[S9] Slept with a backup, then discarded: wakes as zeros, not as the stale backup."""
    a = _allocator()
    cleanup(a)
    w = a.allocate(MiB, "weights")
    view = fill(a, w, 9)
    a.sleep(offload_tags=("weights",))
    a.discard(["weights"])
    a.wake_up()
    assert not w.has_backup and int(view.sum()) == 0


def test_backups_can_be_dropped_on_wake(cleanup):
    """[S10] keep_backups=False gives the host backup back after each restore."""
    a = _allocator(keep_backups=False)
    cleanup(a)
    w = a.allocate(MiB, "weights")
    view = fill(a, w, 4)
    a.sleep(offload_tags=("weights",))
    assert w.backup is not None
    a.wake_up()
    assert w.backup is None and int(view[0]) == 4


def test_wake_zeroes_memory_where_the_back_end_does_not(cleanup):
    """[A3] ACL maps physical memory with undefined contents. A back end that does not map
    zeroed memory (garbage written after every map stands in for HBM) still wakes a
    discarded tag as zeros."""

    def dirty_map(real, *args):
        real(*args)
        addr, size = args[1], args[2]
        ctypes.memset(addr, 0xAB, size)

    vmm = Vmm(map=dirty_map, maps_zeroed=lambda backend: False)
    a = _allocator(vmm=vmm)
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    view = a.tensor(kv)
    a.sleep()
    a.wake_up()
    assert "zero" in vmm.calls and int(view.max()) == 0


def test_persistent_allocations_survive_sleep_and_discard(cleanup):
    """[A5] What keep_only() moved out of the KV-cache tag is never released."""
    a = _allocator()
    cleanup(a)
    kv = a.allocate(4 * MiB, "kv_cache")
    bookkeeping = a.allocate(MiB, "kv_cache")
    kv_tensor = a.tensor(kv).view(torch.int8)[64:]  # a view into the KV allocation
    book = fill(a, bookkeeping, 5)
    assert a.keep_only("kv_cache", [kv_tensor]) == 1
    assert bookkeeping.tag == PERSISTENT_TAG and kv.tag == "kv_cache"
    a.sleep()
    a.discard(["kv_cache", PERSISTENT_TAG])
    assert bookkeeping.awake and not kv.awake and int(book[0]) == 5
    a.wake_up()


def test_host_pool_serves_only_what_it_can(cleanup):
    """[S12] size= is honoured; out=, other layouts and memory formats fall through; a
    served tensor frees its allocation when its last view dies."""
    a = _allocator()
    cleanup(a)
    with a.use_memory_pool("kv_cache"):
        t = torch.empty(size=(3, 4))
        out = torch.empty(6)
        torch.zeros(6, out=out)
        cl = torch.empty((2, 3, 4, 5), memory_format=torch.channels_last)
    assert t.shape == (3, 4) and len(a.allocations) == 2  # t and out
    assert cl.is_contiguous(memory_format=torch.channels_last)
    view = t[1:].view(-1)
    del t
    assert len(a.allocations) == 2  # a view keeps it alive
    del view, out
    assert len(a.allocations) == 0


def test_pluggable_entry_points_report_to_the_allocator(cleanup):
    """The malloc/free entry points torch_npu calls, run over the host back end (the same
    code as the ACL pair): allocations are tagged, usable, and fully released on free."""
    lib = ctypes.CDLL(_C.__file__)
    malloc, free = getattr(lib, _C.HOST_MALLOC), getattr(lib, _C.HOST_FREE)
    malloc.restype, malloc.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p],
    )
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    a = _allocator()
    cleanup(a)
    _C.set_callbacks(a._on_malloc, a._on_free)
    try:
        a._current_tag = "weights"
        ptr = malloc(3 * MiB, 0, None)
        assert ptr and a.allocations[ptr].tag == "weights" and a.allocations[ptr].size >= 3 * MiB
        ctypes.memset(ptr, 7, 3 * MiB)
        a.sleep(offload_tags=("weights",))
        a.wake_up()
        assert ctypes.string_at(ptr, 4) == b"\x07" * 4
        free(ptr, 3 * MiB, 0, None)
        assert ptr not in a.allocations

        def refuse(*args):
            raise RuntimeError("callback refused (injected)")

        _C.set_callbacks(refuse, a._on_free)
        assert not malloc(MiB, 0, None)  # unrecorded memory is given back, not handed out
        assert a.allocations == {}
    finally:
        _C.set_callbacks(None, None)
        a._current_tag = allocator_mod.DEFAULT_TAG
