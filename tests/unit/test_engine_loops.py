"""The plugin scheduler inside vLLM's own engine-core loops, on each vLLM leg: the
data-parallel loop of MoE engines (``DPEngineCoreProc.run_busy_loop``, with its dummy batches and
DP all-reduce) and async scheduling's batch queue (``EngineCore.step_with_batch_queue``, the
default on NPU; vLLM's CPU platform forces synchronous scheduling, so no CPU server runs it).

The engine cores are skeletons: the loop methods, the scheduler and the DP process group (gloo)
are real; the executor is a STAND-IN with no model (it records what it was asked to run and
answers with :func:`fake_model_output`)."""

from __future__ import annotations

import collections
import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import pytest
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.core import DPEngineCoreProc, EngineCore
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from tests.support import free_port
from tests.support.scheduler import SchedulerHarness, announced, fake_model_output
from vllm_ascend_rl.core.recompute_scheduler import AsyncRecomputeScheduler, RecomputeScheduler
from vllm_ascend_rl.readiness import Readiness


class StandInExecutor:
    """STAND-IN for vLLM's executor: records every batch it is asked to run (scheduled tokens,
    or "dummy") and returns a token for each request past its prefill."""

    is_sleeping = False

    def __init__(self, scheduler: Any) -> None:
        self.scheduler, self.ran, self._pending = scheduler, [], deque()
        self.token = 7

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        """As vLLM's model runner: an empty output at once when nothing is scheduled, else
        None and the tokens from ``sample_tokens``."""
        self.ran.append(scheduler_output.total_num_scheduled_tokens)
        if not scheduler_output.total_num_scheduled_tokens:
            return _done(EMPTY_MODEL_RUNNER_OUTPUT)
        self._pending.append(fake_model_output(self.scheduler, scheduler_output, self.token))
        return _done(None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self._pending.popleft()
        return _done(output) if non_block else output

    def execute_dummy_batch(self) -> None:
        self.ran.append("dummy")

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [None]


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def skeleton(cls: type, harness: SchedulerHarness) -> Any:
    """A ``cls`` engine core with no process, model or client: what its loops read."""
    core = object.__new__(cls)
    core.vllm_config, core.scheduler = harness.vllm_config, harness.scheduler
    core.model_executor = StandInExecutor(harness.scheduler)
    core.log_stats, core.is_mm_encoder_only, core.is_pooling_model = False, False, False
    core.is_ec_consumer = True  # no EC connector to wait for
    core.async_scheduling, core.check_for_draft_tokens = False, False
    core.aborts_queue, core.input_queue, core.output_queue = (queue.Queue() for _ in range(3))
    core.batch_queue, core.batch_queue_size = None, 1
    core._deferred_inputs = collections.deque()  # vLLM 0.34: inputs held for the next step
    core._weight_version = None
    return core


# -- data parallel (MoE): DPEngineCoreProc's loop ------------------------------------------
def dp_rank(rank: int, instance: str | None, iterations: list[int]) -> Any:
    harness = SchedulerHarness(RecomputeScheduler, data_parallel_index=rank, instance_id=instance)
    core = skeleton(DPEngineCoreProc, harness)
    core.harness, core.dp_rank, core.dp_size, core.has_coordinator = harness, rank, 2, False
    core.engines_running, core.current_wave, core.step_counter = True, 0, 0
    core.pending_pause = core.ignore_start_dp_wave = False
    core.dp_sync_interval, core.prefill_schedule_interval = 16, 1
    core.eep_scaling_state, core.publish_dp_lb_stats = None, False
    core.process_input_queue_block, core._idle_state_callbacks = False, []
    core.enable_fault_tolerance = False
    core.step_fn = core.step
    core.shutdown_state = None  # EngineCoreProc.is_running compares it with RUNNING
    left = iterations

    def running() -> bool:  # the loop's guard: a bounded number of iterations
        left[rank] -= 1
        return left[rank] >= 0

    core._handle_shutdown = running
    core.is_running = lambda: True
    return core


def in_threads(fn: Any, cores: list[Any]) -> None:
    """``fn(core)`` for both ranks at once (each in a thread: the DP group needs both)."""
    errors: list[BaseException] = []

    def run(core: Any) -> None:
        try:
            fn(core)
        except SystemExit:  # the end of a busy loop
            pass
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in cores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


@pytest.mark.timeout(180)
def test_a_closed_gate_ends_the_dp_wave_instead_of_running_dummy_batches():
    """Both ranks of a MoE engine generate; each worker opens an update (the gate closes).
    They must stop at the next DP sync, as under PAUSED_ALL: a dummy batch would run the model
    while its weights are being replaced, and a rank in the DP all-reduce would never take the
    update that the trainer's handshake waits for on the other rank."""
    iterations = [3, 3]
    port = free_port()
    first = dp_rank(0, None, iterations)
    cores = [first, dp_rank(1, first.vllm_config.instance_id, iterations)]

    def join_dp_group(core: Any) -> None:
        core.dp_group = stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, core.dp_rank, 2, backend="gloo"
        )

    in_threads(join_dp_group, cores)
    requests = [core.harness.add(40, max_tokens=200) for core in cores]
    in_threads(DPEngineCoreProc.run_busy_loop, cores)  # generating: every rank ran its requests
    assert all(core.model_executor.ran[-1] == 1 for core in cores)
    workers = [announced(core.harness) for core in cores]
    for w in workers:
        w.set(Readiness.UPDATING)
    before = [len(core.model_executor.ran) for core in cores]
    iterations[:] = [40, 40]  # more than a DP sync interval (16 in vLLM 0.32)
    in_threads(DPEngineCoreProc.run_busy_loop, cores)
    for core, n in zip(cores, before, strict=True):
        ran = core.model_executor.ran[n:]
        assert all(r in (0, "dummy") for r in ran), ran  # no token while the gate is closed
        assert ran.count("dummy") <= 32, f"{ran.count('dummy')} dummy batches: the wave went on"
        assert ran[-5:] != ["dummy"] * 5 and not core.engines_running
    for w in workers:
        w.set(Readiness.WHOLE)
    iterations[:] = [3, 3]
    in_threads(DPEngineCoreProc.run_busy_loop, cores)  # the gate open: generation goes on
    assert all(core.model_executor.ran[-1] == 1 for core in cores)
    assert all(r.num_output_tokens > 4 for r in requests)


