"""The broadcast channel on real gloo groups: agreement, timeouts, and the broken state.

Both ranks run as threads of this process, each with its own group over a local TCP store.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support import free_port
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel, ChannelError, signature


def run_ranks(world: int, body, timeout_s: float = 5.0) -> list:
    """Open a channel per rank in threads, run ``body(channel)`` on each; return results."""
    port = free_port()
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        try:
            ch = BroadcastChannel.open(get_device("cpu"), "127.0.0.1", port, rank, world, timeout_s)
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


@pytest.mark.parametrize(
    "oks, sigs, expect",
    [
        ([True, True], [7, 7], (True, True)),
        ([True, False], [7, 7], (False, True)),  # a refusal reaches both sides
        ([True, True], [7, 9], (True, False)),  # disagreeing wire parameters are detected
    ],
)
def test_agree_combines_ok_and_signature(oks, sigs, expect):
    results = run_ranks(2, lambda ch: ch.agree(oks[ch.rank], sigs[ch.rank], "test"))
    assert results == [expect, expect]


def test_a_missing_peer_times_out_and_breaks_the_channel():
    def body(ch):
        if ch.rank == 1:
            time.sleep(4)  # alive, but never joins the collective
            return "absent"
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="no progress within timeout_s=2s"):
            ch.agree(True, 1, "lonely handshake")
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
            ch.agree(True, 1, "handshake", poll)
        done.set()
        return "abandoned"

    assert run_ranks(2, body, timeout_s=30)[0] == "abandoned"


def test_rank_outside_world_and_unreachable_master():
    with pytest.raises(ValueError, match="outside world_size"):
        BroadcastChannel.open(get_device("cpu"), "127.0.0.1", free_port(), 2, 2, 1)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=r"rendezvous .* failed within 1s"):
        BroadcastChannel.open(get_device("cpu"), "127.0.0.1", free_port(), 1, 2, 1)
    assert time.monotonic() - t0 < 30


def test_signature_is_stable_and_fits_an_int32_negation():
    assert signature(1, True, 256) == signature(1, True, 256)
    assert signature(1, True, 256) != signature(1, False, 256)
    assert 0 <= signature("x" * 1000) < 2**30


@pytest.mark.parametrize("trainer_sig, same", [(7, False), (5, True)], ids=["other", "own"])
def test_a_refusal_nobody_joins_is_deferred_not_broken(trainer_sig, same):
    """The engine (rank 1) refuses with signature 5 and nobody joins within the grace: it
    returns at once and its contribution stays pending. The trainer's next handshake meets
    it: both learn "not ok", and the engine learns whether the trainer sent the refused
    update's own metadata; the channel stays usable."""
    joined = threading.Event()

    def body(ch):
        if ch.rank == 1:
            t0 = time.monotonic()
            ch.refuse(5, "update handshake", grace_s=0.2)
            waited = time.monotonic() - t0
            pending = ch.deferred is not None
            joined.set()
            met = ch.settle_deferred("a refused update's handshake")
            after = ch.agree(True, 9, "next")
            return waited, pending, met, after, ch.broken
        joined.wait(10)
        verdict = ch.agree(True, trainer_sig, "update handshake")
        return verdict, ch.agree(True, 9, "next")

    trainer, engine = run_ranks(2, body)
    waited, pending, met, after, broken = engine
    assert waited < 1.0 and pending and met is same
    assert trainer == ((False, same), (True, True)) and after == (True, True) and broken is None


def test_where_a_collective_cannot_stay_pending_an_unjoined_refusal_breaks_the_channel():
    """On NPU an HCCL collective is a device task that would block device-wide syncs while
    pending; there the refusal marks the channel broken instead (the engine then closes it).
    Stand-in: the CPU device with NPU's flag."""
    from vllm_ascend_rl.device.cpu import CpuDevice

    class NpuLikeCpu(CpuDevice):
        collective_may_stay_pending = False

    done = threading.Event()

    def body(ch):
        if ch.rank == 1:
            ch.device = NpuLikeCpu()
            t0 = time.monotonic()
            try:
                ch.refuse(5, "update handshake", grace_s=0.2)
                return time.monotonic() - t0, ch.deferred, ch.broken
            finally:
                done.set()
        done.wait(10)  # the trainer stays up but never joins
        return None

    _, (waited, deferred, broken) = run_ranks(2, body)
    assert waited < 1.0 and deferred is None
    assert broken and "a collective may not stay pending" in broken


def test_a_collective_that_trails_the_peers_http_answer_still_completes():
    """The poll fails (the engine answered the update call) a moment before the engine's part
    of the handshake arrives: the handshake still completes in step, nothing breaks."""

    def body(ch):
        if ch.rank == 1:
            time.sleep(0.3)  # the engine contributes late
            return ch.agree(False, 5, "update handshake"), ch.broken

        def answered() -> None:
            raise RuntimeError("update_weights failed: refused")

        return ch.agree(True, 5, "update handshake", answered), ch.broken

    trainer, engine = run_ranks(2, body)
    assert trainer == ((False, True), None) and engine == ((False, True), None)


def test_a_device_sync_waits_behind_a_queued_collective_until_it_completes():
    """Stand-in for the NPU (N3): a device-wide synchronize waits for a collective still
    queued on the device, here a broadcast the trainer has not joined yet."""
    from vllm_ascend_rl.device.cpu import CpuDevice

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


def test_an_unjoined_refusal_holds_device_syncs_only_until_the_exec_timeout():
    """[N9] On NPU an unjoined refusal breaks the channel and the connection is closed, but
    the all-reduce stays queued on the device: the communicator's exec timeout (timeout_s,
    rounded up) bounds how long device-wide syncs wait behind it, not HCCL_EXEC_TIMEOUT."""
    from vllm_ascend_rl.device.cpu import CpuDevice

    class NpuLikeCpu(CpuDevice):
        collective_may_stay_pending = False

    done = threading.Event()

    def body(ch):
        if ch.rank == 1:
            ch.device = NpuLikeCpu(1)
            try:
                t0 = time.monotonic()
                ch.refuse(5, "update handshake", grace_s=0.2)
                ch.close()
                ch.device.synchronize()
                return time.monotonic() - t0, ch.broken
            finally:
                done.set()
        done.wait(20)  # the trainer stays up but never joins
        return None

    _, (waited, broken) = run_ranks(2, body, timeout_s=2.0)
    assert broken and waited < 2.0 + 1.0
