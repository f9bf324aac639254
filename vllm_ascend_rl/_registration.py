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

_WT_FACTORY = "vllm.distributed.weight_transfer.factory"
_HCCL = "vllm_ascend_rl.weight_transfer.hccl"
_HCCL_TRAINER = "vllm_ascend_rl.weight_transfer.hccl_trainer"
_IPC = "vllm_ascend_rl.weight_transfer.npu_ipc"
_IPC_TRAINER = "vllm_ascend_rl.weight_transfer.npu_ipc_trainer"

# (factory module, factory class, register method, name, module, class)
COMPONENTS: tuple[tuple[str, str, str, str, str, str], ...] = (
    (
        _WT_FACTORY,
        "WeightTransferEngineFactory",
        "register_engine",
        HCCL_BACKEND,
        _HCCL,
        "AscendRLHCCLWeightTransferEngine",
    ),
    (
        _WT_FACTORY,
        "WeightTransferTrainerFactory",
        "register_engine",
        HCCL_BACKEND,
        _HCCL_TRAINER,
        "AscendRLHCCLTrainerWeightTransferEngine",
    ),
    (
        _WT_FACTORY,
        "WeightTransferEngineFactory",
        "register_engine",
        NPU_IPC_BACKEND,
        _IPC,
        "AscendRLNPUIPCWeightTransferEngine",
    ),
    (
        _WT_FACTORY,
        "WeightTransferTrainerFactory",
        "register_engine",
        NPU_IPC_BACKEND,
        _IPC_TRAINER,
        "AscendRLNPUIPCTrainerWeightTransferEngine",
    ),
    (
        "vllm.device_allocator.sleep_mode_backend",
        "SleepModeBackendFactory",
        "register_backend",
        CAMEM_BACKEND,
        "vllm_ascend_rl.sleep.backend",
        "CaMemSleepBackend",
    ),
)


def register_all() -> dict[str, str]:
    """Register every component; return ``{factory: name}`` of what this call registered.
    Never raises: the names are ours alone, so a duplicate (something registered them earlier
    in this process) is logged and left alone."""
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
