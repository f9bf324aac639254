"""The CPU stand-in's one chip per engine worker (N1): a worker process owns one emulated
chip, its sleep allocator serves that chip, and touching another chip is an error, as an NPU
worker that used chip 0 would pool nothing on its own chip.

Each case runs in a fresh process: the chip a process serves is process-wide.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_sleep_backend_uses_the_allocator_the_worker_made_for_its_chip():
    out = run("""
        from vllm_ascend_rl.device.cpu import claim_chip
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
        from vllm_ascend_rl.device.cpu import claim_chip
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
        from vllm_ascend_rl.device.cpu import claim_chip
        claim_chip(1)
        claim_chip(1)
        claim_chip(2)
    """)
    assert "this process already serves emulated chip 1" in out.stderr
