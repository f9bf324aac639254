"""May a worker's model run? One :class:`ModelReadiness` per served model: the update session
(a failed ``hold`` update), the sleepable worker (a level-2 sleep) and a reload from disk set
it; the plugin scheduler asks at every resume through :func:`engine_unready`. vLLM's workers
and vllm-ascend's ``NPUWorker`` (``worker.py:715-720`` at 182b75e) give the weight-transfer
engine ``model_runner.get_model()``, the object the worker reads it from too. Neither ``core``
nor ``weight_transfer`` imports the other: both meet here."""

from __future__ import annotations

from enum import Enum
from typing import Any
from weakref import WeakKeyDictionary

import torch

RELOAD_HINT = (
    "the weights were discarded by a level-2 sleep: wake them "
    "(/wake_up?tags=weights), load new ones (a weight transfer, or reload_weights "
    "from disk), then wake the KV cache (/wake_up?tags=kv_cache)"
)


class Readiness(Enum):
    WHOLE = "whole"
    LOADING = "a weight update is loading (on_failure=hold): finish it first"
    NOT_WHOLE = "not whole"  # a hold update failed after layers took new weights
    DISCARDED = RELOAD_HINT


class ModelReadiness:
    """The model's weights: whole, or why not (``reason``)."""

    def __init__(self) -> None:
        self.state = Readiness.WHOLE
        self.reason: str | None = None

    def set(self, state: Readiness, reason: str | None = None) -> None:
        """``reason`` for NOT_WHOLE; the others say it themselves."""
        self.state = state
        self.reason = None if state is Readiness.WHOLE else reason or state.value


_READINESS: WeakKeyDictionary[torch.nn.Module, ModelReadiness] = WeakKeyDictionary()


def readiness_of(model: torch.nn.Module) -> ModelReadiness:
    """The readiness of ``model`` (WHOLE until something sets it)."""
    return _READINESS.setdefault(model, ModelReadiness())


def model_unready(worker: Any) -> str | None:
    """Run on a worker: why its model must not run now, or None."""
    return readiness_of(worker.model_runner.get_model()).reason


def engine_unready(engine_core: Any) -> str | None:
    """Why ``engine_core`` must not generate now, or None: its executor's memory is not all
    resident (a sleep, or vLLM 0.32's ``release_kv_cache_memory``), or some worker's model is
    not ready (asked over the engine core's own ``collective_rpc``)."""
    executor = engine_core.model_executor
    if executor.is_sleeping:
        return (
            f"memory is not resident ({', '.join(sorted(executor.sleeping_tags))} released), "
            "and a step would run on it; call /wake_up first"
        )
    return next(filter(None, executor.collective_rpc(model_unready)), None)
