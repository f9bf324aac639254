"""The engine's update state machine, every (state, event) pair, legal and illegal.

The session runs on a real module (its forward guard is a real hook), a real receive pool and
CPU device. vLLM's layerwise reload is replaced by a recorder (STAND-IN, not hardware: the
reload itself is exercised against vLLM by the e2e suites), so each transition's actions on
the reload are visible: begin on start, finish on a completed finish, abort on every other end.
"""

from __future__ import annotations

import time

import pytest
import torch

from vllm_ascend_rl import metrics
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.readiness import Readiness
from vllm_ascend_rl.weight_transfer.session import (
    TRANSITIONS,
    Event,
    FinishFailed,
    IllegalTransition,
    State,
    UpdateSession,
)


class RecordingReload:  # STAND-IN for vLLM's layerwise reload (see the module docstring)
    def __init__(self, kept: int = 0, restored: int = 0) -> None:
        self.calls: list[str] = []
        self.kept, self.restored = kept, restored
        self.fail_finish = False

    def begin(self, model, model_config, keep_old=True, workers_on_host=1) -> None:
        self.calls.append(f"begin(keep_old={keep_old})")

    def finish(self, model_config) -> None:
        self.calls.append("finish")
        if self.fail_finish:
            self.fail_finish = False
            raise ValueError("attention post-processing failed")

    def abort(self, model_config) -> tuple[int, int, int]:
        self.calls.append("abort")
        return self.restored, self.kept, 0


def session(hold: bool = False, kept: int = 0, restored: int = 0) -> UpdateSession:
    s = UpdateSession(torch.nn.Linear(2, 2), None, get_device("cpu"), 1, "test")
    s.reconnect("hold" if hold else "restore", buffers=2, bucket_bytes=1 << 18, idle_s=60)
    s.reload = RecordingReload(kept, restored)
    return s


def fire(s: UpdateSession, event: Event) -> None:
    {
        Event.START: s.start,
        Event.RECEIVE: lambda: s.receive("v2"),
        Event.LOADED: lambda: s.load_all(iter(()), 0),
        Event.FINISH: s.finish,
        Event.FAIL: lambda: s.fail(RuntimeError("a test failed it")),
        Event.CANCEL: lambda: s.cancel("a test cancelled it", "test"),
    }[event]()


PATHS = {  # how each state is reached from IDLE
    State.IDLE: [],
    State.OPEN: [Event.START],
    State.RECEIVING: [Event.START, Event.RECEIVE],
    State.RECEIVED: [Event.START, Event.RECEIVE, Event.LOADED],
    State.CANCELLED: [Event.START, Event.CANCEL],
}


def in_state(state: State) -> UpdateSession:
    s = session()
    for event in PATHS[state]:
        fire(s, event)
    assert s.state is state
    s.reload.calls.clear()
    return s


# What each legal transition does to the reload.
ACTIONS = {
    (State.IDLE, Event.START): ["begin(keep_old=True)"],
    # The worker dropped its record of the open update (a refused foreign call): a new one.
    (State.OPEN, Event.START): ["abort", "begin(keep_old=True)"],
    (State.RECEIVED, Event.START): ["abort", "begin(keep_old=True)"],
    (State.CANCELLED, Event.START): ["begin(keep_old=True)"],
    (State.OPEN, Event.FINISH): ["abort"],  # nothing arrived: the old weights stay
    (State.OPEN, Event.FAIL): ["abort"],
    (State.OPEN, Event.CANCEL): ["abort"],
    (State.RECEIVING, Event.FAIL): ["abort"],
    (State.RECEIVED, Event.FINISH): ["finish"],  # the only way new weights are applied
    (State.RECEIVED, Event.FAIL): ["abort"],
    (State.RECEIVED, Event.CANCEL): ["abort"],
}


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_every_state_and_event(state, event):
    s = in_state(state)
    after = TRANSITIONS.get((state, event))
    if after is None:
        with pytest.raises(IllegalTransition):
            fire(s, event)
        assert s.state is state and s.reload.calls == [], "an illegal event changed something"
        return
    fire(s, event)
    assert s.state is after
    assert s.reload.calls == ACTIONS.get((state, event), [])
    guarded = after in (State.OPEN, State.RECEIVING, State.RECEIVED)
    assert (s._guard is not None) is guarded


