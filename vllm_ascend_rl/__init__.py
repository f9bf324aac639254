"""vllm_ascend_rl: async-RL plumbing for vLLM on Ascend NPUs, runnable and tested on CPU.
``register()`` is the ``vllm.general_plugins`` entry point (vLLM calls it in every process;
trainers call it before ``WeightTransferTrainerFactory.trainer_init``): idempotent, light, and
registering names of its own (``ascend_rl_*``), so it coexists with vllm-ascend."""

from __future__ import annotations

__version__ = "0.1.0"

_registered: dict[str, str] | None = None


def register() -> dict[str, str]:
    """Register the plugin's components in vLLM's factories; return what was registered."""
    global _registered
    if _registered is None:
        from vllm_ascend_rl._registration import register_all
        from vllm_ascend_rl.logs import get_logger

        _registered = register_all()
        done = ", ".join(f"{k} -> {v}" for k, v in _registered.items()) or "nothing"
        get_logger(__name__).info("vllm_ascend_rl %s registered: %s", __version__, done)
    return _registered


__all__ = ["__version__", "register"]
