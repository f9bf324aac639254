"""May a worker's model run? Asked by the plugin scheduler at every resume (one
``collective_rpc``); answered by the worker's weight-transfer engine. Neither ``core`` nor
``weight_transfer`` imports the other: both meet here."""

from __future__ import annotations

from typing import Any


def weights_not_whole(worker: Any) -> str | None:
    """Run on a worker: why its weights must not run now, or None (also for an engine that is
    not ours, e.g. vLLM's NCCL engine, which never leaves a model half-loaded)."""
    session = getattr(getattr(worker, "weight_transfer_engine", None), "session", None)
    not_whole = getattr(session, "not_whole", None)
    return not_whole() if callable(not_whole) else None


def workers_not_whole(engine_core: Any) -> str | None:
    """Why some worker of ``engine_core`` must not run the model now, or None if every worker
    may; asked over the engine core's own ``collective_rpc``."""
    answers = engine_core.model_executor.collective_rpc(weights_not_whole)
    return next(filter(None, answers), None)