def test_the_table_is_the_documented_machine():
    """Every state can be left, IDLE is reached from every state, and only start leaves IDLE
    for an open update."""
    for state in State:
        assert any(k[0] is state for k in TRANSITIONS), state
    assert {k[0] for k, v in TRANSITIONS.items() if v is State.IDLE} == set(State)
    assert [k for k, v in TRANSITIONS.items() if k[0] is State.IDLE and v is not State.IDLE] == [
        (State.IDLE, Event.START)
    ]


def test_a_forward_pass_during_an_open_update_cancels_it_and_finish_ends_it():
    s = in_state(State.OPEN)
    s.model(torch.zeros(1, 2))  # generation ran while the update was open
    assert s.state is State.CANCELLED and s.reload.calls == ["abort"]
    assert "generation ran while it was open" in s.cancelled
    with pytest.raises(IllegalTransition, match="generation ran while it was open"):
        s.receive("v2")  # update_weights learns why
    s.finish()
    assert s.state is State.IDLE and s._guard is None


@pytest.mark.parametrize("hold", [False, True], ids=["restore", "hold"])
def test_a_finish_that_fails_ends_the_update_and_the_next_finish_closes_the_workers(hold):
    s = session(hold=hold, kept=2 if hold else 0, restored=0 if hold else 2)
    for event in PATHS[State.RECEIVED]:
        fire(s, event)
    s.reload.fail_finish = True
    with pytest.raises(FinishFailed, match="post-load processing failed: ValueError") as e:
        s.finish()
    assert s.state is State.IDLE and s.reload.calls[-2:] == ["finish", "abort"]
    if hold:
        assert s.readiness.state is Readiness.NOT_WHOLE and "2 layer(s)" in str(e.value)
    else:
        assert s.readiness.state is Readiness.WHOLE and "restored in 2 layer(s)" in str(e.value)
    s.finish()  # the worker still counted it open: nothing to do, no error
    assert s.state is State.IDLE and s.reload.calls[-1] == "abort"
    fire(s, Event.START)  # the next update opens
    assert s.state is State.OPEN


def test_a_start_while_an_update_is_open_here_cancels_it_first():
    """The worker ended its record of the update (vLLM's and vllm-ascend's workers do on any
    error of update_weights, a refused foreign call included) and starts a new one."""
    s = in_state(State.RECEIVED)
    fire(s, Event.START)
    assert s.state is State.OPEN and s.reload.calls == ["abort", "begin(keep_old=True)"]
    assert s.readiness.state is Readiness.UPDATING


def test_a_failed_restore_update_says_what_was_restored():
    s = session(restored=3)
    for event in PATHS[State.RECEIVING]:
        fire(s, event)
    assert (
        s.fail(RuntimeError("test"))
        == "model unchanged (the old weights were restored in 3 layer(s))"
    )
    assert s.readiness.reason is None


def test_hold_a_failed_update_leaves_generation_refused_until_one_completes():
    s = session(hold=True, kept=2)
    s.start()
    assert s.reload.calls == ["begin(keep_old=False)"]  # no backup of the old weights
    s.receive("v2-partial")
    assert "a weight update is open" in s.readiness.reason  # a resume would mix versions
    state = s.fail(RuntimeError("test"))
    assert "of version 'v2-partial' failed after 2 layer(s)" in state
    assert s.readiness.state is Readiness.NOT_WHOLE and s.readiness.reason in state
    assert s.state is State.IDLE
    with pytest.raises(RuntimeError, match="refusing to run the model"):
        s.model(torch.zeros(1, 2))  # the guard stays while the weights are not whole
    s.reload.kept = 0  # the next update completes
    for event in (Event.START, Event.RECEIVE, Event.LOADED, Event.FINISH):
        fire(s, event)
    assert s.readiness.reason is None and s._guard is None
    s.model(torch.zeros(1, 2))


def test_hold_an_update_that_changed_no_layer_leaves_the_weights_whole():
    s = session(hold=True, kept=0)
    s.start()
    s.receive("v2")
    assert s.readiness.state is Readiness.UPDATING
    s.fail(RuntimeError("test"))
    assert s.readiness.state is Readiness.WHOLE and s._guard is None


