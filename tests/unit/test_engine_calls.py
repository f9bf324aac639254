"""The stack-reading shim against vLLM's own ``EngineCore`` methods (on each vLLM leg): if
vLLM renames them or stops calling the scheduler from them, these tests fail, naming what the
plugin scheduler can no longer tell apart. The engine core is a skeleton (no model, no
executor process): only the methods under test are vLLM's; its executor is a STAND-IN."""

from __future__ import annotations

import types

import pytest
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.core import EngineCore

from vllm_ascend_rl.core.engine_calls import engine_core_call


class RecordingScheduler:
    def __init__(self) -> None:
        self.calls = []

    def set_pause_state(self, pause_state: PauseState) -> None:
        self.calls.append((pause_state, engine_core_call(self)))


def skeleton() -> tuple[EngineCore, RecordingScheduler]:
    core = object.__new__(EngineCore)
    core.scheduler = RecordingScheduler()
    core.model_executor = types.SimpleNamespace(  # STAND-IN: an executor that is awake
        wake_up=lambda tags: None, is_sleeping=False, sleep=lambda level: None
    )
    return core, core.scheduler


def test_resume_is_seen_with_its_engine_core():
    core, sched = skeleton()
    EngineCore.resume_scheduler(core)
    ((state, call),) = sched.calls
    assert state == PauseState.UNPAUSED
    assert call.name == "resume_scheduler", "vLLM's /resume no longer reaches set_pause_state"
    assert call.engine_core is core  # the resume check asks this engine core's workers


def test_wake_up_is_told_apart_from_resume():
    core, sched = skeleton()
    EngineCore.wake_up(core, ["weights", "kv_cache"])
    ((_, call),) = sched.calls
    assert call.name == "wake_up", "vLLM's wake_up no longer resumes through set_pause_state"
    assert call.args["tags"] == ["weights", "kv_cache"]


def test_sleep_is_seen_with_its_level():
    core, sched = skeleton()
    core.pause_scheduler = lambda mode, clear_cache: sched.set_pause_state(PauseState.PAUSED_ALL)
    EngineCore.sleep(core, level=1)
    ((_, call),) = sched.calls
    assert call.name == "sleep" and call.args["level"] == 1


def test_another_engine_cores_call_is_not_ours():
    core, sched = skeleton()
    other, _ = skeleton()
    other.scheduler = object()  # a different engine (data parallel) on the stack
    EngineCore.resume_scheduler(core)
    assert sched.calls[0][1].engine_core is core
    sched.set_pause_state(PauseState.PAUSED_NEW)  # not from an engine-core call
    assert sched.calls[1][1].name is None


class _Scheduled(Exception):
    """Stops vLLM's step once the scheduler has been asked."""


def test_a_step_is_seen_with_its_engine_core():
    """The step gate ends an abandoned update through the engine core of the step asking."""
    core, sched = skeleton()
    sched.has_requests = lambda: True

    def schedule(*args):
        sched.calls.append((None, engine_core_call(sched)))
        raise _Scheduled

    sched.schedule = schedule
    with pytest.raises(_Scheduled):
        EngineCore.step(core)
    ((_, call),) = sched.calls
    assert call.name == "step", "vLLM's step no longer asks the scheduler to schedule"
    assert call.engine_core is core
