"""vllm_ascend_rl: async-RL plumbing for vLLM on Ascend NPUs, runnable and tested on CPU.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it once in every
process (API server, engine core, workers); trainer processes call it themselves before
``WeightTransferTrainerFactory.trainer_init``. It is idempotent, imports nothing heavy beyond
vLLM's factory modules, and registers fixed names of its own (``ascend_rl_hccl``,
``ascend_rl_npu_ipc``, ``ascend_rl_camem``), so it coexists with vllm-ascend in either plugin
order.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered: dict[str, str] | None = None


def register() -> dict[str, str]:
    """Register the plugin's components in vLLM's factories; return what was registered."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm_ascend_rl._registration import register_all
    from vllm_ascend_rl.logs import get_logger

    _registered = register_all()
    get_logger(__name__).info(
        "vllm_ascend_rl %s registered: %s",
        __version__,
        ", ".join(f"{k} -> {v}" for k, v in _registered.items()) or "nothing",
    )
    return _registered


__all__ = ["__version__", "register"]
