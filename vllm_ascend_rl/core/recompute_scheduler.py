"""Schedulers for async RL, loaded with ``--scheduler-cls``; the recompute policy and its
guarantees: docs/scheduler.md. Thin subclasses of vLLM's schedulers on purpose: overrides only
wrap upstream's methods, so ``/pause``, ``/resume`` and ``/is_paused`` behave as in vLLM and no
copied loop can drift. ``recompute_mode=bounce`` finishes a victim that ``schedule()`` preempts
for KV blocks (never one preempted elsewhere: ``pause(keep)``, weight updates) with
``finish_reason="abort"``, ``stop_reason="recomputed"`` and its tokens, for the router to
resend; ``local`` (the default) is upstream's preemption."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_ascend_rl.core import BOUNCE_STOP_REASON
from vllm_ascend_rl.core.engine_calls import engine_core_call
from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.readiness import StepGate

logger = get_logger(__name__)

CONFIG_KEY = "ascend_rl"
RECOMPUTE_MODES = ("local", "bounce")
SLEEP_LEVELS = (0, 1, 2)  # 0 pauses scheduling only
CONNECTORS = ("kv_transfer_config", "ec_transfer_config")  # the vllm_config fields bounce refuses
GATE_POLL_S = 0.005  # while the step gate is closed and requests wait: how long a step waits


def recompute_mode_from(additional_config: Any) -> str:
    """The validated ``recompute_mode``: a bad value fails engine start-up, not a request."""
    section = (additional_config or {}).get(CONFIG_KEY, {})
    if not isinstance(section, dict):
        raise ValueError(
            f"--additional-config: {CONFIG_KEY!r} must be an object such as "
            f'{{"{CONFIG_KEY}": {{"recompute_mode": "bounce"}}}}, got {section!r}'
        )
    unknown = set(section) - {"recompute_mode"}
    if unknown:
        raise ValueError(
            f"--additional-config: unknown {CONFIG_KEY} key(s) {sorted(unknown)}; "
            "known: ['recompute_mode']"
        )
    mode = section.get("recompute_mode", "local")
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"--additional-config: {CONFIG_KEY}.recompute_mode must be one of "
            f"{list(RECOMPUTE_MODES)}, got {mode!r}"
        )
    return mode


def refuse_bounce_with_connector(vllm_config: Any) -> None:
    """A bounce frees the victim's KV blocks at once; a KV or EC connector may still be
    sending or receiving them (vLLM delays such frees), so the two cannot run together."""
    if recompute_mode_from(vllm_config.additional_config) != "bounce":
        return
    connectors = [n for n in CONNECTORS if getattr(vllm_config, n, None) is not None]
    if connectors:
        raise ValueError(
            f"{CONFIG_KEY}.recompute_mode=bounce cannot run with a connector "
            f"({', '.join(connectors)}): a bounce frees the request's KV blocks at once, "
            "while the connector may still be transferring them. Use recompute_mode=local."
        )


class RecomputeScheduler(Scheduler):
    """vLLM's synchronous scheduler plus the recompute policy."""

    # The weight-transfer engines accept on_failure="hold" only under a scheduler that
    # refuses /resume while a worker's model is not whole (readiness.py).
    refuses_resume_when_not_whole = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_bounce_with_connector(kwargs.get("vllm_config") or args[0])
        super().__init__(*args, **kwargs)
        self.recompute_mode = recompute_mode_from(self.vllm_config.additional_config)
        self.num_bounced = 0
        self._in_schedule = False
        self._bounced: list[Request] = []  # finished by a bounce, output not delivered yet
        self._asleep: PauseState | None = None  # from a sleep to its wake: the pause before
        self.gate = StepGate(self.vllm_config)
        self._stale_kv = False  # the step gate closed while generating: drop the KV cache
        if self.recompute_mode != "local":
            logger.info("recompute_mode=%s: KV-starved requests are bounced", self.recompute_mode)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """Upstream's, behind the step gate: while a worker's model is not whole nothing is
        scheduled, as under ``pause(keep)``; running requests are preempted when it closes,
        so they resume by recomputing on the weights that reopen it."""
        # Read again after a short wait if closed: no busy loop while it stays closed.
        closed = self._read_step_gate() and self._read_step_gate(GATE_POLL_S)
        if self._stale_kv:
            self._stale_kv = False
            try:
                self.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError as e:  # blocks a KV connector still holds: those stay cached
                logger.error("step gate: the prefix cache could not be reset: %s", e)
            else:
                logger.info("step gate closed: running requests recompute when it opens")
        pause_state = self._pause_state
        if closed:
            self._pause_state = PauseState.PAUSED_ALL
        # Only preemptions made inside schedule() (for KV blocks) may bounce.
        self._in_schedule = True
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self._in_schedule = False
            self._pause_state = pause_state

    def _read_step_gate(self, wait_s: float = 0.0) -> bool:
        """The workers' news; whether the gate is closed (no step may run). A worker that
        became unready while generation was not paused makes the KV cache stale (it was
        computed on weights being replaced): dropped as ``pause(keep)`` with ``clear_cache``
        drops it. Under a pause the pause's own ``clear_cache`` decided."""
        if self.gate.drain(wait_s) and self.pause_state == PauseState.UNPAUSED:
            self._stale_kv = True
        return bool(self.gate.unready)

    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False
    ) -> None:
        if self._in_schedule and self.recompute_mode == "bounce":
            self._bounce(request)
        else:
            super()._preempt_request(request, timestamp, drop_stale_output)

    def _bounce(self, request: Request) -> None:
        """Finish the victim instead of requeueing it. Freeing it returns its blocks for the
        allocation that preempted it and puts its id in this step's ``finished_req_ids``, so
        the worker drops it; tokens still in flight for it (async scheduling) are discarded."""
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = BOUNCE_STOP_REASON
        self._free_request(request)
        self._bounced.append(request)
        self.num_bounced += 1
        logger.info(
            "bounced %s after %d generated tokens (KV cache full; %d bounced so far)",
            request.request_id,
            request.num_output_tokens,
            self.num_bounced,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # A bounce is its own output with no tokens, after every token the victim generated.
        for request in self._bounced:
            outputs.setdefault(request.client_index, EngineCoreOutputs(outputs=[])).outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        self._bounced.clear()
        return outputs

    def get_num_unfinished_requests(self) -> int:
        """None while the step gate is closed, as under PAUSED_ALL: a data-parallel engine
        core then ends its wave at the next DP sync instead of running dummy batches."""
        return 0 if self.gate.unready else super().get_num_unfinished_requests()

    def has_requests(self) -> bool:
        # Keeps the engine stepping until a bounce's output is delivered, and while the step
        # gate holds requests. The engine core asks after every call it runs: the gate's news
        # is read here even when it is idle.
        held = self._read_step_gate() and super().get_num_unfinished_requests() > 0
        return bool(self._bounced) or held or super().has_requests()

    # -- pause state across sleep and memory release ------------------------------------
    def set_pause_state(self, pause_state: PauseState) -> None:
        """Upstream's, except that generation cannot restart while memory is not resident or
        a worker's weights are not whole, and the resume that vLLM's ``wake_up`` issues keeps a
        pause that was in force before the sleep. Which engine-core call is asking:
        :mod:`vllm_ascend_rl.core.engine_calls`."""
        call = engine_core_call(self)
        level = call.args.get("level")
        if call.name == "sleep" and level not in SLEEP_LEVELS:
            # vLLM 0.30.0's /sleep passes any level on and pauses before the workers refuse.
            raise ValueError(f"sleep level {level} is not supported: use 0, 1 or 2")
        if pause_state != PauseState.UNPAUSED:
            if call.name == "sleep" and self._asleep is None:
                self._asleep = self.pause_state  # the pause in force before the sleep
        elif call.name == "wake_up":
            pause_state = self.pause_state if self._asleep is None else self._asleep
            self._asleep = None
            if pause_state != PauseState.UNPAUSED:
                logger.warning(
                    "wake_up: keeping the pause (%s) taken before the engine slept or "
                    "released memory; call /resume to resume generation",
                    pause_state.name,
                )
        else:
            if self._asleep is not None:  # also a sleep still waiting for its pause, or failed
                refusal: str | None = (
                    "the engine was put to sleep, and a step would run on memory that is not "
                    "resident; call /wake_up first (also after a /sleep that failed)"
                )
            else:
                self._read_step_gate()  # the workers' news, read as every step reads it
                refusal = self.gate.resume_refusal()
            if refusal is not None:
                raise RuntimeError(
                    f"refusing to resume generation: {refusal}. The pause stays in force and "
                    "queued requests wait."
                )
        super().set_pause_state(pause_state)


class AsyncRecomputeScheduler(AsyncScheduler, RecomputeScheduler):
    """The same policy over vLLM's ``AsyncScheduler``; also correct under synchronous
    stepping (CPU), so one ``--scheduler-cls`` works on CPU and NPU."""
