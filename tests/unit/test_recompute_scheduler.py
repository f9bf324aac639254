"""The plugin schedulers, driven in-process with vLLM's own config and request objects.

They must behave exactly like vLLM's schedulers under every PauseState: the pause logic is
upstream's own code, inherited, never copied.
"""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.support.scheduler import SchedulerHarness, announced, fake_model_output
from vllm_ascend_rl.core.recompute_scheduler import AsyncRecomputeScheduler, RecomputeScheduler
from vllm_ascend_rl.readiness import Readiness

OURS = [RecomputeScheduler, AsyncRecomputeScheduler]
UPSTREAM_OF = {RecomputeScheduler: Scheduler, AsyncRecomputeScheduler: AsyncScheduler}
INHERITED = ["finish_requests", "pause_state"]


@pytest.fixture(params=OURS, ids=lambda c: c.__name__)
def harness(request, tiny_model) -> SchedulerHarness:
    return SchedulerHarness(request.param, model_path=tiny_model)


def scheduled(out) -> dict[str, int]:
    return dict(out.num_scheduled_tokens)


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_pause_and_scheduling_methods_are_upstreams_own(cls):
    upstream = UPSTREAM_OF[cls]
    assert issubclass(cls, upstream) and issubclass(cls, Scheduler)
    for name in (*INHERITED, "reset_prefix_cache"):
        assert getattr(cls, name) is getattr(upstream, name), f"{cls.__name__}.{name} is a copy"
    assert issubclass(AsyncRecomputeScheduler, RecomputeScheduler)
    mro = AsyncRecomputeScheduler.__mro__
    assert mro.index(AsyncScheduler) < mro.index(RecomputeScheduler) < mro.index(Scheduler)


def test_unpaused_schedules_new_requests(harness):
    r1, r2 = harness.add(40), harness.add(24)
    out, _ = harness.step()
    assert scheduled(out) == {r1.request_id: 40, r2.request_id: 24}
    assert r1.status == r2.status == RequestStatus.RUNNING


def test_paused_new_drains_running_and_admits_nothing(harness):
    sched = harness.scheduler
    running = harness.add(40, max_tokens=3)
    harness.step()
    queued = harness.add(24)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    assert sched.get_num_unfinished_requests() == 1  # only the running request counts
    out, _ = harness.step()
    assert scheduled(out) == {running.request_id: 1}
    assert queued.status == RequestStatus.WAITING
    harness.step()  # third and last token
    assert running.is_finished() and running.num_output_tokens == 3
    assert not sched.has_unfinished_requests(), "a drained PAUSED_NEW engine must be idle"
    out, _ = harness.step()
    assert scheduled(out) == {} and queued.status == RequestStatus.WAITING
    sched.set_pause_state(PauseState.UNPAUSED)
    out, _ = harness.step()
    assert scheduled(out) == {queued.request_id: 24}


def test_paused_all_schedules_nothing_and_keeps_kv(harness):
    sched = harness.scheduler
    running = harness.add(40)
    harness.step()
    queued = harness.add(24)
    blocks_before = sched.kv_cache_manager.get_block_ids(running.request_id)
    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert sched.get_num_unfinished_requests() == 0
    for _ in range(3):
        out, _ = harness.step()
        assert out.total_num_scheduled_tokens == 0
    assert running.status == RequestStatus.RUNNING and running.num_output_tokens == 1
    assert sched.kv_cache_manager.get_block_ids(running.request_id) == blocks_before
    assert queued.status == RequestStatus.WAITING
    sched.set_pause_state(PauseState.UNPAUSED)
    out, _ = harness.step()
    assert scheduled(out) == {running.request_id: 1, queued.request_id: 24}


def test_each_data_parallel_engine_core_has_a_gate_of_its_own(tiny_model):
    """Dense DP: every engine core runs as DP=1 rank 0 with the server's instance_id; only
    ``data_parallel_index`` tells them apart. A worker's open update holds its own core only,
    and a core that cannot bind its gate does not start."""
    cores = [SchedulerHarness(RecomputeScheduler, model_path=tiny_model)]
    instance = cores[0].vllm_config.instance_id
    cores.append(
        SchedulerHarness(
            RecomputeScheduler, model_path=tiny_model, data_parallel_index=1, instance_id=instance
        )
    )
    requests = [core.add(40) for core in cores]
    announced(cores[1]).set(Readiness.UPDATING)  # core 1's worker opens an update
    assert scheduled(cores[0].step()[0]) == {requests[0].request_id: 40}
    assert cores[1].step()[0].total_num_scheduled_tokens == 0
    with pytest.raises(RuntimeError, match=f"another engine core .*'{instance}', 1.* holds it"):
        SchedulerHarness(
            RecomputeScheduler, model_path=tiny_model, data_parallel_index=1, instance_id=instance
        )


