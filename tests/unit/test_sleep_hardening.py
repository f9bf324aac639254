"""Sleep-mode fixes for what hardware would show and the host back end hides, each shown by
fault injection on the host back end (review findings in brackets). The fakes stand in for
NPU behaviour only: undefined memory after mapping, queued device work, a copy that fails."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sysconfig
import threading
import time

import pytest
import torch
from npu_standin import native
from npu_standin.device import CpuDevice
from npu_standin.host_pool import host_tensor

from tests.unit.test_camem_allocator import fill
from vllm_ascend_rl import vmm
from vllm_ascend_rl.sleep import allocator as allocator_mod
from vllm_ascend_rl.sleep.allocator import PERSISTENT_TAG, CaMemAllocator, SleepError

MiB = 1 << 20


class Vmm:
    """The real extension, with hooks to fail or observe single calls."""

    VmmError = vmm.VmmError

    def __init__(self, **hooks) -> None:
        self.hooks, self.calls = hooks, []

    def __getattr__(self, name):
        real = getattr(vmm, name)
        if name in ("VmmError", "backends", "maps_zeroed"):
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
        a.vmm = vmm
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
    a = _allocator(vmm=Vmm(table_sleep=lambda real, *args: (log.append("unmap"), real(*args))[1]))
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
    now = [a.allocations[w.addr] for w in weights]
    assert all(not w.mapped and w.handle is None and w.has_backup for w in now)
    assert a.get_current_usage() == 0
    a.wake_up()
    assert [int(v[0]) for v in views] == [1, 2, 3]


def test_a_failed_free_after_unmap_leaves_a_consistent_asleep_allocation(cleanup, caplog):
    """[S2] Unmap succeeded, the handle's free failed (it was freed behind the table's back):
    the table records the allocation as unmapped and without a handle at once, and the handle
    is never freed a second time (that would fail again, with EBADF). The sleep stands (R3:
    raising now would leave vLLM believing the engine awake on unmapped memory): logged."""
    a = _allocator()
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    vmm.free("host", kv.handle)
    a.sleep()
    assert "host VMM free failed (code 9)" in caplog.text
    now = a.allocations[kv.addr]
    assert not now.mapped and now.handle is None
    a.sleep()  # nothing left to release
    a.free(kv.addr)
    assert kv.addr not in a.allocations


FIRST_MIDDLE_LAST = [0, 2, 4]  # of five weight allocations (and, unmapping, of six)


class FailingDevice(CpuDevice):
    """Stands in for an NPU whose host copy fails at the ``fail_read``-th backup (pyACL's
    aclrtMemcpy into pinned host memory when pinned memory runs out)."""

    def __init__(self, fail_read: int) -> None:
        super().__init__(0)
        self.fail_read, self.reads = fail_read, 0

    def read_device(self, addr, out):
        self.reads += 1
        if self.reads == self.fail_read:
            raise RuntimeError("aclrtMemcpy failed with ACL error 207001 (out of memory)")
        super().read_device(addr, out)


def _weights_and_kv(a: CaMemAllocator) -> tuple[list, list[torch.Tensor]]:
    allocations = [a.allocate(MiB, "weights") for _ in range(5)] + [a.allocate(MiB, "kv_cache")]
    return allocations, [fill(a, x, i + 1) for i, x in enumerate(allocations)]


def _whole(a: CaMemAllocator, allocations, views, same_memory: bool = True) -> None:
    """Awake as before: every allocation mapped (on the same physical memory, unless it slept
    since), contents and usage unchanged."""
    now = a.allocations
    assert all(now[x.addr].mapped for x in allocations)
    assert not same_memory or all(now[x.addr].handle == x.handle for x in allocations)
    assert [int(v[0]) for v in views] == [1, 2, 3, 4, 5, 6]
    assert [int(v[-1]) for v in views] == [1, 2, 3, 4, 5, 6]
    assert a.get_current_usage() == 6 * MiB and a.is_awake("weights") and a.is_awake("kv_cache")


@pytest.mark.parametrize("at", FIRST_MIDDLE_LAST)
def test_a_sleep_failing_to_back_up_any_allocation_leaves_everything_awake(
    monkeypatch, cleanup, at
):
    """R3: the k-th weight backup fails: nothing was unmapped, the engine stays awake on the
    same memory, and the next sleep works."""
    _use_device(monkeypatch, FailingDevice(fail_read=at + 1))
    a = _allocator()
    cleanup(a)
    allocations, views = _weights_and_kv(a)
    order = [x.addr for x in a._entries() if x.tag == "weights"]  # the order a sleep takes
    with pytest.raises(SleepError, match=rf"failed backing up allocation {at + 1} of 5 .*aclrt"):
        a.sleep(offload_tags=("weights",))
    _whole(a, allocations, views)
    assert not any(a.allocations[addr].has_backup for addr in order)
    a.sleep(offload_tags=("weights",))  # the copy works now
    a.wake_up()
    views[5].fill_(6)  # the KV cache woke zeroed
    _whole(a, allocations, views, same_memory=False)


@pytest.mark.parametrize("at", [*FIRST_MIDDLE_LAST, 5])
@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_failing_to_unmap_any_allocation_maps_everything_back(cleanup, at, level):
    """R3: unmapping the k-th allocation fails (backups taken, k-1 unmapped): those are
    mapped back on their own physical memory, so weights and KV cache keep their contents
    (level 2 keeps no backup, so the contents must survive on the device)."""
    calls = {"n": 0}

    def unmap(real, *args):
        calls["n"] += 1
        if calls["n"] == at + 1:
            raise vmm.VmmError(16, "Device or resource busy", "host.unmap")
        return real(*args)

    a = _allocator(vmm=Vmm(table_unmap=unmap))
    cleanup(a)
    allocations, views = _weights_and_kv(a)
    with pytest.raises(SleepError, match=rf"failed unmapping allocation {at + 1} of 6 "):
        a.sleep(offload_tags=("weights",) if level == 1 else ())
    _whole(a, allocations, views)
    calls["n"] = -100  # no more failures
    a.sleep(offload_tags=("weights",))
    assert a.get_current_usage() == 0
    a.wake_up()
    assert [int(v[0]) for v in views] == [1, 2, 3, 4, 5, 0]  # the KV cache wakes zeroed


def test_free_keeps_the_allocation_known_until_it_is_released(cleanup):
    """[S2] A step of free() that fails leaves the allocation known, in the state it reached
    (unmapped, handle forgotten), not leaked; the next free() releases the rest."""
    a = _allocator()
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    vmm.free("host", kv.handle)
    with pytest.raises(SleepError, match="free failed"):
        a.free(kv.addr)
    now = a.allocations[kv.addr]
    assert not now.mapped and now.handle is None
    a.free(kv.addr)
    assert kv.addr not in a.allocations


def test_integer_arguments_are_checked():
    """[S3] -1 is refused, not wrapped to 2**64-1; a handle above INT_MAX is not truncated
    into an unrelated file descriptor."""
    with pytest.raises(ValueError, match="non-negative"):
        vmm.reserve("host", -1)
    with pytest.raises(TypeError):
        vmm.reserve("host", True)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(vmm.VmmError) as e:
            vmm.free("host", (1 << 32) + fd)
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

    a = _allocator(vmm=Vmm(table_sleep=unmap))
    cleanup(a)
    for _ in range(4):
        a.allocate(MiB, "kv_cache")
    a.sleep()
    other.join(10)
    assert not errors and len(a.allocations) == 5
    assert sum(x.mapped for x in a.allocations.values()) == 1  # made after the sleep


def test_discarding_an_asleep_backup_drops_it(cleanup):
    """[S9] Slept with a backup, then discarded: wakes as zeros, not as the stale backup."""
    a = _allocator()
    cleanup(a)
    w = a.allocate(MiB, "weights")
    view = fill(a, w, 9)
    a.sleep(offload_tags=("weights",))
    a.discard(["weights"])
    assert a.allocations[w.addr].backup is None
    a.wake_up()
    assert not a.allocations[w.addr].has_backup and int(view.sum()) == 0


def test_backups_can_be_dropped_on_wake(cleanup):
    """[S10] keep_backups=False gives the host backup back after each restore."""
    a = _allocator(keep_backups=False)
    cleanup(a)
    w = a.allocate(MiB, "weights")
    view = fill(a, w, 4)
    a.sleep(offload_tags=("weights",))
    assert a.allocations[w.addr].backup is not None
    a.wake_up()
    assert a.allocations[w.addr].backup is None and int(view[0]) == 4


def test_wake_zeroes_memory_where_the_back_end_does_not(cleanup):
    """[A3] ACL maps physical memory with undefined contents. A back end that does not map
    zeroed memory (garbage written after every map stands in for HBM) still wakes a
    discarded tag as zeros."""

    def dirty_map(real, addr, *args):
        found = real(addr, *args)
        ctypes.memset(addr, 0xAB, MiB)
        return found

    vmm = Vmm(table_wake=dirty_map, maps_zeroed=lambda backend: False)
    a = _allocator(vmm=vmm)
    cleanup(a)
    kv = a.allocate(MiB, "kv_cache")
    view = host_tensor(a, kv)
    a.sleep()
    a.wake_up()
    assert "zero" in vmm.calls and int(view.max()) == 0


def test_persistent_allocations_survive_sleep_and_discard(cleanup):
    """[A5] What keep_only() moved out of the KV-cache tag is never released."""
    a = _allocator()
    cleanup(a)
    kv = a.allocate(4 * MiB, "kv_cache")
    bookkeeping = a.allocate(MiB, "kv_cache")
    kv_tensor = host_tensor(a, kv).view(torch.int8)[64:]  # a view into the KV allocation
    book = fill(a, bookkeeping, 5)
    assert a.keep_only("kv_cache", [kv_tensor]) == 1
    now = a.allocations
    assert now[bookkeeping.addr].tag == PERSISTENT_TAG and now[kv.addr].tag == "kv_cache"
    a.sleep()
    a.discard(["kv_cache", PERSISTENT_TAG])
    now = a.allocations
    assert now[bookkeeping.addr].mapped and not now[kv.addr].mapped and int(book[0]) == 5
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


def _entry_points():
    """The table's malloc/free pair, which torch_npu's ACL pair calls (vmm_entry.cpp), through
    ctypes.CDLL (which releases the GIL for the call)."""
    lib = ctypes.CDLL(vmm.LIBRARY)
    malloc, free = lib.vmm_entry_malloc, lib.vmm_entry_free
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
    free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return malloc, free


def test_pluggable_entry_points_record_in_the_table(cleanup, capfd):
    """The malloc/free entry points torch_npu calls, run over the stand-in's host back end:
    allocations are tagged with the pool's tag, usable, sleep and wake like any other, and are
    fully released on free."""
    malloc, free = _entry_points()
    host = native.HOST_BACKEND
    a = _allocator()
    cleanup(a)
    with a.use_memory_pool("weights"):
        ptr = malloc(host, 3 * MiB, 0)
    assert ptr and a.allocations[ptr].tag == "weights" and a.allocations[ptr].size >= 3 * MiB
    ctypes.memset(ptr, 7, 3 * MiB)
    a.sleep(offload_tags=("weights",))
    a.wake_up()
    assert ctypes.string_at(ptr, 4) == b"\x07" * 4
    free(host, ptr)
    assert ptr not in a.allocations
    assert not malloc(host, 1 << 60, 0) and a.allocations == {}  # refused, nothing recorded
    free(host, ptr)  # not (any more) ours: ignored
    err = capfd.readouterr().err
    assert "host reserve at 0x0 failed" in err and "which the sleep allocator did not make" in err


# A thread that has never run Python, to call the entry points the way torch_npu does.
NATIVE_THREAD_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>
#include <time.h>

struct job {
  void* (*malloc)(const void*, ssize_t, int);
  void (*free)(const void*, void*);
  const void* backend;
  ssize_t size;
  void* ptr; /* NULL: malloc into it; else: free it */
};

static void* run(void* arg) {
  struct job* j = arg;
  if (j->ptr == NULL) {
    j->ptr = j->malloc(j->backend, j->size, 0);
  } else {
    j->free(j->backend, j->ptr);
    j->ptr = NULL;
  }
  return NULL;
}

int start_job(struct job* j, pthread_t* t) { return pthread_create(t, NULL, run, j); }

/* 0 once the job's thread ended within `ms`, else ETIMEDOUT. */
int wait_job(pthread_t t, int ms) {
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += ms / 1000;
  deadline.tv_nsec += (ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  return pthread_timedjoin_np(t, NULL, &deadline);
}

int join_job(pthread_t t) { return pthread_join(t, NULL); }
"""


