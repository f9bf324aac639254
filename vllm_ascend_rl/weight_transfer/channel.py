"""The trainer-to-engine broadcast group, with deadlines and an agreement step: before any
payload every rank joins one all-reduce (MIN) of ``[verdict, signature, -signature]``, so a
refusal reaches every rank (none waits in a collective until the backend's timeout) and all
learn whether their signatures match. After a failed or timed-out collective the byte stream is
out of step: the group is marked broken for good. Rank 0 hosts the group's store; closing, it
sets a key per rank there, which :meth:`BroadcastChannel.peer_gone` looks for."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp

from vllm_ascend_rl.device import Device
from vllm_ascend_rl.device.group import exec_timeout_of, open_group
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer import TransportError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store, Work

logger = get_logger(__name__)

Poll = Callable[[], None]  # raises to abandon a wait (e.g. the HTTP side failed)

POLL_GRACE_S = 2.0  # how long a collective may trail the peer's HTTP answer


def _await(work: Work, timeout_s: float, poll: Poll | None) -> Exception | None:
    """Wait until ``work`` completes, at most ``timeout_s``; ``poll`` runs while waiting.
    Returns the poll's error if the work completed only after the poll failed."""
    deadline, pause = time.monotonic() + timeout_s, 0.0
    while not work.is_completed():
        if poll is not None:
            try:
                poll()
            except Exception as e:
                # The peer's HTTP answer can overtake its side of this collective (done, then
                # the call fails): give the collective a moment so a refusal ends in step.
                grace = time.monotonic() + POLL_GRACE_S
                while not work.is_completed():
                    if time.monotonic() > grace:
                        raise
                    time.sleep(0.001)
                return e
        if time.monotonic() > deadline:
            raise TimeoutError(f"no progress within timeout_s={timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(0.002, pause + 0.0001)
    return None


class ChannelError(TransportError):
    """A collective failed or timed out; the channel must be re-initialized."""


@dataclass(eq=False)
class BroadcastChannel:
    """A process group whose rank 0 (the trainer) broadcasts to every engine worker."""

    pg: ProcessGroup | None  # None once closed
    store: Store
    device: Device
    rank: int
    world_size: int
    timeout_s: float
    exec_timeout_s: float  # how long a failed collective stays queued on the device (HCCL's)
    broken: str | None = None
    _started: dict[int, float] = field(default_factory=dict)  # id(work) -> when it was issued

    @classmethod
    def open(
        cls,
        device: Device,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        within_s: float | None = None,
    ) -> BroadcastChannel:
        """Rendezvous and form the group within ``within_s`` (default ``timeout_s``); every
        collective after that is bounded by ``timeout_s``."""
        within_s = timeout_s if within_s is None else within_s
        try:
            pg, store, config = open_group(
                device, host, port, rank, world_size, timeout_s, within_s
            )
        except Exception as e:
            raise ChannelError(
                f"rendezvous at {host}:{port} as rank {rank} of {world_size} failed within "
                f"{within_s:.0f}s ({type(e).__name__}: {e}). Check master_address/"
                "master_port and that world_size counts the trainer plus every engine "
                "worker."
            ) from e
        return cls(pg, store, device, rank, world_size, timeout_s, exec_timeout_of(config))

    def broadcast(self, tensor: torch.Tensor) -> Work:
        """Start broadcasting ``tensor`` from rank 0; returns the pending work."""
        opts = BroadcastOptions()
        opts.rootRank = 0
        return self._issued(self._group().broadcast([tensor], opts))

    def _issued(self, work: Work) -> Work:
        self._started[id(work)] = time.monotonic()
        self.device.collective_issued(work, self.exec_timeout_s)
        return work

    def wait(
        self, work: Work, what: str, poll: Poll | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait for ``work`` within ``timeout_s`` (default the channel's), calling ``poll``
        while waiting."""
        started = self._started.pop(id(work), time.monotonic())
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        polled = None  # the poll's error, if the work completed only after it failed
        try:
            polled = _await(work, timeout_s, poll)
            work.wait()
            # With our group's watchdog off (NPU), an HCCL error need not raise in wait():
            # the work records it, communicator errors too (ProcessGroupHCCL.cpp:807-841).
            if (failure := work.exception()) is not None:
                raise RuntimeError(f"the collective failed: {failure}")
        except Exception as error:
            e = polled or error  # the peer's own answer says more than the collective
            detail = f"{type(e).__name__}: {e}"
            # The backend's own timer runs timeout_s from issue; gloo words its expiry "Timed
            # out ..." or "Application timeout caused pair closure". Late means timeout.
            late = time.monotonic() - started >= 0.8 * timeout_s
            if late and not isinstance(e, TimeoutError):  # ours already says so
                detail = f"no progress within timeout_s={timeout_s:.0f}s ({detail})"
            self.broken = f"{what} failed: {detail}"
            raise ChannelError(self.broken) from e

    def agree(
        self,
        code: int,
        sig: int,
        what: str,
        poll: Poll | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bool]:
        """All-reduce (MIN) ``[code, sig, -sig]``: (the lowest code any rank sent, whether
        every rank sent the same signature)."""
        pg = self._group()
        t = torch.tensor([code, sig, -sig], dtype=torch.int32, device=self.device.torch_device())
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN  # type: ignore[assignment]  # torch stubs: RedOpType
        self.wait(self._issued(pg.allreduce([t], opts)), what, poll, timeout_s)
        lowest, lo, neg_hi = (int(v) for v in t.cpu())
        return lowest, lo == -neg_hi

    def _group(self) -> ProcessGroup:
        """The group, unless the channel is broken (closing breaks it)."""
        if self.broken or self.pg is None:
            raise ChannelError(
                f"weight-transfer channel is broken ({self.broken}); call "
                "init_weight_transfer_engine again"
            )
        return self.pg

    def mark_up(self) -> None:
        """Engine side: this rank has installed the channel (:meth:`wait_up`)."""
        self.store.set(f"up/{self.rank}", "up")

    def wait_up(self, timeout_s: float) -> None:
        """Rank 0: wait until every engine rank has installed the channel."""
        keys = [f"up/{rank}" for rank in range(1, self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as e:
            raise ChannelError(
                f"not every engine rank took the channel within timeout_s ({type(e).__name__}: "
                f"{str(e)[:120]})"
            ) from e

    def peer_gone(self) -> str | None:
        """Engine side, never waiting on a live store: why rank 0 is gone (it closed the
        channel or its process exited), or None."""
        if self.broken:
            return self.broken
        try:
            closed = self.store.check([f"closed/{self.rank}"])
        except Exception as e:  # the store went away with its host process
            return f"its store is gone ({type(e).__name__}: {str(e)[:120]})"
        return "it closed the channel" if closed else None

    def close(self) -> None:
        """Release the group; a broken one is torn down without waiting for a collective that
        may be queued on a dead peer (on NPU: abort the communicator, not shutdown). Rank 0
        first tells every engine rank (:meth:`peer_gone`)."""
        pg, self.pg = self.pg, None
        if pg is not None and self.rank == 0:
            try:
                for rank in range(1, self.world_size):
                    self.store.set(f"closed/{rank}", "closed")
            except Exception as e:
                logger.info("telling the engine ranks the channel closed: %s", e)
        broken = self.broken is not None  # a collective may wait on a dead peer
        self.broken = self.broken or "closed"
        if broken:
            until = time.monotonic() + self.exec_timeout_s
            self.device.hang_until = max(self.device.hang_until, until)
        if pg is not None:
            try:
                self.device.close_group(pg, broken)
            except Exception as e:  # a peer that failed may have torn it down already
                logger.info("closing the weight-transfer group: %s: %s", type(e).__name__, e)
