"""``register()``: the vllm.general_plugins entry point must be idempotent, cheap, and never
raise because another plugin (vllm-ascend) registered a name first."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

import vllm_ascend_rl
from vllm_ascend_rl import _registration
from vllm_ascend_rl._registration import Component, register_component

FACTORIES = [WeightTransferEngineFactory, WeightTransferTrainerFactory]


@pytest.fixture(autouse=True)
def restore_registries():
    saved = [dict(f._registry) for f in FACTORIES]
    chosen = dict(_registration._chosen)
    yield
    for f, reg in zip(FACTORIES, saved, strict=True):
        f._registry.clear()
        f._registry.update(reg)
    _registration._chosen.clear()
    _registration._chosen.update(chosen)


DUMMY = Component(
    "weight_transfer_engine",
    "rl_test_engine",
    "vllm.distributed.weight_transfer.nccl_engine",
    "NCCLWeightTransferEngine",
)


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "vllm_ascend_rl"]
    assert len(ours) == 1 and ours[0].value == "vllm_ascend_rl:register"


def test_register_twice_does_not_raise_and_is_stable():
    first = vllm_ascend_rl.register()
    second = vllm_ascend_rl.register()
    assert first == second
    assert register_component(DUMMY) == "rl_test_engine"
    entry = WeightTransferEngineFactory._registry["rl_test_engine"]
    assert register_component(DUMMY) == "rl_test_engine"  # idempotent: nothing re-registered
    assert WeightTransferEngineFactory._registry["rl_test_engine"] is entry
    assert (
        WeightTransferEngineFactory._registry["rl_test_engine"]().__name__
        == "NCCLWeightTransferEngine"
    )


def test_name_taken_by_another_plugin_uses_the_fallback():
    # What vllm-ascend does: register the same name through vLLM's public API first.
    WeightTransferEngineFactory.register_engine(
        "rl_test_engine", "vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"
    )
    theirs = WeightTransferEngineFactory._registry["rl_test_engine"]
    assert register_component(DUMMY) == "ascend_rl_rl_test_engine"
    assert register_component(DUMMY) == "ascend_rl_rl_test_engine"
    assert WeightTransferEngineFactory._registry["rl_test_engine"] is theirs  # untouched
    assert (
        _registration.registered_name("weight_transfer_engine", "rl_test_engine")
        == "ascend_rl_rl_test_engine"
    )


def test_both_names_taken_skips_without_raising():
    for name in ("rl_test_engine", "ascend_rl_rl_test_engine"):
        WeightTransferEngineFactory.register_engine(
            name, "vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"
        )
    assert register_component(DUMMY) is None


def test_import_and_register_are_cheap():
    """Importing the package pulls in neither torch nor vLLM; register() loads no engine."""
    code = (
        "import sys, vllm_ascend_rl\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'\n"
        "vllm_ascend_rl.register(); vllm_ascend_rl.register()\n"
        "loaded = [m for m in sys.modules if m.startswith('vllm_ascend_rl.')\n"
        "          and m.split('.')[1] not in ('_registration', 'logs')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _fresh(name: str) -> None:
    for f in FACTORIES:
        f._registry.pop(name, None)
        f._registry.pop(f"ascend_rl_{name}", None)
    _registration._chosen.clear()


def test_hccl_is_registered_in_both_factories():
    _fresh("hccl")
    names = _registration.register_all()
    assert names["weight_transfer_engine:hccl"] == names["weight_transfer_trainer:hccl"] == "hccl"
    engine_cls = WeightTransferEngineFactory._registry["hccl"]()
    trainer_cls = WeightTransferTrainerFactory._registry["hccl"]()
    assert engine_cls.__name__ == "HCCLWeightTransferEngine"
    assert trainer_cls.__name__ == "HCCLTrainerWeightTransferEngine"
    from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

    assert HCCLTrainerInitInfo.backend == "hccl"


def test_hccl_taken_by_vllm_ascend_falls_back_and_trainer_dispatch_follows():
    from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

    _fresh("hccl")
    for f in FACTORIES:  # what vllm-ascend's register_engine() does
        f.register_engine(
            "hccl", "vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"
        )
    try:
        names = _registration.register_all()
        assert names["weight_transfer_engine:hccl"] == "ascend_rl_hccl"
        assert names["weight_transfer_trainer:hccl"] == "ascend_rl_hccl"
        # The trainer factory dispatches on init_info.backend: it must reach our engine.
        assert HCCLTrainerInitInfo.backend == "ascend_rl_hccl"
        assert (
            WeightTransferTrainerFactory._registry["ascend_rl_hccl"]().__name__
            == "HCCLTrainerWeightTransferEngine"
        )
        assert (
            WeightTransferEngineFactory._registry["hccl"]().__name__ == "NCCLWeightTransferEngine"
        )  # theirs, untouched
    finally:
        HCCLTrainerInitInfo.backend = "hccl"
