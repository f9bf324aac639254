"""Fixtures shared by unit and end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ascend_rl.testing import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model():
    """The default tiny checkpoint ("v1" weights, seed 1)."""
    return build_tiny_model(TinyModelSpec(seed=1))


SHM = Path("/dev/shm")
LEAK_PREFIXES = ("psm_", "sem.mp-", "vllm_ascend_rl_")  # vLLM's segments, its locks, ours


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every server, trainer and engine the suite starts must give its /dev/shm back: a
    leaked vLLM segment holds hundreds of MiB of RAM until reboot."""
    if not SHM.is_dir():
        yield
        return
    before = {p.name for p in SHM.iterdir()}
    yield
    leaked = sorted(
        p.name for p in SHM.iterdir() if p.name not in before and p.name.startswith(LEAK_PREFIXES)
    )
    assert not leaked, f"the test session left shared memory behind: {leaked}"
