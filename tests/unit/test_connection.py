"""Who owns an engine worker's weight channel: the connection's state machine, its table pair
by pair, then each way in and out through the calls the engine makes (claim, start, link,
close) with a recording link (a STAND-IN for a transport, not for hardware: the transports
run against real peers in test_wire.py, test_oversized_tensors.py and the e2e suites)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer import connection as connection_module
from vllm_ascend_rl.weight_transfer.connection import (
    TRANSITIONS,
    Connection,
    ConnEvent,
    ConnState,
    NotConnected,
    NotOwner,
)


class RecordingLink:  # STAND-IN for a transport's link (see the module docstring)
    def __init__(self) -> None:
        self.gone: str | None = None
        self.calls: list[str] = []

    def opened(self) -> None:
        self.calls.append("opened")

    def peer_gone(self) -> str | None:
        return self.gone

    def close(self) -> None:
        self.calls.append("close")


def connection(tick: Callable[[], bool] = lambda: False) -> Connection[RecordingLink]:
    return Connection(threading.RLock(), get_device("cpu"), tick)


def up(conn: Connection[RecordingLink], trainer: str = "t1") -> RecordingLink:
    link = RecordingLink()
    conn.claim(trainer, 30.0)
    conn.start(lambda deadline: link, background=False)
    return link


@pytest.mark.parametrize("state", list(ConnState))
@pytest.mark.parametrize("event", list(ConnEvent))
def test_every_state_event_pair_moves_as_the_table_says(state, event):
    conn = connection()
    conn.state = state  # placed directly: the table itself is under test here
    after = TRANSITIONS.get((state, event))
    if after is None:
        with pytest.raises(RuntimeError, match=f"{event.value} while {state.value}"):
            conn._fire(event)
        assert conn.state is state
    else:
        conn._fire(event, "why")
        assert conn.state is after


def test_an_init_connects_inline_and_the_link_is_the_owners():
    conn = connection()
    with pytest.raises(NotConnected, match="not initialized"):
        conn.link()
    link = up(conn)
    assert conn.state is ConnState.UP and conn.link() is link and link.calls == ["opened"]
    assert conn.link(owner="t1") is link
    with pytest.raises(NotOwner, match="belongs to trainer t1"):
        conn.link(owner="t2")


def test_another_trainer_is_refused_while_the_owner_connects_or_is_up():
    conn = connection()
    conn.claim("t1", 30.0)
    with pytest.raises(ValueError, match=r"belongs to trainer t1 \(init at .*, connecting\)"):
        conn.claim("t2", 30.0)
    conn.close("test")
    link = up(conn)
    with pytest.raises(ValueError, match="connected"):
        conn.claim("t2", 30.0)
    assert conn.state is ConnState.UP and link.calls == ["opened"]  # untouched
    up(conn, "t1")  # the owner's own init replaces its link
    assert link.calls == ["opened", "close"]


def test_a_trainer_that_left_frees_the_channel_for_another():
    conn = connection()
    link = up(conn)
    link.gone = "it closed the channel"
    conn.claim("t2", 30.0)  # the owner is asked first, and found gone
    assert conn.state is ConnState.CONNECTING and conn.trainer == "t2"
    assert link.calls == ["opened", "close"]


def test_a_failed_connect_is_failed_and_says_why():
    conn = connection()
    conn.claim("t1", 30.0)

    def refuse(deadline: float) -> RecordingLink:
        raise ConnectionError("nobody listens")

    with pytest.raises(ConnectionError):
        conn.start(refuse, background=False)
    assert conn.state is ConnState.FAILED
    with pytest.raises(NotConnected, match="init failed: ConnectionError: nobody listens"):
        conn.link()
    up(conn, "t2")  # a failed init frees the channel


def test_a_connect_that_returns_after_the_deadline_expires_and_closes_its_link():
    conn = connection()
    conn.claim("t1", 0.05)
    link = RecordingLink()

    def late(deadline: float) -> RecordingLink:
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
        return link

    with pytest.raises(NotConnected):
        conn.start(late, background=False)
    assert conn.state is ConnState.FAILED and "within timeout_s=0.05s" in conn.why
    assert link.calls == ["close"]


def test_an_init_fails_at_its_deadline_while_the_connect_still_runs():
    """torch's rendezvous may retry past its deadline: a call after the deadline finds the
    init failed, not still connecting until the connect gives up."""
    conn = connection()
    release, link = threading.Event(), RecordingLink()
    conn.claim("t1", 0.2)
    conn.start(lambda deadline: release.wait(30) and link, True)
    time.sleep(0.3)
    with pytest.raises(NotConnected, match=r"init failed: no connection within timeout_s=0.2s"):
        conn.link()
    assert conn.state is ConnState.FAILED
    assert link.calls == []  # the connect has not returned yet
    release.set()
    deadline = time.monotonic() + 10
    while link.calls != ["close"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.calls == ["close"] and conn.state is ConnState.FAILED


def test_a_connect_a_newer_init_replaced_closes_its_link_unused():
    conn = connection()
    release, link = threading.Event(), RecordingLink()

    def slow(deadline: float) -> RecordingLink:
        release.wait(10)
        return link

    conn.claim("t1", 30.0)
    conn.start(slow, background=True)
    newer = up(conn)  # the same trainer inits again while the first connect runs
    release.set()
    deadline = time.monotonic() + 10
    while link.calls != ["close"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.calls == ["close"] and conn.link() is newer


def test_the_connections_thread_closes_the_link_of_a_trainer_that_left(monkeypatch):
    monkeypatch.setattr(connection_module, "WATCH_TICK_S", 0.01)
    conn = connection()
    link = up(conn)
    link.gone = "its process exited"
    deadline = time.monotonic() + 10
    while conn.state is ConnState.UP and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn.state is ConnState.GONE and link.calls == ["opened", "close"]
    with pytest.raises(NotConnected, match="the trainer left: its process exited"):
        conn.link()


def test_the_thread_ticks_on_after_the_trainer_left_while_the_tick_says_so(monkeypatch):
    """The engine's tick ends an update left idle: it must run after the trainer died too (no
    call will come), and the thread ends once the tick has nothing left to watch."""
    monkeypatch.setattr(connection_module, "WATCH_TICK_S", 0.01)
    ticks: list[ConnState] = []
    open_update = threading.Event()
    open_update.set()

    def tick() -> bool:
        ticks.append(conn.state)
        return open_update.is_set()

    conn = connection(tick)
    link = up(conn)
    deadline = time.monotonic() + 10
    while not ticks and time.monotonic() < deadline:
        time.sleep(0.01)
    link.gone = "its process exited"
    while ConnState.GONE not in ticks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ticks[0] is ConnState.UP and ticks[-1] is ConnState.GONE
    open_update.clear()  # the tick ended the update
    thread = conn._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
