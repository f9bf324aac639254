"""Servers with the device's sleepable worker, shared by the sleep-mode and sleep-misuse tests."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tests.support import PLUGIN_SCHEDULER, VLLMServer, engine_args
from tests.support.profile import current_profile
from vllm_ascend_rl.client import EngineControlClient, EngineControlError


def sleepable_server(
    model: str | os.PathLike,
    log_path: str | os.PathLike,
    *,
    scheduler: str | None = PLUGIN_SCHEDULER,
    extra_args: Sequence[str] = (),
    kv_cache_gib: int = 1,
    graphs: bool = False,
) -> VLLMServer:
    """A server (not started) with the sleepable worker (``scheduler=None``: vLLM's own;
    ``graphs``: vLLM's default compile mode, ACL graphs on Ascend)."""
    return VLLMServer(
        model,
        kv_cache_gib=kv_cache_gib,
        log_path=log_path,
        extra_args=[
            *engine_args(graphs),
            "--worker-cls",
            current_profile().sleepable_worker,
            *(["--scheduler-cls", scheduler] if scheduler else []),
            *extra_args,
        ],
    )


def leave_awake(client: EngineControlClient, model: str | os.PathLike) -> None:
    """Leave the engine awake, with valid weights (reloaded from disk if a level-2 sleep
    discarded them), and resumed."""
    if client.is_sleeping():
        try:
            client.wake_up(["weights"])
        except EngineControlError:
            pass
        client.reload_weights(str(model))
        client.wake_up()
    client.resume()
