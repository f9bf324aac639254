"""Which trainer owns an engine worker's weight channel, and the channel itself, as a state
machine (docs/failure-semantics.md#one-trainer-owns-the-weight-channel). :data:`TRANSITIONS`::

    NONE --claim--> CONNECTING --connected--> UP --close--> GONE
                        |--fail / expire--> FAILED
                        '--close--> GONE
    NONE / FAILED / GONE --claim--> CONNECTING   (a claim closes the current link first)

An init from another trainer is refused while the owner is CONNECTING or UP (an UP owner is
first asked whether it is still there); the owner's own init replaces its connection. Each
init has one thread of its own: it runs the transport's ``connect(deadline)`` (the init waits
for it on NPU IPC, where the trainer counts the workers that said hello when its init call
returns; not on HCCL, where the engine keeps generating through the rendezvous), whose outcome
is one event, ``connected`` or ``fail``. An init still connecting past ``timeout_s`` fails
(``expire``) at the first look after it, however long torch's rendezvous retries. Once UP the
thread checks every ``WATCH_TICK_S`` whether the trainer left and, if so, closes the link: an
idle engine gets no call from vLLM, and only a poll notices a trainer that died between updates
and frees what the worker maps or holds for it (a TCPStore key for HCCL, the socket's end for
NPU IPC). The same tick lets the engine end an update left idle (``tick``), also after the
link closed. Every change happens under ``lock``, which the engine holds through each of vLLM's
calls; a thread whose init a newer one replaced changes nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import Enum
from typing import Generic, Protocol, TypeVar

from vllm_ascend_rl.device import Device
from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

WATCH_TICK_S = 0.5  # how often the connection's thread checks that its trainer is still there


class Link(Protocol):
    """A transport's live connection to the owner's trainer, as the connection sees it."""

    def opened(self) -> None:
        """This worker's side is UP (lock held): tell the trainer, if it waits for that."""

    def peer_gone(self) -> str | None:
        """Why the trainer is gone, or None; never waits (lock held)."""

    def close(self) -> None:
        """Release the link; safe to call on a broken one (lock held)."""


L = TypeVar("L", bound=Link)


class ConnState(Enum):
    NONE = "not initialized"
    CONNECTING = "connecting"
    UP = "connected"
    FAILED = "init failed"
    GONE = "disconnected"


class ConnEvent(Enum):
    CLAIM = "init_weight_transfer_engine"
    CONNECTED = "connected"
    FAIL = "connection failed"
    EXPIRE = "timeout_s passed"
    CLOSE = "close"


C, V = ConnState, ConnEvent
TRANSITIONS: dict[tuple[ConnState, ConnEvent], ConnState] = {
    (C.NONE, V.CLAIM): C.CONNECTING,  # a claim closes the old link first: never from UP
    (C.FAILED, V.CLAIM): C.CONNECTING,
    (C.GONE, V.CLAIM): C.CONNECTING,
    (C.CONNECTING, V.CONNECTED): C.UP,
    (C.CONNECTING, V.FAIL): C.FAILED,
    (C.CONNECTING, V.EXPIRE): C.FAILED,
    (C.CONNECTING, V.CLOSE): C.GONE,
    (C.UP, V.CLOSE): C.GONE,
    (C.NONE, V.CLOSE): C.NONE,
    (C.FAILED, V.CLOSE): C.FAILED,
    (C.GONE, V.CLOSE): C.GONE,
}

ANONYMOUS = "(anonymous)"  # the trainer of an init or update that names none (by hand)


class NotConnected(RuntimeError):
    """A call that needs the owner's connection, with none up."""

    cause = "not_connected"


class NotOwner(ValueError):
    """An update another trainer than the channel's owner sent."""

    cause = "not_owner"


