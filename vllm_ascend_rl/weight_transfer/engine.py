"""The engine (worker) side of both transports: one :class:`AscendRLEngine` writes vLLM's
methods once over an :class:`UpdateSession` (the update's state) and a :class:`Connection`
(who owns the channel, and its link). A transport subclasses it with its info classes and a
``dial`` that returns ``connect(deadline) -> EngineLink``; ``hccl.py`` and ``npu_ipc.py`` do.
Every method vLLM calls holds ``lock``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_ascend_rl import metrics
from vllm_ascend_rl.device import device_for, worker_index
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import StepHold, gate_address
from vllm_ascend_rl.weight_transfer.buckets import Bucket, total_bytes
from vllm_ascend_rl.weight_transfer.connection import Connection, Link, NotOwner
from vllm_ascend_rl.weight_transfer.session import UpdateCancelled, UpdateSession
from vllm_ascend_rl.weight_transfer.validation import (
    ExpectedParam,
    WeightUpdateRefused,
    expected_params,
    validate_update,
)
from vllm_ascend_rl.weight_transfer.wire import (
    CheckpointUpdateInfo,
    EngineInitInfo,
    Verdict,
    WireParams,
    parse_wire,
    plan_for,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

logger = get_logger(__name__)


class EngineLink(Link, Protocol):
    """What a transport does for one update (worker thread, lock held). A link that breaks
    raises; the engine then closes it before anything else runs."""

    def agree(self, verdict: Verdict, reason: str | None, plan: list[Bucket], info: Any) -> None:
        """The handshake: raises (WeightUpdateRefused) unless every side goes ahead with
        ``plan``."""

    def buckets(self, plan: list[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """``plan``'s buckets, each as a uint8 buffer, in order."""


I = TypeVar("I", bound=EngineInitInfo)  # noqa: E741
U = TypeVar("U", bound=CheckpointUpdateInfo)
K = TypeVar("K", bound=EngineLink)


def check_init(vllm_config: Any, wire: WireParams) -> None:
    """Refuse, before any rendezvous, ``hold`` without the plugin scheduler (it refuses
    ``/resume`` while the weights are not whole)."""
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    if wire.on_failure == "hold" and not getattr(scheduler, "refuses_resume_when_not_whole", False):
        raise ValueError(
            f"on_failure='hold' needs the plugin scheduler to refuse /resume while the weights "
            f"are not whole (this engine runs {scheduler.__name__}): start it with "
            "--scheduler-cls vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler, "
            "or use on_failure='restore'"
        )


def refused(verdict: int, same: bool, reason: str | None) -> WeightUpdateRefused | None:
    """The refusal an update handshake's outcome means for this engine, or None to go on."""
    if verdict == Verdict.GO and same:
        return None
    if reason is None and verdict == Verdict.GO:
        reason = "the trainer's plan differs from update_info"
    if reason is None:
        return WeightUpdateRefused("another side refused it", cause="refused_by_peer")
    return WeightUpdateRefused(reason)


