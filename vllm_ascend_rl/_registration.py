"""The plugin's components in vLLM's factories, under names of our own (``ascend_rl_*``):
vllm-ascend registers ``hccl`` and ``npu_ipc`` with unguarded calls, and vLLM runs general
plugins uncaught in site-packages order, so shared names would make start-up order-dependent.
The ``AscendRL`` class prefix tells the plugins apart in vLLM's log line (it names the class)."""

from __future__ import annotations

import importlib

from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

HCCL_BACKEND = "ascend_rl_hccl"
NPU_IPC_BACKEND = "ascend_rl_npu_ipc"
CAMEM_BACKEND = "ascend_rl_camem"

_WT = "vllm.distributed.weight_transfer.factory"
_ENGINE = (_WT, "WeightTransferEngineFactory", "register_engine")
_TRAINER = (_WT, "WeightTransferTrainerFactory", "register_engine")
_PKG = "vllm_ascend_rl.weight_transfer"
_SLEEP = ("vllm.device_allocator.sleep_mode_backend", "SleepModeBackendFactory", "register_backend")

# (factory module, factory class, register method, name, module, class)
COMPONENTS: tuple[tuple[str, str, str, str, str, str], ...] = (
    (*_ENGINE, HCCL_BACKEND, f"{_PKG}.hccl", "AscendRLHCCLWeightTransferEngine"),
    (*_TRAINER, HCCL_BACKEND, f"{_PKG}.hccl_trainer", "AscendRLHCCLTrainerWeightTransferEngine"),
    (*_ENGINE, NPU_IPC_BACKEND, f"{_PKG}.npu_ipc", "AscendRLNPUIPCWeightTransferEngine"),
    (
        *_TRAINER,
        NPU_IPC_BACKEND,
        f"{_PKG}.npu_ipc_trainer",
        "AscendRLNPUIPCTrainerWeightTransferEngine",
    ),
    (*_SLEEP, CAMEM_BACKEND, "vllm_ascend_rl.sleep.backend", "CaMemSleepBackend"),
)


def register_all() -> dict[str, str]:
    """Register every component; return ``{"factory:name": "module.class"}`` of what this
    call registered. Never raises: the names are ours alone, so a duplicate (something
    registered them earlier in this process) is logged and left alone."""
    done: dict[str, str] = {}
    for module, factory, method, name, target, class_name in COMPONENTS:
        register = getattr(getattr(importlib.import_module(module), factory), method)
        try:
            register(name, target, class_name)
        except ValueError as e:
            logger.warning("vllm_ascend_rl: %s %r not registered: %s", factory, name, e)
            continue
        done[f"{factory}:{name}"] = f"{target}.{class_name}"
    return done