class Connection(Generic[L]):
    """One engine worker's owner and link; ``state`` changes only through :meth:`_fire`."""

    def __init__(self, lock: threading.RLock, hw: Device, tick: Callable[[], bool]) -> None:
        """``tick`` runs on the connection's thread, lock held, every ``WATCH_TICK_S``; the
        thread keeps ticking after the link closes while it returns True."""
        self.lock, self.hw, self.tick = lock, hw, tick
        self.state = ConnState.NONE
        self.trainer, self.since, self.why = "", "", ""
        self.timeout_s = self.deadline = 0.0
        self._link: L | None = None  # set exactly while UP
        self._thread: threading.Thread | None = None  # the latest init's (see start)

    def _fire(self, event: ConnEvent, why: str = "") -> None:
        after = TRANSITIONS.get((self.state, event))
        if after is None:
            raise RuntimeError(f"connection: {event.value} while {self.state.value}")
        if after is not self.state or event is ConnEvent.CLAIM:
            self.why = why
        self.state = after

    def describe(self) -> str:
        text = f"trainer {self.trainer} (init at {self.since}, {self.state.value}"
        return text + (f": {self.why})" if self.why else ")")

    # -- events (lock held) ------------------------------------------------------------
    def claim(self, trainer: str, timeout_s: float) -> None:
        """At init: refuse (ValueError, nothing changed) if another trainer owns the channel;
        else close the current link and make ``trainer`` the owner, CONNECTING."""
        self._check_deadline_and_peer()
        trainer = trainer or ANONYMOUS
        live = self.state in (ConnState.CONNECTING, ConnState.UP)
        if live and self.trainer != trainer:
            raise ValueError(
                f"refused init_weight_transfer_engine: the weight channel belongs to "
                f"{self.describe()}. It is released when that trainer shuts its engine down or "
                "exits (the engine notices at once); until then only it may re-init"
            )
        self.close("replaced by a new init_weight_transfer_engine")
        self._fire(ConnEvent.CLAIM)
        self.trainer, self.since = trainer, time.strftime("%H:%M:%S")
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s

    def close(self, why: str) -> None:
        """Close the link, if any (any thread); the owner is GONE."""
        link, self._link = self._link, None
        self._fire(ConnEvent.CLOSE, why)
        if link is not None:
            link.close()

    def link(self, owner: str | None = None) -> L:
        """The owner's link, for a call that needs it; NotConnected, at once, saying why not.
        Given the trainer an update comes from, NotOwner unless it is the channel's owner."""
        self._check_deadline_and_peer()
        if self._link is not None:
            sender = None if owner is None else owner or ANONYMOUS
            if sender is not None and sender != self.trainer:
                raise NotOwner(
                    f"this update comes from trainer {sender}, but the weight channel "
                    f"belongs to {self.describe()}: only the trainer that made the channel may "
                    "update through it"
                )
            return self._link
        if self.state is ConnState.NONE:
            raise NotConnected(
                "the weight transfer engine is not initialized: call init_weight_transfer_engine "
                "first"
            )
        if self.state is ConnState.CONNECTING:
            left = max(0.0, self.deadline - time.monotonic())
            raise NotConnected(
                f"the weight channel is still connecting to {self.describe()}, {left:.0f}s of "
                "its timeout_s left: the trainer has not finished its side of the init"
            )
        raise NotConnected(
            f"no weight channel: {self.describe()}. Call init_weight_transfer_engine again"
        )

    def _check_deadline_and_peer(self) -> None:
        """What time and the trainer say now: an init past its deadline failed, and a
        trainer that left is released."""
        if self.state is ConnState.CONNECTING and time.monotonic() >= self.deadline:
            self._fire(ConnEvent.EXPIRE, f"no connection within timeout_s={self.timeout_s:g}s")
            logger.error("weight transfer init failed: %s", self.describe())
        why = self._link.peer_gone() if self._link is not None else None
        if why:
            logger.warning("weight transfer: the trainer left (%s); releasing its connection", why)
            self.close(f"the trainer left: {why}")

    # -- connecting and watching -------------------------------------------------------
    def start(self, connect: Callable[[float], L], background: bool) -> None:
        """Run ``connect(deadline)`` for the init just claimed on a thread of its own, which
        then watches the trainer until it leaves; unless ``background``, wait here until the
        connect has settled, raising its error."""
        settled: Future[None] = Future()
        run = (connect, settled)
        self._thread = threading.Thread(target=self._run, args=run, name="weight-connection")
        self._thread.daemon = True
        self._thread.start()
        if not background:
            settled.result()  # raises the connect's error; the connect is bounded by the deadline

    def _run(self, connect: Callable[[float], L], settled: Future[None]) -> None:
        try:
            self._settle(connect)
        except BaseException as e:
            settled.set_exception(e)
            return
        settled.set_result(None)
        while True:
            time.sleep(WATCH_TICK_S)
            with self.lock:
                if self._thread is not threading.current_thread():
                    return
                watching = self.tick()
                if self.state is C.UP:
                    self._check_deadline_and_peer()
                elif not watching:
                    return

    def _settle(self, connect: Callable[[float], L]) -> None:
        """Connect, then fire the outcome, unless the init expired or a newer one replaced it
        meanwhile (then the new link is closed unused)."""
        try:
            self.hw.bind_thread()
            link = connect(self.deadline)
        except Exception as e:
            with self.lock:
                self._check_deadline_and_peer()  # past the deadline the init failed by expiring
                if self._thread is threading.current_thread() and self.state is C.CONNECTING:
                    self._fire(ConnEvent.FAIL, f"{type(e).__name__}: {e}")
                    logger.error("weight transfer init failed: %s", self.describe())
            raise
        with self.lock:
            self._check_deadline_and_peer()
            if self._thread is not threading.current_thread() or self.state is not C.CONNECTING:
                link.close()
                raise NotConnected(f"this init is over: {self.describe()}")
            self._link = link
            self._fire(ConnEvent.CONNECTED)
            try:
                link.opened()
            except Exception as e:
                self.close(f"telling the trainer failed: {type(e).__name__}: {e}")
                raise
