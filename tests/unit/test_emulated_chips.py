"""The CPU stand-in's emulated chips.

One chip per engine worker (N1): a worker process owns one emulated chip, its sleep allocator
serves that chip, and touching another chip is an error, as an NPU worker that used chip 0
would pool nothing on its own chip. Each such case runs in a fresh process (``run_fresh``):
the chip a process serves is process-wide.

Device-wide memory (N7): every process on a chip shares its memory, and a worker sizes its
start-up from it as vllm-ascend's does, so servers that start together on one chip fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.fresh_process import run_fresh as run


def test_the_sleep_backend_uses_the_allocator_the_worker_made_for_its_chip():
    out = run("""
        from npu_standin.chip import claim_chip
        from vllm_ascend_rl.sleep.allocator import CaMemAllocator
        from vllm_ascend_rl.sleep.backend import CaMemSleepBackend
        backend = CaMemSleepBackend()          # vLLM's factory, in the worker's __init__
        claim_chip(1)                          # init_device: this worker is on chip 1
        allocator = CaMemAllocator.get_instance("host", device=1)
        assert backend.allocator is allocator
        alloc = allocator.allocate(1 << 20, "kv_cache")
        backend.suspend(1)
        assert allocator.get_current_usage() == 0
        backend.resume(None)
        assert allocator.get_current_usage() == alloc.size
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_an_allocator_made_for_chip_0_fails_on_the_worker_of_chip_1():
    """e2f0888's order: the allocator was made before init_device, on device 0."""
    out = run("""
        from npu_standin.chip import claim_chip
        from vllm_ascend_rl.sleep.allocator import CaMemAllocator
        allocator = CaMemAllocator.get_instance("host", device=0)
        claim_chip(1)
        allocator.allocate(1 << 20, "kv_cache")
        allocator.sleep()
    """)
    assert out.returncode != 0
    assert "the engine worker of emulated chip 1 touched chip 0" in out.stderr


@pytest.mark.parametrize(
    "call, words",
    [
        ('CaMemAllocator.get_instance("host")', "nothing created it yet"),
        (
            'CaMemAllocator.get_instance("host", device=1); CaMemAllocator.get_instance(device=0)',
            "serves host device 1; asked for host device 0",
        ),
    ],
    ids=["no_device_yet", "another_device"],
)
def test_the_allocator_refuses_to_guess_or_change_its_device(call, words):
    out = run(f"""
        from vllm_ascend_rl.sleep.allocator import CaMemAllocator
        {call}
    """)
    assert out.returncode != 0 and words in out.stderr, out.stderr[-2000:]


def test_a_process_serves_one_chip():
    out = run("""
        from npu_standin.chip import claim_chip
        claim_chip(1)
        claim_chip(1)
        claim_chip(2)
    """)
    assert "this process already serves emulated chip 1" in out.stderr


def test_a_process_is_on_the_chip_it_claimed_else_on_its_rank(monkeypatch):
    """No caller names the chip: an engine worker's claim, else the ``torch.distributed`` rank
    (a trainer rank), else 0."""
    from npu_standin import chip

    from vllm_ascend_rl.device import current_device, device_for

    monkeypatch.setattr(chip, "_CLAIMED", [])
    monkeypatch.setattr(chip.dist, "is_initialized", lambda: False)
    assert device_for("cpu").index == current_device().index == 0
    monkeypatch.setattr(chip.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(chip.dist, "get_rank", lambda: 1)
    assert device_for("cpu").index == 1
    monkeypatch.setattr(chip, "_CLAIMED", [3])
    assert device_for("cpu").index == 3


# -- device-wide memory (N7's shape) ------------------------------------------------------
@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_RL_CPU_CHIP_LEDGER", str(tmp_path))
    return tmp_path


@pytest.fixture
def other_server():
    """A live process standing for another server on the chip (its ledger entry counts only
    while it runs)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    if proc.poll() is None and proc.returncode is None:
        proc.kill()
    try:
        proc.wait(10)
    except ChildProcessError:
        pass


def test_servers_on_one_chip_started_one_after_the_other_fit(ledger, other_server):
    from npu_standin.chip import CHIP_BYTES, ChipMemory, StartupMemory

    chip = ChipMemory(3)
    chip.record(int(0.4 * CHIP_BYTES), pid=other_server)  # the first server is up
    start = StartupMemory.take(chip, 0.4)
    chip.record(1 << 20)  # this worker's weights
    assert start.kv_budget(own_bytes=1 << 20) == start.requested - (1 << 20)


def test_a_server_starting_while_another_on_its_chip_profiles_gets_no_kv_cache(
    ledger, other_server
):
    """e2f0888's NPU layout: two servers on one chip started together. The other's start-up
    lands in this worker's profile window and counts as this worker's own use."""
    from npu_standin.chip import CHIP_BYTES, ChipMemory, StartupMemory

    chip = ChipMemory(0)
    start = StartupMemory.take(chip, 0.4)
    chip.record(int(0.4 * CHIP_BYTES), pid=other_server)
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        start.kv_budget(own_bytes=1 << 20)


def test_two_servers_of_half_a_chip_each_never_fit_on_it(ledger, other_server):
    from npu_standin.chip import CHIP_BYTES, ChipMemory, StartupMemory

    chip = ChipMemory(0)
    chip.record(int(0.5 * CHIP_BYTES) + (1 << 20), pid=other_server)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        StartupMemory.take(chip, 0.5)


def test_a_process_that_exits_gives_its_chip_memory_back(ledger, other_server):
    from npu_standin.chip import CHIP_BYTES, ChipMemory

    chip = ChipMemory(5)
    chip.record(1 << 30, pid=other_server)
    assert chip.mem_get_info() == (CHIP_BYTES - (1 << 30), CHIP_BYTES)
    assert ChipMemory(4).mem_get_info()[0] == CHIP_BYTES  # other chips are not touched
    os.kill(other_server, signal.SIGKILL)
    os.waitpid(other_server, 0)  # gone (the fixture's own kill then finds nothing)
    assert chip.mem_get_info()[0] == CHIP_BYTES


def test_a_process_sees_the_host_chips_it_is_given(monkeypatch):
    from npu_standin.chip import host_chip

    from vllm_ascend_rl.device import get_device

    monkeypatch.setenv("VLLM_ASCEND_RL_CPU_CHIPS", "4,6")
    assert [host_chip(0), host_chip(1)] == [4, 6]
    assert get_device("cpu", 1).location()["chip"] == "cpu6"
    with pytest.raises(RuntimeError, match="emulated chip 2 is not visible"):
        host_chip(2)
