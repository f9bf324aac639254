"""The hold file between the driver worker and the plugin scheduler (on_failure="hold")."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vllm_ascend_rl.core import hold as hold_module
from vllm_ascend_rl.core.hold import HoldPublisher, read_hold


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setattr(hold_module, "HOLD_DIR", tmp_path)
    parallel = SimpleNamespace(distributed_executor_backend="uni", data_parallel_index=0)
    return SimpleNamespace(parallel_config=parallel)


def test_a_hold_is_read_until_released(config):
    publisher = HoldPublisher(config, enabled=True)
    assert read_hold(config) is None
    publisher.hold("the weights are not whole: 3 layers")
    assert read_hold(config) == "the weights are not whole: 3 layers"
    publisher.release()
    assert read_hold(config) is None


def test_a_lapsing_hold_ends_by_itself_and_a_later_hold_does_not(config):
    publisher = HoldPublisher(config, enabled=True)
    publisher.hold("update in progress", lapses_after_s=0.3)
    assert read_hold(config) == "update in progress"
    time.sleep(0.4)
    assert read_hold(config) is None
    publisher.hold("weights arriving")  # replaces it, with no lapse
    time.sleep(0.4)
    assert read_hold(config) == "weights arriving"
    publisher.release()


def test_only_the_driver_worker_publishes(config):
    HoldPublisher(config, enabled=False).hold("x")
    assert read_hold(config) is None
