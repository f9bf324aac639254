"""``register()``: the vllm.general_plugins entry point registers fixed names of our own, so it
coexists with vllm-ascend's registrations whatever order vLLM discovers the two plugins in."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.fresh_process import run_fresh
from tests.support.standin_vllm_ascend import (
    ENTRY_POINT,
    THEIR_NAMES,
    install_standin,
    real_vllm_ascend_installed,
)
from vllm_ascend_rl._registration import CAMEM_BACKEND, HCCL_BACKEND, NPU_IPC_BACKEND

OURS = {
    ("WeightTransferEngineFactory", HCCL_BACKEND): (
        "vllm_ascend_rl.weight_transfer.hccl.AscendRLHCCLWeightTransferEngine"
    ),
    ("WeightTransferTrainerFactory", HCCL_BACKEND): (
        "vllm_ascend_rl.weight_transfer.hccl_trainer.AscendRLHCCLTrainerWeightTransferEngine"
    ),
    ("WeightTransferEngineFactory", NPU_IPC_BACKEND): (
        "vllm_ascend_rl.weight_transfer.npu_ipc.AscendRLNPUIPCWeightTransferEngine"
    ),
    ("WeightTransferTrainerFactory", NPU_IPC_BACKEND): (
        "vllm_ascend_rl.weight_transfer.npu_ipc_trainer.AscendRLNPUIPCTrainerWeightTransferEngine"
    ),
    ("SleepModeBackendFactory", CAMEM_BACKEND): "vllm_ascend_rl.sleep.backend.CaMemSleepBackend",
}

# Runs in a fresh process, after `standin` and `order` are set: put the stand-in first or last
# on sys.path, let vLLM load every general plugin exactly as it does in a server process, and
# report who owns which name.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.environ.pop("VLLM_PLUGINS", None)
    if order == "last":
        sys.path.append(standin)
    else:
        sys.path.insert(0, standin)
    if order == "trainer":  # a trainer registers by hand, then something loads plugins
        import vllm_ascend_rl
        vllm_ascend_rl.register()
    from importlib.metadata import entry_points
    from vllm.plugins import load_general_plugins
    from vllm.distributed.weight_transfer import factory
    from vllm.device_allocator import sleep_mode_backend

    load_general_plugins()  # vLLM calls plugins without catching: an error ends here

    owners = {}
    for fname, f in [
        ("WeightTransferEngineFactory", factory.WeightTransferEngineFactory),
        ("WeightTransferTrainerFactory", factory.WeightTransferTrainerFactory),
        ("SleepModeBackendFactory", sleep_mode_backend.SleepModeBackendFactory),
    ]:
        for name, load in f._registry.items():
            if name in ("hccl", "npu_ipc") or name.startswith("ascend_rl_"):
                cls = load()
                owners[f"{fname}:{name}"] = f"{cls.__module__}.{cls.__qualname__}"
    eps = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    print("@@" + json.dumps({"eps": eps, "owners": owners}))
    """
)


def _probe(standin, order: str) -> dict:
    out = run_fresh(f"standin, order = {str(standin)!r}, {order!r}\n{PROBE}")
    assert out.returncode == 0, f"plugin loading failed ({order}):\n{out.stderr[-3000:]}"
    line = next(x for x in out.stdout.splitlines() if x.startswith("@@"))
    return json.loads(line[2:])


# Beside the real vllm-ascend the stand-in would register vllm-ascend's names a second time,
# which vLLM refuses; there tests/e2e/test_hccl_weight_swap.py checks the real plugin.
needs_standin = pytest.mark.skipif(
    real_vllm_ascend_installed(), reason="vllm-ascend is installed: it is checked, not a stand-in"
)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return install_standin(tmp_path_factory.mktemp("standin"))


@pytest.fixture(scope="module")
def probes(standin) -> dict[str, dict]:
    orders = ("first", "last", "trainer")
    return {order: _probe(standin, order) for order in orders}


@needs_standin
@pytest.mark.parametrize("order", ["first", "last", "trainer"])
def test_coexists_with_vllm_ascend_in_any_discovery_order(probes, order):
    eps, owners = probes[order]["eps"], probes[order]["owners"]
    ours_first = eps.index("vllm_ascend_rl") < eps.index(ENTRY_POINT)
    assert ours_first == (order == "last"), f"discovery order was not {order}: {eps}"
    for (factory, name), cls in THEIR_NAMES.items():  # their names stay theirs
        assert owners[f"{factory}:{name}"] == f"vllm_ascend_standin.{cls}"
    for (factory, name), cls in OURS.items():
        assert owners[f"{factory}:{name}"] == cls


@needs_standin
def test_our_names_are_identical_in_every_order(probes):
    ours = [
        {k: v for k, v in p["owners"].items() if k.split(":")[1].startswith("ascend_rl_")}
        for p in probes.values()
    ]
    assert ours[0] == ours[1] == ours[2]
    assert len(ours[0]) == len(OURS)


def test_engine_class_names_cannot_be_mistaken_for_vllm_ascends():
    """vLLM's factory logs only ``cls.__name__``."""
    theirs = set(THEIR_NAMES.values())
    for (factory, _), cls in OURS.items():
        if not factory.startswith("WeightTransfer"):
            continue
        name = cls.rsplit(".", 1)[1]
        assert name.startswith("AscendRL") and name not in theirs


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "vllm_ascend_rl"]
    assert len(ours) == 1 and ours[0].value == "vllm_ascend_rl:register"


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
