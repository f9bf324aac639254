"""The trainer-to-engine broadcast group, with deadlines and an agreement step.

A refusal must reach both sides: if one side raised before a collective, the other would wait
in it until the backend's timeout. So before any payload, every rank contributes to one
all-reduce (MIN) of ``[ok, signature, -signature]``: all ranks learn whether everyone is ready
and whether everyone computed the same signature of what is about to be sent. After any failed
or timed-out collective the group is unusable (the byte stream is out of step) and is marked
broken; the caller must open a new one.

A refusal is the exception to "wait for everyone": an engine that refuses an update on its own
(the metadata does not fit its model) gives a trainer a short grace to join, then returns the
refusal and leaves its contribution pending (``deferred``). A hand-written ``update_weights``
with no trainer behind it is thus refused at once; the next trainer update meets the pending
contribution, learns it was refused, and retries (see ``STALE_HANDSHAKE``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp

from vllm_ascend_rl.device import Device
from vllm_ascend_rl.device.group import exec_timeout_s, open_group
from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

Poll = Callable[[], None]  # raises to abandon a wait (e.g. the HTTP side failed)

REFUSAL_GRACE_S = 2.0  # a trainer posts its handshake as it sends update_weights: long enough
# The engine's answer to the trainer update that met an earlier refusal's pending handshake;
# the trainer retries that update once.
STALE_HANDSHAKE = (
    "this update's handshake met the pending refusal of an earlier update_weights that no "
    "trainer joined (a hand-written call?); nothing was sent, retry the update"
)


POLL_GRACE_S = 2.0  # how long a collective may trail the peer's HTTP answer


def _completes_within(work, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _verdict(t: torch.Tensor) -> tuple[bool, bool]:
    """A completed handshake: (everyone ok, everyone sent the same signature)."""
    all_ok, lo, neg_hi = (int(v) for v in t.cpu())
    return bool(all_ok), lo == -neg_hi


def _await(work, deadline: float, timeout_s: float, poll: Poll | None) -> Exception | None:
    """Wait until ``work`` completes or ``deadline``; ``poll`` runs while waiting. Returns the
    poll's error if the work completed only after the poll failed."""
    pause = 0.0
    while not work.is_completed():
        if poll is not None:
            try:
                poll()
            except Exception as e:
                # The peer's answer over HTTP can overtake its part of this collective (it
                # completes its side, then fails the call): a refusal must still end the
                # handshake in step, so give the collective a moment.
                if not _completes_within(work, POLL_GRACE_S):
                    raise
                return e
        if time.monotonic() > deadline:
            raise TimeoutError(f"no progress within timeout_s={timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(0.002, pause + 0.0001)
    return None


class ChannelError(RuntimeError):
    """A collective failed or timed out; the channel must be re-initialized."""


def signature(*parts: object) -> int:
    """A 30-bit digest of ``parts``, small enough to negate inside an int32 all-reduce."""
    return zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF


class BroadcastChannel:
    """A process group whose rank 0 (the trainer) broadcasts to every engine worker."""

    def __init__(self, pg, device: Device, rank: int, world_size: int, timeout_s: float):
        self.pg, self.device = pg, device
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.broken: str | None = None
        self._started: dict[int, float] = {}  # id(work) -> when the collective was issued
        self.deferred: tuple[object, torch.Tensor] | None = None  # a refusal nobody met yet

    @classmethod
    def open(
        cls, device: Device, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> BroadcastChannel:
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is outside world_size {world_size}: the world is "
                "the trainer plus every engine worker"
            )
        try:
            pg = open_group(device, host, port, rank, world_size, timeout_s)
        except Exception as e:
            raise ChannelError(
                f"rendezvous at {host}:{port} as rank {rank} of {world_size} failed within "
                f"{timeout_s:.0f}s ({type(e).__name__}: {e}). Check master_address/"
                "master_port and that world_size counts the trainer plus every engine "
                "worker."
            ) from e
        return cls(pg, device, rank, world_size, timeout_s)

    # -- collectives -----------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor):
        """Start broadcasting ``tensor`` from rank 0; returns the pending work."""
        self._check()
        opts = BroadcastOptions()
        opts.rootRank = 0
        return self._issued(self.pg.broadcast([tensor], opts))

    def _issued(self, work):
        self._started[id(work)] = time.monotonic()
        self.device.collective_issued(work, exec_timeout_s(self.timeout_s))
        return work

    def wait(self, work, what: str, poll: Poll | None = None) -> None:
        """Wait for ``work`` within ``timeout_s``, calling ``poll`` while waiting."""
        now = time.monotonic()
        deadline = now + self.timeout_s
        started = self._started.pop(id(work), now)
        try:
            polled = _await(work, deadline, self.timeout_s, poll)
            try:
                work.wait()
                # With our group's watchdog off (NPU), an HCCL error need not raise in wait();
                # the work records it, communicator errors included (ProcessGroupHCCL.cpp:
                # 807-841).
                failure = work.exception()
            except Exception:
                if polled is not None:  # the peer's own answer says more than the collective
                    raise polled from None
                raise
            if failure is not None:
                raise polled or RuntimeError(f"the collective failed: {failure}")
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
            # The backend runs its own timer of timeout_s from when the collective was issued
            # (gloo words it "Timed out ..." or "Application timeout caused pair closure"): a
            # failure that late is a timeout, whatever its wording.
            late = time.monotonic() - started >= 0.8 * self.timeout_s
            if late and "no progress" not in detail:
                detail = f"no progress within timeout_s={self.timeout_s:.0f}s ({detail})"
            self.broken = f"{what} failed: {detail}"
            raise ChannelError(self.broken) from e

    def agree(self, ok: bool, sig: int, what: str, poll: Poll | None = None) -> tuple[bool, bool]:
        """All-reduce ``ok`` and ``sig``: (everyone ok, everyone has the same signature)."""
        self._check()
        work, t = self._issue_handshake(ok, sig)
        self.wait(work, what, poll)
        return _verdict(t)

    def _issue_handshake(self, ok: bool, sig: int) -> tuple[object, torch.Tensor]:
        """Start the all-reduce (MIN) of ``[ok, sig, -sig]``; (pending work, its tensor)."""
        t = torch.tensor([int(ok), sig, -sig], dtype=torch.int32, device=self.device.torch_device())
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        return self._issued(self.pg.allreduce([t], opts)), t

    def refuse(self, sig: int, what: str, grace_s: float) -> None:
        """Contribute a refusal to the handshake and wait up to ``grace_s`` for the others;
        if they have not joined by then, leave it pending in ``deferred`` (not broken), or
        where the device cannot leave a collective pending, mark the channel broken."""
        self._check()
        if self.deferred is not None:  # one pending refusal answers the next handshake
            return
        work, t = self._issue_handshake(False, sig)
        if _completes_within(work, min(grace_s, self.timeout_s)):
            self.wait(work, what)
        elif self.device.collective_may_stay_pending:
            self.deferred = (work, t)
        else:
            self.broken = (
                f"{what}: no trainer joined a refusal within {grace_s:.0f}s, and on "
                f"{self.device.kind} a collective may not stay pending"
            )

    def deferred_met(self) -> bool:
        return self.deferred is not None and self.deferred[0].is_completed()

    def settle_deferred(self, what: str) -> bool:
        """Wait (within ``timeout_s``) for the pending refusal to meet the others'
        handshake. True if they sent the refused update's own signature (a slow trainer
        joined the refused update), False if it met another update's handshake."""
        assert self.deferred is not None
        (work, t), self.deferred = self.deferred, None
        self.wait(work, what)
        return _verdict(t)[1]

    def _check(self) -> None:
        if self.broken:
            raise ChannelError(
                f"weight-transfer channel is broken ({self.broken}); call "
                "init_weight_transfer_engine again"
            )

    def close(self) -> None:
        """Release the group. A broken channel may still have a collective queued on a dead
        peer: the device tears it down without waiting for it (on NPU: abort the
        communicator, not a shutdown that synchronizes the hung stream)."""
        pg, self.pg = self.pg, None
        broken = self.broken is not None or self.deferred is not None  # a collective waits
        self.deferred = None
        self.broken = self.broken or "closed"
        if pg is not None:
            try:
                self.device.close_group(pg, broken)
            except Exception as e:  # a peer that failed may have torn it down already
                logger.info("closing the weight-transfer group: %s: %s", type(e).__name__, e)