def test_an_open_update_holds_every_step_and_running_requests_recompute_on_the_new_weights(
    harness,
):
    sched = harness.scheduler
    req = harness.add(40)
    for _ in range(3):
        harness.step()
    worker0, worker1 = announced(harness, 0), announced(harness, 1)
    worker1.set(Readiness.UPDATING)  # start_weight_update on one worker is enough
    for _ in range(3):
        out, _ = harness.step()
        assert out.total_num_scheduled_tokens == 0, "a step ran during an open update"
    assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert sched.pause_state == PauseState.UNPAUSED  # /is_paused is the user's, unchanged
    queued = harness.add(24)
    worker0.set(Readiness.UPDATING)
    worker1.set(Readiness.WHOLE)
    assert harness.step()[0].total_num_scheduled_tokens == 0  # worker 0 still loading
    worker0.set(Readiness.WHOLE)  # finish_weight_update
    out, _ = harness.step()
    # Prompt plus every token generated before the update, recomputed on the new weights.
    assert scheduled(out) == {req.request_id: 40 + 3, queued.request_id: 24}
    assert req.num_output_tokens == 4 and req.num_preemptions == 1


def test_an_update_that_opened_and_closed_between_steps_still_drops_the_old_kv(harness):
    """An idle engine never scheduled while the update was open: the prefix cache of the old
    weights must not serve the next request."""
    first = harness.add(64, max_tokens=2)
    harness.step(), harness.step()
    assert first.is_finished()
    worker = announced(harness)
    worker.set(Readiness.UPDATING)
    worker.set(Readiness.WHOLE)
    again = harness.add(64)  # the same prompt: two full blocks cached before the update
    out, _ = harness.step()
    assert scheduled(out) == {again.request_id: 64}  # no block served from the cache


def test_an_update_under_a_pause_keeps_the_kv_cache_as_the_pause_chose(harness):
    """``pause(keep, clear_cache=false)`` then a sync: the trainer chose stale KV, and the
    gate does not override it (only an update that meets generation drops the cache)."""
    sched = harness.scheduler
    req = harness.add(40)
    for _ in range(3):
        harness.step()
    sched.set_pause_state(PauseState.PAUSED_ALL)  # /pause?mode=keep&clear_cache=false
    worker = announced(harness)
    worker.set(Readiness.UPDATING)
    sched.has_requests()  # the engine core reads the gate after the call that opened it
    worker.set(Readiness.WHOLE)
    sched.has_requests()
    sched.set_pause_state(PauseState.UNPAUSED)
    assert scheduled(harness.step()[0]) == {req.request_id: 1}  # decodes on, no recompute
    assert req.num_preemptions == 0


def test_weights_not_whole_hold_steps_until_a_complete_update(harness):
    req = harness.add(40)
    harness.step()
    worker = announced(harness)
    worker.set(Readiness.NOT_WHOLE, "a hold update failed")
    for _ in range(2):
        assert harness.step()[0].total_num_scheduled_tokens == 0
    worker.set(Readiness.WHOLE)
    assert scheduled(harness.step()[0]) == {req.request_id: 40 + 1}


def test_a_resume_waits_for_a_model_the_gate_was_told_is_not_whole(harness):
    """The step gate answers a resume too, with no call to the workers: a model that is not
    whole refuses it, an open update does not (the gate holds the steps until it ends)."""
    sched = harness.scheduler
    sched.set_pause_state(PauseState.PAUSED_NEW)
    worker = announced(harness)
    worker.set(Readiness.NOT_WHOLE, "a hold update failed")
    with pytest.raises(RuntimeError, match="refusing to resume generation: a hold update failed"):
        sched.set_pause_state(PauseState.UNPAUSED)
    assert sched.pause_state == PauseState.PAUSED_NEW
    worker.set(Readiness.UPDATING)
    sched.set_pause_state(PauseState.UNPAUSED)
    assert sched.pause_state == PauseState.UNPAUSED


@pytest.mark.timeout(60)
def test_sixteen_workers_announcing_many_changes_between_two_reads(harness):
    """An engine core busy in one long call reads nothing meanwhile: announcements queue up
    without blocking a worker (a datagram queue holds only ``net.unix.max_dgram_qlen``, 10)."""
    req = harness.add(40)
    harness.step()
    workers = [announced(harness, w) for w in range(16)]
    for _ in range(20):
        for w in workers:
            w.set(Readiness.UPDATING)
            w.set(Readiness.WHOLE)
    workers[7].set(Readiness.UPDATING)
    assert harness.step()[0].total_num_scheduled_tokens == 0
    workers[7].set(Readiness.WHOLE)
    assert scheduled(harness.step()[0]) == {req.request_id: 40 + 1}


