"""NPU-IPC weight transfer, trainer side (engine side: ``npu_ipc.py``).

Each trainer rank exports a ring on its chip and listens on a doorbell, to which its chip's
engine workers connect. The ranks agree among themselves over a gloo group of their own, made
at ``trainer_init`` over ``torch.distributed``'s default group (as vLLM's IPC trainer gathers
its handles), and each rank talks only to its own workers. One update::

    every rank -> all     its ring's handles           (the sender ships {chip: handles})
    sender -> all         start_weight_update's outcome (update_weights runs in the background)
    every rank -> all     its workers' lowest verdict   (each worker: ready i, over its doorbell)
    every rank            go i (everyone's lowest) to its workers, then its buckets into its ring

A rank whose step fails still enters the agreement, with its failure, and every rank gives the
update up; a rank that dies fails the others' next agreement at once (its sockets close), a
silent one after twice ``timeout_s``. A worker that fails tells its rank at once."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict
from datetime import timedelta
from itertools import cycle
from typing import Any

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource

from vllm_ascend_rl.device import ExportedBuffer, IpcHandleError
from vllm_ascend_rl.device.base import check_same_location
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import StepHold
from vllm_ascend_rl.weight_transfer import TransportError
from vllm_ascend_rl.weight_transfer.buckets import (
    Bucket,
    TensorSpec,
    as_bytes,
    iter_bucket_tensors,
    pack_into,
    pieces,
    slot_bytes,
)
from vllm_ascend_rl.weight_transfer.doorbell import (
    Abort,
    Done,
    Doorbell,
    DoorbellListener,
    Filled,
    Go,
    Hello,
    Poll,
    Ready,
    Welcome,
)
from vllm_ascend_rl.weight_transfer.npu_ipc import (
    AscendRLNPUIPCWeightTransferInitInfo,
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


class RankError(TransportError):
    """Another trainer rank failed, died, or stayed away from an agreement past its bound."""


def _release(ring: list[ExportedBuffer]) -> None:
    for buf in ring:
        buf.close()
    ring.clear()


def welcome(doorbell: Doorbell, hello: Hello, wire: int, here: dict[str, str]) -> bool:
    """Answer a worker's hello; True (welcome) only if its wire signature and chip are ours."""
    reason = None
    if hello.wire != wire:
        reason = f"trainer and engine disagree on protocol or wire parameters: {hello!r}"
    else:
        try:
            check_same_location(here, hello.location)
        except IpcHandleError as e:
            reason = f"engine worker {hello.worker}: {e}"
    doorbell.send(Welcome(reason=reason))
    return reason is None


class Acceptor:
    """Accepts this rank's engine workers (:class:`Hello`) on its doorbell in a thread until
    stopped."""

    def __init__(self, listener: DoorbellListener, greet: Callable[[Doorbell, Hello], bool]):
        self.listener, self.greet = listener, greet
        self.workers: list[Doorbell] = []
        self.step_hold = StepHold.GATE  # the lowest of the welcomed workers'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ipc-acceptor")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            doorbell = self.listener.accept(0.05)
            if doorbell is None:
                continue
            try:
                hello = doorbell.expect(Hello, None, "init handshake")
                if self.greet(doorbell, hello):
                    self.workers.append(doorbell)
                    self.step_hold = min(self.step_hold, StepHold(hello.step_hold))
                else:
                    doorbell.close()
            except Exception as e:  # a bad connection must not stop the others
                logger.warning("NPU-IPC doorbell: dropped a connection: %s", e)
                doorbell.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.listener.close()


