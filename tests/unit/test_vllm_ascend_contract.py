"""vllm-ascend's worker contract, checked where CPU can: its FRACTAL_NZ refusal is reported at
engine start with the setting to change, and a release that calls
``receive_weights(info, load_weights=...)`` gets an error naming the commit we need.

``vllm_ascend.ascend_config`` is MOCKED (we have no Ascend stack); the engines are real.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_standin.device import CpuDevice

from tests.support.stand_in_config import engine_config
from vllm_ascend_rl.device.npu import nz_format_refusal, nz_weight_mode
from vllm_ascend_rl.weight_transfer import engine as engine_module
from vllm_ascend_rl.weight_transfer.hccl import (
    AscendRLHCCLWeightTransferEngine,
)
from vllm_ascend_rl.weight_transfer.npu_ipc import AscendRLNPUIPCWeightTransferEngine


def _mock_ascend_config(monkeypatch, get_ascend_config) -> None:  # MOCK of vllm-ascend
    for name in ("vllm_ascend", "vllm_ascend.ascend_config"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm_ascend.ascend_config"].get_ascend_config = get_ascend_config


@pytest.mark.parametrize("mode", [1, 2])
def test_nz_on_is_refused_with_the_setting_to_change(monkeypatch, mode):
    _mock_ascend_config(monkeypatch, lambda: types.SimpleNamespace(weight_nz_mode=mode))
    assert nz_weight_mode() == mode
    reason = nz_format_refusal()
    assert f"weight_nz_mode={mode}" in reason
    assert """--additional-config '{"weight_nz_mode": 0}'""" in reason


def test_nz_off_is_accepted(monkeypatch):
    _mock_ascend_config(monkeypatch, lambda: types.SimpleNamespace(weight_nz_mode=0))
    assert nz_format_refusal() is None


def test_releases_without_weight_nz_mode_read_the_environment(monkeypatch):
    """vllm-ascend v0.22-v0.26 have no weight_nz_mode; they check VLLM_ASCEND_ENABLE_NZ."""
    _mock_ascend_config(monkeypatch, lambda: types.SimpleNamespace())
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    assert nz_weight_mode() == 1  # vllm-ascend's default
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    assert nz_format_refusal() is None


@pytest.mark.parametrize(
    "additional_config, env, mode",
    [
        (None, None, 1),  # vllm-ascend's default
        (None, "0", 0),
        ({"weight_nz_mode": 0}, None, 0),
        ({"weight_nz_mode": 2}, "0", 2),  # the additional config wins over the variable
        ({"rl_config": {"enabled": True}, "weight_nz_mode": 2}, None, 0),  # rl_config forces 0
    ],
)
def test_outside_an_engine_the_mode_is_what_its_start_flags_give(
    monkeypatch, additional_config, env, mode
):
    """The doctor's view of a server it has not started (vllm-ascend's resolution order,
    ascend_config.py:361-372, 582-587 at 182b75e); vllm-ascend is absent here."""
    monkeypatch.delitem(sys.modules, "vllm_ascend.ascend_config", raising=False)
    if env is None:
        monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", env)
    assert nz_weight_mode(additional_config) == mode
    assert (nz_format_refusal(additional_config) is None) == (mode == 0)


def _vllm_config():
    return engine_config()


class _NZDevice(CpuDevice):  # stands in for an NPU whose vllm-ascend has NZ on
    def weight_update_refusal(self) -> str | None:
        return "FRACTAL_NZ is on: set weight_nz_mode=0"


@pytest.mark.parametrize(
    "engine_cls", [AscendRLHCCLWeightTransferEngine, AscendRLNPUIPCWeightTransferEngine]
)
def test_engine_start_fails_fast_when_nz_is_on(monkeypatch, engine_cls):
    monkeypatch.setattr(engine_module, "device_for", lambda *a, **k: _NZDevice())
    with pytest.raises(ValueError, match="weight_nz_mode=0"):
        engine_cls(None, _vllm_config(), torch.device("cpu"), torch.nn.Linear(2, 2))