def test_a_resume_waits_while_a_worker_announced_released_memory(harness):
    """A sleepable worker announces which sleep pools are released (its sleep backend, after
    a sleep, a staged wake or a discard): a resume is refused, naming them, until it announces
    them resident again; steps are not held by it (the sleep's own pause holds them)."""
    sched = harness.scheduler
    req = harness.add(40)
    harness.step()
    sched.set_pause_state(PauseState.PAUSED_NEW)
    worker = announced(harness)
    worker.set_released(["kv_cache"])  # /release_kv_cache_memory, or a wake of the weights only
    with pytest.raises(RuntimeError, match=r"memory is not resident \(kv_cache released\)"):
        sched.set_pause_state(PauseState.UNPAUSED)
    assert sched.pause_state == PauseState.PAUSED_NEW
    worker.set_released([])
    sched.set_pause_state(PauseState.UNPAUSED)
    assert scheduled(harness.step()[0]) == {req.request_id: 1}


def test_reset_prefix_cache_preempts_running_requests_for_recompute(harness):
    sched = harness.scheduler
    req = harness.add(40)
    for _ in range(3):
        harness.step()
    assert req.num_output_tokens == 3
    sched.set_pause_state(PauseState.PAUSED_ALL)  # what /pause?mode=keep does first
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert req.status == RequestStatus.PREEMPTED
    assert req.num_computed_tokens == 0 and req.num_preemptions == 1
    assert req not in sched.running and req in sched.waiting
    assert (
        sched.kv_cache_manager.block_pool.get_num_free_blocks()
        == sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
    )  # all but the null block
    out, _ = harness.step()
    assert out.total_num_scheduled_tokens == 0, "paused: the preempted request must wait"
    sched.set_pause_state(PauseState.UNPAUSED)
    out, _ = harness.step()
    # Recompute: prompt plus every generated token is prefilled again, on the V1 resume path.
    assert scheduled(out) == {req.request_id: 40 + 3}
    resumed = getattr(out.scheduled_cached_reqs, "resumed_req_ids", None)
    if resumed is None:  # vLLM 0.34: a resumed request is re-sent in full, as a new one
        resumed = {r.req_id for r in out.scheduled_new_reqs}
    assert req.request_id in resumed
    assert req.status == RequestStatus.RUNNING and req.num_output_tokens == 4


def _trace(cls) -> list:
    """A fixed sequence of adds, steps and pause-state changes; returns what each step did."""
    h = SchedulerHarness(cls, num_blocks=24)
    sched, log = h.scheduler, []
    plan = [
        "add",
        "step",
        "add",
        "step",
        PauseState.PAUSED_NEW,
        "add",
        "step",
        "step",
        PauseState.PAUSED_ALL,
        "step",
        "reset",
        PauseState.UNPAUSED,
        "step",
        "add",
        "add",
        "step",
        "step",
        "abort",
        "step",
        "step",
    ]
    for i, op in enumerate(plan):
        if op == "add":
            h.add(64 + 16 * i, max_tokens=4, request_id=f"r{i}", first_token=i)
        elif op == "step":
            out, outputs = h.step()
            finished = sorted(
                o.request_id
                for eo in outputs.values()
                for o in eo.outputs
                if o.finish_reason is not None
            )
            log.append((scheduled(out), finished, sorted(out.preempted_req_ids or [])))
        elif op == "reset":
            log.append(sched.reset_prefix_cache(reset_running_requests=True))
        elif op == "abort":
            sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        else:
            sched.set_pause_state(op)
        log.append((sched.pause_state, sched.get_num_unfinished_requests()))
    return log


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_matches_upstream_step_by_step(cls, tiny_model):
    assert _trace(cls) == _trace(UPSTREAM_OF[cls])


@pytest.mark.parametrize("cls", [AsyncRecomputeScheduler, AsyncScheduler], ids=lambda c: c.__name__)
def test_async_stepping_with_a_batch_in_flight(cls, tiny_model):
    """Under async scheduling the engine schedules step N+1 before step N's output is back."""
    h = SchedulerHarness(cls, model_path=tiny_model)
    sched = h.scheduler
    req = h.add(40, max_tokens=8)
    out1 = sched.schedule()  # prefill
    out2 = sched.schedule()  # decode, scheduled on a placeholder
    assert scheduled(out2) == {req.request_id: 1}
    assert req.num_output_placeholders == 2
    sched.set_pause_state(PauseState.PAUSED_ALL)  # a pause arrives with two steps in flight
    sched.update_from_output(out1, fake_model_output(sched, out1, 11))
    sched.update_from_output(out2, fake_model_output(sched, out2, 12))
    assert list(req.output_token_ids) == [11, 12] and req.num_output_placeholders == 0
    assert sched.schedule().total_num_scheduled_tokens == 0
    sched.set_pause_state(PauseState.UNPAUSED)
    assert scheduled(sched.schedule()) == {req.request_id: 1}
