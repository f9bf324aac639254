"""The broadcast channel on real gloo groups: agreement, timeouts, and the broken state.

Both ranks run as threads of this process, each with its own group over a local TCP store.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from npu_standin.device import CpuDevice

from tests.support import free_port
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer import channel
from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel, ChannelError
from vllm_ascend_rl.weight_transfer.wire import Verdict, signature


def run_ranks(world: int, body, timeout_s: float = 5.0) -> list:
    """Open a channel per rank in threads, run ``body(channel)`` on each; return results.

    The ranks share an emulated chip of their own, not the process's (``get_device``): a
    collective a test abandons stays queued on its chip until its exec deadline, as on an NPU,
    and would hold a later test's device syncs."""
    port = free_port()
    results: list = [None] * world
    chip = CpuDevice(0)

    def rank_main(rank: int) -> None:
        try:
            ch = BroadcastChannel.open(chip, "127.0.0.1", port, rank, world, timeout_s)
            try:
                results[rank] = body(ch)
            finally:
                ch.close()
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_broadcast_reaches_every_rank():
    def body(ch):
        t = (
            torch.arange(10, dtype=torch.int64)
            if ch.rank == 0
            else torch.zeros(10, dtype=torch.int64)
        )
        ch.wait(ch.broadcast(t), "payload")
        return t.tolist()

    assert run_ranks(3, body) == [list(range(10))] * 3


GO, NO = Verdict.GO, Verdict.REFUSED


@pytest.mark.parametrize(
    "codes, sigs, expect",
    [
        ([GO, GO], [7, 7], (GO, True)),
        ([GO, NO], [7, 7], (NO, True)),  # a refusal reaches both sides
        ([NO, GO], [7, 9], (NO, False)),  # from either side
        ([GO, GO], [7, 9], (GO, False)),  # disagreeing plans or wire parameters are detected
    ],
)
def test_agree_combines_verdicts_and_signatures(codes, sigs, expect):
    results = run_ranks(2, lambda ch: ch.agree(codes[ch.rank], sigs[ch.rank], "test"))
    assert results == [expect, expect]


def test_a_missing_peer_times_out_and_breaks_the_channel():
    def body(ch):
        if ch.rank == 1:
            time.sleep(4)  # alive, but never joins the collective
            return "absent"
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no progress within timeout_s=2s"):
            ch.agree(GO, 1, "lonely handshake")
        elapsed = time.monotonic() - t0
        with pytest.raises(ChannelError, match="broken"):
            ch.broadcast(torch.zeros(1))
        return elapsed

    elapsed, absent = run_ranks(2, body, timeout_s=2)
    assert absent == "absent"
    assert 1.5 < elapsed < 10


def test_poll_abandons_a_wait():
    done = threading.Event()

    def body(ch):
        if ch.rank == 1:  # alive, never joins: only the poll can end rank 0's wait
            done.wait(30)
            return None

        def poll():
            raise RuntimeError("the HTTP side failed")

        with pytest.raises(ChannelError, match="the HTTP side failed"):
            ch.agree(GO, 1, "handshake", poll)
        done.set()
        return "abandoned"

    assert run_ranks(2, body, timeout_s=30)[0] == "abandoned"


def test_unreachable_master_fails_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=r"rendezvous .* failed within 1s"):
        BroadcastChannel.open(get_device("cpu"), "127.0.0.1", free_port(), 1, 2, 1)
    assert time.monotonic() - t0 < 30


def test_signature_is_stable_and_fits_an_int32_negation():
    assert signature(1, True, 256) == signature(1, True, 256)
    assert signature(1, True, 256) != signature(1, False, 256)
    assert 0 <= signature("x" * 1000) < 2**30


def test_a_collective_that_trails_the_peers_http_answer_still_completes(monkeypatch):
    """The poll fails (the engine answered the update call) before the engine's part of the
    handshake arrives: the handshake still completes in step, nothing breaks. The engine
    contributes only once the poll has failed; the grace is long enough for a loaded host."""
    monkeypatch.setattr(channel, "POLL_GRACE_S", 30.0)
    answered = threading.Event()

    def body(ch):
        if ch.rank == 1:
            assert answered.wait(10)
            time.sleep(0.3)  # the engine contributes late
            return ch.agree(Verdict.REFUSED, 5, "update handshake"), ch.broken

        def poll() -> None:
            answered.set()
            raise RuntimeError("update_weights failed: refused")

        return ch.agree(Verdict.GO, 5, "update handshake", poll), ch.broken

    trainer, engine = run_ranks(2, body)
    assert trainer == ((Verdict.REFUSED, True), None) and engine == ((Verdict.REFUSED, True), None)


def test_a_device_sync_waits_behind_a_queued_collective_until_it_completes():
    """Stand-in for the NPU (N3): a device-wide synchronize waits for a collective still
    queued on the device, here a broadcast the trainer has not joined yet."""
    joined = threading.Event()
    synced: list[bool] = []

    def body(ch):
        t = torch.zeros(4, dtype=torch.int64)
        if ch.rank == 1:
            ch.device = CpuDevice(1)  # a chip of its own
            work = ch.broadcast(t)
            sync = threading.Thread(target=ch.device.synchronize)
            sync.start()
            sync.join(1.0)
            synced.append(not sync.is_alive())  # still waiting: the broadcast is queued
            joined.set()
            sync.join(10)
            synced.append(not sync.is_alive())
            ch.wait(work, "payload")
            return t.tolist()
        joined.wait(10)
        t.fill_(3)
        ch.wait(ch.broadcast(t), "payload")
        return None

    _, received = run_ranks(2, body)
    assert synced == [False, True] and received == [3] * 4


def test_a_handshake_nobody_joins_holds_device_syncs_only_until_the_exec_timeout():
    """[N9] A handshake no trainer joins (an update_weights nobody sent) times out and the
    connection is closed, but the all-reduce stays queued on the device: the communicator's
    exec timeout (timeout_s, rounded up) bounds how long device-wide syncs wait behind it."""
    done = threading.Event()

    def body(ch):
        if ch.rank == 1:
            ch.device = CpuDevice(1)
            try:
                t0 = time.monotonic()
                with pytest.raises(ChannelError, match="no progress"):
                    ch.agree(Verdict.REFUSED, 5, "update handshake")
                ch.close()
                ch.device.synchronize()
                return time.monotonic() - t0, ch.broken
            finally:
                done.set()
        done.wait(20)  # the trainer stays up but never joins
        return None

    _, (waited, broken) = run_ranks(2, body, timeout_s=2.0)
    assert broken and waited < 2 * 2.0 + 1.0
