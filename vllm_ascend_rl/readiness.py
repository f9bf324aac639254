"""May a worker's model run? One :class:`ModelReadiness` per served model: the update session
(an open update, a failed ``hold`` update), the sleepable worker (a level-2 sleep) and a reload
from disk set it. vLLM's workers and vllm-ascend's ``NPUWorker`` (``worker.py:715-720`` at
182b75e) give the weight-transfer engine ``model_runner.get_model()``, the object the worker
reads it from too. Neither ``core`` nor ``weight_transfer`` imports the other: both meet here.

The plugin scheduler learns it from a :class:`StepGate`, at every step and every resume: each
worker announces its readiness when it changes, and the sleepable workers which of their memory
pools a sleep released, as a line on a Unix stream socket in Linux's abstract namespace that
the scheduler listens on (no file to clean up), sent before the call that changed it returns to
the engine core. The engine core runs those calls and the steps on one thread, so the step
after ``start_weight_update`` already sees the update open, with no per-step call to the
workers; graph replay cannot skip a check that runs before the step is scheduled."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterable
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
    """The model's weights: whole, or why not (``reason``), its speculative-decoding drafter's
    (``drafter``: why they are not whole, or None), and the worker's memory pools a sleep left
    released; announced to the step gate once a weight-transfer engine or the sleepable worker
    gave the address (:meth:`announce_to`)."""

    def __init__(self) -> None:
        self.state = Readiness.WHOLE
        self.reason: str | None = None
        self.drafter: str | None = None  # a hold update of the drafter failed part-way
        self.released: list[str] = []  # the sleep pools not resident now (tags)
        self._gate: tuple[str, int] | None = None  # the step gate's address, this worker
        self._link: socket.socket | None = None

    def set(self, state: Readiness, reason: str | None = None) -> None:
        """``reason`` for NOT_WHOLE; the others say it themselves."""
        self.state = state
        self.reason = None if state is Readiness.WHOLE else reason or state.value
        self._announce()

    def set_drafter(self, reason: str | None) -> None:
        """Why the drafter's weights are not whole (a step runs the drafter too), or None."""
        self.drafter = reason
        self._announce()

    @property
    def refusal(self) -> str | None:
        """Why the model must not run now (its weights or its drafter's are not whole)."""
        return self.reason if self.state is Readiness.NOT_WHOLE else self.drafter

    def set_released(self, tags: Iterable[str]) -> None:
        """The worker's sleep pools that are not resident now: a resume is refused while any
        is (a step would run on released memory)."""
        self.released = sorted(tags)
        self._announce()

    def announce_to(self, address: str, worker: int) -> None:
        """Announce every change from now on to the step gate at ``address`` (its
        :func:`gate_address`), as worker ``worker``."""
        self._gate = (address, worker)

    def step_hold(self, vllm_config: Any) -> StepHold:
        """What holds this worker's engine core's steps while an update is open: a gate is
        there if it takes a connection (at the address fixed by :meth:`announce_to`)."""
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1 and vllm_config.model_config.is_moe:
            return StepHold.LOCKSTEP
        return StepHold.GATE if self._linked() is not None else StepHold.NONE

    def _linked(self) -> socket.socket | None:
        """The stream connection to the gate, made now if it was not; None if there is none."""
        if self._link is None and self._gate is not None:
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            link.settimeout(30.0)
            try:
                link.connect(self._gate[0])
                self._link = link
            except OSError:
                link.close()
        return self._link

    def _announce(self) -> None:
        """One line of JSON on the stream connection to the gate, made at the first change (the
        scheduler is created after the workers); a gate that is not there gates nothing."""
        if self._gate is None:
            return
        news = {
            "worker": self._gate[1],
            "reason": self.reason or self.drafter,
            "updating": self.state is Readiness.UPDATING,
            "released": self.released,
        }
        for _attempt in range(2):  # a link the gate closed is made again once
            link = self._linked()
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


def gate_address(vllm_config: Any) -> str:
    """The step gate's socket of one engine core: its instance and data-parallel index (vLLM
    resets ``data_parallel_rank`` to 0 in every dense DP engine core, not the index). Read it
    while the engine core is being built (a worker's ``__init__`` or ``load_model``, the
    scheduler's ``__init__``): once built, the engine core re-runs ``VllmConfig.__post_init__``
    (``v1/engine/core.py:1311`` in 0.32.0, ``:1203`` in 0.30.0), which draws a new
    ``instance_id``."""
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
        self.unready: dict[int, tuple[str, bool]] = {}  # worker -> (reason, an open update?)
        self.released: dict[int, list[str]] = {}  # worker -> its sleep pools not resident

    def resume_refusal(self) -> str | None:
        """Why generation must not resume (as last read): some worker's model is not whole, or
        a sleep left some of its memory released. An open update does not refuse a resume: the
        gate holds the steps until it ends."""
        why = next((why for why, updating in self.unready.values() if not updating), None)
        released = sorted({tag for tags in self.released.values() for tag in tags})
        if why is None and released:
            why = (
                f"memory is not resident ({', '.join(released)} released), and a step would "
                "run on it; call /wake_up first"
            )
        return why

    def drain(self, wait_s: float = 0.0) -> bool:
        """Read every announcement waiting, first waiting up to ``wait_s`` for one while
        closed; whether some worker became unready."""
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
            data, alive = self.links.pop(link), True  # after the partial line kept before
            while alive:
                try:
                    chunk = link.recv(65536)
                except BlockingIOError:  # nothing more now
                    break
                data += chunk
                alive = bool(chunk)  # b"": the worker is gone (its process ended)
            *lines, rest = data.split(b"\n")
            if alive:
                self.links[link] = rest
            else:
                link.close()
            for news in map(json.loads, lines):
                worker = news["worker"]
                self.released[worker] = news["released"]
                if news["reason"] is None:
                    self.unready.pop(worker, None)
                else:
                    self.unready[worker] = (news["reason"], news["updating"])
                    closed = True
        return closed