class AscendRLEngine(WeightTransferEngine[I, U], Generic[I, U, K]):
    """Loads through vLLM's layerwise reload, refuses bad updates whole, one trainer at a time."""

    backend: ClassVar[str]
    alone_bytes: ClassVar[int | None]  # a tensor above this is sent alone (None: never)
    connects_in_background: ClassVar[bool]  # see connection.py
    # A draft update (vLLM's worker retargets us, set_weight_update_target, before
    # start_weight_update) is vetted against, and loaded into, the drafter (session.py).
    supports_draft_weight_update = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.hw = device_for(device)
        refusal = self.hw.weight_update_refusal()
        if refusal:  # now, not at the first sync
            raise ValueError(refusal)
        workers = self.parallel_config.world_size
        metrics.engine_worker(vllm_config, worker_index(self.parallel_config))
        self.session = UpdateSession(model, self.model_config, self.hw, workers, self.backend)
        self.lock = threading.RLock()
        gate = gate_address(vllm_config)  # now, while the engine core is being built
        self.session.readiness.announce_to(gate, worker_index(self.parallel_config))
        self.connection: Connection[K] = Connection(self.lock, self.hw, self._end_if_abandoned)
        self.init_info: I | None = None
        self.step_hold = StepHold.GATE
        self._expected: dict[int, dict[str, ExpectedParam] | None] = {}

    def dial(self, info: I) -> Callable[[float], K]:
        """Check ``info`` against this worker (ValueError now), and say how to connect."""
        raise NotImplementedError

    # -- vLLM's methods ----------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> I:
        return parse_wire(self.init_info_cls, init_dict, f"init_info for {type(self).__name__}")

    def parse_update_info(self, update_dict: dict[str, Any]) -> U:
        what = f"update_info for {type(self).__name__}"
        return parse_wire(self.update_info_cls, update_dict, what)

    def init_transfer_engine(self, init_info: I) -> None:
        """Claims the channel for ``init_info``'s trainer and connects (see connection.py)."""
        check_init(self.vllm_config, init_info)
        self.step_hold = self.session.readiness.step_hold(self.vllm_config)  # for the trainer
        connect = self.dial(init_info)
        with self.lock:
            self.connection.claim(init_info.trainer_id, init_info.timeout_s)
            self.session.reconnect(
                init_info.on_failure,
                init_info.packed_num_buffers,
                init_info.packed_buffer_size_bytes,
                init_info.timeout_s,
            )
            self.init_info = init_info
        self.connection.start(connect, self.connects_in_background)

    def start_weight_update(self) -> None:
        with self._entered():
            self.connection.link()
            self.session.start(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's parse-receive-synchronize; any failure ends the update (old weights back) and
        its error says what the model holds now. Another trainer's call is refused and leaves
        the owner's open update alone."""
        with self._entered():
            opened = self.session.is_open
            try:
                WeightTransferEngine.update_weights(self, update_info)
            except Exception as e:
                if opened and isinstance(e, NotOwner):
                    self.session.count_refusal(e)
                    raise WeightUpdateRefused(
                        f"refused weight update: {e}. The owner's open update goes on", e.cause
                    ) from e
                state = self.session.fail(e)
                self.reset_weight_update_target()  # as vLLM's worker does; NPUWorker does not
                if isinstance(e, ValueError):  # refusals and malformed calls: nothing loaded
                    raise WeightUpdateRefused(f"refused weight update, {state}: {e}") from e
                if isinstance(e, RuntimeError) and not isinstance(e, UpdateCancelled):
                    raise type(e)(f"{e}; {state}") from e
                raise

    def receive_weights(self, update_info: U) -> None:
        link = self.connection.link(owner=update_info.trainer_id)
        assert self.init_info is not None  # set with the connection
        self.session.receive(update_info.weight_version)
        verdict, reason = self._vet(update_info, self.init_info.validation)
        plan = plan_for(self.init_info, update_info.specs, self.alone_bytes)
        try:
            link.agree(verdict, reason, plan, update_info)
            self.session.load_all(link.buckets(plan), total_bytes(update_info.specs))
        except Exception as e:
            if link.peer_gone() or not isinstance(e, WeightUpdateRefused):
                # First: nothing may wait behind a transfer on a dead peer.
                self.connection.close(f"the update failed: {type(e).__name__}: {e}")
            raise

    def finish_weight_update(self) -> None:
        with self._entered():
            try:
                self.session.finish()
            finally:  # the next update is the served model's unless retargeted again
                self.reset_weight_update_target()

    def shutdown(self) -> None:
        with self._entered():
            self.session.cancel("the weight transfer engine was shut down", "shutdown")
            self.connection.close("the weight transfer engine was shut down")
            self.session.pool.release()

    def _end_if_abandoned(self) -> bool:
        """The connection thread's tick (lock held): end an update left idle past the init's
        ``timeout_s`` (its trainer died or forgot it); whether an update is still open."""
        if self.session.abandon_due():  # the session logs why it cancels it
            with self._entered():
                self.session.abandon()
                self.hw.synchronize()  # the restore's copies are done before the lock goes
        return self.session.is_open

    def release_buffers(self) -> None:
        """Give back the receive pool (e.g. before the engine sleeps)."""
        with self.lock:
            self.session.pool.release()

    def expected(self, model_config: ModelConfig) -> dict[str, ExpectedParam] | None:
        """The parameters of ``model_config``'s checkpoint (the served model's or its
        drafter's; None if they cannot be known), read once."""
        if id(model_config) not in self._expected:
            self._expected[id(model_config)] = expected_params(model_config)
        return self._expected[id(model_config)]

    # -- steps -------------------------------------------------------------------------
    @contextmanager
    def _entered(self) -> Iterator[None]:
        """The lock held and the vLLM config current: vLLM's GPU worker runs the update hooks
        inside ``set_current_vllm_config`` (gpu_worker.py:1514, 1571, 1597 in 0.32.0; 1236,
        1292, 1310 in 0.27.1), vllm-ascend's NPUWorker does not (worker.py:297-336 at
        182b75e): a loader or a layer's post-load processing that reads it works on both."""
        with self.lock, set_current_vllm_config(self.vllm_config):
            yield

    def _vet(self, info: U, validation: str) -> tuple[Verdict, str | None]:
        """This worker's verdict on an update's metadata, and the reason if it is not GO."""
        try:
            session = self.session
            expected = self.expected(session.model_config)
            packed_modules = getattr(session.model, "packed_modules_mapping", None)
            validate_update(info.specs, expected, validation, packed_modules)
        except WeightUpdateRefused as e:
            return Verdict.REFUSED, str(e)
        return Verdict.GO, None
