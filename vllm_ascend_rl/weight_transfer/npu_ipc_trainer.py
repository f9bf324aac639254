"""NPU-IPC weight transfer, trainer side (engine side: ``npu_ipc.py``).

Each trainer rank exports a ring on its chip and listens on a doorbell. ``trainer_init`` gathers
the ranks' chips and doorbells once (over ``torch.distributed``'s default group, as vLLM's IPC
trainer does) and gives the engine ``{chip: doorbell}``. Workers connect to their chip's rank,
ranks to the sender; updates go over those links, never a collective a dead peer could hang::

    sender -> ranks    update i           ranks -> sender   ring i (this rank's handles)
    sender -> engine   update_weights({chip: handles})
    workers -> their rank: ready i        ranks -> sender   ready i (their workers' verdict)
    sender -> ranks    go i (everyone's verdict), each rank -> its workers: go i
    each rank packs every bucket into its own ring and rings its own workers
    ranks -> sender    sent i

A rank that fails tells the sender and its workers at once; so does the sender."""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import asdict
from itertools import cycle
from typing import Any

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource

from vllm_ascend_rl.device import ExportedBuffer, IpcHandleError
from vllm_ascend_rl.device.base import check_same_location
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import StepHold
from vllm_ascend_rl.weight_transfer import ipc_messages as msg
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    TensorSpec,
    as_bytes,
    iter_bucket_tensors,
    pack_into,
    pieces,
    slot_bytes,
)
from vllm_ascend_rl.weight_transfer.doorbell import Doorbell, DoorbellError, DoorbellListener, Poll
from vllm_ascend_rl.weight_transfer.npu_ipc import (
    AscendRLNPUIPCWeightTransferInitInfo,
    AscendRLNPUIPCWeightTransferUpdateInfo,
    NPUIPCTrainerInitInfo,
)
from vllm_ascend_rl.weight_transfer.trainer_side import (
    BackgroundCall,
    Pairs,
    TrainerTransport,
    WeightSyncError,
)
from vllm_ascend_rl.weight_transfer.wire import (
    Verdict,
    plan_signature,
    trainer_id,
    wire_params,
    wire_signature,
)

logger = get_logger(__name__)


def gather_ranks(obj: Any) -> list[Any]:
    """``obj`` of every trainer rank (a collective on the default group; ``[obj]`` without)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _release(ring: list[ExportedBuffer]) -> None:
    for buf in ring:
        buf.close()
    ring.clear()


def welcome(doorbell: Doorbell, hello: msg.Hello, wire: int, here: dict[str, str]) -> bool:
    """Answer a worker's hello; True (welcome) only if its wire signature and chip are ours."""
    reason = None
    if hello.wire != wire:
        reason = f"trainer and engine disagree on protocol or wire parameters: {hello!r}"
    else:
        try:
            check_same_location(here, hello.location)
        except IpcHandleError as e:
            reason = f"engine worker {hello.worker}: {e}"
    doorbell.send(msg.Welcome(reason=reason))
    return reason is None


class Acceptor:
    """Accepts connections on a rank's doorbell in a thread until stopped: engine workers
    (:class:`Hello`) and, on the sender, the other trainer ranks (:class:`Peer`)."""

    def __init__(self, listener: DoorbellListener, greet: Callable[[Doorbell, msg.Hello], bool]):
        self.listener, self.greet = listener, greet
        self.workers: list[Doorbell] = []
        self.step_hold = StepHold.GATE  # the lowest of the welcomed workers'
        self.peers: dict[int, Doorbell] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ipc-acceptor")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            doorbell = self.listener.accept(0.05)
            if doorbell is None:
                continue
            try:
                match doorbell.recv("init handshake"):
                    case msg.Peer(rank=rank):
                        doorbell.send(msg.Welcome())
                        self.peers[rank] = doorbell
                    case msg.Hello() as hello:
                        if self.greet(doorbell, hello):
                            self.workers.append(doorbell)
                            self.step_hold = min(self.step_hold, StepHold(hello.step_hold))
                        else:
                            doorbell.close()
                    case other:
                        raise DoorbellError(f"expected Hello or Peer, got {other!r}")
            except Exception as e:  # a bad connection must not stop the others
                logger.warning("NPU-IPC doorbell: dropped a connection: %s", e)
                doorbell.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.listener.close()