class AscendRLNPUIPCTrainerWeightTransferEngine(TrainerTransport[NPUIPCTrainerInitInfo]):
    """Trainer side: each rank owns its chip's ring and its workers' doorbells; the sender
    (rank 0) also drives the engine's calls."""

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
        self.group: Any = None  # the trainer ranks' gloo group (None: one rank)
        self.connected = False
        self.ring: list[ExportedBuffer] = []
        self.chip = self.hw.location()["chip"]
        self.update_id = 0
        # Unlink and unmap the ring when this engine is collected or the trainer exits.
        self._finalizer = weakref.finalize(self, _release, self.ring)

    # -- agreements among the trainer ranks ---------------------------------------------
    def _all(self, obj: Any) -> list[Any]:
        """``obj`` of every trainer rank, in rank order (a collective of the rank group)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # a rank died, or stayed away past the group's bound
            self.connected = False  # the group's collectives are out of step now
            raise RankError(f"the trainer ranks could not agree: {type(e).__name__}: {e}") from e
        return out

    def _share(self, step: Callable[[], Any]) -> list[Any]:
        """Every rank's ``step()``, in rank order. A rank whose step raised enters the agreement
        with its failure; then that rank raises its own error, and every other rank RankError."""
        try:
            mine, failure = step(), None
        except Exception as e:
            mine, failure, error = None, f"{type(e).__name__}: {e}", e
        answers = self._all((self.init_info.rank, mine, failure))
        if failure is not None:
            raise error
        failed = [f"trainer rank {rank} failed: {why}" for rank, _, why in answers if why]
        if failed:
            raise RankError("; ".join(failed))
        return [answer for _, answer, _ in answers]

    def _sender_says(self, value: Any) -> Any:
        """The sender's ``value``, on every rank (the others' are not read)."""
        answers = self._all((self.is_sender, value))
        return next(v for sender, v in answers if sender)

    # -- connection -------------------------------------------------------------------
    def connect(self) -> None:
        """Every rank: its ring's doorbell and its workers' hellos, during the sender's init
        call."""
        info = self.init_info
        here = self.hw.location()
        listener = DoorbellListener(info.timeout_s)
        try:
            # The trainer ranks agree over a gloo group (none for one rank), on the CPU whatever
            # the training backend, each agreement bounded by twice timeout_s (a rank may wait
            # there while another waits up to timeout_s for its workers).
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                timeout = timedelta(seconds=2 * info.timeout_s + 30)
                self.group = dist.new_group(backend="gloo", timeout=timeout)
            ranks = self._all({"chip": self.chip, "doorbell": listener.address})
            chips = [r["chip"] for r in ranks]
            if len(set(chips)) != len(chips):
                raise WeightSyncError(
                    f"NPU IPC needs one trainer rank per chip; ranks are on {chips}"
                )
            worker_info = AscendRLNPUIPCWeightTransferInitInfo(
                doorbells={r["chip"]: r["doorbell"] for r in ranks},
                zero_copy=info.zero_copy,
                trainer_id=trainer_id(),
                **wire_params(info),
            )
            wire = wire_signature(worker_info, None)
            acceptor = Acceptor(listener, lambda d, hello: welcome(d, hello, wire, here))
            try:
                failure = None
                if self.is_sender:  # every worker says hello inside the call
                    init = self.client.init_weight_transfer_engine
                    what = "init_weight_transfer_engine"
                    failure = BackgroundCall(what, init, asdict(worker_info)).failure(None)
                failure = self._sender_says(failure)
            finally:
                acceptor.stop()
                self.doorbells = acceptor.workers
            if failure is not None:
                raise WeightSyncError(f"init_weight_transfer_engine failed: {failure}")
            found = self._all((len(self.doorbells), int(acceptor.step_hold)))
            if not sum(count for count, _ in found):
                raise WeightSyncError("no engine worker connected to a trainer doorbell")
        except Exception:
            listener.close()  # unless the acceptor, stopped, closed it already
            self.shutdown()  # closes the doorbells, drops the rank group
            raise
        self.connected = True
        self.step_hold = StepHold(min(hold for _, hold in found))

    # -- one update: the sender's steps (TrainerTransport) ------------------------------
    def not_ready(self) -> str | None:
        if not self.connected:
            return "not connected"
        return next((d.broken for d in self.doorbells if d.broken), None)

    def payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict:
        return {
            **super().payload(specs, plan),
            "buffers": self._rings(plan),
            "update_id": self.update_id,
        }

    def cancel(self, reason: str) -> None:
        self._sender_says(reason)

    def agree(self, plan: list[Bucket], update: BackgroundCall) -> Verdict:
        self._sender_says(None)  # the update is open: each rank hears from its workers
        return self._agree(plan, update.raise_if_failed)

    def send(self, plan: list[Bucket], pairs: Pairs, update: BackgroundCall) -> None:
        self._stream(plan, pairs, update.raise_if_failed)

    def succeeded(self) -> None:
        for buf in self.ring:  # every worker has mapped them: take the names off /dev/shm
            buf.unlink()

    def abort(self) -> None:
        self.connected = False
        for d in self.doorbells:
            with suppress(Exception):  # already gone
                d.send(Abort(reason="the trainer gave up this update"))
            d.close()

    # -- one update: another rank's part --------------------------------------------------
    def follow(self, specs: list[TensorSpec], plan: list[Bucket], source: WeightSource) -> None:
        """The sender's steps, seen from another rank: its ring to the sender; if the update
        opened, its workers' verdict to every rank, and on go, the buckets."""
        try:
            self._rings(plan)
            if self._sender_says(None) is not None:  # the sender's start failed: no update
                return
            if self._agree(plan, lambda: None) == Verdict.GO:
                self._stream(plan, iter(source), lambda: None)
        except BaseException:
            self.abort()
            raise

    # -- shared by every rank -------------------------------------------------------------
    def _rings(self, plan: list[Bucket]) -> dict[str, list[dict[str, Any]]]:
        """Every rank's ring handles by chip; the update's id is the sender's."""

        def mine() -> tuple[bool, int, str, list[dict[str, Any]]]:
            return self.is_sender, self.update_id + 1, self.chip, self._ring_handles(plan)

        answers = self._share(mine)
        self.update_id = next(update_id for sender, update_id, _, _ in answers if sender)
        return {chip: handles for _, _, chip, handles in answers}

    def _agree(self, plan: list[Bucket], poll: Poll) -> Verdict:
        """This rank's workers' lowest verdict on ``plan`` (a GO for other buckets refuses it),
        then every rank's; the lowest goes to the workers that said GO."""
        sig, other = plan_signature(plan), (Verdict.REFUSED, "the worker planned other buckets")
        replies: list[Ready] = []

        def lowest_here() -> tuple[Verdict, str | None]:
            for d in self.doorbells:
                replies.append(d.expect(Ready, self.update_id, "update handshake", poll))
            return _lowest(
                [
                    other if r.verdict == Verdict.GO and r.plan != sig else (r.verdict, r.reason)
                    for r in replies
                ]
            )

        verdict, reason = _lowest(self._share(lowest_here))
        go = Go(id=self.update_id, verdict=verdict, reason=reason)
        for d, r in zip(self.doorbells, replies, strict=True):
            if r.verdict == Verdict.GO:  # every worker that said GO waits for the verdict
                d.send(go)
        return verdict

    def _ring_handles(self, plan: list[Bucket]) -> list[dict[str, Any]]:
        need = slot_bytes(plan, self.init_info.packed_buffer_size_bytes)
        if not self.ring or self.ring[0].open_tensor().numel() < need:
            _release(self.ring)  # exported once; replaced only if a bucket outgrows it
            self.ring.extend(
                self.hw.create_ipc_buffer(max(need, 1))
                for _ in range(self.init_info.packed_num_buffers)
            )
        return [b.handle for b in self.ring]

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
                d.expect(Done, index, f"bucket {index} acknowledgement", poll)

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
                    d.send(Filled(id=bucket.index))
                unacknowledged.append(bucket.index)
        while unacknowledged:
            acknowledged()

    def shutdown(self) -> None:
        for d in self.doorbells:
            d.close()
        self.doorbells, self.connected = [], False
        if self.group is not None:
            with suppress(Exception):  # never fails the shutdown
                dist.destroy_process_group(self.group)
            self.group = None
        _release(self.ring)


def _lowest(answers: list[tuple[Verdict, str | None]]) -> tuple[Verdict, str | None]:
    """The lowest of the ``answers`` (GO if none), and the first refusal's reason."""
    verdict = min((v for v, _ in answers), default=Verdict.GO)
    return verdict, next((why for v, why in answers if v != Verdict.GO), None)
