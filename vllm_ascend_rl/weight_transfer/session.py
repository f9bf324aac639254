"""One engine worker's weight update as a state machine (docs/failure-semantics.md).

Each of vLLM's calls is an :class:`Event` (the forward pass may run between them), and
:data:`TRANSITIONS` says where each leads::

    IDLE --start--> OPEN --receive--> RECEIVING --loaded--> RECEIVED --finish--> IDLE
                     |                    |                   |  '--receive--> RECEIVING
                     |--finish--> IDLE    '--fail--> IDLE     '--cancel--> CANCELLED
                     '--cancel--> CANCELLED --finish/fail--> IDLE, --start--> OPEN
    OPEN / RECEIVED --start--> OPEN (the open update cancelled first)

- ``fail`` ends the update at once: vLLM's worker closes its session when ``update_weights`` raises.
  So does a ``finish`` that raises, but there the worker still counts the update open: the
  ``finish`` that follows (IDLE --finish--> IDLE) has nothing left to do and lets it close.
- ``cancel`` (forward pass, new init, shutdown) ends it too, but the worker still counts it as
  open, so ``finish`` (or a failing ``update_weights``) follows.
- ``start`` while an update is open here means the worker ended its record of it (another
  trainer's ``update_weights`` was refused on a worker that does not keep the owner's
  update, ``worker.SleepableMixin.update_weights``): that update is cancelled, a new one opens.
- Any end but ``finish`` from ``RECEIVED`` restores the old weights (``restore``) or, under
  ``hold`` once layers took new weights, leaves the model *not whole*: the plugin scheduler
  refuses every resume (``readiness.py``) until an update completes.
- From ``start`` to the end the readiness is UPDATING: the plugin scheduler runs no step
  (``readiness.StepGate``). The engine ends an open update (``abandon``) once no call came for
  the connection's ``timeout_s`` (``abandon_due``, asked by the connection's thread).
- An update loads into the model vLLM's worker retargeted the engine at before ``start`` (the
  speculative-decoding drafter after ``/start_draft_weight_update``), else the served one; a
  drafter left not whole is the readiness's ``drafter``, cleared only by a drafter update.
  The forward guard and the readiness stay on the served model, which every step runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from vllm_ascend_rl import metrics
from vllm_ascend_rl.compat import mtp_check_off
from vllm_ascend_rl.device import Device
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import Readiness, readiness_of
from vllm_ascend_rl.weight_transfer.buckets import Bucket, ReceivePool, total_bytes, unpack_views
from vllm_ascend_rl.weight_transfer.reload import LayerwiseReload
from vllm_ascend_rl.weight_transfer.validation import WeightUpdateRefused

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from vllm.config import ModelConfig

logger = get_logger(__name__)

_FIGURES = ("weight_update_bytes", "weight_update_transport_seconds", "weight_update_load_seconds")


class State(Enum):
    IDLE = "no update open"
    OPEN = "open, nothing received"
    RECEIVING = "receiving"
    RECEIVED = "received, not finished"
    CANCELLED = "cancelled, not finished"


class Event(Enum):
    START = "start_weight_update"
    RECEIVE = "update_weights"
    LOADED = "every bucket loaded"
    FINISH = "finish_weight_update"
    FAIL = "failure"
    CANCEL = "cancellation"


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.IDLE, E.START): S.OPEN,
    (S.IDLE, E.FINISH): S.IDLE,  # after a finish that failed: the worker's record ends
    (S.IDLE, E.FAIL): S.IDLE,
    (S.IDLE, E.CANCEL): S.IDLE,
    (S.OPEN, E.START): S.OPEN,  # the worker dropped the update (see start)
    (S.OPEN, E.RECEIVE): S.RECEIVING,
    (S.OPEN, E.FINISH): S.IDLE,  # nothing arrived: the old weights stay
    (S.OPEN, E.FAIL): S.IDLE,
    (S.OPEN, E.CANCEL): S.CANCELLED,
    (S.RECEIVING, E.LOADED): S.RECEIVED,
    (S.RECEIVING, E.FAIL): S.IDLE,
    (S.RECEIVED, E.START): S.OPEN,  # the worker dropped the update (see start)
    (S.RECEIVED, E.RECEIVE): S.RECEIVING,  # another chunk of the same update
    (S.RECEIVED, E.FINISH): S.IDLE,  # the update is applied
    (S.RECEIVED, E.FAIL): S.IDLE,
    (S.RECEIVED, E.CANCEL): S.CANCELLED,
    (S.CANCELLED, E.START): S.OPEN,  # the worker dropped the update (see start)
    (S.CANCELLED, E.FINISH): S.IDLE,
    (S.CANCELLED, E.FAIL): S.IDLE,
    (S.CANCELLED, E.CANCEL): S.CANCELLED,
}


class IllegalTransition(RuntimeError):
    """An event the update's current state does not allow; nothing changed."""

    cause = "out_of_sequence"


