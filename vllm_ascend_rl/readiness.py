"""May a worker's model run? One :class:`ModelReadiness` per served model: the update session
(an open update, a failed ``hold`` update), the sleepable worker (a level-2 sleep) and a reload
from disk set it. vLLM's workers and vllm-ascend's ``NPUWorker`` (``worker.py:715-720`` at
182b75e) give the weight-transfer engine ``model_runner.get_model()``, the object the worker
reads it from too. Neither ``core`` nor ``weight_transfer`` imports the other: both meet here.

The plugin scheduler learns it from a :class:`StepGate`, at every step and every resume: each
worker announces its readiness when it changes, as a line on a Unix stream socket in Linux's
abstract namespace that the scheduler listens on (no file to clean up), sent before the call
that changed it returns to the engine core. The engine core runs those calls and the steps on one
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
from enum import Enum, IntEnum
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


class StepHold(IntEnum):
    """What holds an engine core's steps while one of its workers has an update open; a
    worker tells its trainer at init (the lowest of all workers counts)."""

    NONE = 0  # its scheduler has no step gate (not the plugin's, or replaced by vllm-ascend)
    LOCKSTEP = 1  # MoE with data parallel: engine cores step together, dummy batches included
    GATE = 2  # the plugin scheduler's step gate


class ModelReadiness:
    """The model's weights: whole, or why not (``reason``); announced to the step gate once a
    weight-transfer engine gave the address (:meth:`announce_to`)."""

    def __init__(self) -> None:
        self.state = Readiness.WHOLE
        self.reason: str | None = None
        self.idle_s = math.inf  # UPDATING: the scheduler ends the update after this long idle
        self.abandon: Callable[[], None] | None = None  # ends an open update (the engine's)
        self._gate: tuple[str, int] | None = None  # the step gate's address, this worker
        self._link: socket.socket | None = None

    def set(self, state: Readiness, reason: str | None = None, idle_s: float = math.inf) -> None:
        """``reason`` for NOT_WHOLE; the others say it themselves. Setting UPDATING again
        restarts its idle clock."""
        self.state, self.idle_s = state, idle_s
        self.reason = None if state is Readiness.WHOLE else reason or state.value
        self._announce()

    def announce_to(self, vllm_config: Any, worker: int) -> None:
        """Announce every change from now on to the step gate of ``vllm_config``'s engine."""
        self._gate = (gate_address(vllm_config), worker)

    def step_hold(self, vllm_config: Any) -> StepHold:
        """What holds this worker's engine core's steps while an update is open: a gate is
        there if it takes a connection (at the address fixed by :meth:`announce_to`)."""
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1 and vllm_config.model_config.is_moe:
            return StepHold.LOCKSTEP
        return StepHold.GATE if self._linked() else StepHold.NONE

    def _linked(self) -> bool:
        """Whether the stream connection to the gate is made (now, if it was not)."""
        if self._link is None and self._gate is not None:
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            link.settimeout(30.0)
            try:
                link.connect(self._gate[0])
            except OSError:
                link.close()
                return False
            self._link = link
        return self._link is not None

    def _announce(self) -> None:
        """One line of JSON on the stream connection to the gate, made at the first change (the
        scheduler is created after the workers); a gate that is not there gates nothing."""
        if self._gate is None:
            return
        news = {
            "worker": self._gate[1],
            "reason": self.reason,
            "idle_s": min(self.idle_s, 1e9),
            "updating": self.state is Readiness.UPDATING,
        }
        for _attempt in range(2):  # a link the gate closed is made again once
            link = self._link if self._linked() else None
            if link is None:
                break
            try:
                link.sendall(json.dumps(news).encode() + b"\n")
                return
            except OSError:
                link.close()
                self._link = None
        logger.debug("step gate %r not reached (no plugin scheduler?)", self._gate[0][1:])


_READINESS: WeakKeyDictionary[torch.nn.Module, ModelReadiness] = WeakKeyDictionary()


def readiness_of(model: torch.nn.Module) -> ModelReadiness:
    """The readiness of ``model`` (WHOLE until something sets it)."""
    return _READINESS.setdefault(model, ModelReadiness())


