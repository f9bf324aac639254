"""Trainer-side pieces shared by the HCCL and NPU-IPC engines.

The control plane is vLLM's ``VLLMWeightSyncClient`` (usually ``HTTPVLLMWeightSyncClient``).
Calls that block while the data plane runs go to daemon threads (a stuck HTTP call must never
keep the trainer process alive), and HTTP errors are re-raised with the server's own message,
which ``raise_for_status`` would drop.
"""

from __future__ import annotations

import sys
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from vllm_ascend_rl.device import Device, current_device
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.weight_transfer.buckets import Bucket, TensorSpec, total_bytes
from vllm_ascend_rl.weight_transfer.channel import STALE_HANDSHAKE, ChannelError
from vllm_ascend_rl.weight_transfer.delta import STALE_BASE, DeltaPlan, TrainerBase, wire_specs
from vllm_ascend_rl.weight_transfer.doorbell import DoorbellError
from vllm_ascend_rl.weight_transfer.probe import TrainerTransportProbe
from vllm_ascend_rl.weight_transfer.wire import plan_for

logger = get_logger(__name__)
Pairs = Iterator[tuple[str, Any]]


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says which side failed and why."""


# Failures of the connection itself (as opposed to bugs in the caller's weight source).
TRANSPORT_ERRORS = (ChannelError, DoorbellError, WeightSyncError)


@dataclass(frozen=True)
class SyncResult:
    """What one ``send_weights()`` moved: bytes, wall seconds, and throughput."""

    bytes: int
    seconds: float  # start_weight_update .. finish_weight_update returned
    num_tensors: int
    num_buckets: int
    weight_version: str | None = None
    transfer_seconds: float = 0.0  # data plane only: first byte sent .. last byte landed

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second, end to end."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# The worker refuses a second start while one is open: vLLM v1/worker/gpu_worker.py
# _start_weight_update (0.27.1 and 0.32), vllm-ascend worker/worker.py:303 (182b75e).
ABANDONED_UPDATE = "start_weight_update called while a weight update is already active"

NOT_PAUSED = (
    "the engine is not paused: pause it before send_weights (/pause, "
    "EngineControlClient.pause) and resume after. A forward pass during an update would run "
    "on half-loaded layers, and under full graph replay (vLLM 0.27.1's default; vllm-ascend's "
    "ACL graphs) no hook can stop it. Or init with on_failure='hold', which holds generation "
    "in the plugin scheduler while an update is open. Nothing was sent."
)


def engine_paused(client: Any) -> bool | None:
    """Whether the engine behind ``client`` is paused: asked over HTTP (``/is_paused``) for
    an HTTP client, through ``client.is_paused()`` where it has one; None if it cannot tell."""
    ask = getattr(client, "is_paused", None)
    if callable(ask):
        return ask()
    base_url = getattr(client, "base_url", None)
    if not base_url:
        return None
    from vllm_ascend_rl.client import EngineControlClient, EngineControlError

    try:
        return EngineControlClient(base_url, timeout_s=30).is_paused()
    except EngineControlError as e:
        raise WeightSyncError(f"could not tell whether the engine is paused: {e}") from e


def server_message(e: BaseException) -> str:
    """The most useful text of an exception from a weight-sync client call."""
    response = getattr(e, "response", None)
    if response is not None:
        from vllm_ascend_rl.client import error_message

        return f"HTTP {response.status_code}: {error_message(response)}"
    import requests

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
        self._thread = threading.Thread(
            target=self._run, args=(fn, args), daemon=True, name=f"weight-sync-{what}"
        )
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # handed to the caller thread
            self.error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the call to end; True if it has."""
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

    def failure(self, timeout_s: float) -> str | None:
        """Wait for the call to end; its error message, or None if it succeeded."""
        self._done.wait(timeout_s)
        if not self._done.is_set():
            return f"{self.what} did not return within {timeout_s:.0f}s"
        return None if self.error is None else server_message(self.error)


def check_world_size(client: Any, world_size: int, timeout_s: float = 30) -> None:
    """With an HTTP client, compare ``world_size`` with the server's before any rendezvous."""
    base_url = getattr(client, "base_url", None)
    if not base_url:
        return
    import requests

    try:
        r = requests.get(
            f"{base_url}/get_world_size", params={"include_dp": "true"}, timeout=timeout_s
        )
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


class Progress:
    """A byte progress bar for long transfers; silent when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool | None, desc: str) -> None:
        show = enabled if enabled is not None else (total >= 512 << 20 and sys.stderr.isatty())
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)
        self.start = time.perf_counter()

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> float:
        """Close the bar (idempotent); seconds since it was created."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return time.perf_counter() - self.start