def test_hold_is_refused_at_init_without_the_plugin_scheduler():
    """Only the plugin scheduler refuses /resume while the weights are not whole."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ascend_rl.core.recompute_scheduler import AsyncRecomputeScheduler
    from vllm_ascend_rl.weight_transfer.engine import check_init
    from vllm_ascend_rl.weight_transfer.wire import WireParams

    def config(cls):
        return SimpleNamespace(scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: cls))

    with pytest.raises(ValueError, match="needs the plugin scheduler"):
        check_init(config(Scheduler), WireParams(on_failure="hold"))
    check_init(config(Scheduler), WireParams())  # restore needs no scheduler of ours
    check_init(config(AsyncRecomputeScheduler), WireParams(on_failure="hold"))


def counted(result: str, cause: str | None = None) -> float:
    """This process's engine-side count of updates that ended with ``result`` (and ``cause``)."""
    return sum(
        v
        for (name, labels), v in metrics.values().items()
        if name == "weight_updates"
        and dict(labels).get("backend") == "test"
        and dict(labels)["result"] == result
        and cause in (None, dict(labels)["cause"])
    )


def test_every_update_is_counted_once_where_it_ends():
    before = {r: counted(r) for r in ("ok", "cancelled", "failed", "refused")}
    s = session()
    for event in (Event.START, Event.RECEIVE, Event.LOADED, Event.FINISH):
        fire(s, event)
    s.start()
    s.model(torch.zeros(1, 2))  # generation cancels it
    with pytest.raises(IllegalTransition) as refused:
        s.receive("v2")
    s.fail(refused.value)  # vLLM's worker ends the failed update_weights: the same update
    s.fail(IllegalTransition("update_weights called without start_weight_update"))
    after = {r: counted(r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "ok": 1,
        "cancelled": 1,
        "failed": 1,  # the call with no update open, on its own
        "refused": 0,
    }
    assert counted("cancelled", "generation_ran") >= 1


def test_an_open_update_is_due_to_be_abandoned_only_after_idle_s_without_a_call():
    """start and every loaded update_weights restart the idle clock; abandoning restores the
    old weights, and the worker's next call finds the update cancelled."""
    s = session()
    s.idle_s = 0.2
    fire(s, Event.START)
    assert s.is_open and not s.abandon_due()
    time.sleep(0.25)
    assert s.abandon_due()
    fire(s, Event.RECEIVE), fire(s, Event.LOADED)  # a call came: the clock restarts
    assert not s.abandon_due()
    time.sleep(0.25)
    s.abandon()
    assert s.state is State.CANCELLED and not s.is_open and not s.abandon_due()
    assert s.reload.calls[-1] == "abort" and s.readiness.state is Readiness.WHOLE
    assert "no call came for 0.2 s" in (s.cancelled or "")
    fire(s, Event.FINISH)
    assert s.state is State.IDLE


def test_a_drafter_left_not_whole_holds_generation_until_a_drafter_update_completes():
    """A draft update (the engine retargeted at the drafter) that fails part-way under hold:
    the served model's own updates do not lift it, a drafter update does."""
    s, drafter, x = session(hold=True, kept=1), torch.nn.Linear(2, 2), torch.zeros(1, 2)
    s.start(drafter, "draft config")
    assert (s.model, s.model_config) == (drafter, "draft config")
    s.receive("d2")
    state = s.fail(RuntimeError("test"))
    assert "the drafter's weights are not whole" in state and "of version 'd2'" in state
    assert (s.model, s.model_config) == (s.target, None)  # the next update is the target's
    assert s.readiness.state is Readiness.WHOLE and s.readiness.drafter in state
    assert "until an update of the drafter completes" in state
    with pytest.raises(RuntimeError, match="refusing to run the model: the drafter's"):
        s.target(x)
    s.reload.kept = 0
    for event in (Event.START, Event.RECEIVE, Event.LOADED, Event.FINISH):
        fire(s, event)  # the served model's update completes
    assert s.readiness.refusal == s.readiness.drafter is not None and s._guard is not None
    s.start(drafter, "draft config")
    assert s.readiness.state is Readiness.UPDATING
    for event in (Event.RECEIVE, Event.LOADED, Event.FINISH):
        fire(s, event)
    assert s.readiness.refusal is None and s._guard is None
    assert s.readiness.state is Readiness.WHOLE
    s.target(x)


def test_a_drafter_that_shares_the_served_models_tensors_is_refused_before_anything_opens():
    """EAGLE's and MTP's embedding or head are the served model's own modules."""
    from vllm_ascend_rl.weight_transfer.validation import WeightUpdateRefused

    s = session()
    drafter = torch.nn.Sequential(torch.nn.Linear(2, 2), s.target)
    with pytest.raises(WeightUpdateRefused, match=r"shares 2 parameter\(s\).*1\.weight") as e:
        s.start(drafter, "draft config")
    assert e.value.cause == "draft_shares_target"
    assert s.state is State.IDLE and s.reload.calls == [] and s.model is s.target
