"""Fixtures and options shared by unit and end-to-end tests.

``--device npu`` (or ``VLLM_ASCEND_RL_DEVICE=npu``) is the one switch that makes the e2e suites
start NPU servers and trainers: it is exported to every process the tests start. ``make
test-npu`` runs ``-m ascend`` (every test that runs on NPUs) that way on an Ascend host.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import TinyModelSpec, build_tiny_model


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "npu"),
        default=os.environ.get("VLLM_ASCEND_RL_DEVICE", "cpu"),
        help="device the suites run on (exported as VLLM_ASCEND_RL_DEVICE)",
    )


def pytest_configure(config):
    os.environ["VLLM_ASCEND_RL_DEVICE"] = config.getoption("--device")


def pytest_collection_modifyitems(config, items):
    on_npu = config.getoption("--device") == "npu"
    need_npu = pytest.mark.skip(reason="needs Ascend NPUs: make test-npu on an Ascend host")
    need_cpu = pytest.mark.skip(reason="exercises a CPU stand-in of the hardware")
    for item in items:
        if item.get_closest_marker("npu_only") and not on_npu:
            item.add_marker(need_npu)
        if item.get_closest_marker("cpu_only") and on_npu:
            item.add_marker(need_cpu)


@pytest.fixture(scope="session")
def tiny_model():
    """The default tiny checkpoint ("v1" weights, seed 1)."""
    return build_tiny_model(TinyModelSpec(seed=1))


SHM = Path("/dev/shm")
LEAK_PREFIXES = ("psm_", "sem.mp-", "vllm_ascend_rl_")  # vLLM's segments, its locks, ours
LEAK_INFIXES = ("-cpushm_",)  # vLLM's CPU tensor-parallel communicator


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
        p.name
        for p in SHM.iterdir()
        if p.name not in before
        and (p.name.startswith(LEAK_PREFIXES) or any(i in p.name for i in LEAK_INFIXES))
    )
    assert not leaked, f"the test session left shared memory behind: {leaked}"