class AscendRLNPUIPCTrainerWeightTransferEngine(TrainerTransport[NPUIPCTrainerInitInfo]):
    """Trainer side: each rank owns its chip's ring and workers' doorbells; rank 0 also drives
    the update and coordinates the other ranks."""

    init_info_cls = NPUIPCTrainerInitInfo
    transport = "NPU-IPC"
    alone_bytes = None  # a tensor larger than a bucket goes through the ring in pieces

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: NPUIPCTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, init_info=init_info)
        self.doorbells: list[Doorbell] = []  # this rank's engine workers
        self.peers: list[Doorbell] = []  # sender: the other ranks; others: the sender
        self.ring: list[ExportedBuffer] = []
        self.chip = self.hw.location()["chip"]
        self.update_id = 0
        # Unlink and unmap the ring when this engine is collected or the trainer exits.
        self._finalizer = weakref.finalize(self, _release, self.ring)

    # -- connection -------------------------------------------------------------------
    def connect(self) -> None:
        """Every rank: its ring's doorbell, its workers' hellos, and the sender's link."""
        info = self.init_info
        here = self.hw.location()
        listener = DoorbellListener(info.timeout_s)
        ranks = gather_ranks({"rank": info.rank, "chip": self.chip, "doorbell": listener.address})
        chips = [r["chip"] for r in ranks]
        if len(set(chips)) != len(chips):
            listener.close()
            raise WeightSyncError(f"NPU IPC needs one trainer rank per chip; ranks are on {chips}")
        worker_info = AscendRLNPUIPCWeightTransferInitInfo(
            doorbells={r["chip"]: r["doorbell"] for r in ranks},
            zero_copy=info.zero_copy,
            trainer_id=trainer_id(),
            **wire_params(info),
        )
        wire = wire_signature(worker_info, None)
        acceptor = Acceptor(listener, lambda d, hello: welcome(d, hello, wire, here))
        try:
            if self.is_sender:
                self._connect_as_sender(acceptor, asdict(worker_info), len(ranks) - 1)
            else:
                sender = next(r for r in ranks if r["rank"] == 0)
                self._connect_as_peer(acceptor, sender["doorbell"])
        except Exception:
            acceptor.stop()
            for d in [*acceptor.workers, *acceptor.peers.values(), *self.peers]:
                d.close()
            self.peers = []
            raise
        self.doorbells = acceptor.workers

    def _connect_as_sender(self, acceptor: Acceptor, init_body: dict, num_peers: int) -> None:
        timeout_s = self.init_info.timeout_s
        deadline = time.monotonic() + timeout_s
        while len(acceptor.peers) < num_peers:  # the other ranks connect right after the gather
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"only {len(acceptor.peers)} of {num_peers} other trainer ranks reached the "
                    f"sender's doorbell within timeout_s={timeout_s:.0f}s"
                )
            time.sleep(0.05)
        init_call = BackgroundCall(
            "init_weight_transfer_engine", self.client.init_weight_transfer_engine, init_body
        )
        failure = init_call.failure(None)  # every worker said hello inside the call
        acceptor.stop()
        self.peers = [acceptor.peers[r] for r in sorted(acceptor.peers)]
        counts, self.step_hold = [len(acceptor.workers)], acceptor.step_hold
        for peer in self.peers:
            peer.send(msg.Init(reason=failure))
            if failure is None:
                workers = peer.expect(msg.Workers, None, "init handshake")
                counts.append(workers.count)
                self.step_hold = min(self.step_hold, StepHold(workers.step_hold))
        if failure is not None:
            raise WeightSyncError(f"init_weight_transfer_engine failed: {failure}")
        if not sum(counts):
            raise WeightSyncError("no engine worker connected to a trainer doorbell")

    def _connect_as_peer(self, acceptor: Acceptor, sender_address: str) -> None:
        sender = Doorbell.connect(sender_address, self.init_info.timeout_s)
        self.peers = [sender]
        sender.send(msg.Peer(rank=self.init_info.rank))
        sender.expect(msg.Welcome, None, "joining the sender")
        init = sender.expect(msg.Init, None, "waiting for the engine's init")
        acceptor.stop()
        if init.reason is not None:
            raise WeightSyncError(f"init_weight_transfer_engine failed: {init.reason}")
        sender.send(msg.Workers(count=len(acceptor.workers), step_hold=acceptor.step_hold))

    # -- one update: the sender's steps (TrainerTransport) ------------------------------
    def not_ready(self) -> str | None:
        if not self.doorbells and not self.peers:
            return "not connected"
        return next((d.broken for d in [*self.doorbells, *self.peers] if d.broken), None)

    def payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict:
        self.update_id += 1
        for peer in self.peers:
            peer.send(msg.Update(id=self.update_id))
        rings = {self.chip: self._ring_handles(plan)}
        for peer in self.peers:
            ring = peer.expect(msg.Ring, self.update_id, "collecting the ranks' rings")
            rings[ring.chip] = ring.handles
        return {
            **AscendRLNPUIPCWeightTransferUpdateInfo.fields_from_specs(specs),
            "buffers": rings,
            "update_id": self.update_id,
        }

    def cancel(self, reason: str) -> None:
        for peer in self.peers:
            peer.send(msg.Cancel(id=self.update_id, reason=reason))

    def agree(self, plan: list[Bucket], update: BackgroundCall) -> Verdict:
        replies = self._ready(update.raise_if_failed)
        # No poll on the update call here: a worker that refused fails it at once, and the
        # refusal reaches us through its rank a moment later; a dead rank is seen anyway.
        ranks = [p.expect(msg.Ready, self.update_id, "update handshake") for p in self.peers]
        verdict, reason = _lowest(replies, plan, ranks)
        go = msg.Go(id=self.update_id, verdict=verdict, reason=reason)
        for peer in self.peers:
            peer.send(go)
        self._go(replies, go)
        return verdict

    def send(self, plan: list[Bucket], pairs: Pairs, update: BackgroundCall) -> None:
        poll = update.raise_if_failed
        self._stream(plan, pairs, poll)
        for peer in self.peers:
            peer.expect(msg.Sent, self.update_id, "waiting for the other trainer ranks", poll)

    def succeeded(self) -> None:
        for buf in self.ring:  # every worker has mapped them: take the names off /dev/shm
            buf.unlink()

    def abort(self) -> None:
        for d in [*self.doorbells, *self.peers]:
            with suppress(Exception):  # already gone
                d.send(msg.Abort(reason="the trainer gave up this update"))
            d.close()

    # -- one update: another rank's part --------------------------------------------------
    def follow(self, specs: list[TensorSpec], plan: list[Bucket]) -> None:
        """Answer the sender: its update with this rank's ring, then with its workers' lowest
        verdict; its verdict goes on to them, and on go, the buckets."""
        reason = self.not_ready()
        if reason:
            raise WeightSyncError(
                f"weight transfer is not usable ({reason}): call trainer_init again"
            )
        sender = self.peers[0]
        try:
            update = sender.expect(msg.Update, None, "waiting for the sender's next update")
            self.update_id = update_id = update.id
            sender.send(msg.Ring(id=update_id, chip=self.chip, handles=self._ring_handles(plan)))
            replies = self._ready(self._watch)
            verdict, reason = _lowest(replies, plan)
            sender.send(msg.Ready(id=update_id, verdict=verdict, reason=reason))
            go = sender.expect(msg.Go, update_id, "waiting for the sender's verdict")
            self._go(replies, go)
            if go.verdict != Verdict.GO:
                return
            self._stream(plan, iter(self.source), self._watch)
            sender.send(msg.Sent(id=update_id))
        except _Cancelled:
            return
        except BaseException:
            self.abort()
            raise

    def _watch(self) -> None:
        """Poll hook: _Cancelled if the sender cancels (its start failed: no worker answers)."""
        match self.peers[0].pending("watching the sender"):
            case msg.Cancel(reason=reason):
                raise _Cancelled(reason)
            case None:
                return
            case other:
                raise WeightSyncError(f"unexpected message from the sender: {other!r}")

    # -- shared by every rank -------------------------------------------------------------
    def _ring_handles(self, plan: list[Bucket]) -> list[dict[str, Any]]:
        need = slot_bytes(plan, self.init_info.packed_buffer_size_bytes)
        if not self.ring or self.ring[0].open_tensor().numel() < need:
            _release(self.ring)  # exported once; replaced only if a bucket outgrows it
            self.ring.extend(
                self.hw.create_ipc_buffer(max(need, 1))
                for _ in range(self.init_info.packed_num_buffers)
            )
        return [b.handle for b in self.ring]

    def _ready(self, poll: Poll) -> list[msg.Ready]:
        """This rank's workers' replies, as they sent them."""
        return [
            d.expect(msg.Ready, self.update_id, "update handshake", poll) for d in self.doorbells
        ]

    def _go(self, replies: list[msg.Ready], go: msg.Go) -> None:
        for d, r in zip(self.doorbells, replies, strict=True):
            if r.verdict == Verdict.GO:  # every worker that said GO waits for the verdict
                d.send(go)

    def _stream(self, plan: list[Bucket], pairs: Pairs, poll: Poll) -> None:
        """Copy each bucket (larger ones in slot-sized pieces) into the next slot and ring this
        rank's workers; a slot is refilled only once every worker acknowledged it."""
        piece, depth = self.init_info.packed_buffer_size_bytes, len(self.ring)
        # Piece k goes into slot k % len(ring), as the engine reads it.
        slots = cycle([b.open_tensor() for b in self.ring])
        unacknowledged: deque[int] = deque()  # bucket index of each piece, oldest first

        def acknowledged() -> None:
            index = unacknowledged.popleft()
            for d in self.doorbells:
                d.expect(msg.Done, index, f"bucket {index} acknowledgement", poll)

        for bucket, tensors in iter_bucket_tensors(plan, pairs):
            whole = as_bytes(tensors[0]) if bucket.nbytes > piece else None
            for start, n in pieces(bucket.nbytes, piece):
                if len(unacknowledged) == depth:  # the next slot's piece is still read
                    acknowledged()
                slot = next(slots)[:n]
                if whole is None:
                    pack_into(slot, bucket, tensors, self.hw.copy_bytes)
                else:
                    self.hw.copy_bytes(slot, whole[start : start + n])
                self.hw.synchronize()  # the engine reads it from another process
                for d in self.doorbells:
                    d.send(msg.Filled(id=bucket.index))
                unacknowledged.append(bucket.index)
        while unacknowledged:
            acknowledged()

    def shutdown(self) -> None:
        for d in [*self.doorbells, *self.peers]:
            d.close()
        self.doorbells, self.peers = [], []
        _release(self.ring)


class _Cancelled(Exception):
    """The sender cancelled this update before any engine worker saw it."""


def _lowest(
    workers: list[msg.Ready], plan: list[Bucket], ranks: Sequence[msg.Ready] = ()
) -> tuple[Verdict, str | None]:
    """The lowest verdict of this rank's ``workers`` on ``plan`` (a GO for other buckets
    refuses it) and of the other ``ranks``, and the first refusal's reason."""
    sig, other = plan_signature(plan), (Verdict.REFUSED, "the worker planned other buckets")
    answers: list[tuple[Verdict, str | None]] = [
        other if r.verdict == Verdict.GO and r.plan != sig else (r.verdict, r.reason)
        for r in workers
    ]
    answers += [(r.verdict, r.reason) for r in ranks]
    verdict = min((v for v, _ in answers), default=Verdict.GO)
    return verdict, next((why for v, why in answers if v != Verdict.GO), None)
