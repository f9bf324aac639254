"""The trainer side both transports share: :class:`TrainerTransport` writes ``send_weights``
(start, update, finish over vLLM's ``VLLMWeightSyncClient``) once, and each transport implements
its steps. Blocking client calls run in daemon threads (a stuck HTTP call must not keep the
trainer alive); HTTP errors keep the server's message, which ``raise_for_status`` drops."""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import requests
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from vllm_ascend_rl import metrics
from vllm_ascend_rl.client import EngineControlClient, EngineControlError, error_message
from vllm_ascend_rl.device import current_device
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import StepHold
from vllm_ascend_rl.weight_transfer import TransportError
from vllm_ascend_rl.weight_transfer.buckets import Bucket, TensorSpec, total_bytes
from vllm_ascend_rl.weight_transfer.wire import CheckpointUpdateInfo, Verdict, plan_for

if TYPE_CHECKING:
    from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo
    from vllm_ascend_rl.weight_transfer.npu_ipc import NPUIPCTrainerInitInfo

logger = get_logger(__name__)
Pairs = Iterator[tuple[str, Any]]
InfoT = TypeVar("InfoT", "HCCLTrainerInitInfo", "NPUIPCTrainerInitInfo")


class WeightSyncError(TransportError):
    """A weight sync failed; the message says which side failed and why, ``cause`` is its
    metrics code (refusals: :data:`REFUSALS`)."""

    def __init__(self, message: str, cause: str = "engine_call") -> None:
        super().__init__(message)
        self.cause = cause


# Causes of a sync refused before any byte moved (the weights are the old ones).
REFUSALS = ("refused_by_engine", "not_connected", "not_paused")


@dataclass(frozen=True)
class SyncResult:
    """What one ``send_weights()`` moved, and how fast."""

    bytes: int
    seconds: float  # start_weight_update .. finish_weight_update returned
    num_tensors: int
    num_buckets: int
    weight_version: str | None = None

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second, end to end."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def server_message(e: BaseException) -> str:
    """The most useful text of an exception from a weight-sync client call."""
    response = getattr(e, "response", None)
    if response is not None:
        return f"HTTP {response.status_code}: {error_message(response)}"
    if isinstance(e, requests.ConnectionError):
        return f"the engine's server is unreachable or died ({type(e).__name__}: {e})"
    return f"{type(e).__name__}: {e}"


def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a client method; raise WeightSyncError with the engine's message on failure."""
    try:
        return fn(*args)
    except Exception as e:
        raise WeightSyncError(f"{what} failed: {server_message(e)}") from e


