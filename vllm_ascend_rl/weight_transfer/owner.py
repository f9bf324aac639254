"""Which trainer owns an engine worker's weight channel (docs/failure-semantics.md#one-trainer-
owns-the-weight-channel), as a state machine::

    (none) --init--> CONNECTING --connected--> UP --trainer left / channel broke--> GONE
                         '--error or timeout_s--> FAILED

An init from another trainer is refused while the owner is CONNECTING or UP (an UP owner is
first asked whether it is still there); the owner's own init replaces its connection. Each owner
has one thread, off the engine's: it makes the connection within ``timeout_s`` of the init (the
engine generates meanwhile), then checks every ``WATCH_TICK_S`` whether the trainer left, and if
so releases what the worker holds for it. Every change happens under the engine's lock, which the
worker thread holds through each of vLLM's calls.

An engine provides ``lock`` (an RLock), ``owner``, ``hw``, ``install(conn)``,
``peer_gone()`` (why the trainer is gone, or None, never waiting) and ``disconnect(why)``."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

WATCH_TICK_S = 0.5  # how often an owner's thread checks that its trainer is still there


class OwnerState(Enum):
    CONNECTING = "connecting"
    UP = "connected"
    FAILED = "init failed"
    GONE = "disconnected"


ANONYMOUS = "(anonymous)"  # the trainer of an init or update that names none (by hand)
_identity: tuple[int, str] = (0, "")


def _named(trainer: str) -> str:
    return trainer or ANONYMOUS


def trainer_id() -> str:
    """This process's identity as a trainer (host, pid, random), new in a forked child."""
    global _identity
    if _identity[0] != os.getpid():
        pid = os.getpid()
        _identity = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
    return _identity[1]


class Owner:
    """One trainer's claim on the channel (the engine holds the connection)."""

    def __init__(self, trainer: str, timeout_s: float) -> None:
        self.trainer = _named(trainer)
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.since = time.strftime("%H:%M:%S")
        self.state = OwnerState.CONNECTING
        self.why: str | None = None

    def live(self) -> bool:
        if self.state is OwnerState.CONNECTING and time.monotonic() > self.deadline:
            self.end(OwnerState.FAILED, f"no connection within timeout_s={self.timeout_s:g}s")
        return self.state in (OwnerState.CONNECTING, OwnerState.UP)

    def end(self, state: OwnerState, why: str) -> None:
        if self.state in (OwnerState.CONNECTING, OwnerState.UP):
            self.state, self.why = state, why

    def describe(self) -> str:
        text = f"trainer {self.trainer} (init at {self.since}, {self.state.value}"
        return text + (f": {self.why})" if self.why else ")")


def claim(engine: Any, info: Any) -> Owner:
    """At init, on the worker thread (lock held): refuse (ValueError, nothing changed) if
    another trainer owns the channel; else end the current connection, make ``info``'s trainer
    the owner (CONNECTING) and give the session the init's parameters."""
    current: Owner | None = engine.owner
    if current is not None and current.state is OwnerState.UP:
        _check_peer(engine)
    if current is not None and current.live() and current.trainer != _named(info.trainer_id):
        raise ValueError(
            f"refused init_weight_transfer_engine: the weight channel belongs to "
            f"{current.describe()}. It is released when that trainer shuts its engine down or "
            "exits (the engine notices at once); until then only it may re-init"
        )
    engine.disconnect("replaced by a new init_weight_transfer_engine")
    engine.owner = Owner(info.trainer_id, info.timeout_s)
    engine.session.reconnect(
        info.on_failure, info.packed_num_buffers, info.packed_buffer_size_bytes
    )
    engine.init_info = info
    return engine.owner


def serve(engine: Any, owner: Owner, connect: Callable[[float], Any] | None = None) -> None:
    """Start ``owner``'s thread: ``connect(deadline)`` (raises on failure) and install the
    connection, unless ``connect`` is None (the caller installed it); then watch the trainer
    until it leaves or the engine lets go of it."""

    def run() -> None:
        engine.hw.bind_thread()
        if connect is not None:
            try:
                conn = connect(owner.deadline)
                with engine.lock:
                    if engine.owner is not owner or not owner.live():
                        conn.close()  # too late, or replaced meanwhile
                        return
                    engine.install(conn)
                    owner.state = OwnerState.UP
            except Exception as e:
                with engine.lock:
                    owner.end(OwnerState.FAILED, f"{type(e).__name__}: {e}")
                    if engine.owner is owner:
                        engine.disconnect(owner.why)  # if installing failed
                logger.error("weight transfer init failed: %s", owner.describe())
                return
        while True:
            time.sleep(WATCH_TICK_S)
            with engine.lock:
                if engine.owner is not owner or owner.state is not OwnerState.UP:
                    return
                _check_peer(engine)

    threading.Thread(target=run, daemon=True, name="weight-transfer-owner").start()


def _check_peer(engine: Any) -> None:
    """Release the UP owner's connection if its trainer is gone (lock held)."""
    why = engine.peer_gone()
    if why:
        logger.warning("weight transfer: the trainer left (%s); releasing its connection", why)
        engine.disconnect(f"the trainer left: {why}")


class NotConnected(RuntimeError):
    """A call that needs the owner's connection, with none up."""

    cause = "not_connected"


class NotOwner(ValueError):
    """An update another trainer than the channel's owner sent."""

    cause = "not_owner"


def require_up(engine: Any) -> None:
    """For a call that needs the owner's connection (worker thread, lock held): raises, at
    once, why there is none."""
    owner: Owner | None = engine.owner
    if owner is None:
        raise NotConnected(
            f"{type(engine).__name__} is not initialized: call init_weight_transfer_engine first"
        )
    if owner.state is OwnerState.UP:
        _check_peer(engine)
    if owner.live() and owner.state is OwnerState.UP:
        return
    if owner.state is OwnerState.CONNECTING:
        left = owner.deadline - time.monotonic()
        raise NotConnected(
            f"the weight channel is still connecting to {owner.describe()}, {left:.0f}s of "
            "its timeout_s left: the trainer has not finished its side of the init"
        )
    raise NotConnected(
        f"no weight channel: {owner.describe()}. Call init_weight_transfer_engine again"
    )


def require_owner(engine: Any, trainer: str) -> None:
    """Refuse, at once, an update that the channel's owner did not send."""
    owner: Owner = engine.owner
    if _named(trainer) != owner.trainer:
        raise NotOwner(
            f"this update comes from trainer {_named(trainer)}, but the weight channel "
            f"belongs to {owner.describe()}: only the trainer that made the channel may "
            "update through it"
        )