class CheckpointTrainer(TrainerTransportProbe, TrainerWeightTransferEngine):
    """Trainer-side template shared by the HCCL and NPU-IPC engines.

    ``send_weights`` drives ``start_weight_update``, ``update_weights`` (in a daemon thread,
    since the engine blocks in it while the data moves) and ``finish_weight_update``. A
    transport implements ``_connect``, ``_not_ready``, ``_payload``, ``_agree``, ``_send`` and
    ``_abort``; a refusal in ``_agree`` leaves the connection usable, a failure after it does
    not.
    """

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info,
        device: Device | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        # delta=True: what the engine holds, to send only what changed (see delta.py)
        self.base = TrainerBase() if init_info.delta and init_info.is_sender else None
        # Read once, here: on NPU the current device is per thread, and the rendezvous and
        # the HTTP calls run on helper threads. A CPU trainer rank emulates its own chip.
        self.hw = device or current_device(cpu_chip=init_info.rank)

    transport: ClassVar[str] = "this"  # for messages

    @classmethod
    def trainer_init(
        cls,
        init_info,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(
                f"{cls.transport} weight transfer needs a WeightSource (e.g. ModuleSource)"
            )
        engine = cls(client=client, source=source, init_info=init_info)
        engine._connect()
        return engine

    # -- transport hooks ---------------------------------------------------------------
    @abstractmethod
    def _connect(self) -> None:
        """Set up the connections this rank needs (runs on every trainer rank; the sender
        also issues ``init_weight_transfer_engine``)."""

    alone_bytes: ClassVar[int | None] = None  # as on the engine side (plan_for)

    def _plan(self, specs: list[TensorSpec]) -> list[Bucket]:
        return plan_for(self.init_info, specs, self.alone_bytes)

    @abstractmethod
    def _not_ready(self) -> str | None:
        """Why the connection cannot carry an update now, or None."""

    @abstractmethod
    def _payload(self, specs: list[TensorSpec], plan: list[Bucket]) -> dict: ...

    @abstractmethod
    def _agree(self, specs: list[TensorSpec], update: BackgroundCall) -> bool:
        """True if every engine goes ahead; False if one refused (its reason is in
        ``update``)."""

    @abstractmethod
    def _send(
        self, plan: list[Bucket], pairs: Pairs, update: BackgroundCall, bar: Progress
    ) -> None:
        """Send ``pairs`` (``(name, tensor)`` in plan order) bucket by bucket."""

    @abstractmethod
    def _abort(self) -> None:
        """Give up the connection after a failure in the middle of an update."""

    def _succeeded(self) -> None:
        """Called after ``finish_weight_update`` returned."""

    def _cancel(self, reason: str) -> None:
        """The sender gave up an update before any engine saw it (start_weight_update
        failed); tell whoever waits for it."""

    def _follow(self, specs: list[TensorSpec], plan: list[Bucket]) -> None:
        """A non-sender rank's part of an update. By default it only iterates the source,
        which keeps it in the source's gather collectives."""
        for _ in self.source:
            pass

    # -- the update --------------------------------------------------------------------
    def _require_paused(self) -> None:
        """Refuse to open an update while the engine generates (unless ``hold``): the
        engine's forward guard is a Python hook, which graph replay bypasses."""
        if self.init_info.on_failure == "hold":
            return
        paused = engine_paused(self.client)
        if paused is None:
            logger.warning("cannot tell whether %s is paused: pause it first", self.engine_name)
        elif not paused:
            raise WeightSyncError(NOT_PAUSED)

    def _start_update(self) -> None:
        """``start_weight_update``; if vLLM's worker still counts an abandoned update as open
        (a trainer died before ``finish_weight_update``), end that one first. Our engines'
        finish applies an abandoned update only if all its weights arrived, and restores the
        old weights otherwise, so the model is whole either way."""
        try:
            call("start_weight_update", self.client.start_weight_update)
        except WeightSyncError as e:
            if ABANDONED_UPDATE not in str(e):
                raise
            logger.warning("ending a weight update another trainer left open: %s", e)
            call("finish_weight_update", self.client.finish_weight_update, None)
            call("start_weight_update", self.client.start_weight_update)

    def _open_update(self, specs: list[TensorSpec], payload: dict) -> BackgroundCall:
        """start_weight_update, then update_weights (in the background) and the handshake.
        Retried once if the handshake met an earlier refused call's (STALE_HANDSHAKE)."""
        for attempt in (1, 2):
            try:
                self._require_paused()
                self._start_update()
            except WeightSyncError as e:
                self._cancel(str(e))
                raise
            update = BackgroundCall("update_weights", self.client.update_weights, payload)
            try:
                go = self._agree(specs, update)
            except TRANSPORT_ERRORS as e:
                self._abort()
                raise WeightSyncError(f"update handshake failed: {update.failure(5) or e}") from e
            if go:
                return update
            # Refused before any byte moved; the connection stays usable.
            reason = update.failure(self.init_info.timeout_s)
            if attempt == 1 and reason and STALE_HANDSHAKE in reason:
                logger.warning("retrying the update: %s", reason)
                continue
            raise WeightSyncError(f"engine refused the update: {reason}")
        raise AssertionError("unreachable")

    @property
    def engine_name(self) -> str:
        """The engine this trainer feeds, for messages."""
        url = getattr(self.client, "base_url", None)
        return f"the engine at {url}" if url else f"the engine behind {type(self.client).__name__}"

    def send_weights(
        self, weight_version: str | None = None, progress: bool | None = None
    ) -> SyncResult:
        """Push every weight of the source into the engine: start, update, finish.

        Returns bytes, seconds and GB/s. ``weight_version`` is passed to
        ``finish_weight_update`` and tags subsequent outputs. ``progress`` shows a byte
        progress bar (default: for transfers of 512 MiB or more on a terminal). A failure
        raises WeightSyncError naming the engine.
        """
        try:
            return self._send_weights(weight_version, progress)
        except WeightSyncError as e:
            raise WeightSyncError(f"weight sync to {self.engine_name}: {e}") from e

    def _send_weights(self, weight_version: str | None, progress: bool | None) -> SyncResult:
        assert self.source is not None
        specs = [TensorSpec(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]
        if not self.is_sender:
            plan = self._plan(specs)
            self._follow(specs, plan)
            return SyncResult(0, 0.0, len(specs), len(plan), weight_version)
        reason = self._not_ready()
        if reason:
            raise WeightSyncError(
                f"weight transfer is not usable ({reason}): call trainer_init again"
            )
        started = time.perf_counter()
        delta = None if self.base is None else self.base.encode(iter(self.source))
        try:
            return self._transfer(specs, delta, weight_version, progress, started)
        except WeightSyncError as e:
            if delta is None or delta.base_version is None or STALE_BASE not in str(e):
                raise
            # The engine's base is not ours (it restarted, or its weights were reloaded):
            # refused before any byte moved; send every tensor whole once.
            logger.warning("sending whole tensors: %s", e)
            return self._transfer(specs, self.base.whole(delta), weight_version, progress, started)

    def _rollback_base(self) -> None:
        if self.base is not None:
            self.base.rollback()

    def _transfer(
        self,
        specs: list[TensorSpec],
        delta: DeltaPlan | None,
        weight_version: str | None,
        progress: bool | None,
        started: float,
    ) -> SyncResult:
        """One update of ``specs`` (whole, or as ``delta`` encoded them)."""
        wire = specs if delta is None else wire_specs(specs, delta.nnz)
        plan = self._plan(wire)
        nbytes, timeout_s = total_bytes(wire), self.init_info.timeout_s
        try:
            payload = self._payload(specs, plan)  # before the engine opens an update
            if weight_version is not None:
                payload["weight_version"] = weight_version
            if delta is not None:
                payload.update(delta.payload)
        except TRANSPORT_ERRORS as e:
            self._abort()
            raise WeightSyncError(f"preparing the update failed: {e}") from e
        update = self._open_update(wire, payload)
        bar = Progress(nbytes, progress, "weights -> engine")
        try:
            self._send(
                plan, iter(self.source) if delta is None else delta.wire_pairs(), update, bar
            )
            transfer_s = bar.close()
            if delta is not None:  # while the engine still loads; undone if it fails
                self.base.apply(delta)
            update.result(timeout_s)
        except TRANSPORT_ERRORS as e:
            self._abort()  # the engine notices at once instead of after its timeout
            self._rollback_base()
            reason = update.failure(min(timeout_s, 30.0))
            raise WeightSyncError(f"weight transfer failed: {reason or e}") from e
        except BaseException:
            self._abort()
            self._rollback_base()
            raise
        finally:
            bar.close()
        try:
            call("finish_weight_update", self.client.finish_weight_update, weight_version)
        except BaseException:
            self._rollback_base()
            raise
        self._succeeded()
        if delta is not None:
            self.base.commit()
        return SyncResult(
            nbytes, time.perf_counter() - started, len(specs), len(plan), weight_version, transfer_s
        )
