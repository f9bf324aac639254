"""``recompute_mode=bounce`` on vLLM's own scheduler objects, in-process, no model."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.support.scheduler import SchedulerHarness, fake_model_output
from vllm_ascend_rl.core.recompute_scheduler import (
    AsyncRecomputeScheduler,
    RecomputeScheduler,
    recompute_mode_from,
    refuse_bounce_with_connector,
)

BOUNCE = {"ascend_rl": {"recompute_mode": "bounce"}}
OURS = [RecomputeScheduler, AsyncRecomputeScheduler]


def harness(cls, tiny_model, mode=BOUNCE, **kwargs) -> SchedulerHarness:
    kwargs.setdefault("num_blocks", 9)  # 8 usable blocks of 32 tokens
    return SchedulerHarness(cls, model_path=tiny_model, additional_config=mode, **kwargs)


def finishes(results: dict) -> dict[str, tuple]:
    return {
        o.request_id: (o.finish_reason, o.stop_reason, list(o.new_token_ids))
        for eco in results.values()
        for o in eco.outputs
        if o.finish_reason is not None
    }


def step_until_bounce(h: SchedulerHarness, limit: int = 200):
    for _ in range(limit):
        out, res = h.step()
        if finishes(res):
            return out, res
    raise AssertionError("nothing bounced")


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_kv_starved_victim_is_finished_as_recomputed_with_its_tokens(cls, tiny_model):
    h = harness(cls, tiny_model)
    reqs = [h.add(40, max_tokens=100) for _ in range(4)]
    out, res = step_until_bounce(h)
    (rid, (reason, stop, new_tokens)), *more = finishes(res).items()
    assert not more
    victim = next(r for r in reqs if r.request_id == rid)
    assert victim is reqs[-1]  # FCFS: upstream's victim, the last running
    assert (reason, stop, new_tokens) == (FinishReason.ABORT, "recomputed", [])
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert 0 < victim.num_output_tokens < 100  # its tokens stay on the request/stream
    assert rid in out.finished_req_ids  # the worker drops it this very step
    assert rid not in h.scheduler.requests and victim.num_preemptions == 0
    assert h.scheduler.num_bounced == 1
    while h.scheduler.has_requests():
        h.step()
    for r in reqs:  # every request either ran to its length or was bounced
        assert r.num_output_tokens == 100 or r.stop_reason == "recomputed"
        assert r.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)


def test_local_mode_is_upstream_preemption(tiny_model):
    h = harness(RecomputeScheduler, tiny_model, mode={})
    reqs = [h.add(40, max_tokens=100) for _ in range(4)]
    while h.scheduler.has_requests():
        _, res = h.step()
        assert all(f[0] == FinishReason.LENGTH for f in finishes(res).values())
    assert h.scheduler.num_bounced == 0
    assert sum(r.num_preemptions for r in reqs) >= 1
    assert all(r.num_output_tokens == 100 for r in reqs)


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_reset_prefix_cache_preempts_normally_even_in_bounce_mode(cls, tiny_model):
    h = harness(cls, tiny_model, num_blocks=64)
    reqs = [h.add(40, max_tokens=50) for _ in range(3)]
    h.step()
    h.step()
    sched = h.scheduler
    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert all(r.status == RequestStatus.PREEMPTED for r in reqs)
    assert sched.num_bounced == 0
    _, res = h.step()  # paused: nothing scheduled, nothing finished
    assert not finishes(res)
    sched.set_pause_state(PauseState.UNPAUSED)
    while sched.has_requests():
        _, res = h.step()
        assert all(f[0] == FinishReason.LENGTH for f in finishes(res).values())
    assert all(r.num_output_tokens == 50 for r in reqs)


def test_priority_policy_bounces_the_lowest_priority_request(tiny_model):
    h = harness(RecomputeScheduler, tiny_model, policy="priority")
    high = h.add(40, max_tokens=100, priority=0)
    low = h.add(40, max_tokens=100, priority=5)  # larger value = lower priority
    mid = [h.add(40, max_tokens=100, priority=1) for _ in range(2)]
    _, res = step_until_bounce(h)
    assert list(finishes(res)) == [low.request_id]
    assert high.status == RequestStatus.RUNNING and all(
        m.status == RequestStatus.RUNNING for m in mid
    )


@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
def test_a_pause_during_a_bounce_still_delivers_it(cls, tiny_model):
    h = harness(cls, tiny_model)
    sched = h.scheduler
    [h.add(40, max_tokens=100) for _ in range(4)]
    while True:
        out = sched.schedule()
        if sched.num_bounced:
            break
        sched.update_from_output(out, fake_model_output(sched, out))
    sched.set_pause_state(PauseState.PAUSED_ALL)  # /pause lands between schedule and output
    res = sched.update_from_output(out, fake_model_output(sched, out))
    assert [f[1] for f in finishes(res).values()] == ["recomputed"]
    paused_out, res = h.step()
    assert paused_out.total_num_scheduled_tokens == 0 and not finishes(res)
    sched.set_pause_state(PauseState.UNPAUSED)
    out, _ = h.step()
    assert out.total_num_scheduled_tokens > 0


def test_async_placeholders_in_flight_for_a_victim_are_discarded(tiny_model):
    h = harness(AsyncRecomputeScheduler, tiny_model)
    sched = h.scheduler
    [h.add(40, max_tokens=100) for _ in range(4)]
    prev = sched.schedule()
    bounced = None
    for _ in range(200):  # two batches in flight, as with async scheduling
        cur = sched.schedule()
        res = sched.update_from_output(prev, fake_model_output(sched, prev))
        if finishes(res):
            bounced = next(iter(finishes(res)))
            break
        prev = cur
    assert bounced is not None
    # The batch scheduled before the bounce still names the victim; its output is dropped.
    res = sched.update_from_output(cur, fake_model_output(sched, cur))
    assert bounced not in finishes(res)
    assert all(bounced not in [o.request_id for o in e.outputs] for e in res.values())
    while sched.has_requests():
        h.step()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"ascend_rl": {"recompute_mode": "sideways"}}, "must be one of ['local', 'bounce']"),
        ({"ascend_rl": {"recompute": "bounce"}}, "unknown ascend_rl key(s) ['recompute']"),
        ({"ascend_rl": "bounce"}, "must be an object"),
    ],
)
def test_bad_config_is_refused_at_construction(config, message, tiny_model):
    with pytest.raises(ValueError) as e:
        harness(RecomputeScheduler, tiny_model, mode=config)
    assert message in str(e.value)
    assert recompute_mode_from({}) == "local" and recompute_mode_from(None) == "local"


@pytest.mark.parametrize("field", ["kv_transfer_config", "ec_transfer_config"])
def test_bounce_is_refused_with_a_connector(field, tiny_model):
    h = harness(RecomputeScheduler, tiny_model)
    config = h.vllm_config
    setattr(config, field, object())  # any configured connector (the scheduler never reaches it)
    with pytest.raises(ValueError, match=f"bounce cannot run with a connector \\({field}\\)"):
        RecomputeScheduler(
            vllm_config=config, kv_cache_config=None, structured_output_manager=None, block_size=32
        )
    config.additional_config = {}  # local recompute with a connector is upstream's business
    refuse_bounce_with_connector(config)