class _Job(ctypes.Structure):
    _fields_ = [
        ("malloc", ctypes.c_void_p),
        ("free", ctypes.c_void_p),
        ("backend", ctypes.c_void_p),
        ("size", ctypes.c_ssize_t),
        ("ptr", ctypes.c_void_p),
    ]


@pytest.fixture(scope="module")
def native_thread(tmp_path_factory) -> str:
    """A small shared library that runs one entry-point call on a native thread."""
    out = tmp_path_factory.mktemp("native") / "native_thread.so"
    source = out.with_suffix(".c")
    source.write_text(NATIVE_THREAD_C)
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    cmd = [compiler, "-shared", "-fPIC", "-O1", "-pthread", str(source), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(out)


def test_entry_points_take_no_gil(native_thread, cleanup):
    """[S4] torch_npu calls the entry points under its allocator mutex, while a Python thread
    holding the GIL may be waiting for that mutex (freeing a pooled tensor). Here the main
    thread holds the GIL while it waits for a native thread inside the entry points: through
    ctypes.PyDLL the GIL stays held for the whole wait. Entry points that took the GIL (as
    they did through Python callbacks) could not finish, and the wait would time out."""
    a = _allocator()
    cleanup(a)
    entry = [ctypes.cast(f, ctypes.c_void_p).value for f in _entry_points()]
    job = _Job(*entry, native.HOST_BACKEND, 2 * MiB, None)
    starter, holding_gil = ctypes.CDLL(native_thread), ctypes.PyDLL(native_thread)
    holding_gil.wait_job.argtypes = [ctypes.c_ulong, ctypes.c_int]
    starter.join_job.argtypes = [ctypes.c_ulong]
    with a.use_memory_pool("kv_cache"):
        for _ in ("malloc", "free"):
            thread = ctypes.c_ulong()
            assert starter.start_job(ctypes.byref(job), ctypes.byref(thread)) == 0
            waited = holding_gil.wait_job(thread, 10_000)
            if waited != 0:
                starter.join_job(thread)  # the GIL released: let it finish, then fail
            assert waited == 0, "an entry point waited for the GIL"
            if job.ptr:
                assert a.allocations[job.ptr].tag == "kv_cache"
    assert job.ptr is None and a.allocations == {}


def test_an_asleep_allocation_freed_through_the_entry_point_is_released_once(cleanup, capfd):
    """[S4] Sleep changed the allocation's state in the table, so the entry point's free sees
    it: it releases the address range and nothing else. A second unmap or handle free would
    be logged (the host handle is gone: EBADF)."""
    malloc, free = _entry_points()
    host = native.HOST_BACKEND
    a = _allocator()
    cleanup(a)
    with a.use_memory_pool("kv_cache"):
        ptr = malloc(host, 2 * MiB, 0)
    handle = a.allocations[ptr].handle
    a.sleep()
    assert a.allocations[ptr].handle is None and not a.allocations[ptr].mapped
    free(host, ptr)
    assert ptr not in a.allocations and "vllm_ascend_rl" not in capfd.readouterr().err
    with pytest.raises(vmm.VmmError):  # the sleep freed it, once
        vmm.free("host", handle)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.msync(ptr, 4096, 1) == -1 and ctypes.get_errno() == 12  # ENOMEM: released
    a.wake_up()  # nothing left to wake
    assert a.allocations == {}


@pytest.mark.timeout(120)
def test_concurrent_entry_point_calls_keep_the_table_consistent(cleanup, capfd):
    """[S4, S8] Four threads malloc and free through the entry points while the main thread
    sleeps and wakes: no address is handed out twice, every free finds its entry, no release
    fails or runs twice, and the table ends empty."""
    malloc, free = _entry_points()
    host = native.HOST_BACKEND
    a = _allocator()
    cleanup(a)
    live: set[int] = set()
    guard = threading.Lock()
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        mine: list[int] = []
        try:
            for i in range(150):
                ptr = malloc(host, (1 + (seed + i) % 4) * 64 * 1024, 0)
                assert ptr, "malloc failed"
                with guard:
                    assert ptr not in live, "an address handed out twice"
                    live.add(ptr)
                mine.append(ptr)
                while len(mine) > 3 or (i == 149 and mine):
                    gone = mine.pop(0)
                    with guard:
                        live.remove(gone)
                    free(host, gone)
        except BaseException as e:
            errors.append(e)

    with a.use_memory_pool("kv_cache"):
        threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        cycles = 0
        while any(t.is_alive() for t in threads):
            a.sleep()
            a.wake_up()
            cycles += 1
        for t in threads:
            t.join(60)
    assert not errors and cycles > 0
    assert a.allocations == {} and "vllm_ascend_rl" not in capfd.readouterr().err