class UpdateCancelled(IllegalTransition):
    """A call on an update already cancelled; the message says why and what the model holds."""


class TransferFailed(RuntimeError):
    """Bytes stopped arriving mid-update; the connection is gone."""

    cause = "transfer"


class FinishFailed(RuntimeError):
    """Post-load processing failed in ``finish_weight_update``; the update ended as a failed
    ``update_weights`` ends one (the message says what the model holds)."""

    cause = "finish_failed"


def cause_of(e: BaseException) -> str:
    """The metrics' cause code of a failed or refused update (an exception's ``cause``)."""
    return getattr(e, "cause", None) or ("bad_request" if isinstance(e, ValueError) else "error")


class UpdateSession:
    """One worker's update state and what an open update holds (reload and old weights'
    backup, receive pool, forward guard); each public method is an event."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        hw: Device,
        workers_on_host: int,
        backend: str,
    ) -> None:
        self.model, self.model_config, self.hw = model, model_config, hw  # the open update's
        self.target, self.target_config = model, model_config  # the served model
        self.workers_on_host, self.backend = workers_on_host, backend
        self.state = State.IDLE
        self.hold = False  # on_failure="hold": no backup of the old weights
        self.idle_s = 120.0  # the connection's timeout_s: an open update idle longer is abandoned
        self.quiet_until = 0.0  # when the open update's idle bound passes, unless a call comes
        self.reload = LayerwiseReload()
        self.pool = ReceivePool(hw.torch_device(), 0)
        self.version: str | None = None  # the version the open update loads, if named
        self.cancelled: str | None = None  # why the open update was cancelled
        self.ended = "none was opened"  # how the last update ended
        self.moved = dict.fromkeys(_FIGURES, 0.0)  # this update's figures (metrics)
        self.readiness = readiness_of(model)
        self._guard: RemovableHandle | None = None

    def reconnect(self, on_failure: str, buffers: int, bucket_bytes: int, idle_s: float) -> None:
        """A new trainer connection: cancel any open update, apply the init's parameters (the
        receive pool holds at most ``buffers + 2`` buckets)."""
        self.cancel("init_weight_transfer_engine was called during it", "new_init")
        self.hold, self.idle_s = on_failure == "hold", idle_s
        self.pool.release()
        self.pool.max_bytes = (buffers + 2) * bucket_bytes

    def _go(self, event: Event) -> State:
        """Move on ``event``; the state before. IllegalTransition (nothing changed) if forbidden."""
        before, self.state = self.state, self._next(event)
        return before

    def _next(self, event: Event) -> State:
        """The state ``event`` leads to; IllegalTransition if forbidden (UpdateCancelled after a
        cancellation, saying why)."""
        after = TRANSITIONS.get((self.state, event))
        if after is not None:
            return after
        if self.state is State.CANCELLED:
            raise UpdateCancelled(self.cancelled or "the weight update was cancelled")
        if event is Event.RECEIVE:
            raise IllegalTransition("update_weights called without start_weight_update")
        raise IllegalTransition(
            f"{event.value} is not allowed while the weight update is {self.state.value}"
        )

    # -- events ------------------------------------------------------------------------
    def start(
        self, model: torch.nn.Module | None = None, model_config: ModelConfig | None = None
    ) -> None:
        """``start_weight_update`` into ``model`` (its drafter; the served model if None): open
        layerwise reload (with a host copy of the old weights unless ``hold``) and guard the
        forward pass."""
        if self.state in (State.OPEN, State.RECEIVED):  # the worker's record of it ended
            self.cancel("the worker ended it and started a new one", "superseded")
        self._next(Event.START)  # before the host copy
        if model is not None and model is not self.target:
            _check_drafter(model, self.target)
            self.model, self.model_config = model, model_config or self.target_config
        self.reload.begin(self.model, self.model_config, not self.hold, self.workers_on_host)
        self._go(Event.START)
        self.cancelled = None
        self.moved = dict.fromkeys(_FIGURES, 0.0)
        self._set_guard()
        self.quiet_until = time.monotonic() + self.idle_s
        if self.readiness.state is Readiness.WHOLE:  # layers may hold either version now
            self.readiness.set(Readiness.UPDATING)

    def receive(self, version: str | None) -> None:
        """``update_weights`` begins (before its handshake)."""
        self._go(Event.RECEIVE)
        self.version = version

    def load_all(self, buckets: Iterator[tuple[Bucket, torch.Tensor]], expected: int) -> None:
        """Load each bucket as it arrives (layerwise reload may keep views of it until a layer
        completes); TransferFailed, saying how far it got of ``expected`` bytes, if they stop."""
        received, waiting = 0, time.perf_counter()
        try:
            for bucket, buf in buckets:
                started = time.perf_counter()
                with mtp_check_off():
                    self.model.load_weights(unpack_views(buf, bucket))  # type: ignore[operator]  # torch stubs: Module.__getattr__
                self.moved["weight_update_load_seconds"] += time.perf_counter() - started
                self.moved["weight_update_transport_seconds"] += started - waiting
                self.moved["weight_update_bytes"] += total_bytes(bucket.specs)  # not the padding
                received += bucket.nbytes
                del buf  # the transport reuses a buffer once nothing refers to it
                waiting = time.perf_counter()
        except Exception as e:
            raise TransferFailed(
                f"weight transfer failed after {received} of {expected} bytes "
                f"({type(e).__name__}: {e}). Call init_weight_transfer_engine again before the "
                "next update"
            ) from e
        self._go(Event.LOADED)
        self.quiet_until = time.monotonic() + self.idle_s

    def finish(self) -> None:
        """``finish_weight_update``: apply what arrived, or end an update that got nothing.
        Post-load processing that raises ends the update as ``on_failure`` says (FinishFailed)."""
        before = self._go(Event.FINISH)
        if before is State.IDLE:
            logger.warning(
                "finish_weight_update: no update is open here (it ended: %s)", self.ended
            )
        elif before is State.CANCELLED:
            logger.warning("finish_weight_update: nothing applied, %s", self.cancelled)
        elif before is State.OPEN:
            why = self._abort("cancelled", "nothing_received")
            logger.warning("finish_weight_update without any update: %s", why)
        else:
            try:
                self.reload.finish(self.model_config)
            except Exception as e:
                why = f"post-load processing failed: {type(e).__name__}: {e}"
                held = self._abort("failed", FinishFailed.cause)
                self.ended = f"its finish failed ({why}); {held}"
                raise FinishFailed(f"finish_weight_update: {self.ended}") from e
            self._mark_whole(None)
            self._end("ok", "")

    def fail(self, e: BaseException) -> str:
        """Failure ``e`` ends the update; returns what the model holds now, for messages."""
        result = "refused" if isinstance(e, ValueError) else "failed"
        before = self._go(Event.FAIL)
        if before is State.IDLE:  # a call with no update open, counted on its own
            self._count(result, cause_of(e))
        if before in (State.IDLE, State.CANCELLED):  # nothing open: the failure says why
            return self._whole()
        return self._abort(result, cause_of(e))

    def cancel(self, why: str, cause: str) -> None:
        """End the open update early (``cause``: a metrics code); the worker still counts it as
        open."""
        before = self._go(Event.CANCEL)
        if before in (State.OPEN, State.RECEIVED):
            held = self._abort("cancelled", cause)
            self.cancelled = f"the weight update was cancelled because {why}; {held}"
            logger.error("%s", self.cancelled)

    def count_refusal(self, e: BaseException) -> None:
        """Another trainer's call, refused without touching the open update."""
        self._count("refused", cause_of(e))

    @property
    def is_open(self) -> bool:
        """An update is open and waits for a call (its trainer's next one, or ``finish``)."""
        return self.state in (State.OPEN, State.RECEIVED)

    def abandon_due(self) -> bool:
        """The open update saw no call for ``idle_s``."""
        return self.is_open and time.monotonic() >= self.quiet_until

    def abandon(self) -> None:
        """No call came for ``idle_s`` while the update was open: end it."""
        if self.is_open:
            self.cancel(
                f"no call came for {self.idle_s:g} s (timeout_s) while it was open", "abandoned"
            )

    # -- actions -----------------------------------------------------------------------
    def _abort(self, result: str, cause: str) -> str:
        """Undo the open update's reload; what the model holds now."""
        started = time.perf_counter()
        version = f" of version {self.version!r}" if self.version else ""
        try:
            restored, kept, restored_bytes = self.reload.abort(self.model_config)
        except Exception as e:  # processing fails on the old weights too
            logger.exception("undoing the weight update failed")
            restored, kept, restored_bytes = 0, 0, 0
            self._mark_whole(
                f"the {self._part()} not whole: a weight update{version} failed and could not "
                f"be undone ({type(e).__name__}: {e}); {self._until()}"
            )
        if restored:
            seconds = time.perf_counter() - started
            figures = {"weight_restore_bytes": restored_bytes, "weight_restore_seconds": seconds}
            metrics.record(figures, backend=self.backend)
        if kept:
            self._mark_whole(
                f"the {self._part()} not whole: a weight update{version} failed after {kept} "
                f"layer(s) had taken new weights (on_failure=hold); {self._until()}"
            )
        elif self.readiness.state is Readiness.UPDATING:
            self.readiness.set(Readiness.WHOLE)  # no layer took new weights
        self._end(result, cause)
        if restored:
            return f"model unchanged (the old weights were restored in {restored} layer(s))"
        return self._whole()

    def _whole(self) -> str:
        if self.readiness.refusal:
            return f"{self.readiness.refusal} (still, from an earlier failed update)"
        return "model unchanged"

    def _part(self) -> str:
        return "weights are" if self.model is self.target else "drafter's weights are"

    def _until(self) -> str:
        update = "a weight update" if self.model is self.target else "an update of the drafter"
        return f"generation is refused until {update} completes"

    def _mark_whole(self, why: str | None) -> None:
        """The loaded model's weights are whole (None) or not (``why``)."""
        if self.model is self.target:
            self.readiness.set(Readiness.NOT_WHOLE if why else Readiness.WHOLE, why)
            return
        self.readiness.set_drafter(why)
        if self.readiness.state is Readiness.UPDATING:
            self.readiness.set(Readiness.WHOLE)

    def _count(self, result: str, cause: str) -> None:
        labels = {"side": "engine", "backend": self.backend}
        metrics.record({"weight_updates": 1}, **labels, result=result, cause=cause)

    def _end(self, result: str, cause: str) -> None:
        """Count the update; give the receive pool back (to the device too after a completed
        update, unless a collective may be queued); drop the guard unless the weights are not
        whole."""
        self._count(result, cause)
        self.ended = f"{result} ({cause})" if cause else result
        metrics.record(self.moved, side="engine", backend=self.backend)
        self.version = None
        self.model, self.model_config = self.target, self.target_config
        self._set_guard()
        allocated, peak = self.pool.end_update()
        if allocated and result == "ok" and time.monotonic() >= self.hw.hang_until:
            self.hw.empty_cache()  # a device-wide sync: never behind a hung collective
        mib = [n / 2**20 for n in (allocated, peak, self.pool.max_bytes)]
        text = "receive pool: %.1f MiB allocated by this update, peak %.1f MiB (bound %.1f MiB)"
        logger.info(text, *mib)

    def _set_guard(self) -> None:
        """The forward pre-hook is on while an update is open or the weights are not whole."""
        wanted = self.state is not State.IDLE and self.state is not State.CANCELLED
        wanted = wanted or self.readiness.refusal is not None
        if wanted and self._guard is None:
            self._guard = self.target.register_forward_pre_hook(self._forward)
        elif not wanted and self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: cancel an open update (no token from half-loaded layers); refuse
        to run on weights that are not whole."""
        if self.state in (State.OPEN, State.RECEIVED):
            self.cancel(
                "generation ran while it was open: pause generation (/pause) before "
                "start_weight_update",
                "generation_ran",
            )
        if self.readiness.refusal:
            raise RuntimeError(f"refusing to run the model: {self.readiness.refusal}")


def _check_drafter(drafter: torch.nn.Module, target: torch.nn.Module) -> None:
    """Refuse to update a drafter that shares parameters with the served model (EAGLE's and
    MTP's embedding or head, vLLM's ``_maybe_share_*`` and vllm-ascend's): its update would write
    the served model's weights, which vLLM's loading never does (a target update carries them)."""
    served = {id(p) for p in target.parameters()}  # buffers (rotary caches) are not loaded
    shared = [name for name, p in drafter.named_parameters() if id(p) in served]
    if shared:
        raise WeightUpdateRefused(
            f"refused draft weight update: the drafter shares {len(shared)} parameter(s) with the "
            f"served model ({', '.join(shared[:3])}...), which a target update carries; only "
            "drafters with weights of their own are updated",
            "draft_shares_target",
        )
