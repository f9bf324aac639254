"""CaMemAllocator on the host back end (memfd + mmap) and the C++ extension itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import psutil
import pytest
import torch
from npu_standin import native  # noqa: F401 (adds the host back end)
from npu_standin.host_pool import host_tensor

from vllm_ascend_rl import vmm
from vllm_ascend_rl.sleep import allocator as allocator_mod
from vllm_ascend_rl.sleep.allocator import CaMemAllocator, SleepError

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture
def alloc():
    a = CaMemAllocator("host")
    yield a
    for addr in list(a.allocations):
        a.free(addr)


def fill(a: CaMemAllocator, allocation, value: int) -> torch.Tensor:
    t = host_tensor(a, allocation)
    t.fill_(value)
    return t


def test_addresses_survive_sleep_and_contents_follow_the_tags(alloc):
    w = alloc.allocate(4 * MiB, "weights")
    kv = alloc.allocate(8 * MiB, "kv_cache")
    tw, tkv = fill(alloc, w, 7), fill(alloc, kv, 9)
    ptrs = (tw.data_ptr(), tkv.data_ptr())
    alloc.sleep(offload_tags=("weights",))
    assert alloc.get_current_usage() == 0 and not alloc.is_awake("weights")
    alloc.wake_up()
    assert (tw.data_ptr(), tkv.data_ptr()) == ptrs  # the same tensors, the same addresses
    assert torch.all(tw == 7), "offloaded tag must be restored"
    assert torch.all(tkv == 0), "discarded tag must wake zero-filled"
    assert alloc.get_current_usage() == 12 * MiB


def test_sleep_gives_the_memory_back_and_wake_takes_it_again(alloc):
    before = rss()
    kv = alloc.allocate(256 * MiB, "kv_cache")  # populated: resident like torch.zeros
    assert rss() - before > 240 * MiB
    alloc.sleep()
    assert rss() - before < 16 * MiB
    alloc.wake_up(["kv_cache"])
    fill(alloc, kv, 1)
    assert rss() - before > 240 * MiB


def test_wake_maps_memory_resident_before_it_is_touched(alloc):
    """The wake pays for the pages (populated), so the first forward pass does not."""
    kv = alloc.allocate(256 * MiB, "kv_cache")
    alloc.sleep()
    before = rss()
    alloc.wake_up(["kv_cache"])
    assert rss() - before > 240 * MiB  # resident with no access at all
    assert not host_tensor(alloc, kv)[:: 1 << 20].any()  # and still zero


def test_a_wake_the_host_cannot_back_fails_and_stays_asleep(alloc):
    """An allocation made lazily (not populated) that the host could never back: its wake
    fails with SleepError and the allocation stays asleep, instead of a SIGBUS at first touch."""
    too_much = psutil.virtual_memory().available + (8 << 30)
    lazy = alloc.allocate(too_much, "kv_cache", populate=False)
    alloc.sleep()
    with pytest.raises(SleepError, match=r"wake_up.*rolled back.*Cannot allocate memory"):
        alloc.wake_up()
    assert not alloc.is_awake("kv_cache") and alloc.get_current_usage() == 0
    alloc.free(lazy.addr)


def test_backups_are_allocated_once_and_reused(alloc):
    w = alloc.allocate(2 * MiB, "weights")
    fill(alloc, w, 3)
    alloc.sleep(offload_tags="weights")
    backup = alloc.allocations[w.addr].backup
    assert backup is not None and backup.numel() == w.size
    for value in (4, 5):
        alloc.wake_up("weights")
        fill(alloc, w, value)
        alloc.sleep(offload_tags="weights")
        assert alloc.allocations[w.addr].backup is backup
    alloc.wake_up()
    assert torch.all(host_tensor(alloc, w) == 5)


def test_waking_an_awake_tag_is_a_no_op(alloc):
    kv = alloc.allocate(MiB, "kv_cache")
    t = fill(alloc, kv, 6)
    alloc.wake_up()
    alloc.wake_up(["kv_cache"])
    assert alloc.allocations[kv.addr].handle == kv.handle and torch.all(t == 6)
    alloc.sleep()
    alloc.wake_up(["weights"])  # another tag: kv stays asleep
    assert not alloc.allocations[kv.addr].mapped


class FailingVmm:
    """The real extension, except that the n-th wake of an entry fails like an out-of-memory."""

    VmmError = vmm.VmmError

    def __init__(self, fail_on_wake: int) -> None:
        self.wakes, self.fail_on = 0, fail_on_wake

    def __getattr__(self, name):
        return getattr(vmm, name)

    def table_wake(self, *args):
        self.wakes += 1
        if self.wakes == self.fail_on:
            raise vmm.VmmError(12, "Cannot allocate memory (injected)")
        return vmm.table_wake(*args)


def test_a_wake_that_fails_halfway_rolls_back_to_a_clean_asleep_state():
    a = CaMemAllocator("host", vmm=FailingVmm(fail_on_wake=2))
    try:
        for _ in range(3):
            a.allocate(MiB, "kv_cache")
        a.sleep()
        with pytest.raises(SleepError, match=r"rolled back.*injected"):
            a.wake_up()
        assert not any(x.mapped for x in a.allocations.values()) and a.get_current_usage() == 0
        a.wake_up()  # and it can still wake afterwards
        assert all(x.mapped for x in a.allocations.values())
    finally:
        for addr in list(a.allocations):
            a.free(addr)


def test_discard_releases_without_keeping_contents(alloc):
    w = alloc.allocate(MiB, "weights")
    fill(alloc, w, 8)
    alloc.discard(["weights"])
    assert not alloc.allocations[w.addr].mapped and alloc.allocations[w.addr].backup is None
    alloc.wake_up()
    assert torch.all(host_tensor(alloc, w) == 0)


def test_out_of_memory_is_an_exception_not_a_crash(alloc):
    too_much = psutil.virtual_memory().available + (8 << 30)  # reservable, not committable
    with pytest.raises(SleepError, match=r"host VMM create failed.*Cannot allocate memory"):
        alloc.allocate(too_much, "kv_cache")
    assert alloc.allocations == {}


def test_cpu_memory_pool_serves_factory_calls_from_the_allocator(alloc):
    with alloc.use_memory_pool("kv_cache"):
        buf = torch.zeros(3 * MiB, dtype=torch.int8)
        small = torch.empty(4, 4)
    assert buf.shape == (3 * MiB,) and torch.all(buf == 0)
    owners = {
        a.tag for a in alloc.allocations.values() if a.addr <= buf.data_ptr() < a.addr + a.size
    }
    assert owners == {"kv_cache"}
    assert small.shape == (4, 4)
    outside = torch.zeros(10)
    assert not any(
        a.addr <= outside.data_ptr() < a.addr + a.size for a in alloc.allocations.values()
    )


def test_npu_allocator_settings_that_bypass_the_pool_are_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(SleepError, match="expandable_segments:False"):
        allocator_mod.check_npu_alloc_conf()
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:512")
    with pytest.raises(SleepError, match="without max_split_size_mb"):
        allocator_mod.check_npu_alloc_conf()
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:False")
    allocator_mod.check_npu_alloc_conf()


def test_unknown_back_end_is_a_clear_error():
    with pytest.raises(SleepError, match="'acl' is not available"):
        CaMemAllocator("acl")


def test_extension_errors_carry_the_code():
    with pytest.raises(vmm.VmmError) as e:
        vmm.map("host", 4096, 4096, 987654)
    assert e.value.args[0] == 9 and e.value.op == "host.map"  # EBADF


def test_acl_back_end_compiles_against_the_declarations_header():
    """vmm_acl.cpp is only built where CANN is installed; this keeps it from rotting. It uses
    the compiler Python's build uses, and fails (never skips) without one."""
    compiler = (sysconfig.get_config_var("CXX") or "g++").split()[0]
    assert shutil.which(compiler), f"no C++ compiler {compiler!r}: the extension needs one"
    for source in ("vmm_acl.cpp", "vmm_entry.cpp"):
        r = subprocess.run(
            [
                compiler,
                "-fsyntax-only",
                "-std=c++17",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-DVLLM_ASCEND_RL_WITH_ACL=1",
                f"-I{REPO / 'csrc'}",
                f"-I{REPO / 'tests' / 'support' / 'acl_decls'}",
                str(REPO / "csrc" / source),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"{source}:\n{r.stderr}"
    assert os.path.isfile(REPO / "tests" / "support" / "acl_decls" / "acl" / "acl.h")