class BackgroundCall:
    """Run a blocking client call in a daemon thread while the data plane runs."""

    def __init__(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        self.what = what
        self._result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(
            target=self._run, args=(fn, args), daemon=True, name=f"weight-sync-{what}"
        ).start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # handed to the caller thread
            self.error = e
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def raise_if_failed(self) -> None:
        """Poll hook: raise at once if the call already failed."""
        if self._done.is_set() and self.error is not None:
            raise WeightSyncError(f"{self.what} failed: {server_message(self.error)}")

    def result(self, timeout_s: float) -> Any:
        if not self._done.wait(timeout_s):
            raise WeightSyncError(f"{self.what} did not return within {timeout_s:.0f}s")
        self.raise_if_failed()
        return self._result

    def failure(self, timeout_s: float | None) -> str | None:
        """Wait for the call to end (``timeout_s`` None: as long as the call takes); its error
        message, or None if it succeeded."""
        if not self._done.wait(timeout_s):
            return f"{self.what} did not return within {timeout_s:.0f}s"
        return None if self.error is None else server_message(self.error)


def check_world_size(client: Any, world_size: int, timeout_s: float = 30) -> None:
    """Refuse, before any rendezvous, a ``world_size`` other than the HTTP server's workers + 1."""
    base_url = getattr(client, "base_url", None)
    if not base_url:
        return
    try:
        r = requests.get(f"{base_url}/get_world_size?include_dp=true", timeout=timeout_s)
        r.raise_for_status()
        workers = int(r.json()["world_size"])
    except Exception as e:  # the init call will report an unreachable server itself
        logger.warning("could not read the engine's world size from %s: %s", base_url, e)
        return
    if world_size != workers + 1:
        raise ValueError(
            f"world_size={world_size} but the engine at {base_url} has {workers} "
            f"worker(s): world_size must be {workers + 1} (trainer + workers)"
        )


def source_specs(source: WeightSource) -> list[TensorSpec]:
    return [TensorSpec(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]


def engine_name(client: Any) -> str:
    url = getattr(client, "base_url", None)
    return f"the engine at {url}" if url else f"the engine behind {type(client).__name__}"


class TrainerTransport(TrainerWeightTransferEngine[InfoT]):
    """A trainer engine: ``send_weights`` is written here once; a transport implements the
    steps below it. Every trainer rank calls ``trainer_init`` and ``send_weights``; the sender
    (rank 0) drives the update and counts its outcome (:mod:`vllm_ascend_rl.metrics`)."""

    transport: ClassVar[str]  # for messages: "HCCL", "NPU-IPC"
    alone_bytes: ClassVar[int | None]  # see plan_for
    source: WeightSource  # trainer_init refuses a missing source

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, init_info: InfoT
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info: InfoT = init_info
        # Read once, here: on NPU the current device is per thread, and the rendezvous and
        # the HTTP calls run on helper threads. A CPU trainer rank emulates its own chip.
        self.hw = current_device()
        self.step_hold = StepHold.GATE  # what holds the engine's steps (init handshake)

    @classmethod
    def trainer_init(
        cls,
        init_info: InfoT,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(
                f"{cls.transport} weight transfer needs a WeightSource (e.g. ModuleSource)"
            )
        engine = cls(client=client, source=source, init_info=init_info)
        engine.connect()
        return engine

    # vLLM's returns None: ours says what the update moved.
    def send_weights(  # type: ignore[override]
        self,
        weight_version: str | None = None,
        *,
        source: WeightSource | None = None,
        draft: bool = False,
    ) -> SyncResult:
        """Push ``source`` (default: ``trainer_init``'s) into the engine (start, update,
        finish); ``weight_version`` tags later outputs. ``draft=True`` updates the engine's
        speculative-decoding drafter (``/start_draft_weight_update``), a session of its own:
        send the target, then the drafter. Raises WeightSyncError."""
        labels = {"side": "trainer", "backend": self.init_info.backend}
        try:
            done = self._send(weight_version, source or self.source, draft)
        except Exception as e:
            cause = getattr(e, "cause", "source") if self.is_sender else None
            if cause:
                result = "refused" if cause in REFUSALS else "failed"
                metrics.record({"weight_updates": 1}, **labels, result=result, cause=cause)
            if isinstance(e, WeightSyncError):
                where = engine_name(self.client)
                raise WeightSyncError(f"weight sync to {where}: {e}", e.cause) from e
            raise
        if self.is_sender:
            metrics.record({"weight_updates": 1}, **labels, result="ok", cause="")
            moved = {
                "weight_update_bytes": done.bytes,
                "weight_update_transport_seconds": done.seconds,
            }
            metrics.record(moved, **labels)
        return done

    def _send(self, weight_version: str | None, source: WeightSource, draft: bool) -> SyncResult:
        specs = source_specs(source)
        plan = plan_for(self.init_info, specs, self.alone_bytes)
        reason = self.not_ready()
        if reason:
            raise WeightSyncError(
                f"weight transfer is not usable ({reason}): call trainer_init again",
                "not_connected",
            )
        if not self.is_sender:
            self.follow(specs, plan, source)
            return SyncResult(0, 0.0, len(specs), len(plan), weight_version)
        started = time.perf_counter()
        nbytes, timeout_s = total_bytes(specs), self.init_info.timeout_s
        try:
            payload = self.payload(specs, plan)  # before the engine opens an update
        except TransportError as e:
            self.abort()
            raise WeightSyncError(f"preparing the update failed: {e}", "transfer") from e
        if weight_version is not None:
            payload["weight_version"] = weight_version
        update = self._open_update(plan, payload, draft)
        try:
            self.send(plan, iter(source), update)
            update.result(timeout_s)
        except BaseException as e:
            self.abort()  # the engine notices at once instead of after its timeout
            if not isinstance(e, TransportError):
                raise
            reason = update.failure(min(timeout_s, 30.0))
            raise WeightSyncError(f"weight transfer failed: {reason or e}", "transfer") from e
        call("finish_weight_update", self.client.finish_weight_update, weight_version)
        self.succeeded()
        seconds = time.perf_counter() - started
        return SyncResult(nbytes, seconds, len(specs), len(plan), weight_version)

    def _open_update(self, plan: list[Bucket], payload: dict, draft: bool) -> BackgroundCall:
        """start_weight_update (or the drafter's), then update_weights (in the background) and
        the handshake."""
        try:
            if self.step_hold is not StepHold.GATE:
                require_paused(self.client, self.step_hold)
            start_update(self.client, draft)
        except WeightSyncError as e:
            self.cancel(str(e))
            raise
        update = BackgroundCall("update_weights", self.client.update_weights, payload)
        try:
            verdict = self.agree(plan, update)
        except TransportError as e:
            self.abort()
            raise WeightSyncError(
                f"update handshake failed: {update.failure(5) or e}", "transfer"
            ) from e
        if verdict != Verdict.GO:  # refused before any byte moved; the connection stays usable
            reason = update.failure(self.init_info.timeout_s)
            raise WeightSyncError(f"engine refused the update: {reason}", "refused_by_engine")
        return update

    # -- the transport's steps ----------------------------------------------------------
    @abstractmethod
    def connect(self) -> None:
        """At ``trainer_init``, on every rank: connect to the engine and learn its step hold."""

    @abstractmethod
    def not_ready(self) -> str | None:
        """Why this rank's connection cannot carry an update now, or None."""

    def payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict:
        """The transport's update_info fields for this update."""
        return CheckpointUpdateInfo.fields_from_specs(specs)

    @abstractmethod
    def agree(self, plan: list[Bucket], update: BackgroundCall) -> Verdict:
        """The lowest verdict of every engine worker (the update call runs in ``update``)."""

    @abstractmethod
    def send(self, plan: list[Bucket], pairs: Pairs, update: BackgroundCall) -> None:
        """Send ``pairs`` (``(name, tensor)`` in plan order) bucket by bucket."""

    @abstractmethod
    def abort(self) -> None:
        """Give up the connection after a failure in the middle of an update."""

    def follow(self, specs: list[TensorSpec], plan: list[Bucket], source: WeightSource) -> None:
        """A non-sender rank's part of an update; by default it only iterates ``source`` (its
        gathers are collectives)."""
        for _ in source:
            pass

    def succeeded(self) -> None:
        """``finish_weight_update`` returned."""

    def cancel(self, reason: str) -> None:
        """The update was given up before any engine saw it (refused, or start_weight_update
        failed)."""


UNHELD = {
    StepHold.NONE: "its scheduler has no step gate (not the plugin's, or replaced by "
    "vllm-ascend's scheduler options)",
    StepHold.LOCKSTEP: "it serves a MoE model with data parallel, whose engine cores step "
    "together, dummy batches included",
}


def require_paused(client: Any, hold: StepHold) -> None:
    """Refuse, before the update opens, to sync an engine whose steps nothing holds unless it
    is paused (``client.is_paused()``, else ``/is_paused``; unknown counts as not paused)."""
    ask, url = getattr(client, "is_paused", None), getattr(client, "base_url", None)
    try:
        paused = (
            ask() if callable(ask) else url and EngineControlClient(url, timeout_s=30).is_paused()
        )
    except EngineControlError:
        paused = None
    if not paused:
        raise WeightSyncError(
            f"refusing to open a weight update while {engine_name(client)} may generate: "
            f"{UNHELD[hold]}, and it is {'not' if paused is False else 'not known to be'} "
            "paused. Pause it first (/pause) and resume after, or serve it with --scheduler-cls "
            "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler (not for MoE with "
            "data parallel). Nothing was sent.",
            "not_paused",
        )


def draft_start(client: Any) -> Callable[[], Any]:
    """``/start_draft_weight_update`` through ``client``: its own method if it has one (vLLM's
    clients have none), else the route at its ``base_url``, else on its Ray ``handles``."""
    own, url = getattr(client, "start_draft_weight_update", None), getattr(client, "base_url", None)
    if callable(own):
        return own
    if url:
        timeout_s = getattr(client, "timeout", 300.0)
        return lambda: EngineControlClient(url, timeout_s=timeout_s).request(
            "POST", "/start_draft_weight_update"
        )

    def on_each_actor() -> Any:  # vLLM's Ray client: AsyncLLM / LLM actors have the method
        import ray

        return ray.get([h.start_draft_weight_update.remote() for h in client.handles])

    return on_each_actor


def start_update(client: Any, draft: bool = False) -> None:
    """``start_weight_update`` (the drafter's if ``draft``); if vLLM's worker still holds an
    update a dead trainer left open, end it (our finish restores the old weights unless all of
    it arrived), retry once."""
    what, start = "start_weight_update", client.start_weight_update
    if draft:
        what, start = "start_draft_weight_update", draft_start(client)
    try:
        call(what, start)
    except WeightSyncError as refused:
        try:
            call("finish_weight_update", client.finish_weight_update, None)
        except WeightSyncError:
            raise refused from None  # nothing was left open: the start's own failure
        logger.warning("ended a weight update another trainer left open: %s", refused)
        call(what, start)
