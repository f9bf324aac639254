"""Registering the plugin's components in vLLM's factories without ever raising.

vLLM's factories raise ``ValueError`` on a duplicate name, and vllm-ascend registers some of
the names we want (``hccl``, ``npu_ipc``). Each component therefore has a preferred name and a
fallback (``ascend_rl_<name>``). Entries we stored are tagged, so calling :func:`register_all`
again (vLLM calls general plugins once per process, trainers call it by hand) is a no-op.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

_TAG = "__vllm_ascend_rl__"

# factory kind -> (module of the factory class, class name, name of its register method)
FACTORIES: dict[str, tuple[str, str, str]] = {
    "weight_transfer_engine": (
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferEngineFactory",
        "register_engine",
    ),
    "weight_transfer_trainer": (
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferTrainerFactory",
        "register_engine",
    ),
    "sleep_mode_backend": (
        "vllm.device_allocator.sleep_mode_backend",
        "SleepModeBackendFactory",
        "register_backend",
    ),
}


@dataclass(frozen=True)
class Component:
    """One class to put in one vLLM factory, imported lazily by the factory on first use."""

    factory: str
    name: str
    module: str
    class_name: str
    # A TrainerInitInfo class whose ``backend`` ClassVar must name what we registered under
    # (the trainer factory dispatches on it), as "module:Class".
    init_info: str = ""

    @property
    def fallback_name(self) -> str:
        return f"ascend_rl_{self.name}"


_HCCL = "vllm_ascend_rl.weight_transfer.hccl"
_IPC = "vllm_ascend_rl.weight_transfer.npu_ipc"

# What the plugin registers.
COMPONENTS: tuple[Component, ...] = (
    Component("weight_transfer_engine", "hccl", _HCCL, "HCCLWeightTransferEngine"),
    Component(
        "weight_transfer_trainer",
        "hccl",
        _HCCL,
        "HCCLTrainerWeightTransferEngine",
        init_info=f"{_HCCL}:HCCLTrainerInitInfo",
    ),
    Component("weight_transfer_engine", "npu_ipc", _IPC, "NPUIPCWeightTransferEngine"),
    Component(
        "weight_transfer_trainer",
        "npu_ipc",
        _IPC,
        "NPUIPCTrainerWeightTransferEngine",
        init_info=f"{_IPC}:NPUIPCTrainerInitInfo",
    ),
    Component("sleep_mode_backend", "camem", "vllm_ascend_rl.sleep.backend", "CaMemSleepBackend"),
)

# (factory, preferred name) -> name actually used in this process
_chosen: dict[tuple[str, str], str] = {}


def _factory(kind: str):
    module, cls, method = FACTORIES[kind]
    factory = getattr(importlib.import_module(module), cls)
    return factory, getattr(factory, method)


def _owner(entry) -> tuple[str, str] | None:
    return getattr(entry, _TAG, None)


def register_component(component: Component) -> str | None:
    """Register ``component``; return the name it is reachable under, or ``None``.

    Never raises: a name owned by another plugin makes us use the fallback name, and if that
    is taken too the component is skipped with a warning.
    """
    factory, register = _factory(component.factory)
    registry = factory._registry  # vLLM exposes no membership query; reading is safe
    ours = (component.module, component.class_name)
    for name in (component.name, component.fallback_name):
        entry = registry.get(name)
        if entry is None:
            try:
                register(name, component.module, component.class_name)
            except ValueError:  # lost a race with another registrant; try the next name
                continue
            setattr(registry[name], _TAG, ours)
            logger.info("vllm_ascend_rl: registered %s %r -> %s.%s", component.factory, name, *ours)
        elif _owner(entry) != ours:
            logger.info("vllm_ascend_rl: %s %r is taken by another plugin", component.factory, name)
            continue
        _chosen[(component.factory, component.name)] = name
        _sync_init_info_backend(component, name)
        return name
    logger.warning(
        "vllm_ascend_rl: could not register %s %s.%s: names %r and %r are taken",
        component.factory,
        *ours,
        component.name,
        component.fallback_name,
    )
    return None


def _sync_init_info_backend(component: Component, name: str) -> None:
    """Point an already-imported init-info class at the name we registered under (a module
    imported later reads :func:`registered_name` itself)."""
    if not component.init_info:
        return
    module, cls = component.init_info.split(":")
    loaded = sys.modules.get(module)
    if loaded is not None:
        getattr(loaded, cls).backend = name


def registered_name(factory: str, name: str) -> str:
    """The name under which our component ``name`` was registered in this process."""
    return _chosen.get((factory, name), name)


def register_all(components: tuple[Component, ...] = COMPONENTS) -> dict[str, str | None]:
    return {f"{c.factory}:{c.name}": register_component(c) for c in components}
