"""May a worker's model run? One :class:`ModelReadiness` per served model: the update session
(an open update, a failed ``hold`` update), the sleepable worker (a level-2 sleep) and a reload
from disk set it. vLLM's workers and vllm-ascend's ``NPUWorker`` (``worker.py:715-720`` at
182b75e) give the weight-transfer engine ``model_runner.get_model()``, the object the worker
reads it from too. Neither ``core`` nor ``weight_transfer`` imports the other: both meet here.

The plugin scheduler asks in two ways. At every resume, over the engine core's
``collective_rpc`` (:func:`engine_unready`). At every step, from a :class:`StepGate`: each
worker announces its readiness when it changes, as a datagram to a Unix socket in Linux's
abstract namespace that the scheduler binds (no file to clean up), sent before the call that
changed it returns to the engine core. The engine core runs those calls and the steps on one
thread, so the step after ``start_weight_update`` already sees the update open, with no
per-step call to the workers; graph replay cannot skip a check that runs before the step is
scheduled."""

from __future__ import annotations

import json
import math
import select
import socket
import time
from collections.abc import Callable
from enum import Enum
from typing import Any
from weakref import WeakKeyDictionary

import torch

from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

RELOAD_HINT = (
    "the weights were discarded by a level-2 sleep: wake them "
    "(/wake_up?tags=weights), load new ones (a weight transfer, or reload_weights "
    "from disk), then wake the KV cache (/wake_up?tags=kv_cache)"
)


class Readiness(Enum):
    WHOLE = "whole"
    UPDATING = "a weight update is open: generation waits for finish_weight_update"
    NOT_WHOLE = "not whole"  # a hold update failed after layers took new weights
    DISCARDED = RELOAD_HINT


class ModelReadiness:
    """The model's weights: whole, or why not (``reason``); announced to the step gate once a
    weight-transfer engine gave the address (:meth:`announce_to`)."""

    def __init__(self) -> None:
        self.state = Readiness.WHOLE
        self.reason: str | None = None
        self.idle_s = math.inf  # UPDATING: the scheduler ends the update after this long idle
        self.abandon: Callable[[], None] | None = None  # ends an open update (the engine's)
        self._bell: tuple[socket.socket, str, int] | None = None

    def set(self, state: Readiness, reason: str | None = None, idle_s: float = math.inf) -> None:
        """``reason`` for NOT_WHOLE; the others say it themselves. Setting UPDATING again
        restarts its idle clock."""
        self.state, self.idle_s = state, idle_s
        self.reason = None if state is Readiness.WHOLE else reason or state.value
        self._announce()

    def announce_to(self, vllm_config: Any, worker: int) -> None:
        """Announce every change from now on to the step gate of ``vllm_config``'s engine."""
        if self._bell is None:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            bell.settimeout(5.0)
            self._bell = (bell, gate_address(vllm_config), worker)
            self._announce()

    def _announce(self) -> None:
        if self._bell is None:
            return
        bell, address, worker = self._bell
        news = {"worker": worker, "reason": self.reason, "idle_s": min(self.idle_s, 1e9)}
        try:
            bell.sendto(json.dumps(news).encode(), address)
        except OSError as e:  # no plugin scheduler: nothing gates the steps
            logger.debug("step gate %r not reached: %s", address[1:], e)


_READINESS: WeakKeyDictionary[torch.nn.Module, ModelReadiness] = WeakKeyDictionary()


def readiness_of(model: torch.nn.Module) -> ModelReadiness:
    """The readiness of ``model`` (WHOLE until something sets it)."""
    return _READINESS.setdefault(model, ModelReadiness())


def model_unready(worker: Any) -> str | None:
    """Run on a worker: why generation must not resume, or None. An open update does not
    refuse a resume: the step gate holds the steps until it ends (or is abandoned)."""
    readiness = readiness_of(worker.model_runner.get_model())
    return None if readiness.state is Readiness.UPDATING else readiness.reason


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


def end_abandoned_update(worker: Any) -> None:
    """Run on a worker (the step gate's ``collective_rpc``): end an update left open past its
    idle bound."""
    abandon = readiness_of(worker.model_runner.get_model()).abandon
    if abandon is not None:
        abandon()


def gate_address(vllm_config: Any) -> str:
    """The step gate's socket of one engine core: its instance and data-parallel rank."""
    rank = vllm_config.parallel_config.data_parallel_rank
    return f"\0vllm_ascend_rl.step_gate.{vllm_config.instance_id}.{rank}"


class StepGate:
    """The scheduler's side: which workers' models are not ready, as they announced it."""

    def __init__(self, vllm_config: Any) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        try:
            self.sock.bind(gate_address(vllm_config))
        except OSError as e:
            logger.warning("no step gate (%s): steps are not held during weight updates", e)
        self.unready: dict[int, tuple[str, float]] = {}  # worker -> (reason, idle deadline)
        self.closed_since_taken = False  # some worker became unready since take_closed()

    def reason(self, wait_s: float = 0.0) -> str | None:
        """Why no step may run now, or None; waits up to ``wait_s`` for news while closed."""
        self._drain()
        if self.unready and wait_s > 0 and select.select([self.sock], [], [], wait_s)[0]:
            self._drain()
        return next(iter(self.unready.values()))[0] if self.unready else None

    def take_closed(self) -> bool:
        """Whether some worker became unready since the last call (the KV cache then holds
        values of weights that may be gone)."""
        closed, self.closed_since_taken = self.closed_since_taken, False
        return closed

    def idle_past_bound(self) -> bool:
        """Some worker's open update saw no call for its idle bound."""
        now = time.monotonic()
        return any(deadline <= now for _, deadline in self.unready.values())

    def _drain(self) -> None:
        while True:
            try:
                news = json.loads(self.sock.recv(65536))
            except BlockingIOError:
                return
            if news["reason"] is None:
                self.unready.pop(news["worker"], None)
                continue
            deadline = time.monotonic() + news["idle_s"]
            self.unready[news["worker"]] = (news["reason"], deadline)
            self.closed_since_taken = True