# -- async scheduling: EngineCore.step_with_batch_queue -------------------------------------
def batch_queue_core(tiny_model) -> Any:
    harness = SchedulerHarness(AsyncRecomputeScheduler, model_path=tiny_model)
    core = skeleton(EngineCore, harness)
    core.harness, core.batch_queue, core.batch_queue_size = harness, deque(), 2
    return core


def steps(core: Any, n: int) -> list:
    """``n`` of vLLM's batch-queue steps; the tokens each delivered, by request."""
    delivered = []
    for _ in range(n):
        outputs, _ = EngineCore.step_with_batch_queue(core)
        for eco in (outputs or {}).values():
            delivered += [(o.request_id, t) for o in eco.outputs for t in o.new_token_ids]
    return delivered


@pytest.mark.parametrize("paused", [False, True], ids=["unpaused", "pause_keep"])
def test_an_update_with_a_batch_in_flight_holds_steps_and_recomputes(tiny_model, paused):
    """Async scheduling: a decode batch is in flight when the worker opens its update
    (unpaused), or when ``pause(keep)`` lands and an update follows. No batch with tokens runs
    while the update is open; the in-flight batch's token (computed on the old weights, before
    the update) is delivered once; the request then recomputes and finishes on the new ones."""
    core = batch_queue_core(tiny_model)
    sched, executor = core.scheduler, core.model_executor
    req = core.harness.add(40, max_tokens=8)
    old = steps(core, 3)  # prefill, then a decode scheduled before the prefill's token is back
    assert len(core.batch_queue) == 1, "no batch in flight"
    if paused:
        sched.set_pause_state(PauseState.PAUSED_ALL)  # what /pause?mode=keep sets first
    worker = announced(core.harness)
    worker.set(Readiness.UPDATING)  # start_weight_update
    ran = len(executor.ran)
    held = steps(core, 4)
    assert all(n == 0 for n in executor.ran[ran:]), executor.ran[ran:]
    worker.set(Readiness.WHOLE)  # finish_weight_update
    if paused:
        sched.set_pause_state(PauseState.UNPAUSED)
        assert req.num_preemptions == 0  # the pause's own clear_cache decides, not the gate
    else:
        assert req.num_preemptions == 1 and req.num_computed_tokens == 0
    executor.token = 9  # the new weights' token
    new = steps(core, 12)
    tokens = [t for rid, t in old + held + new if rid == req.request_id]
    assert req.is_finished() and tokens == list(req.output_token_ids)
    assert len(tokens) == 8 and 9 in tokens and tokens[: tokens.index(9)] == [7] * tokens.index(9)