def worker_readiness(worker: Any) -> ModelReadiness:
    """The readiness of a vLLM worker's model."""
    return readiness_of(worker.model_runner.get_model())


def memory_not_resident(engine_core: Any) -> str | None:
    """Why ``engine_core`` must not generate on its memory now, or None: its executor's memory
    is not all resident (a sleep, or vLLM 0.32's ``release_kv_cache_memory``)."""
    executor = engine_core.model_executor
    if not executor.is_sleeping:
        return None
    return (
        f"memory is not resident ({', '.join(sorted(executor.sleeping_tags))} released), "
        "and a step would run on it; call /wake_up first"
    )


def end_abandoned_update(worker: Any) -> None:
    """Run on a worker (the step gate's ``collective_rpc``): end an update left open past its
    idle bound."""
    abandon = worker_readiness(worker).abandon
    if abandon is not None:
        abandon()


def gate_address(vllm_config: Any) -> str:
    """The step gate's socket of one engine core: its instance and data-parallel index (vLLM
    resets ``data_parallel_rank`` to 0 in every dense DP engine core, not the index)."""
    index = vllm_config.parallel_config.data_parallel_index
    return f"\0vllm_ascend_rl.step_gate.{vllm_config.instance_id}.{index}"


class StepGate:
    """The scheduler's side: which workers' models are not ready, as they announced it. A
    listening stream socket, one connection per worker, one JSON line per change."""

    def __init__(self, vllm_config: Any) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.setblocking(False)
        address = gate_address(vllm_config)
        try:
            self.listener.bind(address)
            self.listener.listen(256)
        except OSError as e:  # an engine core without its gate would step through updates
            self.listener.close()
            raise RuntimeError(
                f"the step gate of this engine core cannot listen on {address[1:]!r} ({e}): "
                "another engine core with the same instance_id and data-parallel index "
                f"({vllm_config.instance_id!r}, "
                f"{vllm_config.parallel_config.data_parallel_index}) holds it"
            ) from e
        self.links: dict[socket.socket, bytes] = {}  # a worker's connection -> partial line
        # worker -> (reason, idle deadline, whether it is an open update)
        self.unready: dict[int, tuple[str, float, bool]] = {}

    def reason(self) -> str | None:
        """Why no step may run now (as last read), or None."""
        return next(iter(self.unready.values()))[0] if self.unready else None

    def resume_refusal(self) -> str | None:
        """Why generation must not resume: some worker's model is not whole (as last read). An
        open update does not refuse a resume: the gate holds the steps until it ends."""
        return next((why for why, _, updating in self.unready.values() if not updating), None)

    def idle_past_bound(self) -> bool:
        """Some worker's open update saw no call for its idle bound."""
        now = time.monotonic()
        return any(deadline <= now for _, deadline, _ in self.unready.values())

    def drain(self, wait_s: float = 0.0) -> bool:
        """Read every announcement waiting, first waiting up to ``wait_s`` for one while
        closed; whether some worker became unready. A worker's announcement is sent before the
        call that changed it returns to the engine core."""
        if self.unready and wait_s > 0:
            select.select([self.listener, *self.links], [], [], wait_s)
        while True:
            try:
                link, _ = self.listener.accept()
            except OSError:  # none waiting (or no listener)
                break
            link.setblocking(False)
            self.links[link] = b""
        closed = False
        for link in list(self.links):
            data, alive = self._read(link)
            *lines, rest = (self.links.pop(link) + data).split(b"\n")
            if alive:
                self.links[link] = rest
            else:  # the worker is gone (its process ended)
                link.close()
            for line in lines:
                closed |= self._apply(json.loads(line))
        return closed

    @staticmethod
    def _read(link: socket.socket) -> tuple[bytes, bool]:
        """What ``link`` has now, and whether it is still open."""
        data = b""
        while True:
            try:
                chunk = link.recv(65536)
            except BlockingIOError:
                return data, True
            if not chunk:
                return data, False
            data += chunk

    def _apply(self, news: dict[str, Any]) -> bool:
        if news["reason"] is None:
            self.unready.pop(news["worker"], None)
            return False
        deadline = time.monotonic() + news["idle_s"]
        self.unready[news["worker"]] = (news["reason"], deadline, news["updating"])
        return True
